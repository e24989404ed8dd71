"""Serving sessions over the transports: stdio, TCP and a stream socket (the daemon's), and the
Prometheus endpoint. The command line (:mod:`lsp.cli`) and the daemon (:mod:`lsp.daemon`) both
start servers through here; it imports the server, so they import it only when they serve.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import sys
from typing import Any, BinaryIO

from lsp.engine_host import EmberCore, close_and_exit
from lsp.metrics import prometheus_text
from lsp.protocol import serve_stdio_messages, serve_stream_messages
from lsp.server import build_server
from lsp.stats import process_holdings, resident_mib

log = logging.getLogger("ember")


async def serve_metrics(core: EmberCore, port: int) -> asyncio.Server:
    """A minimal HTTP endpoint for Prometheus; loopback only, it reveals no source text."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            ok = request.split(b" ")[1:2] == [b"/metrics"]
            engine = core.engine.engine_stats() if core.engine is not None else None
            process = {**process_holdings(), "resident_mib": resident_mib()}
            body = prometheus_text(core.metrics, engine, core.engine_counters(), process).encode() if ok else b"not found\n"
            status = b"200 OK" if ok else b"404 Not Found"
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", port)


def stop_on_sigterm(core: EmberCore) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(close_and_exit(core, 0)))


async def serve_stdio(core: EmberCore, metrics_port: int | None = None) -> None:
    if metrics_port is not None:
        await serve_metrics(core, metrics_port)
    server = build_server(core)
    stdout = lsp_stdout()
    stop_on_sigterm(core)
    try:
        await serve_stdio_messages(server, stdout, log)
    finally:
        # stdin closed (the editor quit or crashed) or exit: never outlive the editor.
        await close_and_exit(core, 0)


def lsp_stdout() -> BinaryIO:
    """The LSP stream gets its own copy of fd 1, and fd 1 itself becomes stderr: a library (or
    a child process) that prints to stdout cannot corrupt the protocol."""
    stream = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    return stream


async def serve_connection(
    core: EmberCore, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, token: str | None, peer: Any
) -> None:
    """One editor over a stream (TCP, or the daemon's Unix socket): its own server (documents,
    settings) on the shared ``core``."""
    log.info("editor connected from %s", peer)
    server = build_server(core, token=token, exit_process=False)
    try:
        await serve_stream_messages(server, reader, writer, log)
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        log.info("editor %s went away: %s", peer, exc)
    finally:
        server.on_exit()
        writer.close()
        log.info("editor %s disconnected", peer)


async def serve_tcp(
    core: EmberCore, host: str, port: int, token: str | None, tls: ssl.SSLContext | None, metrics_port: int | None = None
) -> None:
    """Each connection gets its own server (documents, settings); all share ``core``."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_connection(core, reader, writer, token=token, peer=writer.get_extra_info("peername"))

    stop_on_sigterm(core)
    if metrics_port is not None:
        await serve_metrics(core, metrics_port)
    core.start_engine()
    listener = await asyncio.start_server(connection, host, port, ssl=tls)
    addresses = ", ".join(str(sock.getsockname()) for sock in listener.sockets)
    # Tests and scripts read this line to learn the port when PORT is 0.
    print(f"ember listening on {addresses}", file=sys.stderr, flush=True)
    try:
        async with listener:
            await listener.serve_forever()
    finally:
        await core.close()
