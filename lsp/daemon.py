"""The per-user daemon: one warm engine for every editor window (like gopls ``-remote=auto``).

``ember --stdio`` forwards to it (:mod:`lsp.forwarder`). The daemon listens on a Unix socket in a
directory only its user can enter (``$XDG_RUNTIME_DIR/ember``, else ``$TMPDIR/ember-UID``), named
by a hash of the ember version and the engine settings, so that another configuration or version
gets a daemon of its own. It admits connections from its own uid only (``SO_PEERCRED``), serves
each one as TCP mode does (documents and settings per connection; engine, caches and metrics
shared) and exits after ``idle_s`` without a client.

Each connection opens with one line, ``ember-daemon/1 VERSION KEY COMMAND``, answered by
``ok {json}`` or ``refused REASON``; COMMAND is ``lsp`` (LSP follows), ``status`` or ``stop``.
KEY ``-`` joins whatever configuration runs there (``--daemon PATH``).

This module is import-light (the forwarder uses its client half); the serving half imports the
server only when a daemon starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lsp import VERSION
from lsp.config import Settings

if TYPE_CHECKING:
    from lsp.engine_host import EmberCore

log = logging.getLogger(__name__)

PROTOCOL = "ember-daemon/1"
ANY_KEY = "-"
DEFAULT_IDLE_S = 300.0
START_TIMEOUT_S = 60.0  # spawn -> socket answering (the engine loads afterwards, in the daemon)
HANDSHAKE_TIMEOUT_S = 10.0


class DaemonError(RuntimeError):
    """No daemon could be reached or started; the message says why."""


class DaemonRefused(DaemonError):
    """A daemon answered and refused (another version or configuration)."""


class DaemonBusy(DaemonError):
    """Something accepted the connection but did not greet in time: a daemon too busy to answer
    (never taken for a stale socket)."""


@dataclass(frozen=True)
class DaemonAddress:
    """Where one daemon lives: its socket and, beside it, its start lock and log."""

    socket: Path
    key: str

    @classmethod
    def for_key(cls, key: str, directory: Path | None = None) -> DaemonAddress:
        return cls((directory or runtime_dir()) / f"{key}.sock", key)

    @property
    def lock(self) -> Path:
        return self.socket.with_suffix(".lock")

    @property
    def log(self) -> Path:
        return self.socket.with_suffix(".log")


def engine_options(settings: Settings) -> dict[str, Any]:
    """The settings a daemon's engine is built from (camelCase, as ``merge_settings`` reads them).
    Editors whose engine options differ get different daemons; everything else is per connection."""
    options: dict[str, Any] = {
        "model": settings.model,
        "engineUrl": list(settings.engine_url),
        "prefixCache": settings.prefix_cache,
    }
    if not settings.engine_url:
        options["engine"] = settings.engine  # with a URL, the remote server is the engine
    if settings.engine_url:
        options["timeoutMs"] = settings.timeout_ms  # the remote client's fail-over timeouts derive from it
    if settings.engine_args:
        options["engineArgs"] = settings.engine_arg_dict()  # JSON values, as --engine-arg parsed them
    return options


# Environment that changes which model an engine loads, or where: windows that differ in it get
# daemons of their own (a daemon keeps the environment of the window that started it).
ENGINE_ENVIRONMENT = (
    "EMBER_DEFAULT_MODEL", "HF_ENDPOINT", "HF_HOME", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES", "VLLM_CPU_KVCACHE_SPACE",
    "EMBER_LLAMA_SERVER",
)


def engine_environment() -> dict[str, str]:
    """This process' values of :data:`ENGINE_ENVIRONMENT` (part of the daemon's key)."""
    return {name: os.environ[name] for name in ENGINE_ENVIRONMENT if name in os.environ}


def daemon_key(settings: Settings, version: str = VERSION) -> str:
    identity = {"version": version, **engine_options(settings), "env": engine_environment()}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def runtime_dir() -> Path:
    """The private directory for this user's daemon sockets; refused when someone else could
    enter it (a socket there would admit whoever can reach it)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    directory = Path(base) / "ember" if base and Path(base).is_dir() else Path(tempfile.gettempdir()) / f"ember-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise DaemonError(f"{directory} must be a directory that only uid {os.getuid()} can use (mode 0700)")
    return directory


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket; None where the platform cannot
    tell (then the 0700 directory is the only gate)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid


def admits(uid: int | None, own_uid: int) -> bool:
    return uid is None or uid == own_uid


# ---------------------------------------------------------------------------------- client half

Link = tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]  # reader, writer, the daemon's greeting


async def open_daemon(
    address: DaemonAddress, command: str = "lsp", key: str | None = None, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> Link:
    """Connects and greets; raises DaemonError (nobody listens there), DaemonBusy or DaemonRefused."""
    try:
        reader, writer = await asyncio.open_unix_connection(str(address.socket))
    except OSError as exc:  # no such file, or nobody listening: a socket left by a dead daemon
        raise DaemonError(f"no daemon at {address.socket}: {exc.strerror or exc}") from exc
    try:
        writer.write(f"{PROTOCOL} {VERSION} {key or address.key} {command}\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.readline(), timeout_s)
    except TimeoutError as exc:
        writer.close()
        raise DaemonBusy(f"the daemon at {address.socket} did not answer within {timeout_s:.0f} s") from exc
    except OSError as exc:
        writer.close()
        raise DaemonError(f"the daemon at {address.socket} hung up: {exc}") from exc
    if not answer.startswith(b"ok "):
        writer.close()
        reason = answer.decode("utf-8", "replace").strip() or "closed the connection"
        raise DaemonRefused(f"the daemon at {address.socket} refused: {reason}")
    return reader, writer, json.loads(answer[3:])


@contextlib.contextmanager
def start_lock(address: DaemonAddress, timeout_s: float = START_TIMEOUT_S + 10) -> Iterator[None]:
    """One starter at a time per address: two editors launching at once get one daemon."""
    fd = os.open(address.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    waited = f"another ember has been starting the daemon for {timeout_s:.0f} s ({address.lock})"
                    raise DaemonError(waited) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


async def _join(address: DaemonAddress) -> Link | None:
    """The daemon at ``address``; None when nobody listens there (Busy and Refused propagate:
    a live daemon's socket is never taken for a stale one)."""
    try:
        return await open_daemon(address, timeout_s=START_TIMEOUT_S)
    except (DaemonRefused, DaemonBusy):
        raise
    except DaemonError:
        return None


async def connect_or_start(address: DaemonAddress, engine: dict[str, Any], daemon_args: list[str]) -> Link:
    """Joins the daemon at ``address``, starting it (detached) when none answers there."""
    if (link := await _join(address)) is not None:
        return link
    lock = start_lock(address)
    await asyncio.get_running_loop().run_in_executor(None, lock.__enter__)
    try:
        if (link := await _join(address)) is not None:  # another editor started it meanwhile
            return link
        if address.socket.exists() or address.socket.is_symlink():
            log.info("removing the stale daemon socket %s", address.socket)
            address.socket.unlink()
        process = spawn_daemon(address, engine, daemon_args)
        deadline = time.monotonic() + START_TIMEOUT_S
        while (link := await _join(address)) is None:
            if process.returncode is not None:  # set by the reaper thread
                raise DaemonError(f"the daemon exited with code {process.returncode} while starting; see {address.log}")
            if time.monotonic() > deadline:
                raise DaemonError(f"the daemon did not answer within {START_TIMEOUT_S:.0f} s; see {address.log}")
            await asyncio.sleep(0.05)
        return link
    finally:
        lock.__exit__(None, None, None)


def spawn_daemon(address: DaemonAddress, engine: dict[str, Any], daemon_args: list[str]) -> subprocess.Popen[bytes]:
    """``ember daemon serve`` in a session of its own, its output in its log file (never the
    editor's pipes: a detached process holding them would keep the editor, or CI, waiting)."""
    command = [
        sys.executable, "-m", "lsp", "daemon", "serve",
        "--socket", str(address.socket), "--key", address.key, "--engine", json.dumps(engine), *daemon_args,
    ]
    # `-m lsp` puts the working directory first on sys.path: run where ember's own packages are, so
    # that an editor's project with a folder named lsp/, context/ or engine/ cannot shadow them.
    packages_root = Path(__file__).resolve().parent.parent
    with open(address.log, "ab") as log_file:
        os.chmod(address.log, 0o600)
        process = subprocess.Popen(
            command,
            cwd=packages_root,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
            close_fds=True,
        )
    # The daemon stays this process's child until this one exits: reap it when it ends first.
    threading.Thread(target=process.wait, name="ember-daemon-reaper", daemon=True).start()
    log.info("started the ember daemon (pid %d) at %s", process.pid, address.socket)
    return process


def daemon_sockets(directory: Path | None = None) -> list[DaemonAddress]:
    directory = directory or runtime_dir()
    return [DaemonAddress(path, path.stem) for path in sorted(directory.glob("*.sock"))]


async def ask_all(command: str) -> list[dict[str, Any]]:
    """``status`` or ``stop`` to every daemon of this user; unreachable sockets are reported."""
    answers = []
    for address in daemon_sockets():
        try:
            _reader, writer, info = await open_daemon(address, command, key=ANY_KEY)
            writer.close()
            answers.append({"socket": str(address.socket), **info})
        except DaemonError as exc:
            answers.append({"socket": str(address.socket), "error": str(exc)})
    return answers


# ---------------------------------------------------------------------------------- serving half


def inherited_socket() -> socket.socket | None:
    """The listening socket a service manager passed (systemd socket activation: ``LISTEN_PID``
    is this process, ``LISTEN_FDS`` counts the sockets from fd 3), or None. The variables are
    removed so that the engine's processes do not take the socket for theirs."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if not (pid.isdigit() and int(pid) == os.getpid() and count.isdigit() and int(count) >= 1):
        return None
    held = socket.socket(fileno=3)
    if held.family != socket.AF_UNIX or held.type != socket.SOCK_STREAM:
        raise DaemonError(f"the service manager passed a {held.family!r} {held.type!r} socket, not a Unix stream socket")
    held.setblocking(False)
    return held


class Daemon:
    """The listening side: greets, checks the peer, serves LSP connections, exits when idle."""

    def __init__(self, core: EmberCore, address: DaemonAddress, idle_s: float) -> None:
        self.core = core
        self.address = address
        self.idle_s = idle_s
        self.clients = 0
        self.connections = 0
        self.started = time.time()
        self._idle: asyncio.TimerHandle | None = None
        self._stopped = asyncio.Event()

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "version": VERSION,
            "key": self.address.key,
            "socket": str(self.address.socket),
            "clients": self.clients,
            "connections": self.connections,
            "uptime_s": round(time.time() - self.started, 1),
            "idle_exit_s": self.idle_s,
            "engine": engine_options(self.core.settings),
            # The embedded engine serving ("vllm" | "llamacpp"; None for a remote server), and why.
            "serving": dataclasses.asdict(self.core.engine_choice) if self.core.engine_choice else None,
            "ready": self.core.check_engine(),  # as every request does: a dead engine is replaced
            "stage": self.stage(),
        }

    def stage(self) -> dict[str, Any] | None:
        """While the engine starts: what it is doing, as the editors' progress says it."""
        if self.core.ready or self.core.engine_error:
            return None
        state = self.core.load_progress.current()
        return {"message": state.describe(), "percentage": state.overall_percent()}

    async def serve(self) -> None:
        held = inherited_socket()
        if held is not None:
            # The service manager made the socket and holds it (ember daemon install): an editor
            # may be waiting on it already.
            listener = await asyncio.start_unix_server(self._accept, sock=held)
        else:
            if await self._already_served():
                log.info("a daemon already answers at %s; exiting", self.address.socket)
                return
            with contextlib.suppress(FileNotFoundError):
                self.address.socket.unlink()
            listener = await asyncio.start_unix_server(self._accept, path=str(self.address.socket))
            os.chmod(self.address.socket, 0o600)
        how = "the service manager's socket" if held is not None else "its own socket"
        log.info("ember daemon %s (pid %d) listening on %s (%s)", VERSION, os.getpid(), self.address.socket, how)
        self.core.start_engine()
        self._arm_idle()
        await self._stopped.wait()
        # Not `async with listener`: its wait_closed waits for every open connection, and the
        # editors' connections end only when this process does.
        listener.close()

    async def _already_served(self) -> bool:
        try:
            _, writer, _ = await open_daemon(self.address, "status")
        except DaemonError:
            return False
        writer.close()
        return True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = peer_uid(writer.get_extra_info("socket"))
        if not admits(uid, os.getuid()):
            log.warning("refused a connection from uid %s (this daemon serves uid %d only)", uid, os.getuid())
            writer.close()
            return
        try:
            greeting = (await asyncio.wait_for(reader.readline(), HANDSHAKE_TIMEOUT_S)).decode("utf-8", "replace").split()
        except (TimeoutError, OSError):
            writer.close()
            return
        refusal = self._refusal(greeting)
        if refusal:
            log.warning("refused a connection: %s", refusal)
            writer.write(f"refused {refusal}\n".encode())
            writer.close()
            return
        command = greeting[3]
        writer.write(b"ok " + json.dumps(self.info()).encode() + b"\n")
        if command != "lsp":
            await writer.drain()
            writer.close()
            if command == "stop":
                log.info("asked to stop")
                self._retire(when_idle=False)
            return
        await self._serve_editor(reader, writer)

    def _refusal(self, greeting: list[str]) -> str | None:
        if len(greeting) != 4 or greeting[0] != PROTOCOL:
            return f"expected '{PROTOCOL} VERSION KEY COMMAND'"
        _, version, key, command = greeting
        if version != VERSION:
            return f"this daemon is ember {VERSION}, the client is {version}"
        if key not in (self.address.key, ANY_KEY):
            return f"this daemon serves configuration {self.address.key}, not {key}"
        if command not in ("lsp", "status", "stop"):
            return f"unknown command {command!r}"
        return None

    async def _serve_editor(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from lsp.transports import serve_connection

        self.clients += 1
        self.connections += 1
        if self._idle is not None:
            self._idle.cancel()
        try:
            peer = f"uid {os.getuid()} (connection {self.connections})"
            await serve_connection(self.core, reader, writer, token=None, peer=peer)
        finally:
            self.clients -= 1
            if self.clients == 0:
                self._arm_idle()

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(self.idle_s, self._exit_if_idle)

    def _exit_if_idle(self) -> None:
        if not self.clients:
            log.info("no editor for %.0f s: exiting", self.idle_s)
            self._retire(when_idle=True)

    def _retire(self, when_idle: bool) -> None:
        """Removes the socket under the start lock, so that an editor joining now either got in
        before (and sees the connection end) or starts a new daemon; then stops serving."""
        if when_idle and self.clients:
            return
        lock = os.open(self.address.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # an editor is starting or joining right now: look again soon
                self._idle = asyncio.get_running_loop().call_later(0.5, self._retire, when_idle)
                return
            with contextlib.suppress(FileNotFoundError):
                self.address.socket.unlink()
            self._stopped.set()
        finally:
            os.close(lock)


async def serve_daemon(core: EmberCore, address: DaemonAddress, idle_s: float) -> None:
    from lsp.engine_host import close_and_exit

    daemon = Daemon(core, address, idle_s)
    core.host_info = daemon.info
    try:
        await daemon.serve()
    finally:
        await close_and_exit(core, 0)

