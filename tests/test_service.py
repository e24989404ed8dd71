"""``ember daemon install``: the user service that has the daemon ready before the first editor.

The systemd units are checked by ``systemd-analyze verify`` (Debian's systemd package, installed
by editors/install-test-deps.sh) and handed over as systemd does it: ``systemd-socket-activate``
holds the socket, the first editor's connection starts the daemon, which serves on the socket it
was given. The launchd agent cannot run here: its content is checked.
"""

from __future__ import annotations

import asyncio
import os
import plistlib
import signal
import subprocess
import sys
from pathlib import Path

from lsp.cli import parse_args, settings_from_args
from lsp.config import Settings
from lsp.daemon import DaemonAddress, daemon_key, engine_environment, engine_options
from lsp.service import LAUNCHD_LABEL, launchd_agent, serve_command, systemd_units
from tests.test_daemon import NO_ENGINE, Window

ROOT = Path(__file__).resolve().parents[1]


def test_the_systemd_units_verify_and_name_the_default_configurations_socket(tmp_path: Path, runtime: Path) -> None:
    units = systemd_units(Settings(), 300, tmp_path)
    for unit in units:
        unit.path.write_text(unit.text)
    socket_unit, service_unit = (unit.text for unit in units)
    key = daemon_key(Settings())
    assert f"ListenStream=%t/ember/{key}.sock" in socket_unit and "SocketMode=0600" in socket_unit
    assert f"--socket %t/ember/{key}.sock --key {key}" in service_unit and f"ExecStart={sys.executable} -m lsp" in service_unit
    verify = ["systemd-analyze", "--user", "verify", "--man=no", *(str(unit.path) for unit in units)]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    result = subprocess.run(verify, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # verify is not a formality: a unit whose program is missing fails it.
    broken = tmp_path / "broken"
    broken.mkdir()
    for unit in units:
        (broken / unit.path.name).write_text(unit.text.replace(f"ExecStart={sys.executable}", "ExecStart=/nonexistent/python"))
    broken_verify = [*verify[:4], *(str(broken / unit.path.name) for unit in units)]
    result = subprocess.run(broken_verify, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode != 0 and "/nonexistent/python" in result.stdout + result.stderr


def test_the_launchd_agent_starts_the_daemon_at_login_and_again_after_it_exits(tmp_path: Path) -> None:
    (agent,) = launchd_agent(Settings(), 600, tmp_path / "LaunchAgents", tmp_path / "ember")
    plist = plistlib.loads(agent.text.encode())
    key = daemon_key(Settings())
    assert agent.path.name == f"{LAUNCHD_LABEL}.plist" and plist["Label"] == LAUNCHD_LABEL
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is True
    arguments = plist["ProgramArguments"]
    assert arguments[:5] == [sys.executable, "-m", "lsp", "daemon", "serve"]
    assert arguments[arguments.index("--socket") + 1] == str(tmp_path / "ember" / f"{key}.sock")
    assert arguments[arguments.index("--idle-s") + 1] == "600"
    assert plist["WorkingDirectory"] == str(ROOT)


def test_install_writes_the_units_says_so_and_uninstall_removes_them(tmp_path: Path, runtime: Path) -> None:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "XDG_RUNTIME_DIR": str(runtime)}

    def ember(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "lsp", "daemon", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)

    units = tmp_path / "config" / "systemd" / "user"
    first = ember("install")
    assert f"wrote {units / 'ember-daemon.socket'}" in first.stdout and f"wrote {units / 'ember-daemon.service'}" in first.stdout
    # No user service manager runs here: what failed is said, with a non-zero exit.
    assert "systemctl --user" in first.stdout
    assert first.returncode == (1 if " failed: " in first.stdout else 0)
    assert f"kept {units / 'ember-daemon.service'}" in ember("install").stdout
    removed = ember("uninstall")
    assert f"removed {units / 'ember-daemon.socket'}" in removed.stdout and not list(units.iterdir())


async def test_socket_activation_the_first_editor_starts_the_daemon_on_the_held_socket(runtime: Path) -> None:
    """As systemd does it: the socket exists before any daemon; the first editor's connection
    starts ``ember daemon serve`` with the socket handed over, and the editor is served by it."""
    settings = settings_from_args(parse_args(NO_ENGINE))
    key = daemon_key(settings)
    sockets = runtime / "ember"
    sockets.mkdir(mode=0o700)
    address = DaemonAddress(sockets / f"{key}.sock", key)
    log = runtime / "activated.log"
    # Like systemd, systemd-socket-activate gives the daemon its own environment, not ours: only
    # what the unit's Environment= lines carry.
    service_unit = systemd_units(settings, 60, runtime)[1].text
    lines = service_unit.splitlines()
    carried = [line.removeprefix("Environment=").strip("'") for line in lines if line.startswith("Environment=")]
    assert sorted(carried) == sorted(f"{name}={value}" for name, value in engine_environment().items())
    given = [f"--setenv={pair}" for pair in [*carried, f"XDG_RUNTIME_DIR={runtime}"]]
    with open(log, "wb") as out:
        manager = subprocess.Popen(
            ["systemd-socket-activate", "-l", str(address.socket), *given, *serve_command(address, settings, 60)],
            cwd=ROOT, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip
    window = Window(runtime, *NO_ENGINE)
    try:
        for _ in range(100):
            if address.socket.exists():
                break
            await asyncio.sleep(0.05)
        assert engine_options(settings)["engineUrl"] == ["http://127.0.0.1:9/v1"]
        stats = await window.open()
        # The daemon is the process the "service manager" started: it exec'd into ember.
        assert stats["daemon"]["pid"] == manager.pid and stats["daemon"]["clients"] == 1, log.read_text()[-3000:]
        assert "the service manager's socket" in log.read_text()
    finally:
        await window.close()
        os.killpg(manager.pid, signal.SIGTERM)
        manager.wait(timeout=30)
