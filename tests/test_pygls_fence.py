"""The pygls fence (lsp/protocol.py): one test per piece of pygls' private API ember overrides or
uses. Each fails when pygls changes under ember: a private method gone or with another
signature, or an override that no longer does its job. Run these before moving the pygls or
lsprotocol pin in pyproject.toml.

Fast and in-process: real pygls servers and protocols, in-memory transports, no engine.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import logging
import sys
import threading
from types import SimpleNamespace
from typing import Any

import cattrs
import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams
from pygls.io_ import StdinAsyncReader, StdoutWriter, run_async
from pygls.lsp.server import LanguageServer
from pygls.protocol import JsonRPCProtocol, LanguageServerProtocol
from pygls.server import JsonRPCServer

import lsp.session
from lsp.config import Settings
from lsp.engine_host import EmberCore
from lsp.protocol import (
    EmberProtocol,
    UnknownDocument,
    serve_stdio_messages,
    serve_stream_messages,
)
from lsp.server import build_server
from lsp.session import EmberServer

URI = "file:///work/fence.py"
log = logging.getLogger("test_pygls_fence")


class Sink:
    """A transport's writing end: keeps what pygls writes (header and body)."""

    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True

    def messages(self) -> list[dict[str, Any]]:
        bodies, rest = [], self.data
        while rest:
            header, _, rest = rest.partition(b"\r\n\r\n")
            length = int(header.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            bodies.append(json.loads(rest[:length]))
            rest = rest[length:]
        return bodies

    def answer(self, msg_id: Any) -> dict[str, Any]:
        found = [m for m in self.messages() if "method" not in m and m.get("id") == msg_id]
        assert len(found) == 1, self.messages()
        return found[0]


def frame(message: dict[str, Any] | bytes) -> bytes:
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def session(*, token: str | None = None, exit_process: bool = False) -> tuple[EmberServer, Sink]:
    server = build_server(EmberCore(Settings(warmup=False)), token=token, exit_process=exit_process)
    sink = Sink()
    server.protocol.set_writer(sink)
    return server, sink


def feed(server: LanguageServer, message: dict[str, Any]) -> None:
    """What pygls' read loop does with one message body."""
    server.protocol.handle_message(json.loads(json.dumps(message), object_hook=server.protocol.structure_message))


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"processId": None, "capabilities": {}}}
DID_OPEN = {"jsonrpc": "2.0", "method": "textDocument/didOpen",
            "params": {"textDocument": {"uri": URI, "languageId": "python", "version": 1, "text": "x = 1\n"}}}


def did_change(version: int, uri: str = URI) -> dict[str, Any]:
    change = {"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}}, "text": "a"}
    return {"jsonrpc": "2.0", "method": "textDocument/didChange",
            "params": {"textDocument": {"uri": uri, "version": version}, "contentChanges": [change]}}


# ----------------------------------------------------------------------- what ember relies on exists

PRIVATE_SIGNATURES = [
    (JsonRPCProtocol._execute_handler, ["self", "msg_id", "handler", "callback", "args", "kwargs"]),
    (JsonRPCProtocol.structure_message, ["self", "data"]),
    (JsonRPCProtocol.handle_message, ["self", "message"]),
    (JsonRPCProtocol._send_data, ["self", "data"]),
    (JsonRPCProtocol._send_response, ["self", "msg_id", "result", "error"]),
    (LanguageServerProtocol.lsp_text_document__did_open, ["self", "params"]),
    (LanguageServerProtocol.lsp_text_document__did_change, ["self", "params"]),
    (LanguageServerProtocol.lsp_text_document__did_close, ["self", "params"]),
    (LanguageServerProtocol.lsp_exit, ["self", "args"]),
    (run_async, ["stop_event", "reader", "protocol", "logger", "error_handler"]),
    (StdinAsyncReader.__init__, ["self", "stdin", "executor"]),
    (StdoutWriter.__init__, ["self", "stdout"]),
]


@pytest.mark.parametrize(("function", "expected"), PRIVATE_SIGNATURES, ids=lambda value: getattr(value, "__qualname__", ""))
def test_pygls_private_api_has_the_signature_ember_overrides(function: Any, expected: list[str]) -> None:
    assert list(inspect.signature(function).parameters) == expected


def test_pygls_builtin_handlers_ember_replaces_are_registered_by_method_name() -> None:
    """pygls registers its built-in handlers by ``method_name``; an override with the same name
    replaces pygls' handler only while that holds."""
    expected = {
        "lsp_text_document__did_open": types.TEXT_DOCUMENT_DID_OPEN,
        "lsp_text_document__did_change": types.TEXT_DOCUMENT_DID_CHANGE,
        "lsp_text_document__did_close": types.TEXT_DOCUMENT_DID_CLOSE,
        "lsp_exit": types.EXIT,
    }
    server, _ = session()
    for name, method in expected.items():
        assert getattr(LanguageServerProtocol, name).method_name == method
        assert server.protocol.fm.builtin_features[method].__func__ is getattr(EmberProtocol, name)


def test_pygls_bookkeeping_attributes() -> None:
    """``_request_futures`` (a dict), ``_shutdown`` and ``_stop_event`` are read and written by ember."""
    server = LanguageServer("plain", "0")
    assert server.protocol._request_futures == {} and server.protocol._shutdown is False
    assert isinstance(server, JsonRPCServer) and server._stop_event is None


async def test_unknown_document_answers_with_its_code() -> None:
    """pygls answers a handler's JsonRpcException with the class attribute CODE."""
    assert JsonRpcException.CODE == -32603 and UnknownDocument("x").to_response_error().code == -32602
    server, sink = session()
    feed(server, INITIALIZE)
    position = {"line": 0, "character": 0}
    feed(server, {"jsonrpc": "2.0", "id": 2, "method": "textDocument/inlineCompletion", "params": {
        "textDocument": {"uri": URI}, "position": position, "context": {"triggerKind": 1}}})
    await asyncio.sleep(0.05)
    error = sink.answer(2)["error"]
    assert error["code"] == -32602 and URI in error["message"]


# ----------------------------------------------------------------------- _execute_handler, _forget_future

def test_pygls_still_leaks_a_future_per_notification() -> None:
    """Why ember overrides _execute_handler: when this fails, pygls stopped leaking and the
    override (and this test) can go."""
    server = LanguageServer("plain", "0")
    server.protocol.set_writer(Sink())
    feed(server, INITIALIZE)
    feed(server, DID_OPEN)
    for version in range(2, 12):
        feed(server, did_change(version))
    assert len(server.protocol._request_futures) >= 10


def test_execute_handler_forgets_done_futures_without_a_loop() -> None:
    server, _ = session()
    feed(server, INITIALIZE)
    feed(server, DID_OPEN)
    for version in range(2, 52):
        feed(server, did_change(version))
    assert server.documents[URI].text == "a" * 50 + "x = 1\n"
    assert server.protocol._request_futures == {}


async def test_execute_handler_forgets_done_futures_on_the_loop() -> None:
    """On a running loop the entries go in a later loop turn (shutdown iterates over the dict)."""
    server, _ = session()
    feed(server, INITIALIZE)
    feed(server, DID_OPEN)
    for version in range(2, 12):
        feed(server, did_change(version))
    assert len(server.protocol._request_futures) >= 10
    await asyncio.sleep(0.05)
    assert server.protocol._request_futures == {}


# ----------------------------------------------------------------------- structure_message

def test_pygls_structure_message_raises_from_a_cattrs_error() -> None:
    """ember names the bad fields from the cattrs error pygls raises from."""
    server = LanguageServer("plain", "0")
    bad = {"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {"uri": URI}}}
    with pytest.raises(JsonRpcInvalidParams) as raised:
        server.protocol.structure_message(bad)
    assert isinstance(raised.value.__cause__, cattrs.BaseValidationError)


def test_structure_message_turns_unreadable_messages_into_malformed() -> None:
    protocol = session()[0].protocol
    wrong_version = protocol.structure_message({"jsonrpc": "1.0", "id": 3, "method": "shutdown"})
    assert isinstance(wrong_version, EmberProtocol.Malformed) and wrong_version.code == -32600
    missing = protocol.structure_message({"jsonrpc": "2.0", "id": 4, "method": "textDocument/didOpen",
                                          "params": {"textDocument": {"uri": URI, "languageId": "python", "version": 1}}})
    assert isinstance(missing, EmberProtocol.Malformed) and missing.code == -32602 and missing.id == 4
    assert "textDocument" in missing.reason and "text" in missing.reason and "required field missing" in missing.reason
    no_params = protocol.structure_message({"jsonrpc": "2.0", "id": 5, "method": "shutdown"})
    assert isinstance(no_params, types.ShutdownRequest)


# ----------------------------------------------------------------------- handle_message, _send_data, _send_response

def test_handle_message_answers_what_pygls_would_drop() -> None:
    server, sink = session()
    feed(server, {"jsonrpc": "2.0", "id": 10, "method": "ember/stats", "params": {}})
    assert sink.answer(10)["error"]["code"] == -32002
    feed(server, {"id": 11, "method": "initialize", "params": {}})  # no "jsonrpc"
    assert sink.answer(11)["error"]["code"] == -32600
    feed(server, {"jsonrpc": "2.0", "id": "x", "method": "textDocument/didOpen", "params": {}})
    assert sink.answer("x")["error"]["code"] == -32602
    feed(server, INITIALIZE)
    assert "inlineCompletionProvider" in sink.answer(1)["result"]["capabilities"]
    feed(server, {"jsonrpc": "2.0", "id": 12, "method": "shutdown"})
    assert sink.answer(12)["result"] is None
    feed(server, {"jsonrpc": "2.0", "id": 13, "method": "ember/stats", "params": {}})
    assert sink.answer(13)["error"]["code"] == -32600


async def test_unauthorized_connection_is_dropped_and_stops_reading() -> None:
    server, _ = session(token="s3cret")
    reader = asyncio.StreamReader()
    reader.feed_data(frame(DID_OPEN) + frame(INITIALIZE))  # never fed EOF: only stopping ends the loop
    sink = Sink()
    await asyncio.wait_for(serve_stream_messages(server, reader, sink, log), 5)  # type: ignore[arg-type]
    assert sink.closed and sink.data == b"" and server.documents == {}


# ----------------------------------------------------------------------- did_open / did_change / did_close

def test_document_notifications_skip_pygls_workspace(caplog: pytest.LogCaptureFixture) -> None:
    server, sink = session()
    feed(server, INITIALIZE)
    with caplog.at_level(logging.WARNING):
        feed(server, did_change(2, "file:///work/never-opened.py"))  # pygls would raise, ember logs
    assert "didChange for unknown document" in caplog.text
    feed(server, DID_OPEN)
    feed(server, did_change(2))
    assert server.documents[URI].text == "ax = 1\n"
    assert not server.workspace.text_documents
    feed(server, {"jsonrpc": "2.0", "method": "textDocument/didClose", "params": {"textDocument": {"uri": URI}}})
    assert server.documents == {}
    assert not [m for m in sink.messages() if m.get("method") == "window/showMessage"]


# ----------------------------------------------------------------------- lsp_exit

def test_exit_ends_the_connection_not_the_process() -> None:
    server, sink = session(exit_process=False)
    server._stop_event = threading.Event()
    feed(server, INITIALIZE)
    feed(server, {"jsonrpc": "2.0", "method": "exit"})  # pygls would sys.exit here
    assert sink.closed and server._stop_event.is_set()


@pytest.mark.parametrize(("shutdown_first", "code"), [(True, 0), (False, 1)])
async def test_exit_over_stdio_ends_the_process_with_lsps_code(
    monkeypatch: pytest.MonkeyPatch, shutdown_first: bool, code: int
) -> None:
    codes: list[int] = []

    async def close_and_exit(core: EmberCore, exit_code: int) -> None:
        codes.append(exit_code)

    monkeypatch.setattr(lsp.session, "close_and_exit", close_and_exit)
    server, sink = session(exit_process=True)
    feed(server, INITIALIZE)
    if shutdown_first:
        feed(server, {"jsonrpc": "2.0", "id": 2, "method": "shutdown"})
    feed(server, {"jsonrpc": "2.0", "method": "exit"})
    await asyncio.sleep(0)
    assert codes == [code] and not sink.closed


# ----------------------------------------------------------------------- the read loop (run_async, io_)

async def test_stream_loop_survives_unreadable_bodies_and_wrong_lengths() -> None:
    """A body that is not JSON gets -32700 (through report_server_error and _send_data); a
    Content-Length one too short costs that message only (the ResyncReader around pygls' reader)."""
    server, _ = session()
    reader = asyncio.StreamReader()
    short = frame(INITIALIZE).replace(b"Content-Length: %d" % len(json.dumps(INITIALIZE)), b"Content-Length: 20")
    stats = {"jsonrpc": "2.0", "id": 2, "method": "ember/stats", "params": {}}
    reader.feed_data(frame(b"not json") + short + frame(INITIALIZE) + frame(stats))
    reader.feed_eof()
    sink = Sink()
    await asyncio.wait_for(serve_stream_messages(server, reader, sink, log), 5)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    parse_errors = [m for m in sink.messages() if m.get("error", {}).get("code") == -32700]
    assert len(parse_errors) >= 1 and all(m["id"] is None for m in parse_errors)
    assert "capabilities" in sink.answer(1)["result"]
    assert sink.answer(2)["result"]["engine"]["ready"] is False
    await server.core.close()


async def test_stdio_loop_reads_stdin_and_writes_the_given_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = session()
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(frame(INITIALIZE))))
    stdout = io.BytesIO()
    try:
        await asyncio.wait_for(serve_stdio_messages(server, stdout, log), 5)
    finally:
        server.thread_pool.shutdown()
    body = stdout.getvalue().partition(b"\r\n\r\n")[2]
    assert json.loads(body)["id"] == 1
