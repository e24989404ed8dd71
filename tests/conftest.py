"""Shared fixtures: one real ember server (embedded vLLM, SmolLM2-135M) for the whole session."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import ClientServerConfig, LanguageClient

from tests.load_driver import free_port, plain  # free_port: the tests import it from here too

# Every ember the tests start (also through editors' configs, which launch plain `ember`) serves
# the bundled model: no test may reach for a model hub or wait on its timeout (and should one
# still ask, the Hugging Face client answers from the cache at once instead of going online).
os.environ.setdefault("EMBER_MODEL", "bundled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tests that do not name an engine run on vLLM, as before llama.cpp became the CPU's default:
# tests/test_llamacpp.py runs llama.cpp's server under the same kinds of tests.
os.environ.setdefault("EMBER_ENGINE", "vllm")

DATA = Path(__file__).parent / "data"
# The public eval sets: ../shared/eval beside the checkout (as CI lays it out), or $EMBER_EVAL_DIR.
EVAL = Path(os.environ.get("EMBER_EVAL_DIR") or Path(__file__).resolve().parents[2] / "shared" / "eval")

# Every daemon a test starts (`ember --stdio` forwards to one by default) lives in this session's
# own runtime directory, exits soon after its last editor, and is stopped when the session ends:
# a daemon outliving the test command would keep CI waiting.
RUNTIME_DIR = Path(tempfile.mkdtemp(prefix="ember-tests-"))
os.environ["XDG_RUNTIME_DIR"] = str(RUNTIME_DIR)
os.environ.setdefault("EMBER_DAEMON_IDLE_S", "20")
SERVER_ARGS = ["--daemon", "off", "--max-tokens", "24", "--log-level", "INFO"]
# TCP servers and daemons default to vLLM's compiled mode on the CPU (faster decoding for 40-120 s
# more start-up); tests that do not test that default start eager, to keep CI's 2 cores in time.
EAGER = ("--engine-arg", "enforce_eager=true")
READY_TIMEOUT_S = 600  # generous: CI has 2 cores and several engines start at once
# The file the editor tests (Neovim, the VS Code workbench) open, and the line they type at its end.
EDITOR_SAMPLE = '''\
"""Small math helpers."""


def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


def factorial(n):
    """Return n factorial."""
    if n < 2:
        return 1
'''
EDITOR_TYPED = "    return n * "


def ember_executable() -> str:
    """The ``ember`` console script an editor launches: beside this Python, else on PATH."""
    exe = Path(sys.executable).parent / "ember"
    if exe.exists():
        return str(exe)
    found = shutil.which("ember")
    assert found, f"ember console script not found beside {sys.executable} nor on PATH"
    return found


def client_capabilities() -> types.ClientCapabilities:
    return types.ClientCapabilities(
        window=types.WindowClientCapabilities(work_done_progress=True),
        text_document=types.TextDocumentClientCapabilities(
            completion=types.CompletionClientCapabilities(),
            inline_completion=types.InlineCompletionClientCapabilities(),
            synchronization=types.TextDocumentSyncClientCapabilities(),
        ),
    )


async def stats(client: Any) -> dict[str, Any]:
    return plain(await client.protocol.send_request_async("ember/stats", {}))


async def wait_ready(client: Any, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        current = await stats(client)
        engine = current["engine"]
        if engine["ready"]:
            return current
        if engine["error"] and not engine.get("restarting"):
            raise AssertionError(f"engine failed to start: {engine['error']}")
        if time.monotonic() > deadline:
            raise AssertionError("engine did not become ready in time")
        await asyncio.sleep(0.5)


@pytest_lsp.fixture(
    scope="session",
    config=ClientServerConfig(server_command=[sys.executable, "-m", "lsp", "--stdio", *SERVER_ARGS]),
)
async def client(lsp_client: LanguageClient):
    """A session with the real server; the model may still be loading when tests start."""
    result = await lsp_client.initialize_session(
        types.InitializeParams(
            capabilities=client_capabilities(),
            initialization_options={"maxTokens": 24, "debounceMs": 0},
        )
    )
    lsp_client.initialize_result = result  # type: ignore[attr-defined]
    yield
    await lsp_client.shutdown_session()


@pytest.fixture(scope="session", autouse=True)
def session_servers_start_with_the_session(request: pytest.FixtureRequest) -> None:
    """The session's servers (``client``'s over stdio, ``tcp_ember``, ``token_tcp_ember``) start
    before the first test when a selected test uses them: each engine spends ~20 s loading, mostly
    importing on one core, which the tests before their first user overlap instead of waiting for
    (the suite: 739 s with the first two started here, 763 s with ``tcp_ember`` started by its first
    user, 2 cores)."""
    for name in ("client", "tcp_ember", "token_tcp_ember"):
        if any(name in item.fixturenames for item in request.session.items):
            request.getfixturevalue(name)


@pytest.fixture(scope="session")
def vsix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The VS Code extension built once, as the README tells users to build it (``npm run
    package``), copied out of the source tree."""
    vscode = Path(__file__).resolve().parents[1] / "editors" / "vscode"
    (vscode / "ember.vsix").unlink(missing_ok=True)
    npm = shutil.which("npm")
    assert npm, "npm is not on PATH"
    r = subprocess.run([npm, "run", "package"], cwd=vscode, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (vscode / "ember.vsix").is_file(), r.stdout + r.stderr
    return Path(shutil.copy(vscode / "ember.vsix", tmp_path_factory.mktemp("vsix") / "ember.vsix"))


@dataclass(frozen=True)
class TcpServer:
    address: tuple[str, int]
    pid: int


@pytest.fixture(scope="session")
def tcp_ember(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TcpServer]:
    """One ``ember --tcp`` on 127.0.0.1 for the session (its engine loads once): the TCP tests'
    editors and the load test's sessions connect to it."""
    from tests.load_driver import start_tcp

    # `--tcp 0`: the port alone, so tests/test_tcp.py sees the default host.
    proc, address = start_tcp(["--tcp", "0", "--max-tokens", "16", *EAGER], tmp_path_factory.mktemp("tcp") / "stderr.log")
    try:
        yield TcpServer(address, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture(scope="session")
def token_tcp_ember(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """tests/test_security.py's ``ember --tcp 0 --token T --log-level DEBUG`` (a
    ``tests.test_security.TcpServer``), started with the session; its last test ends it with SIGTERM."""
    from tests.test_security import TOKEN
    from tests.test_security import TcpServer as SecurityServer

    server = SecurityServer(
        tmp_path_factory.mktemp("security"),
        "--tcp", "0", "--token", TOKEN, "--log-level", "DEBUG", "--max-tokens", "8", *EAGER,
    )  # fmt: skip
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def tcp_server(tcp_ember: TcpServer) -> tuple[str, int]:
    """The session's ``ember --tcp`` address (host, port)."""
    return tcp_ember.address


def stop_daemons(runtime_dir: Path) -> None:
    """Stops the daemons under ``runtime_dir`` (SIGTERM, then SIGKILL), found by their command line."""
    import psutil

    found = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(runtime_dir) in " ".join(p.info["cmdline"] or ()) and "daemon" in (p.info["cmdline"] or ())
    ]
    for process in found:
        process.terminate()
    _, alive = psutil.wait_procs(found, timeout=10)
    for process in alive:
        process.kill()


@pytest.fixture
def runtime() -> Iterator[Path]:
    """A runtime directory ($XDG_RUNTIME_DIR) of the test's own, for daemon sockets (short: Unix
    socket paths are limited to 108 bytes); its daemons are stopped afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="ed-"))
    yield directory
    stop_daemons(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_daemon_left_behind():
    yield
    stop_daemons(RUNTIME_DIR)


@pytest.fixture(scope="session")
def sample_text() -> str:
    return (DATA / "inventory.py").read_text()
