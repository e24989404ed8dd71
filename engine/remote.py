"""OpenAI-compatible completion servers over HTTP (vLLM, llama.cpp server, Ollama), one or many.

Each request streams ``/v1/completions`` (SSE) from one replica, chosen by rendezvous hashing on
the prompt's prefix key so that a document keeps hitting the replica that holds its KV blocks
(``engine.routing``). A replica that fails before the first token is taken out and the request
moves on to the next one; once text has reached the caller a broken stream is an error, since the
caller already used that text. Down replicas are probed back in by a background task, which also
polls vLLM's ``/metrics`` for load.

Token counts for prompt budgets: when the model (its served name, or the ``root`` folder that vLLM
reports) is a local folder with tokenizer files, its own tokenizer counts; otherwise
:class:`ApproxTokenizer` estimates 1 token per 3.5 characters (about right for code with BPE
vocabularies; budgets should keep a margin).

Over 600 lines on purpose: :class:`RemoteEngine`'s request path (attempts, failover, abort) and
its health checks (probes, metrics polling) share the replicas' state. The wire format is in
:mod:`engine.sse`, the choice of replica in :mod:`engine.routing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import ssl
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from engine.base import Chunk, EngineError, EngineNotReady, GenerationParams, ModelInfo, Tokenizer
from engine.routing import (
    LoadPolicy,
    Replica,
    Sample,
    metric_sum,
    normalize_url,
    order,
    parse_prometheus,
    probe_delay,
    redact_url,
    router_workers,
    session_id,
)
from engine.sse import (
    DONE,
    Malformed,
    Usage,
    choice_logprobs,
    choice_text,
    decode_event,
    events,
    int_or_none,
    parse_usage,
    prompt_timings,
)

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# How long start() waits for fresh vLLM servers' first answer with log-probabilities (see
# Replica.logprobs_ready); a slower one goes on in the background.
LOGPROBS_WARMUP_WAIT_S = 60.0


class ApproxTokenizer:
    """Estimates tokens as characters / 3.5 when the model's tokenizer is not available locally."""

    chars_per_token = 3.5

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)


class _AttemptFailed(Exception):
    """The replica failed before any text reached the caller: another replica may serve it.

    ``retry``: the same servers may serve it a moment later: an HTTP 5xx (a router whose worker
    just died answers 500 until its health check notices) or a connection that broke; a refused
    connection or a missed deadline is not retried."""

    def __init__(self, message: str, *, mark_down: bool = True, retry: bool = False) -> None:
        super().__init__(message)
        self.mark_down = mark_down
        self.retry = retry


class _Broken(Exception):
    """The stream broke after text had reached the caller: the rest must be resumed."""


@dataclass
class _End:
    """The producer's last word: a clean end, an error, or that it was cancelled."""

    error: BaseException | None = None
    cancelled: bool = False


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
    aborted: bool = False


@dataclass(frozen=True)
class ReplicaStatus:
    """A snapshot of one replica for stats and tests (credentials removed from the URL)."""

    name: str
    up: bool
    failures: int
    inflight: int
    waiting: float | None
    running: float | None
    kv_usage: float | None
    last_error: str | None
    router_workers: tuple[int, int] | None  # (healthy, total) when it is a router


def _describe(exc: BaseException) -> str:
    """``ReadTimeout`` or ``ConnectError: [Errno 111] ...``: httpx messages are often empty."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _local_tokenizer_dir(candidate: str | None) -> str | None:
    if not candidate:
        return None
    path = Path(os.path.expanduser(candidate))
    if path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES):
        return str(path)
    return None


def _load_hf_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class RemoteEngine:
    """One or more OpenAI-compatible servers serving the same model (replicas)."""

    def __init__(
        self,
        urls: list[str],
        model: str | None = None,
        *,
        api_key_env: str = "EMBER_API_KEY",
        connect_timeout: float = 3.0,
        first_token_timeout: float = 5.0,
        read_timeout: float = 10.0,
        probe_timeout: float = 3.0,
        probe_initial: float = 1.0,
        probe_max: float = 30.0,
        metrics_interval: float = 2.0,
        silent_polls_down: int = 2,
        load_policy: LoadPolicy = LoadPolicy(),
        tokenizer_path: str | None = None,
        default_max_model_len: int = 2048,
        max_connections: int = 64,
        verify: bool | str | ssl.SSLContext = True,
        max_resumes: int = 2,
        retry_backoff: tuple[float, ...] = (0.25, 0.5, 1.0),
        uds: str | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``connect_timeout``: TCP/TLS connect. ``first_token_timeout``: request sent -> first
        text (queueing and prefill included); past it the replica counts as failed and the next one
        is tried (a request without ``failover``, a warm-up, waits on its replica that long once per
        replica instead). ``read_timeout``: the longest gap between two events once text flows.
        ``probe_*``: backoff of the background probe that brings a down replica back.
        ``metrics_interval``: how often live replicas' /metrics are read (only with several
        replicas); ``silent_polls_down`` polls in a row without an answer take a replica out.
        ``verify``: TLS verification: True (system CAs), False, a CA bundle path or an SSLContext.
        ``max_resumes``: how often a stream that broke mid-way is resumed elsewhere.
        ``retry_backoff``: pauses before repeating a round in which every replica answered 5xx.
        ``uds``: reach the server over this Unix socket (the URL then names no host that is
        dialled). ``tokenizer``: counts tokens, instead of a tokenizer found for the model.
        ``request_fields``: fields added to each request's body, from its routing key (llama.cpp's
        ``id_slot``)."""
        if not urls:
            raise ValueError("RemoteEngine needs at least one URL")
        self.replicas = [Replica(url=u, name=redact_url(u)) for u in dict.fromkeys(normalize_url(u) for u in urls)]
        self._requested_model = model
        self._api_key = os.environ.get(api_key_env) or None
        self.connect_timeout = connect_timeout
        self.first_token_timeout = first_token_timeout
        self.read_timeout = read_timeout
        self.probe_timeout = probe_timeout
        self.probe_initial = probe_initial
        self.probe_max = probe_max
        self.metrics_interval = metrics_interval
        self.silent_polls_down = silent_polls_down
        self.load_policy = load_policy
        self._tokenizer_path = tokenizer_path
        self._default_max_model_len = default_max_model_len
        self._max_connections = max_connections
        self._verify = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        self._client: httpx.AsyncClient | None = None
        self._model: ModelInfo | None = None
        self._uds = uds
        self._given_tokenizer = tokenizer
        self._tokenizer: Tokenizer | None = None
        # The server is llama.cpp's (its /v1/models entries carry `meta`): it reports sampled
        # tokens' log-probabilities only when asked with its own field, n_probs.
        self.llama_cpp = False
        self._active: dict[str, _Active] = {}
        self._streams: set[str] = set()  # request ids whose stream() runs
        self._aborted: set[str] = set()  # of those, aborted between two attempts
        self.max_resumes = max_resumes
        self.retry_backoff = retry_backoff
        self.resumed = 0  # streams resumed after a break
        self.retried = 0  # rounds repeated after every replica failed with a 5xx
        self._monitor: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.vllm = False  # the servers are vLLM's (/v1/models: owned_by "vllm")
        self.engine_args: dict[str, Any] = {}  # the servers were started with their own
        self.warning: str | None = None
        self._logprobs_warmups: dict[str, asyncio.Task[None]] = {}  # replica url -> its warm-up

    # -- Engine protocol -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._model is not None and self._client is not None

    @property
    def dead(self) -> bool:
        return False  # a replica that fails is taken out and probed back in

    @property
    def model(self) -> ModelInfo:
        if self._model is None:
            raise EngineNotReady("not connected to the engine server yet")
        return self._model

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineNotReady("not connected to the engine server yet")
        return self._tokenizer

    async def start(self) -> None:
        """Ask every replica for its models; the first that answers names the model. Replicas that
        do not answer start out down and are probed in the background."""
        self._client = self._client or self._make_client()
        answers = await asyncio.gather(*(self._list_models(r) for r in self.replicas))
        alive = [(r, models) for r, models in zip(self.replicas, answers, strict=True) if models is not None]
        if not alive:
            reasons = "; ".join(f"{r.name}: {r.last_error}" for r in self.replicas)
            raise EngineError(self._scrub(f"no engine server answered ({reasons})"))
        await asyncio.gather(*(self._read_workers(r) for r, _ in alive))
        name, lengths, roots = self._pick_model(alive)
        self.llama_cpp = any(isinstance(m.get("meta"), dict) for _, models in alive for m in models)
        self.vllm = any(m.get("owned_by") == "vllm" for _, models in alive for m in models)
        hf_tok = None if self._given_tokenizer is not None else await self._load_tokenizer(name, roots)
        special: frozenset[str] = frozenset()
        if self._given_tokenizer is not None:
            self._tokenizer = self._given_tokenizer
        elif hf_tok is not None:
            from engine.embedded import HFTokenizer

            vocab = hf_tok.get_vocab() if hasattr(hf_tok, "get_vocab") else {}
            special = frozenset(t for t in vocab if t.startswith(("<", "[", "▁<")))
            self._tokenizer = HFTokenizer(hf_tok)
        else:
            self._tokenizer = ApproxTokenizer()
        max_len = min(lengths) if lengths else self._default_max_model_len
        self._model = ModelInfo(name=name, max_model_len=max_len, special_tokens=special)
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="ember-remote-monitor")
        await self._prepare_logprobs([r for r, _ in alive])
        log.info(
            "remote engine: model %s (max_model_len %d) on %d of %d replicas: %s",
            name, max_len, len(alive), len(self.replicas), ", ".join(r.name for r, _ in alive),
        )
        for r, _ in alive:
            if r.router_workers is not None:
                log.info("%s is a router with %d of %d workers healthy", r.name, *r.router_workers)

    async def stream(
        self, prompt: str, params: GenerationParams, request_id: str, *, routing_key: str | None = None,
        fields: dict[str, Any] | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Chunks of the completion (see :meth:`_serve` for the choice of replica). A stream that
        breaks after text has been yielded is resumed: the prompt plus the text so far, for the
        tokens left, on the next replica (or through the same router, on another worker), up to
        ``max_resumes`` times; with greedy decoding it goes on as the broken stream would have.
        ``fields``: more of the request's body (llama.cpp's ``id_slot``)."""
        if not self.ready:
            raise EngineNotReady("not connected to the engine server yet")
        sent, tokens, broken = "", 0, ""
        # Without failover a request may wait on its replica as long as it would over all of them.
        first_token_s = self.first_token_timeout * (1 if params.failover else len(self.replicas))
        self._streams.add(request_id)
        try:
            for resumes in range(self.max_resumes + 1):
                if tokens >= params.max_tokens:  # it broke after the last token
                    yield Chunk(text="", finish_reason="length")
                    return
                left = replace(params, max_tokens=params.max_tokens - tokens)
                try:
                    body = {**self._body(prompt + sent, left), **(fields or {})}
                    served = self._serve(body, request_id, routing_key, first_token_s)
                    async with contextlib.aclosing(served) as chunks:
                        async for chunk in chunks:
                            sent += chunk.text
                            tokens += chunk.token_count
                            yield chunk
                    return
                except _Broken as exc:
                    broken = self._scrub(str(exc))
                    if resumes == self.max_resumes:
                        raise EngineError(broken) from exc
                    self.resumed += 1
                    log.warning("request %s: %s; resuming after %d tokens", request_id, broken, tokens)
                except EngineError as exc:
                    if not broken:
                        raise
                    raise EngineError(f"{broken}; resuming it failed: {exc}") from exc
        finally:
            self._streams.discard(request_id)
            self._aborted.discard(request_id)

    async def _serve(
        self, body: dict[str, Any], request_id: str, routing_key: str | None, first_token_s: float
    ) -> AsyncGenerator[Chunk, None]:
        """Chunks from the first replica (in :func:`order`) that serves ``body``. A failure before
        the first token moves on to the next replica; when every replica failed and a moment may
        cure it (HTTP 5xx: a router whose worker just died answers 500 until its health check
        notices), the round is repeated after a backoff while the first-token deadline allows.
        Raises :class:`_Broken` when the stream breaks after text was yielded."""
        headers = {"X-Session-ID": session_id(routing_key)} if routing_key is not None else {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + first_token_s
        failures: list[str] = []
        for backoff in (*self.retry_backoff, None):
            retry = False
            for replica in order(self.replicas, routing_key, request_id, self.load_policy):
                if request_id in self._aborted:
                    return
                try:
                    async with contextlib.aclosing(self._attempt(replica, body, request_id, headers, first_token_s)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    replica.failures = 0
                    return
                except _AttemptFailed as exc:
                    message = self._scrub(str(exc))
                    failures.append(message)
                    retry = retry or exc.retry
                    if exc.mark_down:
                        self._mark_down(replica, message)
                    log.info("request %s: %s; trying the next replica", request_id, message)
            if not retry or backoff is None or loop.time() + backoff >= deadline:
                break
            self.retried += 1
            await asyncio.sleep(backoff)
        raise EngineError(self._scrub("no engine server could serve the request: " + "; ".join(failures)))

    async def abort(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is None:
            if request_id in self._streams:
                self._aborted.add(request_id)  # between two attempts: start no other
            return  # already finished, like vLLM's abort of an unknown id
        active.aborted = True
        active.producer.cancel()
        # Closing the connection is what makes vLLM abort: wait until it is closed.
        await asyncio.gather(active.producer, return_exceptions=True)

    async def close(self) -> None:
        for active in list(self._active.values()):
            active.producer.cancel()
        for warmup in self._logprobs_warmups.values():
            warmup.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # -- introspection ----------------------------------------------------------------------------

    def replica_status(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(
                r.name, r.up, r.failures, r.inflight, r.waiting, r.running, r.kv_usage, r.last_error, r.router_workers
            )
            for r in self.replicas
        ]

    @property
    def behind_router(self) -> bool:
        """Whether a router (vllm-router, SGLang's gateway) stands between ember and the engines."""
        return any(r.router_workers is not None for r in self.replicas)

    def engine_stats(self) -> dict[str, Any]:
        """For ``ember/stats`` and Prometheus: the replicas, whether a router is in front and how
        many of its workers are healthy, and how often streams were resumed or rounds repeated."""
        workers = [r.router_workers for r in self.replicas if r.router_workers is not None]
        return {
            "replicas": [dataclasses.asdict(s) for s in self.replica_status()],
            "router": self.behind_router,
            "router_workers_healthy": sum(h for h, _ in workers) if workers else None,
            "router_workers": sum(t for _, t in workers) if workers else None,
            "resumed": self.resumed,
            "retried": self.retried,
        }

    def route(self, routing_key: str | None, request_id: str = "") -> list[str]:
        """The replicas (redacted URLs) a request with this key would try now, in order."""
        return [r.name for r in order(self.replicas, routing_key, request_id, self.load_policy)]

    # -- one attempt on one replica ---------------------------------------------------------------

    def _body(self, prompt: str, params: GenerationParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model.name,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "stream": True,
            # The final event then carries usage (vLLM: with prompt_tokens_details.cached_tokens).
            "stream_options": {"include_usage": True},
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.logprobs:
            body["logprobs"] = 0  # the sampled tokens' own, no alternatives
            if self.llama_cpp:
                body["n_probs"] = 1  # llama.cpp: the sampled token's (and the top one's)
        if self.llama_cpp:
            # Every event then carries the prompt's processed and cached token counts: usage comes
            # only after the last token, which a caller that stops early never reads.
            body["timings_per_token"] = True
        return body

    async def _produce(
        self, replica: Replica, body: dict[str, Any], headers: dict[str, str], queue: asyncio.Queue[Any]
    ) -> None:
        """Reads one HTTP response into ``queue``; always ends with an :class:`_End`."""
        assert self._client is not None
        try:
            async with self._client.stream(
                # A UUID: llama-cpp-python's server answers HTTP 400 to any other X-Request-Id.
                "POST", f"{replica.url}/v1/completions", json=body, headers={**headers, "X-Request-Id": str(uuid.uuid4())}
            ) as response:
                if response.status_code >= 400:
                    raise self._status_error(replica, response.status_code, await response.aread())
                if "json" in response.headers.get("content-type", ""):
                    # A server that ignored `stream: true` answers with one JSON object.
                    queue.put_nowait(decode_event((await response.aread()).decode("utf-8", "replace")))
                    queue.put_nowait(DONE)
                else:
                    async for event in events(response.aiter_lines()):
                        queue.put_nowait(event)
            queue.put_nowait(_End())
        except asyncio.CancelledError:
            queue.put_nowait(_End(cancelled=True))
            raise
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            queue.put_nowait(_End(_AttemptFailed(f"cannot connect to {replica.name} ({_describe(exc)})")))
        except httpx.HTTPError as exc:  # read/write errors, protocol errors, a closed connection
            queue.put_nowait(_End(_AttemptFailed(f"the connection to {replica.name} failed ({_describe(exc)})", retry=True)))
        except Malformed as exc:
            queue.put_nowait(_End(_AttemptFailed(f"{replica.name} sent a malformed stream: {exc}")))
        except (_AttemptFailed, EngineError) as exc:
            queue.put_nowait(_End(exc))
        except Exception as exc:  # noqa: BLE001 - never leave the consumer waiting
            queue.put_nowait(_End(_AttemptFailed(f"reading from {replica.name} failed: {exc!r}")))

    def _status_error(self, replica: Replica, status: int, body: bytes) -> Exception:
        detail = body[:300].decode("utf-8", "replace").strip()
        message = f"{replica.name} answered HTTP {status}: {detail}"
        if status >= 500:
            return _AttemptFailed(message, retry=True)
        if status in (408, 429):  # busy, not broken: try another replica but keep this one in
            return _AttemptFailed(message, mark_down=False)
        # 4xx: the request itself is wrong (bad model name, prompt too long): no replica will take it.
        return EngineError(self._scrub(message))

    async def _attempt(
        self, replica: Replica, body: dict[str, Any], request_id: str, headers: dict[str, str], first_token_s: float
    ) -> AsyncGenerator[Chunk, None]:
        """Chunks from one replica. Raises _AttemptFailed while no text has been yielded, _Broken after.

        Text chunks count one token each (one SSE event is one decode step on vLLM and llama.cpp);
        the last chunk, empty, carries finish_reason and the server's usage: prompt_tokens,
        cached_tokens, and the token count that makes the total equal ``completion_tokens``."""
        if not replica.logprobs_ready and "logprobs" in body:
            body = {key: value for key, value in body.items() if key not in ("logprobs", "n_probs")}
        queue: asyncio.Queue[Any] = asyncio.Queue()
        producer = asyncio.create_task(self._produce(replica, body, headers, queue))
        active = _Active(producer, replica)
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
            if not producer.done():
                # Closing the response closes the connection, and vLLM aborts the request.
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)

    async def _next_item(self, queue: asyncio.Queue[Any], replica: Replica, progress: _Progress) -> Any:
        """The producer's next item, within the deadline that applies now; ``_FINISHED`` when the
        completion is complete and nothing more came in time."""
        if progress.final is not None:
            # Finished: wait briefly for the usage event and [DONE], reading to the end keeps
            # the connection reusable.
            timeout = min(self.read_timeout, 2.0)
        elif progress.yielded:
            timeout = self.read_timeout
        else:
            timeout = max(0.0, progress.first_deadline - asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout(timeout):
                return await queue.get()
        except TimeoutError:
            if progress.final is not None:
                return _FINISHED
            if progress.yielded:
                message = f"no token for {self.read_timeout:g} s after {progress.yielded} chunks"
                self._mark_down(replica, self._scrub(f"{replica.name} stalled: {message}"))
                raise _Broken(f"the stream from {replica.name} broke mid-stream: {message}") from None
            raise _AttemptFailed(f"{replica.name} sent no token within {progress.first_token_s:g} s") from None

    def _check_end(self, end: _End, replica: Replica, progress: _Progress) -> None:
        """The producer ended: fine when cleanly or after the completion was complete; raises otherwise."""
        if end.cancelled:  # close() of the engine
            progress.final = Chunk(text="", finish_reason="abort")
            return
        if end.error is None or progress.final is not None:
            return  # a clean end, or trouble after the completion was complete
        if progress.yielded:
            # The caller already has part of the text: stream() resumes after it, not from the start.
            self._mark_down(replica, self._scrub(str(end.error)))
            message = f"the stream from {replica.name} broke mid-stream after {progress.yielded} chunks: {end.error}"
            raise _Broken(self._scrub(message)) from end.error
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
                    self._mark_down(replica, f"{replica.name} closed a stream before it finished")
                    raise _Broken(
                        f"the stream from {replica.name} broke mid-stream after {progress.yielded} chunks: "
                        "the connection closed before the completion finished"
                    )
                raise _AttemptFailed(f"{replica.name} closed the stream without a completion", retry=True)
            final = Chunk(text="", finish_reason="stop")  # [DONE] without a finish_reason
        usage = progress.usage
        if usage is not None:
            final.prompt_tokens = usage.prompt_tokens
            final.cached_tokens = usage.cached_tokens
            if usage.completion_tokens is not None and usage.completion_tokens >= progress.counted:
                final.token_count = usage.completion_tokens - progress.counted
        return final

    # -- health ----------------------------------------------------------------------------------

    def _mark_down(self, replica: Replica, reason: str) -> None:
        replica.failures += 1
        replica.last_error = reason
        delay = probe_delay(replica.failures, self.probe_initial, self.probe_max)
        replica.next_probe = asyncio.get_running_loop().time() + delay
        if replica.up:
            log.warning("engine replica %s is down (%s); probing again in %.1f s", replica.name, reason, delay)
        replica.up = False
        self._wake.set()

    async def _list_models(self, replica: Replica) -> list[dict[str, Any]] | None:
        """``/v1/models`` entries, [] for a live server that does not list models, None if down."""
        assert self._client is not None
        try:
            response = await self._client.get(f"{replica.url}/v1/models", timeout=self._probe_timeouts())
        except httpx.HTTPError as exc:
            self._mark_down(replica, self._scrub(f"cannot reach {replica.name} ({_describe(exc)})"))
            return None
        if response.status_code == 404:
            return []
        if response.status_code >= 400:
            self._mark_down(replica, self._scrub(f"{replica.name} answered HTTP {response.status_code} on /v1/models"))
            return None
        try:
            data = response.json().get("data") or []
        except (ValueError, AttributeError):
            data = []
        return [d for d in data if isinstance(d, dict)]

    def _pick_model(
        self, alive: list[tuple[Replica, list[dict[str, Any]]]]
    ) -> tuple[str, list[int], list[str]]:
        name = self._requested_model
        if name is None:
            for _, models in alive:
                if models and isinstance(models[0].get("id"), str):
                    name = models[0]["id"]
                    break
        if name is None:
            raise EngineError(
                "the engine server does not list its models (/v1/models): name the model with --model"
            )
        lengths: list[int] = []
        roots: list[str] = []
        for replica, models in alive:
            entry = next((m for m in models if m.get("id") == name), None)
            if entry is None:
                if models:
                    listed = ", ".join(str(m.get("id")) for m in models)
                    log.warning("replica %s does not list model %s (it lists: %s)", replica.name, name, listed)
                continue
            length = int_or_none(entry.get("max_model_len"))
            meta = entry.get("meta")
            if length is None and isinstance(meta, dict):  # llama.cpp reports its context in meta
                length = int_or_none(meta.get("n_ctx")) or int_or_none(meta.get("n_ctx_train"))
            if length:
                lengths.append(length)
            if isinstance(entry.get("root"), str):
                roots.append(entry["root"])
        return name, lengths, roots

    async def _load_tokenizer(self, name: str, roots: list[str]) -> Any:
        for candidate in (self._tokenizer_path, name, *roots):
            path = _local_tokenizer_dir(candidate)
            if path is None:
                continue
            try:
                return await asyncio.to_thread(_load_hf_tokenizer, path)
            except Exception as exc:  # noqa: BLE001 - any unloadable tokenizer: estimate instead
                log.warning("could not load the tokenizer in %s (%s); estimating token counts", path, exc)
        log.info("no local tokenizer for %s: estimating 1 token per %.1f characters", name, ApproxTokenizer.chars_per_token)
        return None

    async def _probe(self, replica: Replica) -> None:
        """Bring a down replica back when it answers /health (vLLM) or /v1/models (others)."""
        assert self._client is not None
        try:
            response = await self._client.get(f"{replica.url}/health", timeout=self._probe_timeouts())
            if response.status_code in (404, 405):
                response = await self._client.get(f"{replica.url}/v1/models", timeout=self._probe_timeouts())
            healthy = response.status_code < 400
            reason = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            healthy = False
            reason = _describe(exc)
        if healthy:
            log.warning("engine replica %s is back", replica.name)
            replica.up = True
            replica.silent_polls = 0
            replica.metrics_due = 0.0
            await self._prepare_logprobs([replica], wait_s=0.0)  # it may be a fresh server
            return
        self._mark_down(replica, self._scrub(f"probe of {replica.name} failed ({reason})"))

    async def _prepare_logprobs(self, replicas: list[Replica], wait_s: float = LOGPROBS_WARMUP_WAIT_S) -> None:
        """Ask each vLLM replica for one token with log-probabilities and wait up to ``wait_s``
        for the answers: a fresh vLLM compiles a kernel on its first such request, and the user's
        first completion should not be the one that waits for it (it ran past the 15 s deadline
        on a 2-core CPU). Until a replica has answered, requests to it ask for no
        log-probabilities (their suggestions carry no confidence)."""
        if not self.vllm:
            return
        for replica in replicas:
            if replica.url not in self._logprobs_warmups:
                replica.logprobs_ready = False
                warmup = asyncio.create_task(self._warm_logprobs(replica), name=f"ember-logprobs-{replica.name}")
                self._logprobs_warmups[replica.url] = warmup
                warmup.add_done_callback(functools.partial(self._warmup_done, replica.url))
        pending = [self._logprobs_warmups[r.url] for r in replicas if r.url in self._logprobs_warmups]
        if pending and wait_s > 0:
            log.info("asking %d engine server(s) for a first answer with log-probabilities", len(pending))
            _, slow = await asyncio.wait(pending, timeout=wait_s)
            if slow:
                log.warning(
                    "%d engine server(s) gave no answer with log-probabilities in %.0f s: asking them for none until they do",
                    len(slow), wait_s,
                )

    def _warmup_done(self, url: str, _: asyncio.Task[None]) -> None:
        self._logprobs_warmups.pop(url, None)

    async def _warm_logprobs(self, replica: Replica) -> None:
        assert self._client is not None
        body = {"model": self.model.name, "prompt": "def", "max_tokens": 1, "temperature": 0.0, "logprobs": 0}
        started = asyncio.get_running_loop().time()
        timeout = httpx.Timeout(600.0, connect=self.connect_timeout)
        try:
            response = await self._client.post(f"{replica.url}/v1/completions", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            log.info("%s: no first answer with log-probabilities (%s); asked again when it is back", replica.name, _describe(exc))
            return
        # An error answer is the request path's to report: the warm-up changes nothing then.
        replica.logprobs_ready = True
        took = asyncio.get_running_loop().time() - started
        log.info("%s answered with log-probabilities (HTTP %d) after %.1f s", replica.name, response.status_code, took)

    async def _read_workers(self, replica: Replica) -> None:
        """Notes whether ``replica`` is a router (its ``/workers`` lists workers) and how many of
        them are healthy; a plain vLLM server answers 404."""
        assert self._client is not None
        try:
            response = await self._client.get(f"{replica.url}/workers", timeout=self._probe_timeouts())
            replica.router_workers = router_workers(response.json()) if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            pass  # unknown this time: keep what was known

    async def _poll_metrics(self, replica: Replica) -> None:
        assert self._client is not None
        loop = asyncio.get_running_loop()
        replica.metrics_due = loop.time() + self.metrics_interval
        try:
            response = await self._client.get(f"{replica.url}/metrics", timeout=self._probe_timeouts())
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Refused: the server is gone. A slow answer is not enough: a busy CPU server is slow.
            self._mark_down(replica, self._scrub(f"cannot connect to {replica.name} ({type(exc).__name__})"))
            return
        except httpx.HTTPError as exc:
            # A busy vLLM still answers /metrics (its API server is not the engine core), so
            # repeated silence means a frozen host; requests that a caller cancels before their
            # first-token deadline would never reveal it.
            replica.silent_polls += 1
            if replica.silent_polls >= self.silent_polls_down:
                silence = f"{replica.name} did not answer /metrics {replica.silent_polls} times ({type(exc).__name__})"
                self._mark_down(replica, self._scrub(silence))
            return
        replica.silent_polls = 0
        if response.status_code == 404:
            replica.has_metrics = False  # not vLLM: routing falls back to local in-flight counts
            return
        if response.status_code >= 400:
            return
        samples = parse_prometheus(response.text)
        replica.waiting = metric_sum(samples, "vllm:num_requests_waiting")
        replica.running = metric_sum(samples, "vllm:num_requests_running")
        replica.kv_usage = metric_sum(samples, "vllm:kv_cache_usage_perc")

    async def _watch(self) -> None:
        """Probe down replicas when their backoff expires and poll /metrics of live ones."""
        loop = asyncio.get_running_loop()
        multi = len(self.replicas) > 1
        while True:
            now = loop.time()
            jobs = []
            for r in self.replicas:
                if not r.up and now >= r.next_probe:
                    jobs.append(self._probe(r))
                elif r.up and r.router_workers is not None and now >= r.metrics_due:
                    r.metrics_due = now + self.metrics_interval
                    jobs.append(self._read_workers(r))
                elif r.up and multi and r.has_metrics and now >= r.metrics_due:
                    jobs.append(self._poll_metrics(r))
            if jobs:
                await asyncio.gather(*jobs, return_exceptions=True)
            now = loop.time()
            dues = [r.next_probe for r in self.replicas if not r.up]
            dues += [r.metrics_due for r in self.replicas if r.up and ((multi and r.has_metrics) or r.router_workers is not None)]
            delay = min(dues, default=now + 60.0) - now
            self._wake.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.05, delay)):
                    await self._wake.wait()

    # -- plumbing ----------------------------------------------------------------------------------

    def _make_client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            import h2  # noqa: F401  (httpx needs it for HTTP/2)

            http2 = True
        except ImportError:
            http2 = False
        limits = httpx.Limits(max_connections=self._max_connections, max_keepalive_connections=self._max_connections)
        return httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=self._uds, limits=limits) if self._uds else None,
            # HTTP/2 is negotiated over TLS when the server offers it; vLLM speaks HTTP/1.1, where
            # keep-alive pooling saves a connect per request.
            http2=http2,
            verify=self._verify,
            headers=headers,
            # No httpx read timeout: first-token and between-token deadlines are enforced per
            # request, where a timeout can move the request to another replica.
            timeout=httpx.Timeout(connect=self.connect_timeout, read=None, write=self.connect_timeout, pool=self.connect_timeout),
            limits=limits,
        )

    def _probe_timeouts(self) -> httpx.Timeout:
        return httpx.Timeout(self.probe_timeout, connect=self.connect_timeout)

    def _scrub(self, message: str) -> str:
        """The API key never appears in messages, even if a server echoes it back."""
        if self._api_key:
            message = message.replace(self._api_key, "***")
        return message


async def fetch_metrics(
    url: str, client: httpx.AsyncClient | None = None, timeout: float = 5.0  # noqa: ASYNC109 - httpx's request timeout
) -> list[Sample]:
    """The Prometheus samples of one server's /metrics ([] when it has none)."""
    base = normalize_url(url)
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=timeout))
        response = await client.get(f"{base}/metrics", timeout=timeout)
        if response.status_code >= 400:
            return []
        return parse_prometheus(response.text)


async def prefix_cache_hits(url: str, client: httpx.AsyncClient | None = None) -> float | None:
    """vLLM's prefix-cache hit counter (tokens) on one server; None if the server does not export it."""
    return metric_sum(await fetch_metrics(url, client), "vllm:prefix_cache_hits_total")


async def finished_requests(url: str, client: httpx.AsyncClient | None = None) -> float | None:
    """Requests one vLLM server finished, aborted ones left out."""
    samples = await fetch_metrics(url, client)
    return metric_sum(samples, "vllm:request_success_total", exclude={"finished_reason": "abort"})

