"""Protocol abuse, fuzzing and shutdown against the real server (``python -m lsp --stdio``, embedded
vLLM on SmolLM2-135M), driven by :class:`RawLsp`: a bare JSON-RPC client that writes raw bytes, so it
can send what an LSP library refuses to (bad JSON, wrong lengths, negative positions, lone surrogates).

One server with the engine is shared by the module (model loading is the slow part); tests that only
exercise the protocol edge run while it loads. Servers that never get ``initialized`` never load the
model, so tests of the ``initialize`` handshake and of framing start their own (about a second each).

What the server answers (decided here, enforced by the tests):

* bad JSON or invalid UTF-8 in a body: the message is dropped, the editor sees a window/showMessage
  error, the next message is served (the id of an unparsable request is unknown: no response);
* a request lsprotocol cannot read (missing/mistyped fields, negative or >2^31 positions):
  -32602 InvalidParams naming the field; not JSON-RPC 2.0 (no/other "jsonrpc", non-string method,
  unusable id): -32600 InvalidRequest ("id": null when the id is unusable); such notifications
  are dropped with a warning in the log;
* unknown request: -32601; unknown notification: ignored;
* before ``initialize``: requests get -32002 ServerNotInitialized, notifications other than exit
  are dropped; after ``shutdown``: requests get -32600 InvalidRequest; ``exit`` ends the process
  with code 0 after ``shutdown``, 1 without (LSP), within 5 s and with no process left behind;
* positions outside the document in a completion request: -32602 with the line/character limits;
  in didChange ranges they are clamped like vscode-languageserver-textdocument (see
  context/source/document.py); changes of one notification apply in order (so ranges may overlap);
  a didChange whose version is not newer is still applied (changes are ordered on the wire) and
  logged; didChange/didClose for unknown URIs are ignored (logged);
* a document above ``maxDocumentBytes`` (default 10 MB; 50 MB here) is kept in sync but gets no
  completions: an empty result and a one-time window/showMessage warning;
* NUL bytes are ordinary text; lone UTF-16 surrogates become U+FFFD (same UTF-16 length, so later
  positions stay valid).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from lsp.config import Settings

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300
# While vLLM loads (imports in a worker thread), the event loop can stall for many seconds on 2 cores.
SLOW_S = 60
PROMPT_S = 10  # "answered promptly", once the model is loaded
# InvalidParams: the request names a document the server does not have.
UNKNOWN_DOCUMENT = -32602


# --------------------------------------------------------------------------------- the raw client


class JsonRpcClient:
    """A hand-written JSON-RPC client on a byte stream (the server's stdout, or a TCP socket).

    A reader thread parses the stream strictly: every byte must belong to a ``Content-Length``
    framed JSON message; anything else (a stray print, a library logging to stdout) lands in
    ``garbage``. ``closed`` is set when the server closes the stream.
    """

    def __init__(self, stream: Any) -> None:
        self.messages: list[dict[str, Any]] = []
        self.garbage: list[bytes] = []
        self.closed = threading.Event()
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    # -- reading

    def _read(self, stream: Any) -> None:
        try:
            while True:
                length = None
                while True:
                    line = stream.readline()
                    if not line:
                        return
                    if line == b"\r\n":
                        if length is not None:
                            break
                        self.garbage.append(line)
                        continue
                    match = re.fullmatch(rb"Content-Length: (\d+)\r\n", line)
                    if match:
                        length = int(match.group(1))
                    elif not line.startswith(b"Content-Type: "):
                        self.garbage.append(line)
                body = stream.read(length)
                try:
                    message = json.loads(body)
                except ValueError:
                    self.garbage.append(body)
                    continue
                with self._cv:
                    self.messages.append(message)
                    self._cv.notify_all()
        except OSError:
            return
        finally:
            self.closed.set()
            with self._cv:
                self._cv.notify_all()

    def response(self, msg_id: Any, timeout: float = SLOW_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for message in self.messages:
                    if "method" not in message and message.get("id", "absent") == msg_id:
                        return message
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no response to request {msg_id!r} within {timeout} s")
                if self.closed.is_set():
                    raise AssertionError(f"the server closed the stream before answering {msg_id!r}")
                self._cv.wait(min(left, 0.5))

    def has_response(self, msg_id: Any) -> bool:
        with self._cv:
            return any("method" not in m and m.get("id", "absent") == msg_id for m in self.messages)

    def notifications(self, method: str, since: int = 0) -> list[dict[str, Any]]:
        with self._cv:
            return [m for m in self.messages[since:] if m.get("method") == method and "id" not in m]

    def mark(self) -> int:
        with self._cv:
            return len(self.messages)

    # -- writing

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def send_raw(self, data: bytes) -> None:
        with self._write_lock:
            self._write(data)

    def send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        self.send_raw(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def request(self, method: str, params: Any = None) -> int:
        msg_id = next(self._ids)
        self.send({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        return msg_id

    def call(self, method: str, params: Any = None, timeout: float = SLOW_S) -> dict[str, Any]:
        return self.response(self.request(method, params), timeout)

    def result(self, method: str, params: Any = None, timeout: float = SLOW_S) -> Any:
        reply = self.call(method, params, timeout)
        assert "error" not in reply, reply
        return reply["result"]

    def notify(self, method: str, params: Any = None) -> None:
        self.send({"jsonrpc": "2.0", "method": method, "params": params})

    # -- LSP shortcuts

    def initialize(self, options: dict[str, Any] | None = None, initialized: bool = True) -> dict[str, Any]:
        result = self.result(
            "initialize", {"processId": None, "capabilities": {}, "initializationOptions": options or {}}
        )
        if initialized:
            self.notify("initialized", {})
        return result

    def stats(self, timeout: float = SLOW_S) -> dict[str, Any]:
        return self.result("ember/stats", {}, timeout)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            engine = self.stats()["engine"]
            if engine["ready"]:
                return
            assert not engine["error"], f"engine failed to start: {engine['error']}"
            assert time.monotonic() < deadline, "the engine did not become ready in time"
            time.sleep(0.5)

    def open(self, uri: str, text: str, version: int = 1, language: str = "python") -> None:
        self.notify(
            "textDocument/didOpen",
            {"textDocument": {"uri": uri, "languageId": language, "version": version, "text": text}},
        )

    def change(self, uri: str, version: int, changes: list[dict[str, Any]]) -> None:
        self.notify(
            "textDocument/didChange",
            {"textDocument": {"uri": uri, "version": version}, "contentChanges": changes},
        )

    def close(self, uri: str) -> None:
        self.notify("textDocument/didClose", {"textDocument": {"uri": uri}})

    def complete_request(self, uri: str, line: int, character: int) -> int:
        return self.request(
            "textDocument/completion",
            {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}},
        )

    def complete(self, uri: str, line: int, character: int, timeout: float = SLOW_S) -> dict[str, Any]:
        return self.response(self.complete_request(uri, line, character), timeout)

    def configure(self, **settings: Any) -> None:
        self.notify("workspace/didChangeConfiguration", {"settings": {"ember": settings}})


class ServerProcess:
    """An ember process started by a test: its process tree, its log, and a teardown that kills
    only what it started. Subclasses set ``proc``, ``log_file`` and ``_stderr``."""

    proc: subprocess.Popen[bytes]
    log_file: Path
    _stderr: Any

    def family(self) -> list[psutil.Process]:
        """The server and every process below it (vLLM's engine core and workers)."""
        parent = psutil.Process(self.proc.pid)
        return [parent, *parent.children(recursive=True)]

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def kill(self) -> None:
        try:
            family = self.family() if self.proc.poll() is None else []
        except psutil.NoSuchProcess:
            family = []
        for process in reversed(family):
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(family, timeout=10)
        self.proc.wait(timeout=10)
        self._stderr.close()


class RawLsp(JsonRpcClient, ServerProcess):
    """``python -m lsp --stdio`` with a :class:`JsonRpcClient` on its pipes."""

    def __init__(self, *args: str, log_file: Path) -> None:
        self.log_file = log_file
        self.stderr_file = log_file.with_suffix(".stderr")
        self._stderr = open(self.stderr_file, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lsp", "--stdio", "--daemon", "off", "--log-file", str(log_file), *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        super().__init__(self.proc.stdout)

    def _write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Waits until every process has exited (a zombie has: it only awaits its parent's wait());
    returns those still running at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for process in processes:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def assert_error(reply: dict[str, Any], code: int, pattern: str = "") -> str:
    assert "error" in reply, f"expected error {code}, got {reply}"
    assert reply["error"]["code"] == code, reply
    assert re.search(pattern, reply["error"]["message"]), reply
    return reply["error"]["message"]


def items(reply: dict[str, Any]) -> list[dict[str, Any]]:
    assert "error" not in reply, reply
    result = reply["result"]
    assert isinstance(result, dict) and isinstance(result["items"], list), reply
    return result["items"]


_uris = itertools.count(1)


def fresh_uri(stem: str = "doc", suffix: str = ".py") -> str:
    return f"file:///work/reliability/{stem}_{next(_uris)}{suffix}"


# --------------------------------------------------------------------------- a reference document

_BREAK = re.compile(r"\r\n|\n|\r")


def clean(text: str) -> str:
    """What the server stores for text from JSON: lone surrogates become U+FFFD."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def lines_of(text: str) -> list[str]:
    return _BREAK.split(text)


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def ref_offset(text: str, line: int, character: int) -> int:
    """LSP position -> str index with the clamping of vscode-languageserver-textdocument (a
    position inside a surrogate pair moves after it, as documented in context/source/document.py)."""
    starts = [0] + [m.end() for m in _BREAK.finditer(text)]
    if line >= len(starts):
        return len(text)
    start, end = starts[line], len(text)
    if line + 1 < len(starts):  # the end of a line is before its terminator
        nxt = starts[line + 1]
        end = nxt - 2 if text[nxt - 2 : nxt] == "\r\n" else nxt - 1
    k, units = start, 0
    while k < end and units < character:
        units += 2 if ord(text[k]) > 0xFFFF else 1
        k += 1
    return k


def ref_apply(text: str, change: dict[str, Any]) -> str:
    if "range" not in change:
        return clean(change["text"])
    start, end = change["range"]["start"], change["range"]["end"]
    a, b = (start["line"], start["character"]), (end["line"], end["character"])
    if a > b:
        a, b = b, a
    s = ref_offset(text, *a)
    e = max(s, ref_offset(text, *b))
    return text[:s] + clean(change["text"]) + text[e:]


def end_position(text: str) -> tuple[int, int]:
    lines = lines_of(text)
    return len(lines) - 1, utf16_len(lines[-1])


def rng(sl: int, sc: int, el: int, ec: int) -> dict[str, Any]:
    return {"start": {"line": sl, "character": sc}, "end": {"line": el, "character": ec}}


def assert_line_structure(server: RawLsp, uri: str, expected: str) -> None:
    """The server's line count and the UTF-16 length of each of its lines, read from the limits
    that its position errors report (there is no request that returns a document's text)."""
    lines = lines_of(expected)
    probe = server.complete_request(uri, len(lines), 0)
    probes = [server.complete_request(uri, i, 1_000_000) for i in range(len(lines))]
    message = assert_error(server.response(probe), -32602, "past the end of the document")
    assert f"({len(lines)} lines)" in message, (message, len(lines))
    for i, msg_id in enumerate(probes):
        message = assert_error(server.response(msg_id), -32602, f"past the end of line {i} ")
        assert f"({utf16_len(lines[i])} UTF-16 code units)" in message, (i, message, lines[i])


def assert_server_text(server: RawLsp, uri: str, expected: str) -> None:
    """The server holds exactly ``expected`` for ``uri`` (which this closes): the line structure
    matches, and a completion at the end gives the same prompt as a fresh document with ``expected``
    (the second request is a completion-cache hit: the cache is keyed by the prompt text, and a
    prefix-only model's prompt holds everything before the cursor)."""
    assert_line_structure(server, uri, expected)
    line, character = end_position(expected)
    # A fresh generation, cached under this prompt; no other open files in the prompt. No early
    # answer: on a loaded machine it comes before the generation ends, and closing the document
    # then cancels the generation before its text reaches the cache.
    server.configure(reuse=False, crossFile=False, earlyAnswerMs=0)
    reference = fresh_uri("reference")
    try:
        before = server.stats()["requests"]
        first = items(server.complete(uri, line, character))
        middle = server.stats()["requests"]
        server.configure(reuse=True)
        server.close(uri)
        server.open(reference, expected)
        second = items(server.complete(reference, line, character))
        after = server.stats()
    finally:
        server.close(reference)
        server.configure(reuse=True, crossFile=True, earlyAnswerMs=Settings().early_answer_ms)
    if middle > before:  # a generation (nothing is generated, or recorded, after a blank prefix)
        assert after["requests"] == middle + 1 and after["last"]["cache_hit"], (
            f"the server's text for {uri} differs from the reference: {after['last']}"
        )
    else:
        assert after["requests"] == middle, "only the reference got a completion: the texts differ"
    assert [i["insertText"] for i in first] == [i["insertText"] for i in second]


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawLsp]:
    """The shared server with the engine (still loading when the first tests run)."""
    log = tmp_path_factory.mktemp("reliability") / "ember.log"
    lsp = RawLsp("--max-tokens", "8", "--log-level", "INFO", log_file=log)
    try:
        lsp.initialize({"debounceMs": 0})
        yield lsp
    finally:
        lsp.kill()


@pytest.fixture(scope="module")
def ready(server: RawLsp) -> RawLsp:
    server.wait_ready()
    return server


@contextmanager
def bare_server(tmp_path: Path) -> Iterator[RawLsp]:
    """A server that is never sent ``initialized``: it never loads the model."""
    lsp = RawLsp("--log-level", "INFO", log_file=tmp_path / "bare.log")
    try:
        yield lsp
    finally:
        lsp.kill()


# ------------------------------------------------------------------ handshake (own, bare servers)


def test_requests_before_initialize_get_server_not_initialized(tmp_path):
    with bare_server(tmp_path) as lsp:
        assert_error(lsp.call("ember/stats", {}), -32002, "initialize")
        uri = fresh_uri()
        lsp.open(uri, "x = 1\n")  # a notification before initialize: dropped
        assert_error(lsp.complete(uri, 0, 0), -32002, "initialize")
        lsp.initialize(initialized=False)
        assert_error(lsp.complete(uri, 0, 0), UNKNOWN_DOCUMENT, "unknown document")
        lsp.open(uri, "x = 1\n")
        assert items(lsp.complete(uri, 0, 5)) == []  # no engine here: an empty answer, not an error
        assert "dropped textDocument/didOpen" in lsp.log_text()


def test_requests_after_shutdown_are_refused_and_exit_is_served(tmp_path):
    with bare_server(tmp_path) as lsp:
        lsp.initialize(initialized=False)
        assert lsp.result("shutdown", None) is None
        assert_error(lsp.call("ember/stats", {}, timeout=5), -32600, "shutdown")  # LSP: InvalidRequest
        lsp.notify("exit")
        assert lsp.proc.wait(timeout=5) == 0


def test_completion_requests_are_rate_limited_per_connection(tmp_path):
    with bare_server(tmp_path) as lsp:
        lsp.initialize({"maxRequestsPerSecond": 5}, initialized=False)
        uri = fresh_uri()
        lsp.open(uri, "x = 1\n")
        mark = lsp.mark()
        started = time.monotonic()
        sent = [lsp.complete_request(uri, 0, 5) for _ in range(60)]
        replies = [lsp.response(i) for i in sent]
        elapsed = time.monotonic() - started
        assert all("error" not in r and items(r) == [] for r in replies)  # empty answers, never errors
        outcomes = lsp.stats()["outcomes"]
        allowed = 60 - outcomes.get("rate_limited", 0)
        assert 5 <= allowed <= 5 + 5 * elapsed + 1, (outcomes, elapsed)
        shown = [m["params"]["message"] for m in lsp.notifications("window/showMessage", mark)]
        assert len(shown) == 1 and "maxRequestsPerSecond" in shown[0], shown
        time.sleep(1.0)  # the bucket refills: the editor is served again
        before = lsp.stats()["outcomes"].get("rate_limited", 0)
        lsp.complete(uri, 0, 5)
        assert lsp.stats()["outcomes"].get("rate_limited", 0) == before


def test_exit_without_shutdown_ends_with_code_1(tmp_path):
    with bare_server(tmp_path) as lsp:
        lsp.notify("exit")  # LSP: exit is served even before initialize
        assert lsp.proc.wait(timeout=10) == 1


def test_wrong_content_length_loses_one_message_not_the_connection(tmp_path):
    with bare_server(tmp_path) as lsp:
        lsp.initialize(initialized=False)
        # Too short: a client that counted characters instead of UTF-8 bytes.
        body = json.dumps({"jsonrpc": "2.0", "id": "raw-900", "method": "ember/stats", "params": {"s": "héllo wörld"}},
                          ensure_ascii=False).encode()
        lsp.send_raw(b"Content-Length: %d\r\n\r\n" % len(body.decode()) + body)
        answered = [lsp.request("ember/stats", {}) for _ in range(3)]
        time.sleep(2)
        assert any(lsp.has_response(i) for i in answered), "the server stopped reading after one bad length"
        # Too long: the body swallows the start of the next message.
        lsp.send_raw(b"Content-Length: 200\r\n\r\n" + b'{"jsonrpc": "2.0", "method": "x", "params": null}')
        answered = [lsp.request("ember/stats", {}) for _ in range(4)]
        time.sleep(2)
        assert any(lsp.has_response(i) for i in answered)


# -------------------------------------------------- protocol abuse (shared server, model loading)


def test_bad_json_body_is_reported_and_the_server_keeps_answering(server):
    mark = server.mark()
    server.send_raw(b'Content-Length: 26\r\n\r\n{"jsonrpc": "2.0", "id": }')
    server.send_raw(b"Content-Length: 4\r\n\r\n[1,]")
    assert "requests" in server.stats()
    shown = server.notifications("window/showMessage", mark)
    assert len(shown) == 2 and all(m["params"]["type"] == 1 for m in shown), shown
    with server._cv:  # JSON-RPC: Parse error, id null
        parse_errors = [m for m in server.messages[mark:] if "id" in m and m["id"] is None and "error" in m]
    assert [m["error"]["code"] for m in parse_errors] == [-32700, -32700], parse_errors


def test_invalid_utf8_body_is_reported_and_the_server_keeps_answering(server):
    mark = server.mark()
    body = b'{"jsonrpc": "2.0", "id": "raw-901", "method": "ember/stats", "params": {"s": "\xff\xfe\xc3"}}'
    server.send_raw(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert "requests" in server.stats()
    assert not server.has_response("raw-901")  # the id of an unreadable message is unknown
    assert any("utf-8" in m["params"]["message"] for m in server.notifications("window/showMessage", mark))


def test_malformed_requests_get_an_answer(server):
    uri = "file:///work/reliability/malformed.py"
    cases = [
        # (message, code, pattern in the error message)
        ({"jsonrpc": "2.0", "id": "raw-910", "method": "textDocument/completion"}, -32602, r"required field missing @ \$\.params"),
        ({"jsonrpc": "2.0", "id": "raw-911", "method": "textDocument/completion", "params": {"textDocument": {"uri": uri}}},
         -32602, r"position"),
        ({"jsonrpc": "2.0", "id": "raw-912", "method": "textDocument/completion",
          "params": {"textDocument": {"uri": uri}, "position": {"line": "one", "character": 0}}}, -32602, r"line"),
        ({"jsonrpc": "2.0", "id": "raw-913", "method": "textDocument/completion",
          "params": {"textDocument": {"uri": uri}, "position": {"line": 2**31, "character": 0}}}, -32602, r"position"),
        ({"id": "raw-914", "method": "ember/stats", "params": {}}, -32600, r"jsonrpc"),
        ({"jsonrpc": "1.0", "id": "raw-915", "method": "ember/stats", "params": {}}, -32600, r"jsonrpc"),
        ({"jsonrpc": "2.0", "id": "raw-916", "method": 42, "params": {}}, -32600, r"method"),
    ]
    for message, _, _ in cases:
        server.send(message)
    for message, code, pattern in cases:
        assert_error(server.response(message["id"]), code, pattern)
    # An id that is neither a number nor a string: answered with "id": null.
    mark = server.mark()
    server.send({"jsonrpc": "2.0", "id": {"nested": 1}, "method": "ember/stats", "params": {}})
    server.stats()  # answered after it, so its answer is in by now
    with server._cv:
        null_id = [m for m in server.messages[mark:] if "method" not in m and m.get("id", "absent") is None]
    assert len(null_id) == 1, null_id
    assert_error(null_id[0], -32600, "id")
    # JSON-RPC lets params be omitted where the method takes none.
    server.send({"jsonrpc": "2.0", "id": "raw-917", "method": "ember/stats"})
    assert "requests" in server.response("raw-917")["result"]
    # A malformed notification has nobody to answer: dropped, logged, and the server goes on.
    server.send({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {"uri": uri}}})
    assert_error(server.complete(uri, 0, 0), UNKNOWN_DOCUMENT, "unknown document")
    assert "ignored a malformed textDocument/didOpen" in server.log_text()


def test_unknown_methods(server):
    assert_error(server.call("ember/noSuchThing", {}), -32601, "ember/noSuchThing")
    assert_error(server.call("textDocument/hover", {"textDocument": {"uri": "file:///x.py"},
                                                    "position": {"line": 0, "character": 0}}), -32601)
    server.notify("ember/noSuchNotification", {"a": 1})
    server.notify("$/setTrace", {"value": "off"})
    server.notify("$/cancelRequest", {"id": 123456})  # an id that was never sent
    assert "requests" in server.stats()


def test_negative_and_huge_positions(server):
    uri = fresh_uri()
    text = "def f(x):\n    return x\n"
    server.open(uri, text)
    for line, character in ((-1, 0), (0, -1), (-(2**40), 3)):
        reply = server.complete(uri, line, character)
        assert_error(reply, -32602, r"position")
    reply = server.call("textDocument/inlineCompletion", {
        "textDocument": {"uri": uri}, "position": {"line": 0, "character": -4}, "context": {"triggerKind": 1}})
    assert_error(reply, -32602, "position")
    # A didChange with a negative position cannot be applied: it is dropped whole.
    server.change(uri, 2, [{"range": rng(0, -1, 0, 3), "text": "XYZ"}])
    assert_line_structure(server, uri, text)
    # Past the end: a clear error naming the limits.
    assert_error(server.complete(uri, 3, 0), -32602, r"line 3 is past the end of the document \(3 lines\)")
    assert_error(server.complete(uri, 1, 13), -32602, r"character 13 is past the end of line 1 \(12 UTF-16")
    assert_error(server.complete(uri, 2**31 - 1, 2**31 - 1), -32602, "past the end")
    server.close(uri)


def test_edits_against_unknown_uris_are_ignored(server):
    uri = fresh_uri("never_opened")
    server.change(uri, 2, [{"range": rng(0, 0, 0, 0), "text": "x"}])
    server.change(uri, 3, [{"text": "full text"}])
    server.close(uri)
    assert_error(server.complete(uri, 0, 0), UNKNOWN_DOCUMENT, "unknown document")
    assert "didChange for unknown document" in server.log_text()
    # Closing twice, and changing after close, are ignored too.
    other = fresh_uri()
    server.open(other, "a = 1\n")
    server.close(other)
    server.close(other)
    server.change(other, 2, [{"text": "b = 2\n"}])
    assert_error(server.complete(other, 0, 0), UNKNOWN_DOCUMENT, "unknown document")
    assert "requests" in server.stats()


def test_clamped_and_overlapping_changes_apply_in_order(server):
    """Several changes in one notification apply one after the other (LSP), so their ranges may
    overlap; ranges past a line or the document clamp to its end."""
    uri = fresh_uri()
    text = "alpha beta\ngamma\r\ndelta\n"
    server.open(uri, text, version=1)
    changes = [
        {"range": rng(0, 0, 0, 5), "text": "ALPHA!"},  # replaces "alpha"
        {"range": rng(0, 3, 1, 2), "text": "--"},  # overlaps the previous change's text
        {"range": rng(0, 4, 0, 1), "text": "<>"},  # a reversed range
        {"range": rng(1, 99, 1, 120), "text": "@end-of-line"},  # past the line's end: clamps
        {"range": rng(40, 0, 50, 3), "text": "\ntail"},  # past the document's end: appends
        {"range": rng(2, 0, 2, 0), "text": "😀"},  # a surrogate pair
        {"range": rng(2, 1, 2, 1), "text": "|"},  # inside the pair: after it
    ]
    server.change(uri, 2, changes)
    expected = text
    for change in changes:
        expected = ref_apply(expected, change)
    assert expected == "A<>-mma\r\ndelta@end-of-line\n😀|\ntail", expected  # worked out by hand
    assert_line_structure(server, uri, expected)
    server.close(uri)


def test_stale_versions_are_applied_in_order_and_logged(server):
    uri = fresh_uri()
    server.open(uri, "x = 1\n", version=10)
    server.change(uri, 3, [{"range": rng(0, 4, 0, 5), "text": "22"}])  # older than 10
    server.change(uri, 3, [{"range": rng(0, 0, 0, 0), "text": "y = 0\n"}])  # the same again
    assert_line_structure(server, uri, "y = 0\nx = 22\n")
    assert re.search(r"didChange for \S+ has version 3, not above 10", server.log_text())
    server.close(uri)


# ----------------------------------------------------------------------- with the model loaded


@pytest.mark.slow
def test_stdout_carries_only_lsp_messages(ready):
    """vLLM (and its engine process) log to stdout by default; over stdio that is the LSP stream."""
    uri = fresh_uri()
    server = ready
    server.open(uri, "def add(a, b):\n    return ")
    items(server.complete(uri, 1, 11))
    server.close(uri)
    assert server.garbage == [], server.garbage[:5]


@pytest.mark.slow
def test_binary_content_and_lone_surrogates(ready):
    server = ready
    text = "data = b'\x00\x01\x02'\x00\n# \x7f\x1b[31m\x0c\u2028x\n" + "s = '\ud800 and \udfff'\nt = "
    uri = fresh_uri()
    server.open(uri, text)
    stored = clean(text)
    assert "\ufffd" in stored and "\x00" in stored
    assert_line_structure(server, uri, stored)
    # Positions after a lone surrogate count it as one UTF-16 unit, like the editor does.
    line = lines_of(stored)[2]
    assert_error(server.complete(uri, 2, utf16_len(line) + 1), -32602, rf"\({utf16_len(line)} UTF-16")
    server.change(uri, 2, [{"range": rng(2, 5, 2, 6), "text": "\udbff"}])
    stored = ref_apply(stored, {"range": rng(2, 5, 2, 6), "text": "\udbff"})
    assert_server_text(server, uri, stored)
    # A URI with a lone surrogate is just a (strange) key.
    odd = "file:///work/reliability/\ud800odd.py"
    server.open(odd, "x = \x00\n")
    items(server.complete(odd, 0, 4))
    server.close(odd)
    assert "requests" in server.stats()


@pytest.mark.slow
def test_50mb_document_does_not_stall_the_server(ready):
    """A 50 MB document is kept in sync, but completions on it are empty (it is above
    maxDocumentBytes) with a warning; other documents keep being served promptly."""
    server = ready
    big_uri = fresh_uri("big")
    line = "value = compute(1, 2, 3)  # " + "x" * 50 + "\n"
    big = line * (50_000_000 // len(line))
    mark = server.mark()
    started = time.monotonic()
    server.open(big_uri, big)
    server.stats(timeout=PROMPT_S)
    assert time.monotonic() - started < PROMPT_S
    lines = big.count("\n")
    assert items(server.complete(big_uri, lines // 2, 5, timeout=PROMPT_S)) == []
    warnings = [m["params"]["message"] for m in server.notifications("window/showMessage", mark)]
    assert any("maxDocumentBytes" in w for w in warnings), warnings
    # Edits in the middle and at the end stay cheap, and positions stay exact.
    started = time.monotonic()
    server.change(big_uri, 2, [{"range": rng(lines // 2, 0, lines // 2, 5), "text": "VALUE"}])
    server.change(big_uri, 3, [{"range": rng(lines, 0, lines, 0), "text": "tail = 1"}])
    assert_error(server.complete(big_uri, lines, 9, timeout=PROMPT_S), -32602, r"\(8 UTF-16")
    assert_error(server.complete(big_uri, lines + 1, 0, timeout=PROMPT_S), -32602, rf"\({lines + 1} lines\)")
    assert time.monotonic() - started < PROMPT_S
    # A small document next to it is still completed.
    small = fresh_uri()
    server.open(small, "def add(a, b):\n    return ")
    assert "result" in server.complete(small, 1, 11, timeout=PROMPT_S)
    server.close(small)
    server.close(big_uri)
    server.stats(timeout=PROMPT_S)


# ------------------------------------------------------------------------------------- fuzzing

TOKENS = ["a", "b", "x1", " ", "    ", "\n", "\r\n", "\r", "\t", "(", ")", ":", "=", "'", "def ", "return ",
          "if x:", "é", "😀", "\x00", "\ud800", "#"]
texts = st.lists(st.sampled_from(TOKENS), max_size=14).map("".join)


def draw_position(data: st.DataObject, text: str) -> tuple[int, int]:
    """Mostly inside the document, sometimes one line or a few characters past an end."""
    lines = lines_of(text)
    line = data.draw(st.integers(0, len(lines)))
    width = utf16_len(lines[line]) if line < len(lines) else 0
    return line, data.draw(st.integers(0, width + 2))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_random_sessions_keep_the_server_alive_and_in_sync(ready, data):
    server = ready
    uri = fresh_uri("fuzz")
    text = clean(data.draw(texts, label="initial text"))
    version = 1
    server.open(uri, text, version)
    try:
        fuzz_session(server, data, uri, text, version)
    finally:
        server.close(uri)  # a failing example must not leave a document open for the next ones


def fuzz_session(server: RawLsp, data: st.DataObject, uri: str, text: str, version: int) -> None:
    pending: list[int] = []
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        action = data.draw(st.sampled_from(["edit", "edit", "edit", "replace", "complete", "cancel"]))
        if action == "edit":
            changes = []
            scratch = text
            for _ in range(data.draw(st.integers(1, 3))):
                (sl, sc), (el, ec) = draw_position(data, scratch), draw_position(data, scratch)
                change = {"range": rng(sl, sc, el, ec), "text": data.draw(texts)}
                changes.append(change)
                scratch = ref_apply(scratch, change)
            version += 1
            server.change(uri, version, changes)
            text = scratch
        elif action == "replace":
            version += 1
            new = data.draw(texts)
            server.change(uri, version, [{"text": new}])
            text = clean(new)
        elif action == "complete":
            pending.append(server.complete_request(uri, *draw_position(data, text)))
        elif pending:
            server.notify("$/cancelRequest", {"id": pending[-1]})
    note(f"final text: {text!r}")
    server.stats()
    for msg_id in pending:
        reply = server.response(msg_id)
        if "error" in reply:  # out-of-range positions, cancelled requests
            assert reply["error"]["code"] in (-32602, -32800), reply
        else:
            items(reply)
    assert_server_text(server, uri, text)


# ------------------------------------------------------------------------------------- shutdown


@pytest.mark.slow
def test_cancellation_storm_leaves_no_generation_running(ready):
    """Hundreds of completions, each cancelled right after it was sent, across many documents (so
    that superseding alone would not stop them): afterwards the engine runs nothing."""
    server = ready
    server.configure(maxRequestsPerSecond=0, maxTokens=200, reuse=False)
    uris = [fresh_uri(f"storm{i}") for i in range(20)]
    for i, uri in enumerate(uris):
        server.open(uri, f"def storm_{i}(values):\n    total = 0\n    for v in values:\n        ")
    sent = []
    for round_ in range(15):
        for uri in uris:
            msg_id = server.complete_request(uri, 3, 8)
            server.notify("$/cancelRequest", {"id": msg_id})
            sent.append(msg_id)
    replies = [server.response(i, timeout=120) for i in sent]
    # Each is answered: cancelled, or an (empty or short) result if it finished before the cancel.
    assert all(r.get("error", {}).get("code", -32800) == -32800 for r in replies), [r for r in replies if "error" in r][:3]
    assert sum("error" in r for r in replies) >= len(sent) // 2, "most requests should have been cancelled"
    deadline = time.monotonic() + 10
    while True:
        engine = server.stats()["engine"]["stats"]
        if engine.get("num_requests_running", 0) == 0 and engine.get("num_requests_waiting", 0) == 0:
            break
        assert time.monotonic() < deadline, f"generation still running 10 s after the storm: {engine}"
        time.sleep(0.5)
    server.configure(maxRequestsPerSecond=20, maxTokens=8, reuse=True)
    for uri in uris:
        server.close(uri)
    # The server still serves a normal request after the storm.
    uri = fresh_uri("after-storm")
    server.open(uri, "def add(a, b):\n    return ")
    reply = server.complete(uri, 1, 11)
    assert "error" not in reply, reply


@pytest.mark.slow
def test_shutdown_and_exit_stop_generation_and_leave_no_child_processes(ready):
    """Last in this module: it ends the shared server."""
    server = ready
    assert any(p.name().startswith("VLLM") for p in server.family()), "expected vLLM's engine processes"
    uri = fresh_uri()
    text = "# count to one thousand\nnumbers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, "
    server.open(uri, text)
    server.configure(maxTokens=1000, reuse=False)
    busy = server.complete_request(uri, *end_position(text))
    time.sleep(1.0)
    assert not server.has_response(busy), "expected a long generation in flight"  # 1000 tokens: ~40 s
    reply = server.call("shutdown", None, timeout=5)
    assert "error" not in reply and reply["result"] is None, reply
    # The generating request is answered at once: cancelled (or what was generated so far).
    answer = server.response(busy, timeout=5)
    assert answer.get("error", {}).get("code", -32800) == -32800, answer
    family = server.family()  # the server, vLLM's processes, multiprocessing's resource tracker
    server.notify("exit")
    alive = wait_gone(family, timeout=5)
    assert not alive, f"left running 5 s after exit: {[(p.pid, p.name()) for p in alive]}"
    assert server.proc.wait(timeout=1) == 0


# ----------------------------------------------------------------------- protocol bookkeeping


def test_notifications_leave_no_futures_behind():
    """pygls files a future per notification and never removes it; ember's protocol does, so a
    long typing session does not grow the server (in-process: the protocol, no engine)."""
    from lsp.config import Settings
    from lsp.engine_host import EmberCore
    from lsp.server import build_server

    server = build_server(EmberCore(Settings()))
    sent: list[bytes] = []
    server.protocol.set_writer(type("Sink", (), {"write": lambda self, data: sent.append(data), "close": lambda self: None})())

    def feed(message: dict[str, Any]) -> None:
        server.protocol.handle_message(json.loads(json.dumps(message), object_hook=server.protocol.structure_message))

    feed({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"processId": None, "capabilities": {}}})
    uri = "file:///work/futures.py"
    feed({"jsonrpc": "2.0", "method": "textDocument/didOpen",
          "params": {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": "x = 1\n"}}})
    for version in range(2, 202):
        feed({"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
            "textDocument": {"uri": uri, "version": version},
            "contentChanges": [{"range": rng(0, 0, 0, 0), "text": "a"}]}})
    assert server.documents[uri].text == "a" * 200 + "x = 1\n"
    assert len(server.protocol._request_futures) == 0, len(server.protocol._request_futures)
