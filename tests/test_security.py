"""Security against the real server: the TCP listener (loopback by default, a token before anything
is read), the logs (no token, no source text), the network (nothing but loopback and unix sockets)
and SIGTERM (generation and engine stop, no process left behind).

One ``ember --tcp 0 --token T --log-level DEBUG`` server with the embedded engine is shared by the
module (started with the session: conftest ``token_tcp_ember``); SIGTERM ends it in the last test.
Refusals to start need no engine and run on their own.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.test_reliability import ROOT, SLOW_S, JsonRpcClient, RawLsp, ServerProcess, assert_error, items, wait_gone

TOKEN = "ember-test-token-" + secrets.token_hex(12)
MARKER = "zebra_" + secrets.token_hex(8)  # source text that must never reach a log
DOC_URI = "file:///work/security/secret_module.py"
DOC_TEXT = f'SECRET_NAME = "{MARKER}"\n\n\ndef greet(name):\n    return "hello " + '
LISTENING = re.compile(r"ember listening on \('([^']+)', (\d+)")


class TcpClient(JsonRpcClient):
    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.sock.settimeout(None)
        super().__init__(self.sock.makefile("rb"))

    def _write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def disconnect(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpServer(ServerProcess):
    """``python -m lsp --tcp ...``; stderr goes to a file (vLLM logs there: a pipe could fill up)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.log_file = tmp / "ember.log"
        self.stderr_file = tmp / "ember.stderr"
        self._stderr = open(self.stderr_file, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lsp", "--log-file", str(self.log_file), *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
        deadline = time.monotonic() + 60
        match = None
        while match is None:
            assert self.proc.poll() is None, self.stderr_file.read_text(errors="replace")
            assert time.monotonic() < deadline, "ember --tcp did not print its address"
            time.sleep(0.2)
            match = LISTENING.search(self.stderr_file.read_text(errors="replace"))
        self.address = (match.group(1), int(match.group(2)))


def initialize_params(token: str | None) -> dict[str, Any]:
    options = {"maxTokens": 8, "debounceMs": 0}
    if token is not None:
        options["token"] = token
    return {"processId": None, "capabilities": {}, "initializationOptions": options}


def did_open(uri: str, text: str) -> dict[str, Any]:
    return {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}}


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


@pytest.fixture(scope="module")
def tcp(token_tcp_ember: TcpServer) -> TcpServer:
    """The module's server: ``tests/conftest.py``'s ``token_tcp_ember``, started with the session."""
    return token_tcp_ember


@pytest.fixture(scope="module")
def session(tcp: TcpServer) -> Iterator[TcpClient]:
    """An authorized editor that opened DOC_TEXT and got a completion on it."""
    client = TcpClient(tcp.address)
    try:
        assert "capabilities" in client.result("initialize", initialize_params(TOKEN))
        client.notify("initialized", {})
        client.wait_ready()
        client.notify("textDocument/didOpen", did_open(DOC_URI, DOC_TEXT))
        line, character = DOC_TEXT.count("\n"), len(DOC_TEXT.rsplit("\n", 1)[1])
        completion = client.complete(DOC_URI, line, character)
        assert isinstance(items(completion), list)
        yield client
    finally:
        client.disconnect()


# ------------------------------------------------------------------------------ the listener


@pytest.mark.slow
def test_tcp_binds_loopback_by_default(tcp):
    assert tcp.address[0] == "127.0.0.1"
    listening = [c for c in psutil.Process(tcp.proc.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(is_loopback(c.laddr.ip) for c in listening), listening


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tcp", "0.0.0.0:0"], "non-loopback address 0.0.0.0 without --token"),
        (["--tcp", "[::]:0"], "non-loopback address :: without --token"),
        (["--tcp", "192.0.2.10:7777"], "non-loopback address 192.0.2.10 without --token"),
        (["--tcp", "0.0.0.0:0", "--token", "  "], "--token must not be empty"),
        (["--tcp", "127.0.0.1:99999"], "--tcp expects"),
    ],
)
def test_unsafe_listeners_refuse_to_start(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "lsp", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert message in result.stderr
    assert "ember listening" not in result.stderr


@pytest.mark.slow
def test_wrong_or_missing_token_is_refused_before_any_document_is_read(tcp):
    for token in ("not-the-token", None, TOKEN + "x", TOKEN[:-1]):
        client = TcpClient(tcp.address)
        try:
            init = client.request("initialize", initialize_params(token))
            # An impatient client sends its document right away: it must never be read.
            client.notify("textDocument/didOpen", did_open(DOC_URI, DOC_TEXT))
            stats = client.request("ember/stats", {})
            assert_error(client.response(init), -32602, "token")
            assert client.closed.wait(SLOW_S), "the connection stayed open after a wrong token"
            assert not client.has_response(stats)
        finally:
            client.disconnect()
    assert "refused a connection: missing or wrong token" in tcp.log_text()


@pytest.mark.slow
def test_messages_before_initialize_close_a_token_protected_connection(tcp):
    for first in (
        {"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": did_open(DOC_URI, DOC_TEXT)},
        {"jsonrpc": "2.0", "id": 1, "method": "ember/stats", "params": {}},
        {"jsonrpc": "2.0", "id": 1, "method": "textDocument/completion"},  # malformed, too
    ):
        client = TcpClient(tcp.address)
        try:
            client.send(first)
            assert client.closed.wait(SLOW_S), f"the connection stayed open after {first['method']}"
            assert client.messages == []
        finally:
            client.disconnect()
    assert "dropped textDocument/didOpen from an unauthorized connection" in tcp.log_text()


# ---------------------------------------------------------------- an authorized editor session


@pytest.mark.slow
def test_only_loopback_and_unix_sockets_after_a_completion(tcp, session):
    """Nothing talks to a host other than this machine (the embedded engine runs here; vLLM's
    processes talk over loopback TCP and unix sockets)."""
    family = tcp.family()
    assert len(family) > 1, "expected vLLM's engine processes below the server"
    inet = [(p.pid, c) for p in family for c in p.net_connections(kind="inet")]
    outside = [
        (pid, c) for pid, c in inet if not is_loopback(c.laddr.ip) or (c.raddr and not is_loopback(c.raddr.ip))
    ]
    assert not outside, outside
    # The check does see sockets: the editor's own connection is one of them.
    editor_port = session.sock.getsockname()[1]
    assert any(c.raddr and c.raddr.port == editor_port for pid, c in inet if pid == tcp.proc.pid)


@pytest.mark.slow
def test_token_is_never_logged(tcp, session):
    log = tcp.log_text()
    assert " DEBUG " in log and "refused a connection" in log  # the log is there, at DEBUG
    assert TOKEN not in log
    assert TOKEN not in tcp.stderr_file.read_text(errors="replace")


@pytest.mark.slow
def test_logs_hold_no_source_text(tcp, session):
    # Messages that once reached the log whole: a non-2.0 message, a change to an unknown document.
    session.send({"jsonrpc": "1.0", "method": "textDocument/didOpen", "params": did_open(DOC_URI + "x", DOC_TEXT)})
    session.notify("textDocument/didChange", {
        "textDocument": {"uri": "file:///work/security/unknown.py", "version": 2},
        "contentChanges": [{"text": DOC_TEXT}],
    })
    session.stats()
    log = tcp.log_text()
    assert "completion metrics" in log  # DEBUG records of the completion are there...
    assert MARKER not in log  # ...but not the document,
    assert not re.search(r'\{"(jsonrpc|id|method|params|result)": ', log)  # nor any message body,
    assert "Sending data" not in log and "InitializeParams(" not in log  # nor pygls' traces.
    assert MARKER not in tcp.stderr_file.read_text(errors="replace")


def test_token_is_redacted_even_from_protocol_traces(tmp_path):
    """With --log-protocol pygls logs the initialize params, which carry the token (a stdio server
    that never loads the model is enough: the redaction sits in the logging setup)."""
    server = RawLsp("--token", TOKEN, "--log-level", "DEBUG", "--log-protocol", log_file=tmp_path / "trace.log")
    try:
        server.initialize({"token": TOKEN}, initialized=False)
        server.stats()
        log = server.log_text()
        assert "InitializeParams(" in log and "Sending data" in log  # the traces are on...
        assert "<token>" in log and TOKEN not in log  # ...and the token is not in them
    finally:
        server.kill()


# ------------------------------------------------------------------------------------ SIGTERM


@pytest.mark.slow
def test_sigterm_stops_generation_and_the_engine_within_5_s(tcp, session):
    """Last in this module: it ends the shared server."""
    session.notify("workspace/didChangeConfiguration", {"settings": {"maxTokens": 1000, "reuse": False}})
    uri = "file:///work/security/long.py"
    text = "# count to a thousand\nnumbers = [1, 2, 3, 4, 5, 6, 7, "
    session.notify("textDocument/didOpen", did_open(uri, text))
    busy = session.complete_request(uri, 1, len(text.split("\n")[1]))
    time.sleep(1.0)
    assert not session.has_response(busy), "expected a long generation in flight"  # 1000 tokens: ~40 s
    family = tcp.family()
    tcp.proc.send_signal(signal.SIGTERM)
    alive = wait_gone(family, timeout=5)
    assert not alive, f"still running 5 s after SIGTERM: {[(p.pid, p.name()) for p in alive]}"
    assert tcp.proc.wait(timeout=1) == 0
    assert session.closed.wait(5), "the editor's connection was not closed"
