"""One request on one replica: ``/v1/completions`` streamed (SSE) into :class:`engine.base.Chunk`s
within the first-token and between-token deadlines.

:class:`Attempts` raises :class:`AttemptFailed` while no text reached the caller (another
replica may serve the request) and :class:`Broken` after (the caller has text: the rest must be
resumed); :mod:`engine.remote` decides which. The wire format is :mod:`engine.sse`'s.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from engine.base import Chunk, EngineError
from engine.replicas import ReplicaHealth, describe
from engine.routing import RemoteConfig, Replica
from engine.sse import DONE, Malformed, Usage, choice_logprobs, choice_text, decode_event, events, parse_usage, prompt_timings


class AttemptFailed(Exception):
    """The replica failed before any text reached the caller: another replica may serve it.

    ``retry``: the same servers may serve it a moment later: an HTTP 5xx (a router whose worker
    just died answers 500 until its health check notices) or a connection that broke; a refused
    connection or a missed deadline is not retried."""

    def __init__(self, message: str, *, mark_down: bool = True, retry: bool = False) -> None:
        super().__init__(message)
        self.mark_down = mark_down
        self.retry = retry


class Broken(Exception):
    """The stream broke after text had reached the caller: the rest must be resumed."""


@dataclass
class _End:
    """The producer's last word: a clean end, an error, or that it was cancelled."""

    error: BaseException | None = None
    cancelled: bool = False


# What a request on a connection the server has closed meets before any answer: the close
# (RemoteProtocolError "Server disconnected without sending a response"), or a reset.
UNANSWERED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Sends of one request on pooled connections found closed before one counts: after a burst of
# requests the pool holds several connections the server closed (one retry met a second: the fake
# 'closing' soak marked its replica down once in 250 requests).
RESENDS = 8

_FINISHED = object()  # the completion was complete and nothing more came in time


@dataclass
class _Progress:
    """How far one attempt's stream has come."""

    first_token_s: float  # how long the first token may take
    first_deadline: float  # loop time by which it must arrive
    yielded: int = 0  # text chunks handed to the caller
    counted: int = 0  # tokens reported in those chunks
    final: Chunk | None = None  # finish_reason known; usage may still come
    usage: Usage | None = None
    done: bool = False  # [DONE] arrived


@dataclass
class _Active:
    producer: asyncio.Task[None]
    replica: Replica
    # The producer is stopped through anyio's scope, not Task.cancel: httpcore shields its clean-up
    # with anyio, and a plain cancel that lands there (in httpx's close at the end of a body, or in
    # a send) leaves the connection checked out of the pool for good.
    scope: anyio.CancelScope
    aborted: bool = False

    def stop(self) -> None:
        self.scope.cancel()


class Attempts:
    """The attempts in flight, by request id (so that one can be aborted)."""

    def __init__(
        self, config: RemoteConfig, client: Callable[[], httpx.AsyncClient], health: ReplicaHealth, scrub: Callable[[str], str]
    ) -> None:
        self.config = config
        self._client = client
        self._health = health
        self._scrub = scrub
        self._active: dict[str, _Active] = {}
        self.reconnected = 0  # requests sent again after a pooled connection was found closed

    async def abort(self, request_id: str) -> bool:
        """Stops the attempt for ``request_id``; False when none runs."""
        active = self._active.get(request_id)
        if active is None:
            return False
        active.aborted = True
        active.stop()
        # Closing the connection is what makes vLLM abort: wait until it is closed.
        await asyncio.gather(active.producer, return_exceptions=True)
        return True

    def cancel_all(self) -> None:
        for active in list(self._active.values()):
            active.stop()

    async def stream(
        self, replica: Replica, body: dict[str, Any], request_id: str, headers: dict[str, str], first_token_s: float
    ) -> AsyncGenerator[Chunk, None]:
        """Chunks from one replica. Raises AttemptFailed while no text has been yielded, Broken after.

        Text chunks count one token each (one SSE event is one decode step on vLLM and llama.cpp);
        the last chunk, empty, carries finish_reason and the server's usage: prompt_tokens,
        cached_tokens, and the token count that makes the total equal ``completion_tokens``."""
        if not replica.logprobs_ready and "logprobs" in body:
            body = {key: value for key, value in body.items() if key not in ("logprobs", "n_probs")}
        queue: asyncio.Queue[Any] = asyncio.Queue()
        scope = anyio.CancelScope()
        producer = asyncio.create_task(self._produce(replica, body, headers, queue, scope))
        active = _Active(producer, replica, scope)
        self._active[request_id] = active
        replica.inflight += 1
        progress = _Progress(first_token_s, first_deadline=asyncio.get_running_loop().time() + first_token_s)
        try:
            while True:
                if active.aborted:
                    # Text already queued is dropped: the caller asked for no more.
                    progress.final = Chunk(text="", finish_reason="abort")
                    break
                item = await self._next_item(queue, replica, progress)
                if item is _FINISHED:
                    break
                if item is DONE:
                    progress.done = True
                    break
                if isinstance(item, _End):
                    self._check_end(item, replica, progress)
                    break
                for chunk in self._text_chunks(item, replica, progress):
                    yield chunk
            yield self._final_chunk(replica, progress)
        finally:
            replica.inflight -= 1
            if self._active.get(request_id) is active:
                del self._active[request_id]
            if not producer.done() and progress.done:
                # The server ended the stream: reading it to its end keeps the connection for reuse.
                await asyncio.wait({producer}, timeout=min(self.config.read_timeout, 2.0))  # as for [DONE] itself
            if not producer.done():
                # Closing the response mid-stream closes the connection, and vLLM aborts the request.
                active.stop()
                await asyncio.gather(producer, return_exceptions=True)

    async def _produce(
        self, replica: Replica, body: dict[str, Any], headers: dict[str, str], queue: asyncio.Queue[Any], scope: anyio.CancelScope
    ) -> None:
        """Reads one HTTP response into ``queue``; always ends with an :class:`_End`."""
        try:
            with scope:
                await self._read(replica, body, headers, queue)
                queue.put_nowait(_End())
                return
            queue.put_nowait(_End(cancelled=True))  # stopped through the scope
        except asyncio.CancelledError:
            queue.put_nowait(_End(cancelled=True))
            raise
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            queue.put_nowait(_End(AttemptFailed(f"cannot connect to {replica.name} ({describe(exc)})")))
        except httpx.HTTPError as exc:  # read/write errors, protocol errors, a closed connection
            queue.put_nowait(_End(AttemptFailed(f"the connection to {replica.name} failed ({describe(exc)})", retry=True)))
        except Malformed as exc:
            queue.put_nowait(_End(AttemptFailed(f"{replica.name} sent a malformed stream: {exc}")))
        except (AttemptFailed, EngineError) as exc:
            queue.put_nowait(_End(exc))
        except Exception as exc:  # noqa: BLE001 - never leave the consumer waiting
            queue.put_nowait(_End(AttemptFailed(f"reading from {replica.name} failed: {exc!r}")))

    async def _read(self, replica: Replica, body: dict[str, Any], headers: dict[str, str], queue: asyncio.Queue[Any]) -> None:
        """One response's events into ``queue``. A request that got no answer at all, on a pooled
        connection the server had closed without saying so (llama-server closes after each
        streamed answer, with no ``Connection: close``), is sent once more: the pool has dropped
        that connection, and the replica is not to blame."""
        client = self._client()
        # A UUID: llama-cpp-python's server answers HTTP 400 to any other X-Request-Id.
        request = client.build_request(
            "POST", f"{replica.url}/v1/completions", json=body, headers={**headers, "X-Request-Id": str(uuid.uuid4())}
        )
        for _ in range(RESENDS):
            try:
                response = await client.send(request, stream=True)
                break
            except UNANSWERED:
                self.reconnected += 1  # that connection is gone from the pool; the next may be stale too
        else:
            response = await client.send(request, stream=True)
        try:
            if response.status_code >= 400:
                raise self._status_error(replica, response.status_code, await response.aread())
            if "json" in response.headers.get("content-type", ""):
                # A server that ignored `stream: true` answers with one JSON object.
                queue.put_nowait(decode_event((await response.aread()).decode("utf-8", "replace")))
                queue.put_nowait(DONE)
            else:
                async for event in events(response.aiter_lines()):
                    queue.put_nowait(event)
        finally:
            await response.aclose()

    def _status_error(self, replica: Replica, status: int, body: bytes) -> Exception:
        detail = body[:300].decode("utf-8", "replace").strip()
        message = f"{replica.name} answered HTTP {status}: {detail}"
        if status >= 500:
            return AttemptFailed(message, retry=True)
        if status in (408, 429):  # busy, not broken: try another replica but keep this one in
            return AttemptFailed(message, mark_down=False)
        # 4xx: the request itself is wrong (bad model name, prompt too long): no replica will take it.
        return EngineError(self._scrub(message))

    async def _next_item(self, queue: asyncio.Queue[Any], replica: Replica, progress: _Progress) -> Any:
        """The producer's next item, within the deadline that applies now; ``_FINISHED`` when the
        completion is complete and nothing more came in time."""
        read_timeout = self.config.read_timeout
        if progress.final is not None:
            # Finished: wait briefly for the usage event and [DONE], reading to the end keeps
            # the connection reusable.
            timeout = min(read_timeout, 2.0)
        elif progress.yielded:
            timeout = read_timeout
        else:
            timeout = max(0.0, progress.first_deadline - asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout(timeout):
                return await queue.get()
        except TimeoutError:
            if progress.final is not None:
                return _FINISHED
            if progress.yielded:
                message = f"no token for {read_timeout:g} s after {progress.yielded} chunks"
                self._health.mark_down(replica, self._scrub(f"{replica.name} stalled: {message}"))
                raise Broken(f"the stream from {replica.name} broke mid-stream: {message}") from None
            raise AttemptFailed(f"{replica.name} sent no token within {progress.first_token_s:g} s") from None

    def _check_end(self, end: _End, replica: Replica, progress: _Progress) -> None:
        """The producer ended: fine when cleanly or after the completion was complete; raises otherwise."""
        if end.cancelled:  # close() of the engine
            progress.final = Chunk(text="", finish_reason="abort")
            return
        if end.error is None or progress.final is not None:
            return  # a clean end, or trouble after the completion was complete
        if progress.yielded:
            # The caller already has part of the text: stream() resumes after it, not from the start.
            self._health.mark_down(replica, self._scrub(str(end.error)))
            message = f"the stream from {replica.name} broke mid-stream after {progress.yielded} chunks: {end.error}"
            raise Broken(self._scrub(message)) from end.error
        raise end.error

    def _text_chunks(self, event: dict[str, Any], replica: Replica, progress: _Progress) -> list[Chunk]:
        """The text of one event (choice 0), noting its usage and finish reason."""
        if "error" in event:
            error = event["error"]
            detail = error.get("message", error) if isinstance(error, dict) else error
            raise EngineError(self._scrub(f"{replica.name} reported an error: {detail}"))
        progress.usage = parse_usage(event.get("usage")) or progress.usage
        prompt = prompt_timings(event.get("timings")) if not progress.yielded else None
        chunks = []
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            text = choice_text(choice)
            finish = choice.get("finish_reason")
            if text:
                progress.yielded += 1
                progress.counted += 1
                chunk = Chunk(text=text, token_count=1, logprobs=choice_logprobs(choice))
                if prompt is not None and progress.yielded == 1:
                    chunk.prompt_tokens, chunk.cached_tokens = prompt.prompt_tokens, prompt.cached_tokens
                chunks.append(chunk)
            if finish:
                progress.final = Chunk(text="", finish_reason=str(finish))
        return chunks

    def _final_chunk(self, replica: Replica, progress: _Progress) -> Chunk:
        """The last chunk: the finish reason and the server's usage; raises when the stream ended
        before the completion did."""
        final = progress.final
        if final is None:
            if not progress.done:
                if progress.yielded:
                    self._health.mark_down(replica, f"{replica.name} closed a stream before it finished")
                    raise Broken(
                        f"the stream from {replica.name} broke mid-stream after {progress.yielded} chunks: "
                        "the connection closed before the completion finished"
                    )
                raise AttemptFailed(f"{replica.name} closed the stream without a completion", retry=True)
            final = Chunk(text="", finish_reason="stop")  # [DONE] without a finish_reason
        usage = progress.usage
        if usage is not None:
            final.prompt_tokens = usage.prompt_tokens
            final.cached_tokens = usage.cached_tokens
            if usage.completion_tokens is not None and usage.completion_tokens >= progress.counted:
                final.token_count = usage.completion_tokens - progress.counted
        return final
