"""Tiny OpenAI-compatible servers: a few lines of HTTP/1.1 each, for the remote engine's fault
tests and for load tests of ember's own process (where the engine's work would only add time)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from tests.conftest import free_port


def sse(event: dict | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event)
    return f"data: {data}\n\n".encode()


def text_event(text: str, finish: str | None = None) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


@dataclass
class FakeServer:
    """``behaviour`` answers POST /v1/completions; /v1/models, /health and /metrics are fixed."""

    behaviour: str
    tag: str = "fake"
    port: int = field(default_factory=free_port)
    hang_everything: bool = False
    metrics_text: str | None = None  # None: /metrics is 404, as on llama.cpp or Ollama
    workers: list[dict] | None = None  # a router's /workers list; None: 404, as on a plain server
    failures_left: int = 1  # for "recovering": HTTP 500 this many times, then "good"
    delay_s: float = 1.5  # for "slow": the first token comes this late, then "good"
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)  # the JSON of each POST /v1/completions
    unanswered: int = 0  # for "closing": requests that met a connection closed under them
    _server: asyncio.AbstractServer | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def completions(self) -> int:
        return sum(1 for method, path, _ in self.requests if path == "/v1/completions")

    async def start(self) -> FakeServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            payload = b""
            if int(headers.get("content-length", 0)):
                payload = await reader.readexactly(int(headers["content-length"]))
            self.requests.append((method, path, headers))
            if path == "/v1/completions" and payload:
                self.bodies.append(json.loads(payload))
            if self.hang_everything:
                await asyncio.sleep(3600)
            if path == "/v1/models":
                body = json.dumps({"data": [{"id": "fake-model", "max_model_len": 1024}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            elif path == "/workers" and self.workers is not None:
                body = json.dumps({"workers": self.workers, "total": len(self.workers)}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            elif path == "/metrics" and self.metrics_text is not None:
                body = self.metrics_text.encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            elif path == "/v1/completions" and self.behaviour == "closing":
                await self._closing(reader, writer)
            elif path == "/v1/completions":
                await getattr(self, f"_{self.behaviour}")(writer, headers)
            else:  # /health and /metrics: not offered, like llama.cpp or Ollama
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _good(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        # What llama.cpp / Ollama-like servers send: comments, keepalives, other SSE fields, no usage.
        writer.write(SSE_HEAD + b": keepalive\n\n" + b"event: completion\n")
        writer.write(sse(text_event(f"from-{self.tag}")) + b"\n" + b": ping\n\n" + sse(text_event(" ok")))
        writer.write(sse(text_event("", "stop")) + sse("[DONE]"))

    async def _closing(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # llama-server's way: a streamed answer whose headers keep the connection open, then the
        # connection closed under the next request sent on it, which gets no answer at all.
        body = sse(text_event(f"from-{self.tag}")) + sse(text_event(" ok")) + sse(text_event("", "stop")) + sse("[DONE]")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request on this connection
        self.unanswered += 1

    async def _always500(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\ndead")

    async def _endless(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        # A stream that never ends: a token every 50 ms, no finish reason, no [DONE].
        writer.write(SSE_HEAD)
        while True:
            writer.write(sse(text_event(" x")))
            await writer.drain()
            await asyncio.sleep(0.05)

    async def _slow(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        await asyncio.sleep(self.delay_s)  # a long prefill queue
        await self._good(writer, headers)

    async def _hang(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        await asyncio.sleep(3600)

    async def _garbage(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        writer.write(SSE_HEAD + b"<html>oops</html>\n" + b"data: {\"choices\": [{\"text\": \n\n" + b"data: [D0NE\n\n")

    async def _midstream(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        # Chunked transfer cut off without its terminating chunk: the peer died mid-response.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in ("hel", "lo"):
            payload = sse(text_event(piece))
            writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.transport.abort()

    async def _stall(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        writer.write(SSE_HEAD + sse(text_event("partial")))
        await writer.drain()
        await asyncio.sleep(3600)

    async def _bad_request(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        body = json.dumps({"error": {"message": f"prompt too long; you sent {headers.get('authorization')}"}}).encode()
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    async def _recovering(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        # A router whose worker just died: 500 until its health check takes the worker out.
        if self.failures_left > 0:
            self.failures_left -= 1
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\ndead")
        else:
            await self._good(writer, headers)

    async def _unavailable(self, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
