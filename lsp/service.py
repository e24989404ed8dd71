"""A user service that keeps the daemon ready before the first editor: ``ember daemon install``.

On Linux, two systemd user units: ``ember-daemon.socket`` holds the daemon's socket (the one a
plain ``ember --stdio`` connects to: the default engine settings' key) from login on, and
``ember-daemon.service`` runs ``ember daemon serve`` on it, started at login and by the first
connection after an idle exit (socket activation: the editor's connection waits in the socket
while the daemon starts). On macOS, a launchd agent that starts the daemon at login and restarts
it when it exits. The environment that selects the engine's model
(:data:`lsp.daemon.ENGINE_ENVIRONMENT`) is written into the files as it is at install time.
Other configurations (``--model``, ``--engine-url``, engine arguments) still start daemons of
their own. The files name the ember version through the key: after an upgrade, ``ember daemon
install`` writes them again, and says what it wrote.
"""

from __future__ import annotations

import json
import os
import plistlib
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from lsp.config import Settings
from lsp.daemon import DEFAULT_IDLE_S, DaemonAddress, daemon_key, engine_environment, engine_options

UNIT = "ember-daemon"
LAUNCHD_LABEL = "dev.ember.daemon"


@dataclass(frozen=True)
class ServiceFile:
    path: Path
    text: str


def packages_root() -> Path:
    """Where ember's own packages are (the daemon runs there, as when an editor starts it)."""
    return Path(__file__).resolve().parent.parent


def serve_command(address: DaemonAddress, settings: Settings, idle_s: float) -> list[str]:
    return [
        sys.executable, "-m", "lsp", "daemon", "serve", "--socket", str(address.socket), "--key", address.key,
        "--engine", json.dumps(engine_options(settings)), "--idle-s", f"{idle_s:g}",
    ]


def systemd_units(settings: Settings, idle_s: float, unit_dir: Path) -> list[ServiceFile]:
    """The socket and service units for the daemon of ``settings`` (``%t`` is the user's
    ``$XDG_RUNTIME_DIR``, where ``ember --stdio`` looks for the socket)."""
    key = daemon_key(settings)
    address = DaemonAddress(Path(f"%t/ember/{key}.sock"), key)
    # systemd unquotes ExecStart like a shell and expands % specifiers and $VARIABLES: escaped,
    # except the runtime directory's %t.
    command = " ".join(shlex.quote(part) for part in serve_command(address, settings, idle_s))
    command = command.replace("%", "%%").replace("$", "$$").replace("%%t/ember/", "%t/ember/")
    socket_unit = f"""[Unit]
Description=ember completion daemon socket (ember --stdio's default configuration, key {key})

[Socket]
ListenStream=%t/ember/{key}.sock
SocketMode=0600
DirectoryMode=0700

[Install]
WantedBy=sockets.target
"""
    # The service manager's environment is not the editor's: what the key depends on goes along.
    environment = "".join(
        f"Environment={shlex.quote(f'{name}={value}').replace('%', '%%')}\n" for name, value in engine_environment().items()
    )
    service_unit = f"""[Unit]
Description=ember completion daemon (one engine for every editor window)
Requires={UNIT}.socket
After={UNIT}.socket

[Service]
Type=simple
WorkingDirectory={packages_root()}
{environment}ExecStart={command}

[Install]
WantedBy=default.target
"""
    return [ServiceFile(unit_dir / f"{UNIT}.socket", socket_unit), ServiceFile(unit_dir / f"{UNIT}.service", service_unit)]


def launchd_agent(settings: Settings, idle_s: float, agents_dir: Path, socket_dir: Path) -> list[ServiceFile]:
    """The launchd agent: the daemon at login, started again when it exits (launchd's own socket
    activation needs an API ember's daemon does not use, so the daemon makes its socket itself)."""
    key = daemon_key(settings)
    address = DaemonAddress(socket_dir / f"{key}.sock", key)
    agent = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": serve_command(address, settings, idle_s),
        "WorkingDirectory": str(packages_root()),
        "EnvironmentVariables": engine_environment(),
        "RunAtLoad": True,
        "KeepAlive": True,
        "StandardErrorPath": str(address.log),
        "StandardOutPath": str(address.log),
    }
    return [ServiceFile(agents_dir / f"{LAUNCHD_LABEL}.plist", plistlib.dumps(agent).decode())]


def service_files(idle_s: float = DEFAULT_IDLE_S) -> list[ServiceFile]:
    """The files for this platform and a plain ``ember --stdio`` (default engine settings)."""
    settings = Settings()
    if sys.platform == "darwin":
        from lsp.daemon import runtime_dir

        return launchd_agent(settings, idle_s, Path.home() / "Library" / "LaunchAgents", runtime_dir())
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return systemd_units(settings, idle_s, config / "systemd" / "user")


def install(idle_s: float = DEFAULT_IDLE_S) -> list[str]:
    """Writes the service files and asks the service manager to start them; returns what was
    done, line by line, for the person who asked."""
    done = []
    for file in service_files(idle_s):
        file.path.parent.mkdir(parents=True, exist_ok=True)
        old = file.path.read_text() if file.path.is_file() else None
        file.path.write_text(file.text)
        done.append(f"{'kept' if old == file.text else 'replaced' if old else 'wrote'} {file.path}")
    done += _tell_manager(start=True)
    return done


def uninstall() -> list[str]:
    done = _tell_manager(start=False)
    for file in service_files():
        if file.path.is_file():
            file.path.unlink()
            done.append(f"removed {file.path}")
    return done


def _tell_manager(start: bool) -> list[str]:
    if sys.platform == "darwin":
        files = service_files()
        commands = [["launchctl", "load" if start else "unload", str(files[0].path)]]
    else:
        units = [f"{UNIT}.socket", f"{UNIT}.service"]
        switch = ["systemctl", "--user", "enable" if start else "disable", "--now", *units]
        commands = [["systemctl", "--user", "daemon-reload"], switch]
        if not start:
            commands.reverse()
    if shutil.which(commands[0][0]) is None:
        return [f"{commands[0][0]} is not here: run {' ; '.join(shlex.join(c) for c in commands)} where it is"]
    done = []
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        line = shlex.join(command)
        done.append(line if result.returncode == 0 else f"{line} failed: {(result.stderr or result.stdout).strip()}")
    return done
