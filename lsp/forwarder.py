"""``ember --stdio`` as a thin forwarder to the per-user daemon (:mod:`lsp.daemon`).

It relays LSP between the editor (stdin/stdout) and the daemon, and keeps what it needs to carry
the editor session over a daemon that dies: the ``initialize`` request, the last settings and the
open documents' current text. When the daemon goes away it tells the editor, starts (or joins) a
new one, replays those, answers the requests that were lost, and goes on relaying.

Command-line settings are sent as ``initializationOptions`` defaults (the editor's own keys win,
as they do over the command line in-process), so one daemon serves windows with other settings.
Imports neither pygls nor vLLM: it is ready in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from context.source.document import Document, utf16_position
from lsp import daemon
from lsp.config import ConfigError, Settings, merge_settings
from lsp.framing import ResyncReader, frame, read_message

log = logging.getLogger("ember.forwarder")

# Requests lost with a dead daemon: completions get an empty answer (the next keystroke asks
# again), anything else an error the editor can show.
_EMPTY_ANSWER = frozenset({"textDocument/completion", "textDocument/inlineCompletion"})
REQUEST_FAILED = -32803
MAX_BACKOFF_S = 30.0


@dataclass
class OpenDocument:
    language_id: str  # as the editor sent it (the daemon normalises it itself)
    document: Document


@dataclass
class SessionState:
    """What a new daemon must be told to continue the editor session."""

    initialize: dict[str, Any] | None = None
    initialized: bool = False
    configuration: dict[str, Any] | None = None
    documents: dict[str, OpenDocument] = field(default_factory=dict)
    position_encoding: str | None = None
    shutdown: bool = False
    exiting: bool = False

    def track(self, message: dict[str, Any]) -> None:
        """Follows the editor's side of the session (documents, settings, lifecycle)."""
        method, params = message.get("method"), message.get("params")
        if method == "initialize":
            self.initialize = message
        elif method == "initialized":
            self.initialized = True
        elif method == "workspace/didChangeConfiguration":
            self.configuration = message
        elif method == "shutdown":
            self.shutdown = True
        elif method == "exit":
            self.exiting = True
        elif isinstance(params, dict) and isinstance(params.get("textDocument"), dict):
            self._track_document(method, params)

    def _track_document(self, method: Any, params: dict[str, Any]) -> None:
        item = params["textDocument"]
        uri = item.get("uri")
        if method == "textDocument/didOpen" and isinstance(item.get("text"), str):
            language_id = str(item.get("languageId", ""))
            # Text only: the daemon parses; here the tree would be work for nothing.
            doc = Document(uri, language_id, item["text"], int(item.get("version") or 0), max_parse_bytes=0)
            self.documents[uri] = OpenDocument(language_id, doc)
        elif method == "textDocument/didClose":
            self.documents.pop(uri, None)
        elif method == "textDocument/didChange" and uri in self.documents:
            doc = self.documents[uri].document
            try:
                for change in params.get("contentChanges") or ():
                    doc.apply_change(change["text"], self._range(doc, change.get("range")), item.get("version"))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("could not follow a didChange of %s (%s); a replay would send older text", uri, exc)

    def _range(self, doc: Document, lsp_range: Any) -> tuple[tuple[int, int], tuple[int, int]] | None:
        if lsp_range is None:
            return None
        start, end = lsp_range["start"], lsp_range["end"]
        return (
            utf16_position(doc, start["line"], start["character"], self.position_encoding),
            utf16_position(doc, end["line"], end["character"], self.position_encoding),
        )

    def replay(self) -> list[dict[str, Any]]:
        """The notifications that bring a new daemon to where the editor is (after initialize)."""
        messages: list[dict[str, Any]] = []
        if self.initialized:
            messages.append({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        if self.configuration is not None:
            messages.append(self.configuration)
        for uri, open_doc in self.documents.items():
            document = open_doc.document
            item = {"uri": uri, "languageId": open_doc.language_id, "version": document.version, "text": document.text}
            messages.append({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": item}})
        return messages


class StdinReader:
    """Blocking reads of the editor's stdin in a worker thread (a pipe, a file or a tty alike)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    async def readline(self) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(None, self.stream.readline)

    async def readexactly(self, n: int) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(None, self.stream.read, n)


class Forwarder:
    def __init__(
        self,
        cli_options: dict[str, Any],
        cli_settings: Settings,
        mode: str,
        argv: list[str],
        daemon_args: list[str],
        out: BinaryIO,
    ) -> None:
        self.cli_options = cli_options
        self.cli_settings = cli_settings
        self.mode = mode  # "auto", "own" (no daemon could be had), or the socket of a daemon to join
        self.own_server_args = [*without_daemon_flag(argv), "--daemon", "off"]
        self.daemon_args = daemon_args
        self.out = out
        self.state = SessionState()
        self.pending: dict[Any, str] = {}  # editor requests the daemon has not answered: id -> method
        self.daemon_requests: set[Any] = set()  # daemon requests the editor has not answered
        self.internal_ids = 0
        self.writer: asyncio.StreamWriter | None = None
        # The daemon -> editor pump; held because the event loop keeps only weak references to tasks.
        self.from_daemon_task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self.held: list[bytes] = []  # editor requests that arrived while no daemon was connected

    # ------------------------------------------------------------------ editor -> daemon

    async def run(self, editor: ResyncReader) -> int:
        try:
            while True:
                body = await read_message(editor)
                if body is None:
                    return 0  # the editor closed stdin: never outlive it
                await self.from_editor(body)
                if self.state.exiting:
                    return await self._exit()
        finally:
            if self.writer is not None:
                self.writer.close()

    async def from_editor(self, body: bytes) -> None:
        message = _parse(body)
        if message is None:
            await self._to_daemon(body, request=True)  # unreadable: the daemon answers it (-32700)
            return
        self.state.track(message)
        method, msg_id = message.get("method"), message.get("id")
        if method == "initialize" and self.writer is None:
            message = self._with_cli_defaults(message)
            self.state.initialize = message
            try:
                await self._connect()
            except daemon.DaemonError as exc:
                error = {"code": REQUEST_FAILED, "message": f"ember: {exc}; `--daemon auto` or `--daemon off` serve without it"}
                self.to_editor(_dump({"jsonrpc": "2.0", "id": msg_id, "error": error}))
                raise
            body = _dump(message)
        elif self.state.initialize is None and method not in (None, "exit") and msg_id is not None:
            error = {"code": -32002, "message": f"ember: {method} before initialize; send initialize first"}
            self.to_editor(_dump({"jsonrpc": "2.0", "id": msg_id, "error": error}))
            return
        if method is not None and msg_id is not None:
            self.pending[msg_id] = method
            await self._to_daemon(body, request=True)
        elif method is None:  # the editor's answer to a daemon request
            if msg_id in self.daemon_requests:
                self.daemon_requests.discard(msg_id)
                await self._to_daemon(body, request=False)
        else:
            await self._to_daemon(body, request=False)

    async def _to_daemon(self, body: bytes, *, request: bool) -> None:
        """Notifications and answers meant for a daemon that is gone are dropped (a replay carries
        their effect); requests wait for the next daemon."""
        if not self.connected.is_set() or self.writer is None:
            if request:
                self.held.append(body)
            return
        try:
            self.writer.write(frame(body))
            await self.writer.drain()
        except ConnectionError:
            if request:
                self.held.append(body)

    def _with_cli_defaults(self, message: dict[str, Any]) -> dict[str, Any]:
        params = message.get("params")
        if not isinstance(params, dict):
            return message
        options = params.get("initializationOptions")
        if options is None or isinstance(options, dict):
            params = {**params, "initializationOptions": {**self.cli_options, **(options or {})}}
        return {**message, "params": params}

    async def _exit(self) -> int:
        """After exit went to the daemon: closes the connection and ends with the code a server
        would (0 after shutdown, else 1)."""
        if self.writer is not None and self.connected.is_set():
            self.writer.close()
        return 0 if self.state.shutdown else 1

    # ------------------------------------------------------------------ daemon

    def engine_settings(self) -> Settings:
        """The command line's engine settings, with the editor's initializationOptions over them."""
        options = ((self.state.initialize or {}).get("params") or {}).get("initializationOptions")
        if not isinstance(options, dict):
            return self.cli_settings
        engine_keys = {"model", "engineUrl", "prefixCache", "timeoutMs", "engineArgs"}
        try:
            return merge_settings(self.cli_settings, {k: v for k, v in options.items() if k in engine_keys})
        except ConfigError:
            return self.cli_settings  # the daemon reports the bad value to the editor itself

    async def _open_link(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]:
        """The daemon for this session's engine settings (started when none runs); where no daemon
        can be had, an in-process server of this window's own (``--daemon off``) as a child."""
        settings = self.engine_settings()
        if self.mode == "auto":
            try:
                address = daemon.DaemonAddress.for_key(daemon.daemon_key(settings))
                return await daemon.connect_or_start(address, daemon.engine_options(settings), self.daemon_args)
            except daemon.DaemonError as exc:
                self.mode = "own"
                self.show_message(2, f"ember: no shared daemon ({exc}); this window runs its own engine")
        if self.mode == "own":
            server = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "lsp", *self.own_server_args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            assert server.stdin is not None and server.stdout is not None
            return server.stdout, server.stdin, {"pid": server.pid, "socket": None}
        return await daemon.open_daemon(daemon.DaemonAddress(Path(self.mode), daemon.ANY_KEY))

    async def _connect(self) -> None:
        reader, writer, info = await self._open_link()
        log.info("forwarding to the ember daemon (pid %s) at %s", info.get("pid"), info.get("socket"))
        self.writer = writer
        self.connected.set()
        self.from_daemon_task = asyncio.ensure_future(self._from_daemon(ResyncReader(reader)))

    async def _from_daemon(self, stream: ResyncReader) -> None:
        try:
            while (body := await read_message(stream)) is not None:
                self._to_editor_from_daemon(body)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            log.info("the daemon connection broke: %s", exc)
        if self.state.exiting:
            return
        self.connected.clear()
        await self._recover()

    def _to_editor_from_daemon(self, body: bytes) -> None:
        message = _parse(body)
        if message is not None:
            msg_id, method = message.get("id"), message.get("method")
            if method is None and msg_id in self.pending:
                if self.pending.pop(msg_id) == "initialize":
                    self._read_capabilities(message)
            elif method is not None and msg_id is not None:
                self.daemon_requests.add(msg_id)
        self.to_editor(body)

    def _read_capabilities(self, message: dict[str, Any]) -> None:
        capabilities = (message.get("result") or {}).get("capabilities") or {}
        encoding = capabilities.get("positionEncoding")
        self.state.position_encoding = encoding if isinstance(encoding, str) else None

    async def _recover(self) -> None:
        """A new daemon for the same editor session: lost requests answered, state replayed."""
        count = len(self.state.documents)
        self.show_message(2, f"ember: the shared daemon stopped; starting a new one and reopening {count} documents")
        editor_initialize = None
        for msg_id, method in list(self.pending.items()):
            if method == "initialize":
                editor_initialize = msg_id  # its answer will come from the new daemon
            else:
                self._answer_lost(msg_id, method)
        self.pending = {}
        self.daemon_requests.clear()
        backoff = 1.0
        while not self.state.exiting:
            try:
                await self._reconnect(editor_initialize)
                return
            except (daemon.DaemonError, ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
                log.error("could not reach a new daemon: %s; trying again in %.0f s", exc, backoff)
                self.show_message(1, f"ember: could not start the shared daemon ({exc}); retrying")
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def _reconnect(self, editor_initialize: Any) -> None:
        if self.state.initialize is None:  # died before initialize: nothing to replay
            return
        reader, writer, info = await self._open_link()
        self.internal_ids += 1
        init_id = editor_initialize if editor_initialize is not None else f"ember-forwarder-{self.internal_ids}"
        writer.write(frame(_dump({**self.state.initialize, "id": init_id})))
        stream = ResyncReader(reader)
        while True:  # the daemon answers initialize before anything else of ours
            body = await read_message(stream)
            if body is None:
                raise ConnectionError("the new daemon closed the connection during initialize")
            message = _parse(body) or {}
            if message.get("id") == init_id and "method" not in message:
                self._read_capabilities(message)
                if editor_initialize is not None:
                    self.to_editor(body)
                break
            self._to_editor_from_daemon(body)
        # No await from the snapshot of the documents to `connected`: an edit arriving in between
        # would be in neither the replay nor the stream.
        for replayed in self.state.replay():
            writer.write(frame(_dump(replayed)))
        held, self.held = self.held, []
        for body in held:
            request = _parse(body)
            if request is not None and request.get("method") is not None and request.get("id") is not None:
                self.pending[request["id"]] = request["method"]
            writer.write(frame(body))
        self.writer = writer
        self.connected.set()
        log.info("reconnected to the ember daemon (pid %s); replayed %d documents", info.get("pid"), len(self.state.documents))
        self.from_daemon_task = asyncio.ensure_future(self._from_daemon(stream))
        await writer.drain()

    # ------------------------------------------------------------------ editor

    def to_editor(self, body: bytes) -> None:
        self.out.write(frame(body))
        self.out.flush()

    def show_message(self, kind: int, text: str) -> None:
        log.warning("%s", text)
        self.to_editor(_dump({"jsonrpc": "2.0", "method": "window/showMessage", "params": {"type": kind, "message": text}}))

    def _answer_lost(self, msg_id: Any, method: str) -> None:
        if method in _EMPTY_ANSWER:
            self.to_editor(_dump({"jsonrpc": "2.0", "id": msg_id, "result": None}))
        else:
            error = {"code": REQUEST_FAILED, "message": f"ember: {method} was lost when the shared daemon stopped; try again"}
            self.to_editor(_dump({"jsonrpc": "2.0", "id": msg_id, "error": error}))


def _parse(body: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return message if isinstance(message, dict) else None


def _dump(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def without_daemon_flag(argv: list[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--daemon":
            skip = True
        elif not arg.startswith("--daemon="):
            kept.append(arg)
    return kept


def daemon_args_from(args: argparse.Namespace) -> list[str]:
    """The flags of a daemon this forwarder starts (its engine settings travel separately)."""
    extra = ["--log-level", args.log_level]
    if args.daemon_idle_s is not None:
        extra += ["--idle-s", str(args.daemon_idle_s)]
    if args.metrics_port is not None:
        extra += ["--metrics-port", str(args.metrics_port)]
    return extra


def forward_stdio(args: argparse.Namespace, argv: list[str], cli_options: dict[str, Any], settings: Settings) -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing else may write into the LSP stream
    sys.stdout = sys.stderr
    forwarder = Forwarder(cli_options, settings, args.daemon, argv, daemon_args_from(args), out)
    try:
        code = asyncio.run(forwarder.run(ResyncReader(StdinReader(sys.stdin.buffer))))
    except daemon.DaemonError as exc:
        log.error("%s", exc)
        forwarder.show_message(1, f"ember: {exc}")
        code = 1
    except (KeyboardInterrupt, BrokenPipeError):
        code = 0
    logging.shutdown()
    os._exit(code)  # the stdin reader thread may still be blocked in a read
