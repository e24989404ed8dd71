"""The pygls fence: the ONLY module in ember that touches pygls' (and lsprotocol's) private API.

pygls gives no public way to do what ember needs at the JSON-RPC edge, so ember overrides or
reaches into these; each is pinned by a test in ``tests/test_pygls_fence.py`` (run it before
moving the pygls pin in ``pyproject.toml``):

- ``JsonRPCProtocol._execute_handler`` (and ``_request_futures``): pygls files the future of every
  notification under a fresh uuid and never removes it, one leaked future per keystroke.
- ``JsonRPCProtocol.structure_message`` (and the ``__cause__`` of the error it raises): a message
  lsprotocol cannot read becomes :class:`EmberProtocol.Malformed` and gets an answer, where pygls
  would drop it and leave the client waiting.
- ``JsonRPCProtocol.handle_message`` (and ``_shutdown``, ``_send_data``, ``_send_response``):
  -32002 before ``initialize``, -32600 after ``shutdown``, errors for malformed requests, and
  nothing but initialize and exit read from a connection without its token.
- ``LanguageServerProtocol.lsp_text_document__did_open/did_change/did_close`` (found by
  ``lsp_method``'s ``method_name``): ember keeps its own documents; pygls' workspace would hold a
  second copy and raise on a didChange for an unknown URI, so ember's handler would never run.
- ``LanguageServerProtocol.lsp_exit``: pygls calls ``sys.exit``; ember ends one connection (the
  process only over stdio, after stopping the engine).
- ``JsonRPCServer._stop_event`` and ``pygls.io_`` (``run_async``, ``StdinAsyncReader``,
  ``StdoutWriter``): ember runs pygls' read loop itself, on its own transports, behind
  :class:`lsp.framing.ResyncReader` (a wrong Content-Length costs one message, not the
  connection), and stops it when a session ends.
- ``JsonRpcException.CODE``: what pygls puts in the error it answers with.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from collections.abc import Generator, Iterator
from typing import Any, BinaryIO, Protocol

from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pygls.io_ import StdinAsyncReader, StdoutWriter, run_async
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method
from pygls.server import JsonRPCServer

from lsp.framing import AsyncReader, ResyncReader

log = logging.getLogger(__name__)


class Session(Protocol):
    """What the protocol reads of the editor session it serves (:class:`lsp.session.EmberServer`)."""

    authorized: bool  # False until a TCP client that needs a token has sent it

    def on_exit(self) -> None: ...

    def end(self, *, clean: bool) -> None: ...


class UnknownDocument(JsonRpcException):
    """-32602 with a message naming the URI."""

    CODE = -32602  # pygls reads the class attribute CODE when it serialises the error


class EmberProtocol(LanguageServerProtocol):
    """pygls' protocol with strict JSON-RPC/LSP edges: every request gets an answer, also a
    malformed one (pygls would drop it and leave the client waiting), requests before
    ``initialize`` get -32002 ServerNotInitialized and notifications then are dropped (LSP),
    requests after ``shutdown`` get -32600 InvalidRequest (LSP)."""

    class Malformed:
        """A message lsprotocol could not read: wrong "jsonrpc", missing or mistyped fields,
        negative positions. ``reason`` names the fields (JSON paths) and briefly what is wrong."""

        def __init__(self, data: dict[str, Any], reason: str, code: int) -> None:
            method, msg_id = data.get("method"), data.get("id")
            self.method = method if isinstance(method, str) else None
            self.id = msg_id if isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool) else None
            self.is_request = "id" in data and "method" in data
            self.reason = reason
            self.code = code

    _initialize_seen = False

    @property
    def session(self) -> Session:
        """The editor session this protocol reads for."""
        return self._server  # type: ignore[return-value]

    def send_json(self, data: dict[str, Any]) -> None:
        """Sends a message as it is: lsprotocol's converter would drop a null id."""
        self._send_data(data)

    def _execute_handler(self, msg_id: Any, handler: Any, callback: Any, args: Any = None, kwargs: Any = None) -> None:
        """pygls files the future of every notification (and of every handler a generator
        yields to) in ``_request_futures`` under a fresh uuid and never removes it: one leaked
        future per keystroke. Remove each entry when its future is done."""
        super()._execute_handler(msg_id, handler, callback, args, kwargs)
        future = self._request_futures.get(msg_id)
        if future is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            future.add_done_callback(functools.partial(self._forget_future, msg_id))
            return
        # Later, on the loop: shutdown cancels futures while iterating over this dict, and a
        # cancelled future runs its callbacks at once (in the thread that finished it).
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._forget_future, msg_id, done))

    def _forget_future(self, msg_id: Any, future: Any) -> None:
        if self._request_futures.get(msg_id) is future:
            del self._request_futures[msg_id]

    def structure_message(self, data: dict[str, Any]) -> Any:
        if "jsonrpc" not in data:
            return data  # a nested object, or a message without "jsonrpc" (handle_message answers it)
        if data.get("jsonrpc") != "2.0":
            return EmberProtocol.Malformed(data, 'invalid request: "jsonrpc" must be "2.0"', -32600)
        if not isinstance(data.get("method", ""), str) or ("id" in data and not isinstance(data["id"], (int, str))):
            return EmberProtocol.Malformed(data, "invalid request: method must be a string, id a number or string", -32600)
        try:
            return super().structure_message(data)
        except Exception as exc:  # noqa: BLE001 - answered as -32602 instead of killing the message
            if "method" in data and "params" not in data:
                try:  # JSON-RPC lets a request or notification omit params (pygls does not)
                    return super().structure_message({**data, "params": None})
                except Exception:  # noqa: BLE001 - the method needs params: report the first error
                    pass
            reason = unreadable_reason(exc)
            return EmberProtocol.Malformed(data, f"invalid params for {data.get('method')}: {reason}", -32602)

    def handle_message(self, message: Any) -> None:
        """Before a valid token (TCP servers that need one) only initialize and exit are read."""
        server = self.session
        if isinstance(message, dict):  # pygls leaves a message without "jsonrpc" unstructured
            message = EmberProtocol.Malformed(message, 'invalid request: "jsonrpc": "2.0" is missing', -32600)
        method = getattr(message, "method", None)
        if not server.authorized and method not in (types.INITIALIZE, types.EXIT):
            log.warning("dropped %s from an unauthorized connection", method)
            if self.writer is not None:
                self.writer.close()
            server.on_exit()
            return
        is_request = method is not None and hasattr(message, "id")
        if isinstance(message, EmberProtocol.Malformed):
            if message.is_request:  # JSON-RPC: "id": null when the id itself is unusable
                reply = {"code": message.code, "message": f"ember: {message.reason}"}
                self._send_data({"jsonrpc": "2.0", "id": message.id, "error": reply})
            else:
                log.warning("ignored a malformed %s message: %s", message.method or "JSON-RPC", message.reason)
            return
        if not self._initialize_seen and method not in (types.INITIALIZE, types.EXIT, None):
            if is_request:
                error = JsonRpcException(f"ember: {method} before initialize; send initialize first", -32002)
                self._send_response(message.id, error=error.to_response_error())
            else:
                log.warning("dropped %s: it arrived before initialize", method)
            return
        if method == types.INITIALIZE:
            self._initialize_seen = True
        if self._shutdown and is_request and method != types.EXIT:
            error = JsonRpcException(f"ember: {method} after shutdown; only exit is accepted", -32600)
            self._send_response(message.id, error=error.to_response_error())
            return
        super().handle_message(message)

    # ember keeps its own documents (context.source.document.Document). pygls' built-in handlers would also
    # keep a second copy in its workspace, re-split into lines on every change, and raise (so that
    # ember's handler never runs) on a didChange for an unknown URI: go straight to ember's handlers.

    def _user_handler(self, method: str, params: Any) -> Iterator[tuple[Any, tuple[Any, ...], None]]:
        if (handler := self.fm.features.get(method)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams) -> Iterator[Any]:
        yield from self._user_handler(types.TEXT_DOCUMENT_DID_OPEN, params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams) -> Iterator[Any]:
        yield from self._user_handler(types.TEXT_DOCUMENT_DID_CHANGE, params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams) -> Iterator[Any]:
        yield from self._user_handler(types.TEXT_DOCUMENT_DID_CLOSE, params)

    @lsp_method(types.EXIT)
    def lsp_exit(self, *args: Any) -> Generator[Any, Any, None]:
        """Ends this connection (the session decides whether the process ends too), never
        ``sys.exit`` from inside the read loop as pygls does."""
        self.session.end(clean=self._shutdown)
        yield from ()


def unreadable_reason(exc: Exception) -> str:
    """What was wrong with a message pygls could not structure: the fields (JSON paths) cattrs
    names in the error pygls raises from."""
    import cattrs

    cause = exc.__cause__ or exc
    if not isinstance(cause, cattrs.BaseValidationError):
        return str(cause)[:200]

    def describe(error: BaseException, _type: Any = None) -> str:
        if isinstance(error, KeyError):
            return "required field missing"
        return f"invalid value ({str(error)[:120]})"

    return "; ".join(cattrs.transform_error(cause, format_exception=describe))


def stop_reading(server: JsonRPCServer) -> None:
    """Ends the read loop of :func:`serve_messages` after the message being handled."""
    if server._stop_event is not None:
        server._stop_event.set()


async def serve_messages(server: LanguageServer, reader: AsyncReader, logger: logging.Logger) -> None:
    """Reads and handles messages until the stream ends or :func:`stop_reading`; a wrong
    Content-Length costs one message. ``logger`` gets the errors of messages that fail."""
    server._stop_event = threading.Event()
    await run_async(
        stop_event=server._stop_event,
        reader=ResyncReader(reader),
        protocol=server.protocol,
        logger=logger,
        error_handler=server.report_server_error,
    )


async def serve_stdio_messages(server: LanguageServer, stdout: BinaryIO, logger: logging.Logger) -> None:
    """:func:`serve_messages` from this process' stdin (read in the server's thread pool),
    answering on ``stdout``."""
    server.protocol.set_writer(StdoutWriter(stdout))
    await serve_messages(server, StdinAsyncReader(sys.stdin.buffer, server.thread_pool), logger)


async def serve_stream_messages(
    server: LanguageServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, logger: logging.Logger
) -> None:
    """:func:`serve_messages` over a socket's streams (TCP, the daemon's Unix socket)."""
    server.protocol.set_writer(writer)
    await serve_messages(server, reader, logger)
