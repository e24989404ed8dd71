"""The per-user daemon behind ``ember --stdio``, with real processes: forwarders launched as editors
launch them, daemons they start themselves, a real engine where completions are asserted.

Tests that need no model point the daemon at an engine URL nobody serves (the daemon's mechanics
do not depend on the engine, and it is up in about a second); the others use the bundled model.
Each test gets its own runtime directory, so daemons never leak between tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from lsprotocol import types
from pytest_lsp.client import make_test_lsp_client

from lsp import VERSION
from lsp.config import Settings, merge_settings
from lsp.daemon import PROTOCOL, DaemonAddress, admits, daemon_key, peer_uid
from lsp.forwarder import SessionState
from tests.conftest import (
    DATA,
    EAGER,
    client_capabilities,
    plain,
    wait_ready,
)

ROOT = Path(__file__).resolve().parents[1]
NO_ENGINE = ["--engine-url", "http://127.0.0.1:9/v1"]  # loopback port 9 (discard): nothing answers
URI = "file:///proj/inventory.py"


def env_for(runtime: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "XDG_RUNTIME_DIR": str(runtime), **extra}


def daemon_processes(runtime: Path) -> list[psutil.Process]:
    return [
        p for p in psutil.process_iter(["cmdline"])
        if "daemon" in (p.info["cmdline"] or ()) and str(runtime) in " ".join(p.info["cmdline"] or ())
    ]


def sockets(runtime: Path) -> list[Path]:
    return sorted((runtime / "ember").glob("*.sock"))


class Window:
    """An editor window: ``ember --stdio`` (the forwarder) driven by pygls' client."""

    def __init__(self, runtime: Path, *args: str, **env: str) -> None:
        self.runtime, self.args, self.env = runtime, args, env
        self.client = make_test_lsp_client()  # keeps window/showMessage and $/progress reports

    @property
    def messages(self) -> list[str]:
        return [params.message for params in self.client.messages]

    async def open(self, options: dict[str, Any] | None = None) -> dict[str, Any]:
        await self.client.start_io(
            sys.executable, "-m", "lsp", "--stdio", *self.args, env=env_for(self.runtime, **self.env), cwd=str(ROOT)
        )
        await self.client.initialize_session(  # initialize, then initialized
            types.InitializeParams(
                capabilities=client_capabilities(), initialization_options={"debounceMs": 0, **(options or {})}
            )
        )
        return await self.stats()

    async def stats(self) -> dict[str, Any]:
        return plain(await self.client.protocol.send_request_async("ember/stats", {"uri": URI}))

    def did_open(self, text: str) -> None:
        item = types.TextDocumentItem(uri=URI, language_id="python", version=1, text=text)
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(text_document=item))

    def type_at_end(self, text: str, current: str, version: int) -> str:
        lines = current.split("\n")
        end = types.Position(line=len(lines) - 1, character=len(lines[-1]))
        change = types.TextDocumentContentChangePartial(range=types.Range(start=end, end=end), text=text)
        self.client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=URI, version=version), content_changes=[change]
            )
        )
        return current + text

    async def complete_at_end(self, text: str) -> str:
        lines = text.split("\n")
        params = types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=URI),
            position=types.Position(line=len(lines) - 1, character=len(lines[-1])),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
        )
        result = await self.client.text_document_inline_completion_async(params)
        return result.items[0].insert_text if result and result.items else ""

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.client.shutdown_async(None), 30)
            self.client.exit(None)
        except Exception:  # noqa: BLE001 - the process may be gone already; stop() reaps it
            pass
        await self.client.stop()


# ------------------------------------------------------------------------------ without a model


def test_the_forwarder_imports_no_engine_or_protocol_library() -> None:
    """``ember --stdio`` is ready at once: the forwarder's path imports neither vLLM, torch, nor pygls."""
    code = (
        "import sys, lsp.cli, lsp.forwarder, lsp.daemon\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'pygls', 'lsprotocol', 'transformers'})\n"
        "print(heavy)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_session_state_follows_utf8_edits_and_replays_them() -> None:
    state = SessionState(position_encoding="utf-8")
    state.track({"method": "initialize", "id": 1, "params": {}})
    state.track({"method": "initialized", "params": {}})
    item = {"uri": URI, "languageId": "python", "version": 1, "text": "s = 'é'\n"}
    state.track({"method": "textDocument/didOpen", "params": {"textDocument": item}})
    # "é" is two UTF-8 bytes: byte column 7 is after it, UTF-16 column 6.
    change = {"range": {"start": {"line": 0, "character": 7}, "end": {"line": 0, "character": 7}}, "text": "x"}
    state.track({"method": "textDocument/didChange", "params": {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [change]}})
    settings = {"method": "workspace/didChangeConfiguration", "params": {"settings": {"ember": {"maxTokens": 8}}}}
    state.track(settings)
    replay = state.replay()
    assert [m["method"] for m in replay] == ["initialized", "workspace/didChangeConfiguration", "textDocument/didOpen"]
    reopened = replay[-1]["params"]["textDocument"]
    assert reopened == {"uri": URI, "languageId": "python", "version": 2, "text": "s = 'éx'\n"}
    state.track({"method": "textDocument/didClose", "params": {"textDocument": {"uri": URI}}})
    assert [m["method"] for m in state.replay()] == ["initialized", "workspace/didChangeConfiguration"]


def test_peer_credentials_of_another_uid_are_refused() -> None:
    left, right = socket.socketpair(socket.AF_UNIX)
    try:
        assert peer_uid(left) == os.getuid()
    finally:
        left.close()
        right.close()
    assert admits(os.getuid(), os.getuid())
    assert not admits(os.getuid() + 1, os.getuid())


def test_daemon_keys_differ_by_engine_settings_and_version() -> None:
    base = Settings()
    other_model = merge_settings(base, {"model": "/models/other"})
    assert daemon_key(base) != daemon_key(other_model)
    assert daemon_key(base) != daemon_key(base, version="0.0.1")
    assert daemon_key(base) == daemon_key(merge_settings(base, {"maxTokens": 8, "debounceMs": 50}))  # per connection


async def test_two_windows_launched_at_once_start_one_daemon(runtime: Path) -> None:
    windows = [Window(runtime, *NO_ENGINE) for _ in range(3)]
    stats = await asyncio.gather(*(w.open() for w in windows))
    try:
        pids = {s["daemon"]["pid"] for s in stats}
        assert len(pids) == 1, pids
        assert len(daemon_processes(runtime)) == 1
        assert len(sockets(runtime)) == 1
        assert (await windows[0].stats())["daemon"]["clients"] == 3
        assert all(s["engine"]["starts"] == 1 for s in stats)
    finally:
        await asyncio.gather(*(w.close() for w in windows))


async def test_a_stale_socket_is_replaced(runtime: Path) -> None:
    key = daemon_key(merge_settings(Settings(), {"engineUrl": NO_ENGINE[1]}))
    (runtime / "ember").mkdir(mode=0o700)
    address = DaemonAddress.for_key(key, runtime / "ember")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(address.socket))  # what a crashed daemon leaves: a socket file nobody listens on
    dead.close()
    stale_inode = address.socket.stat().st_ino
    window = Window(runtime, *NO_ENGINE)
    try:
        stats = await window.open()
        assert stats["daemon"]["socket"] == str(address.socket)
        assert address.socket.stat().st_ino != stale_inode
    finally:
        await window.close()


async def test_the_daemon_exits_when_idle_and_removes_its_socket(runtime: Path) -> None:
    window = Window(runtime, *NO_ENGINE, "--daemon-idle-s", "1")
    stats = await window.open()
    daemon = psutil.Process(stats["daemon"]["pid"])
    assert sockets(runtime)
    await window.close()
    daemon.wait(timeout=30)  # raises psutil.TimeoutExpired if it stays
    assert not sockets(runtime)


async def test_status_and_stop_commands(runtime: Path) -> None:
    window = Window(runtime, *NO_ENGINE)
    stats = await window.open()
    try:
        def ember(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "lsp", *args], env=env_for(runtime), cwd=ROOT, capture_output=True, text=True, timeout=60
            )

        status = [json.loads(line) for line in ember("daemon", "status").stdout.splitlines()]
        assert [s["pid"] for s in status] == [stats["daemon"]["pid"]]
        assert status[0]["clients"] == 1 and status[0]["version"] == VERSION
        daemon = psutil.Process(stats["daemon"]["pid"])
        assert ember("daemon", "stop").returncode == 0
        daemon.wait(timeout=30)
        # The open window is told and gets a new daemon.
        deadline = time.monotonic() + 60
        while not any("daemon stopped" in m for m in window.messages):
            assert time.monotonic() < deadline, window.messages
            await asyncio.sleep(0.1)
        after = await window.stats()
        assert after["daemon"]["pid"] != stats["daemon"]["pid"]
    finally:
        await window.close()


async def test_other_versions_and_other_users_are_refused(runtime: Path) -> None:
    window = Window(runtime, *NO_ENGINE)
    stats = await window.open()
    path = stats["daemon"]["socket"]
    key = Path(path).stem
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(f"{PROTOCOL} 0.0.1 {key} lsp\n".encode())
        answer = await asyncio.wait_for(reader.readline(), 10)
        assert answer.startswith(b"refused ") and b"0.0.1" in answer, answer
        writer.close()
        if os.getuid() == 0:  # root can be another user for a moment; others rely on the unit test above
            os.chmod(runtime, 0o755)
            os.chmod(Path(path).parent, 0o755)
            os.chmod(path, 0o777)
            probe = (  # the daemon closes at once: the greeting or the read may meet the closed socket
                "import os, socket, sys\n"
                "os.setuid(65534)\n"
                "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                "try:\n"
                f"    s.sendall(b'{PROTOCOL} {VERSION} {key} lsp\\n')\n"
                "    print(repr(s.recv(100)))\n"
                "except (BrokenPipeError, ConnectionResetError):\n"
                "    print('closed')\n"
            )
            result = subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, result.stderr
            assert result.stdout.strip() in ("b''", "closed"), result.stdout  # closed without a greeting
            assert "refused a connection from uid 65534" in Path(path).with_suffix(".log").read_text()
        assert (await window.stats())["daemon"]["clients"] == 1
    finally:
        await window.close()


async def test_without_a_usable_runtime_dir_the_window_runs_its_own_server(runtime: Path) -> None:
    (runtime / "ember").mkdir(mode=0o700)
    os.chmod(runtime / "ember", 0o755)  # others could enter: no daemon socket may live there
    window = Window(runtime, *NO_ENGINE)
    try:
        stats = await window.open()
        assert stats["daemon"] is None  # an in-process server (`--daemon off`), child of the forwarder
        assert any("runs its own engine" in m and "0700" in m for m in window.messages), window.messages
        assert not sockets(runtime) and not daemon_processes(runtime)
    finally:
        await window.close()


# ------------------------------------------------------------------------------ with the bundled model


@pytest.mark.slow
async def test_windows_share_one_engine_and_survive_a_killed_daemon(runtime: Path) -> None:
    """Two windows, one daemon and one engine start; then the daemon is killed: the windows are
    told, a new daemon starts, the documents (with the edits made before) are reopened in it, and
    the next request is answered."""
    text = (DATA / "inventory.py").read_text() + "\n\ndef total_weight(items):\n    return "
    # The session's three servers may still be loading their engines on the same two cores: this
    # test is about sharing and recovery, so its answers get a deadline no such contention reaches
    # (CI once hit the default 15 s on the first answer).
    args = ("--max-tokens", "12", "--timeout-ms", "60000", *EAGER)
    first, second = Window(runtime, *args), Window(runtime, *args)
    try:
        await first.open()
        ready = await wait_ready(first.client)
        assert ready["engine"]["starts"] == 1
        # The progress ends on the daemon's loading task, which may run just after ember/stats answered "ready".
        for _ in range(200):
            loading = [r for token, r in first.client.progress_reports.items() if str(token).startswith("ember-load")]
            if loading and "ready" in (loading[0][-1].message or ""):
                break
            await asyncio.sleep(0.05)
        assert loading and "ready" in loading[0][-1].message, "the daemon's loading progress reaches the first window"
        first.did_open(text)
        assert await first.complete_at_end(text), (await first.stats())["last_for_uri"]

        joined = await second.open()
        assert joined["engine"]["ready"], "a second window joins the warm engine"
        assert joined["daemon"]["pid"] == ready["daemon"]["pid"] and joined["daemon"]["clients"] == 2
        assert joined["engine"]["starts"] == 1

        # Edits the new daemon can only know from the forwarder's copy of the document.
        edited = first.type_at_end("\n\ndef restock(item, count):\n    item.quantity += count\n    return ", text, 2)
        daemon = psutil.Process(ready["daemon"]["pid"])
        os.killpg(os.getpgid(daemon.pid), signal.SIGKILL)  # the daemon and its engine process

        deadline = time.monotonic() + 60
        while not any("daemon stopped" in m for m in first.messages):
            assert time.monotonic() < deadline, first.messages
            await asyncio.sleep(0.1)
        recovered = await wait_ready(first.client)
        assert recovered["daemon"]["pid"] != daemon.pid
        # A position on the last edited line: the old text has no such line (it would be -32602).
        answer = await first.complete_at_end(edited)
        last = (await first.stats())["last_for_uri"]
        assert last is not None and last["outcome"] in ("ok", "empty") and last["prompt_tokens"] > 0, last
        assert answer or last["outcome"] == "empty"
        assert (await second.stats())["daemon"]["pid"] == recovered["daemon"]["pid"]
    finally:
        await first.close()
        await second.close()
    assert len(daemon_processes(runtime)) <= 1


async def test_the_daemon_starts_its_engine_for_a_fast_first_window(runtime: Path) -> None:
    """The window that starts a daemon waits for its engine: the daemon is not in the long-lived
    (compiled on a CPU) mode that `--tcp` uses; `--engine-arg enforce_eager=false` opts in."""
    window = Window(runtime, *NO_ENGINE)
    try:
        stats = await window.open()
        assert stats["engine"]["long_lived"] is False
    finally:
        await window.close()


# ------------------------------------------------------------------------------ forwarder edges, scripted daemon


class EditorOut:
    """What the forwarder writes to the editor, as parsed messages."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def flush(self) -> None:
        pass

    def messages(self) -> list[dict[str, Any]]:
        found, rest = [], self.data
        while rest:
            header, _, rest = rest.partition(b"\r\n\r\n")
            length = int(header.split(b":")[1])
            found.append(json.loads(rest[:length]))
            rest = rest[length:]
        return found


async def test_forwarder_answers_lost_requests_and_replays_to_the_next_daemon(runtime: Path) -> None:
    """A scripted daemon that dies on the first completion request: the editor gets an empty answer
    for it and an error for the lost stats request, a message, and the next daemon gets initialize,
    initialized and the document with the edit made before."""
    from lsp.forwarder import Forwarder
    from lsp.framing import ResyncReader, frame, read_message

    path = runtime / "d.sock"
    seen: list[list[dict[str, Any]]] = []

    async def scripted_daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(b'ok {"pid": %d, "socket": "scripted"}\n' % len(seen))
        received: list[dict[str, Any]] = []
        seen.append(received)
        stream = ResyncReader(reader)
        while (body := await read_message(stream)) is not None:
            message = json.loads(body)
            received.append(message)
            if message.get("method") == "initialize":
                writer.write(frame(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {"capabilities": {}}}).encode()))
            elif message.get("method") == "textDocument/inlineCompletion":
                if len(seen) == 1:
                    writer.close()  # dies with two requests in flight
                    return
                writer.write(frame(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": {"items": []}}).encode()))

    server = await asyncio.start_unix_server(scripted_daemon, path=str(path))
    out = EditorOut()
    forwarder = Forwarder({"maxTokens": 8}, Settings(), str(path), [], [], out)  # type: ignore[arg-type]

    async def send(message: dict[str, Any]) -> None:
        await forwarder.from_editor(json.dumps({"jsonrpc": "2.0", **message}).encode())

    async def until(predicate: Any) -> None:
        for _ in range(200):
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(out.messages())

    item = {"uri": URI, "languageId": "python", "version": 1, "text": "x = 1\n"}
    change = {"range": {"start": {"line": 1, "character": 0}, "end": {"line": 1, "character": 0}}, "text": "y = "}
    position = {"textDocument": {"uri": URI}, "position": {"line": 1, "character": 4}}
    try:
        await send({"id": 1, "method": "initialize", "params": {"capabilities": {}, "initializationOptions": {"debounceMs": 0}}})
        await send({"method": "initialized", "params": {}})
        await send({"method": "textDocument/didOpen", "params": {"textDocument": item}})
        await send({"method": "textDocument/didChange", "params": {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [change]}})
        await send({"id": 2, "method": "ember/stats", "params": {}})
        await send({"id": 3, "method": "textDocument/inlineCompletion", "params": position})
        await until(lambda: len(seen) == 2 and len(seen[1]) >= 3)  # the next daemon got the replay
        await send({"id": 4, "method": "textDocument/inlineCompletion", "params": position})
        await until(lambda: any(m.get("id") == 4 for m in out.messages()))
    finally:
        server.close()

    answers = {m["id"]: m for m in out.messages() if "id" in m and "method" not in m}
    assert answers[1]["result"] == {"capabilities": {}}
    assert answers[2]["error"]["code"] == -32803  # lost: the editor may ask again
    assert answers[3]["result"] is None  # a lost completion is an empty one
    assert answers[4]["result"] == {"items": []}  # the next request is served by the next daemon
    assert any(m.get("method") == "window/showMessage" and "daemon stopped" in m["params"]["message"] for m in out.messages())
    first, second = seen
    assert first[0]["params"]["initializationOptions"] == {"maxTokens": 8, "debounceMs": 0}  # command line under the editor's
    assert [m["method"] for m in second[:3]] == ["initialize", "initialized", "textDocument/didOpen"]
    assert second[0]["id"] != 1  # the editor's initialize was answered already
    assert second[2]["params"]["textDocument"] == {"uri": URI, "languageId": "python", "version": 2, "text": "x = 1\ny = "}


async def test_status_names_the_engines_stage_while_it_starts(tmp_path: Path) -> None:
    """``ember daemon status`` (the daemon's info) says what the engine is doing while it starts,
    with the percentage the editors' progress shows."""
    from engine.embedded import EmbeddedConfig, EmbeddedEngine
    from lsp.daemon import Daemon
    from lsp.engine_host import EmberCore

    importing = asyncio.Event()

    class Importing(EmbeddedEngine):
        async def start(self) -> None:
            self._stage("importing")
            importing.set()
            await asyncio.Event().wait()  # vLLM being imported, for as long as the test looks

    def factory(settings: Settings, progress: Any) -> EmbeddedEngine:
        return Importing(EmbeddedConfig(model_path="/models/m", model_name="m"), lambda stage: progress.set(stage, "m"))

    core = EmberCore(Settings(), factory)
    core.start_engine()
    await asyncio.wait_for(importing.wait(), 10)
    daemon = Daemon(core, DaemonAddress(tmp_path / "d.sock", "k"), idle_s=60)
    assert daemon.info()["stage"] == {"message": "loading m: importing vLLM", "percentage": 15}
    await core.close()
