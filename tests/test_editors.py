"""Editor integrations: the VS Code extension (editors/vscode) and the Helix config (editors/helix).

Needs `bash editors/install-test-deps.sh` first (it runs `npm ci` in editors/vscode).
The Neovim plugin is tested in tests/test_nvim.py; the packaged extension in the real VS Code
workbench (code-server in Chromium) in tests/test_vscode_workbench.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import EAGER, ember_executable

REPO = Path(__file__).resolve().parents[1]
VSCODE = REPO / "editors" / "vscode"
HELIX = REPO / "editors" / "helix" / "languages.toml"

# Every setting of the server (lsp/config.py) an editor user may set, except the switches that
# benchmarks use to measure what each idea buys and the server's own size limit.
BENCHMARK_SWITCHES = {"promptStrategy", "fimLayout", "reuse", "warmup", "prefixCache", "postprocess", "maxDocumentBytes"}


def server_keys() -> set[str]:
    from lsp.config import Settings

    camel = {re.sub(r"_(\w)", lambda m: m.group(1).upper(), f.name) for f in dataclasses.fields(Settings)}
    return camel - BENCHMARK_SWITCHES | {"token"}



def npm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("npm")
    assert exe, "npm is not on PATH"
    assert (VSCODE / "node_modules" / "vscode-languageclient").is_dir(), (
        "editors/vscode/node_modules is missing: run `bash editors/install-test-deps.sh`"
    )
    return subprocess.run(
        [exe, *args], cwd=VSCODE, capture_output=True, text=True, timeout=timeout
    )


def compile_extension() -> None:
    r = npm("run", "compile")
    assert r.returncode == 0, r.stdout + r.stderr


# --- VS Code ---------------------------------------------------------------------------------


def test_vscode_typechecks() -> None:
    r = npm("run", "typecheck")
    assert r.returncode == 0, r.stdout + r.stderr


def test_vscode_unit_tests_pass() -> None:
    r = npm("test")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    passed = re.search(r"^# pass (\d+)$", out, re.M)
    failed = re.search(r"^# fail (\d+)$", out, re.M)
    assert passed and int(passed.group(1)) >= 10, out
    assert failed and int(failed.group(1)) == 0, out


def test_vscode_vsix_builds(vsix: Path) -> None:
    with zipfile.ZipFile(vsix) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("extension/package.json"))
    assert {"extension/out/extension.js", "extension/out/config.js"} <= names
    assert "extension/node_modules/vscode-languageclient/package.json" in names
    assert not any(n.startswith("extension/src/") or "/out/test/" in n or "/out/smoke/" in n for n in names)
    assert manifest["main"] == "./out/extension.js"


def test_vscode_settings_cover_server_keys() -> None:
    manifest = json.loads((VSCODE / "package.json").read_text())
    props = manifest["contributes"]["configuration"]["properties"]
    keys = {k.removeprefix("ember.") for k in props}
    assert server_keys() <= keys, server_keys() - keys
    assert {"serverPath", "tcp", "token"} <= keys
    # vscode-languageclient >= 10 registers textDocument/inlineCompletion (LSP 3.18) by itself.
    dep = manifest["dependencies"]["vscode-languageclient"]
    assert int(re.search(r"\d+", dep).group()) >= 10
    installed = json.loads((VSCODE / "node_modules/vscode-languageclient/package.json").read_text())
    assert int(installed["version"].split(".")[0]) >= 10
    client_js = (VSCODE / "node_modules/vscode-languageclient/lib/common/client.js").read_text()
    assert "InlineCompletionItemFeature" in client_js



def _start_tcp_server(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    server = subprocess.Popen(
        [ember_executable(), "--tcp", f"127.0.0.1:{port}", *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            assert time.monotonic() < deadline, "ember --tcp did not listen within 120 s"
            time.sleep(0.5)


@pytest.mark.slow
def test_vscode_tcp_connection_with_token(tmp_path: Path) -> None:
    """With ember.tcp and ember.token set, the extension's connection gets past the token check."""
    compile_extension()
    node = shutil.which("node")
    assert node
    server, port = _start_tcp_server(tmp_path, "--token", "s3cret", *EAGER)
    try:
        results = {}
        for token in ("s3cret", "wrong"):
            out = tmp_path / f"{token}.json"
            r = subprocess.run(
                [node, str(VSCODE / "out/smoke/tcp.js"), f"127.0.0.1:{port}", token, str(out)],
                capture_output=True, text=True, timeout=90,
            )
            assert out.exists(), r.stdout + r.stderr
            results[token] = json.loads(out.read_text())
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    ok = results["s3cret"]
    assert "error" not in ok, ok
    assert ok["initializationOptions"] == {"maxTokens": 16, "token": "s3cret"}
    assert ok["capabilities"].get("inlineCompletionProvider") is not None
    assert "error" in results["wrong"] and "capabilities" not in results["wrong"]


# --- Helix -----------------------------------------------------------------------------------


def test_helix_languages_toml() -> None:
    cfg = tomllib.loads(HELIX.read_text())
    server = cfg["language-server"]["ember"]
    assert server["command"] == "ember"
    assert server["args"] == ["--stdio"]
    assert set(server["config"]) <= server_keys()
    assert {"maxTokens", "debounceMs"} <= set(server["config"])
    langs = {lang["name"]: lang for lang in cfg["language"]}
    expected = {"python", "javascript", "typescript", "tsx", "rust", "go", "java", "c", "cpp"}
    assert expected <= set(langs)
    for name in expected:
        servers = langs[name]["language-servers"]
        assert "ember" in servers, name
        assert len(servers) >= 2, f"{name}: Helix's default servers must stay in the list"

    # `ember` is the console script this package installs, and it is installed.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["ember"]
    exe = Path(ember_executable())
    assert exe.name == server["command"]
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--stdio" in r.stdout


def _lsp_send(stream, msg: dict) -> None:
    body = json.dumps(msg).encode()
    stream.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    stream.flush()


def _lsp_read(stream) -> dict:
    length = None
    while True:
        line = stream.readline()
        assert line, "server closed stdout"
        if line in (b"\r\n", b"\n"):
            break
        k, _, v = line.decode().partition(":")
        if k.strip().lower() == "content-length":
            length = int(v)
    assert length is not None
    return json.loads(stream.read(length))


def test_helix_config_initializes_ember(tmp_path: Path) -> None:
    """Start ember as Helix would (command + args, `config` as initializationOptions)."""
    cfg = tomllib.loads(HELIX.read_text())["language-server"]["ember"]
    exe = shutil.which(cfg["command"], path=str(Path(ember_executable()).parent))
    assert exe
    proc = subprocess.Popen(
        [exe, *cfg["args"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "stderr.log", "wb"),
        start_new_session=True,
    )
    try:
        _lsp_send(proc.stdin, {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {
                "processId": os.getpid(),
                "clientInfo": {"name": "helix", "version": "25.07"},
                "rootUri": tmp_path.as_uri(),
                "initializationOptions": cfg["config"],
                "capabilities": {"textDocument": {"completion": {"completionItem": {"snippetSupport": True}}}},
            },
        })
        while True:
            msg = _lsp_read(proc.stdout)
            if msg.get("id") == 1 and "method" not in msg:
                break
            if "method" in msg and "id" in msg:  # a request from the server: answer it
                _lsp_send(proc.stdin, {"jsonrpc": "2.0", "id": msg["id"], "result": None})
        assert "error" not in msg, msg
        caps = msg["result"]["capabilities"]
        assert caps.get("completionProvider") is not None, caps
        sync = caps.get("textDocumentSync")
        kind = sync.get("change") if isinstance(sync, dict) else sync
        assert kind == 2, f"expected incremental sync, got {sync}"
        _lsp_send(proc.stdin, {"jsonrpc": "2.0", "id": 2, "method": "shutdown", "params": None})
        _lsp_send(proc.stdin, {"jsonrpc": "2.0", "method": "exit", "params": None})
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
