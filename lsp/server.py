"""The LSP edge: one short, typed handler per feature, delegating to :mod:`lsp.completer`.

An :class:`EmberCore` (engine, caches, metrics) lives once per process; each editor connection
gets its own :class:`EmberServer` (documents, settings), so TCP sessions stay apart while vLLM
batches their requests.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import re
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

from context.document import Document, PositionError, utf16_position
from context.prompt import Snippet, select_snippets
from engine.base import Engine
from engine.models import LoadProgress
from lsp import VERSION
from lsp.completer import Completer, prompt_budget
from lsp.config import ConfigError, Settings, merge_settings, vllm_flags
from lsp.metrics import Metrics, RequestMetrics

log = logging.getLogger(__name__)

STATS_METHOD = "ember/stats"
# Settings that only take effect when the engine starts (setting name -> Settings field).
STARTUP_SETTINGS = {"model": "model", "engineUrl": "engine_url", "engineArgs": "engine_args"}
WARMUP_PAUSE_S = 0.4
PROGRESS_REPORT_S = 0.25  # how often model download/loading progress is sent to the editor
SNIPPET_CHARS = 880  # cross-file context: within the prompt builder's snippet budget (256 tokens)
SNIPPET_SOURCE_CHARS = 200_000  # how much of another open file is searched for definitions


def import_lines(text: str) -> str:
    """The lines that decide which other files matter; the cross-file choice is redone only when
    they (or the other files) change, not on every keystroke."""
    return "\n".join(line for line in text[:20_000].splitlines() if line.lstrip().startswith(("import ", "from ", "#include", "use ", "require(")) or " require(" in line)


class UnknownDocument(JsonRpcException):
    """-32602 with a message naming the URI."""

    CODE = -32602  # pygls reads the class attribute CODE when it serialises the error


@dataclass
class RateLimit:
    """A token bucket holding one second's worth of requests: bursts up to ``rate`` pass at once."""

    rate: float
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)

    def allow(self) -> bool:
        if self.rate <= 0:
            return True
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class EmberCore:
    """Process-wide state: the engine, the completion caches and the metrics.

    ``long_lived``: this process serves editors for hours (TCP server, per-user daemon), so the
    embedded engine may spend longer starting for faster decoding (compiled mode on the CPU);
    over stdio, one editor waits for the start and eager mode stays."""

    def __init__(
        self,
        settings: Settings,
        engine_factory: Callable[[Settings, LoadProgress], Engine] | None = None,
        *,
        long_lived: bool = False,
    ) -> None:
        self.settings = settings
        self.long_lived = long_lived
        self._engine_factory = engine_factory or functools.partial(default_engine_factory, long_lived=long_lived)
        # Written by the worker thread that builds the engine, read by report_loading.
        self.load_progress = LoadProgress()
        self.engine: Engine | None = None
        self.engine_error: str | None = None
        # The engine runs, but not as asked (engine arguments rejected or not applicable): shown
        # to every editor once the engine is ready, and in ember/stats.
        self.engine_warning: str | None = None
        self._start_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._engine_settings = settings
        self._backoff_s = 1.0
        self.restarts = 0
        self.engine_starts = 0
        # What the process serving this core says of itself in ember/stats (the daemon sets it).
        self.host_info: Callable[[], dict[str, Any]] | None = None
        self.metrics = Metrics()
        self.memory_baseline: tracemalloc.Snapshot | None = None
        self.completer = Completer(lambda: self.engine, self.metrics)

    @property
    def ready(self) -> bool:
        if self.engine is not None and getattr(self.engine, "dead", False):
            self.restart_engine()
            return False
        return self.engine is not None and self.engine.ready

    @property
    def engine_settings(self) -> Settings:
        """The settings the engine was (or is being) started with."""
        return self._engine_settings

    @property
    def restarting(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    def restart_engine(self) -> None:
        """Replace a dead engine, waiting longer after each failure (1 s, 2 s, 4 s ... 60 s)."""
        if self._restart_task is not None and not self._restart_task.done():
            return
        dead, self.engine = self.engine, None
        self.engine_error = "the engine process died; restarting it"
        log.error("engine died; restarting in %.0f s", self._backoff_s)

        async def restart() -> None:
            if dead is not None:
                await dead.close()
            await asyncio.sleep(self._backoff_s)
            self._backoff_s = min(60.0, self._backoff_s * 2)
            self._start_task = None
            await self.start_engine(self._engine_settings)
            if self.engine is not None:
                self.restarts += 1

        self._restart_task = asyncio.get_running_loop().create_task(restart())

    def start_engine(self, settings: Settings | None = None) -> asyncio.Task[None]:
        """Start loading the model once; later calls return the same task."""
        if self._start_task is None:
            self._engine_settings = settings or self.settings
            self.load_progress.set("loading" if self._engine_settings.engine_url else "resolving", model_label(self._engine_settings))
            self._start_task = asyncio.get_running_loop().create_task(self._start(self._engine_settings))
        return self._start_task

    async def _start(self, settings: Settings) -> None:
        self.engine_starts += 1
        try:
            engine = await asyncio.to_thread(self._engine_factory, settings, self.load_progress)
            await engine.start()
            self.engine = engine
            self.engine_error = None
            notes = (remote_engine_args_note(settings), getattr(engine, "warning", None))
            self.engine_warning = "; ".join(note for note in notes if note) or None
        except Exception as exc:  # the reason reaches the editor through progress and messages
            self.engine_error = str(exc)
            log.error("engine failed to start: %s", exc)

    async def wait_ready(self) -> bool:
        if self._restart_task is not None and not self._restart_task.done():
            await asyncio.shield(self._restart_task)
        if self._start_task is not None:
            await asyncio.shield(self._start_task)
        return self.ready

    async def close(self) -> None:
        for task in (self._start_task, self._restart_task):
            if task is not None and not task.done():
                task.cancel()
        if self.engine is not None:
            await self.engine.close()


def model_label(settings: Settings) -> str:
    """What the editor is told is loading before the model is resolved."""
    if settings.engine_url:
        return ",".join(settings.engine_url)
    return settings.model or "the default code model"


def remote_engine_args_note(settings: Settings) -> str | None:
    """Engine arguments are the embedded engine's: a remote server was started with its own."""
    if not (settings.engine_url and settings.engine_args):
        return None
    return (
        "engineArgs are ignored with engineUrl: the remote server has its own; start it with "
        f"{vllm_flags(settings.engine_arg_dict())}"
    )


def default_engine_factory(settings: Settings, progress: LoadProgress, *, long_lived: bool = False) -> Engine:
    """Remote when an engine URL is configured, else embedded vLLM (resolving the model may
    download it or convert a GGUF file: this runs in a worker thread, telling ``progress``)."""
    if settings.engine_url:
        from engine.remote import RemoteEngine

        deadline_s = settings.timeout_ms / 1000
        return RemoteEngine(
            list(settings.engine_url),
            settings.model,
            # Fail over to another replica early enough to still answer within the deadline.
            first_token_timeout=max(2.0, deadline_s / 3),
            read_timeout=max(5.0, deadline_s / 2),
        )
    from engine.embedded import EmbeddedConfig, EmbeddedEngine
    from engine.models import resolve_model

    started = time.monotonic()
    model = resolve_model(settings.model, progress=progress)
    log.info("model %s (%s: %s), resolved in %.1f s", model.name, model.source, model.path, time.monotonic() - started)
    if model.fallback_reason:
        progress.set_fallback(model.fallback_reason)
    progress.set("loading", model.name)
    config = EmbeddedConfig(
        model_path=model.path,
        model_name=model.name,
        prefix_caching=settings.prefix_cache,
        long_lived=long_lived,
        engine_args=settings.engine_arg_dict(),
    )
    return EmbeddedEngine(config)


class EmberProtocol(LanguageServerProtocol):
    """pygls' protocol with strict JSON-RPC/LSP edges: every request gets an answer, also a
    malformed one (pygls would drop it and leave the client waiting), requests before
    ``initialize`` get -32002 ServerNotInitialized and notifications then are dropped (LSP),
    requests after ``shutdown`` get -32600 InvalidRequest (LSP)."""

    class Malformed:
        """A message lsprotocol could not read: wrong "jsonrpc", missing or mistyped fields,
        negative positions. ``reason`` names the fields (JSON paths) and briefly what is wrong."""

        def __init__(self, data: dict[str, Any], reason: str, code: int) -> None:
            method, msg_id = data.get("method"), data.get("id")
            self.method = method if isinstance(method, str) else None
            self.id = msg_id if isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool) else None
            self.is_request = "id" in data and "method" in data
            self.reason = reason
            self.code = code

    _initialize_seen = False

    def _execute_handler(self, msg_id: Any, handler: Any, callback: Any, args: Any = None, kwargs: Any = None) -> None:
        """pygls files the future of every notification (and of every handler a generator
        yields to) in ``_request_futures`` under a fresh uuid and never removes it: one leaked
        future per keystroke. Remove each entry when its future is done."""
        super()._execute_handler(msg_id, handler, callback, args, kwargs)
        future = self._request_futures.get(msg_id)
        if future is None:
            return
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            future.add_done_callback(lambda done, key=msg_id: self._forget_future(key, done))
        else:
            # Later, on the loop: shutdown cancels futures while iterating over this dict, and a
            # cancelled future runs its callbacks at once (in the thread that finished it).
            future.add_done_callback(lambda done, key=msg_id: loop.call_soon_threadsafe(self._forget_future, key, done))

    def _forget_future(self, msg_id: Any, future: Any) -> None:
        if self._request_futures.get(msg_id) is future:
            del self._request_futures[msg_id]

    def structure_message(self, data: dict[str, Any]) -> Any:
        if "jsonrpc" not in data:
            return data  # a nested object, or a message without "jsonrpc" (handle_message answers it)
        if data.get("jsonrpc") != "2.0":
            return EmberProtocol.Malformed(data, 'invalid request: "jsonrpc" must be "2.0"', -32600)
        if not isinstance(data.get("method", ""), str) or ("id" in data and not isinstance(data["id"], (int, str))):
            return EmberProtocol.Malformed(data, "invalid request: method must be a string, id a number or string", -32600)
        try:
            return super().structure_message(data)
        except Exception as exc:  # noqa: BLE001 - answered as -32602 instead of killing the message
            import cattrs

            if "method" in data and "params" not in data:
                try:  # JSON-RPC lets a request or notification omit params (pygls does not)
                    return super().structure_message({**data, "params": None})
                except Exception:  # noqa: BLE001 - the method needs params: report the first error
                    pass

            cause = exc.__cause__ or exc
            if isinstance(cause, cattrs.BaseValidationError):

                def describe(error: BaseException, _type: Any = None) -> str:
                    if isinstance(error, KeyError):
                        return "required field missing"
                    return f"invalid value ({str(error)[:120]})"

                reason = "; ".join(cattrs.transform_error(cause, format_exception=describe))
            else:
                reason = str(cause)[:200]
            return EmberProtocol.Malformed(data, f"invalid params for {data.get('method')}: {reason}", -32602)

    def handle_message(self, message: Any) -> None:
        """Before a valid token (TCP servers that need one) only initialize and exit are read."""
        server: EmberServer = self._server  # type: ignore[assignment]
        if isinstance(message, dict):  # pygls leaves a message without "jsonrpc" unstructured
            message = EmberProtocol.Malformed(message, 'invalid request: "jsonrpc": "2.0" is missing', -32600)
        method = getattr(message, "method", None)
        if not server.authorized and method not in (types.INITIALIZE, types.EXIT):
            log.warning("dropped %s from an unauthorized connection", method)
            if self.writer is not None:
                self.writer.close()
            server.on_exit()
            return
        is_request = method is not None and hasattr(message, "id")
        if isinstance(message, EmberProtocol.Malformed):
            if message.is_request:  # JSON-RPC: "id": null when the id itself is unusable
                error = {"code": message.code, "message": f"ember: {message.reason}"}
                self._send_data({"jsonrpc": "2.0", "id": message.id, "error": error})
            else:
                log.warning("ignored a malformed %s message: %s", message.method or "JSON-RPC", message.reason)
            return
        if not self._initialize_seen and method not in (types.INITIALIZE, types.EXIT, None):
            if is_request:
                error = JsonRpcException(f"ember: {method} before initialize; send initialize first", -32002)
                self._send_response(message.id, error=error.to_response_error())
            else:
                log.warning("dropped %s: it arrived before initialize", method)
            return
        if method == types.INITIALIZE:
            self._initialize_seen = True
        if self._shutdown and is_request and method != types.EXIT:
            error = JsonRpcException(f"ember: {method} after shutdown; only exit is accepted", -32600)
            self._send_response(message.id, error=error.to_response_error())
            return
        super().handle_message(message)

    # ember keeps its own documents (context.document.Document). pygls' built-in handlers would also
    # keep a second copy in its workspace, re-split into lines on every change, and raise (so that
    # ember's handler never runs) on a didChange for an unknown URI: go straight to ember's handlers.

    def _user_handler(self, method: str, params: Any):
        if (handler := self.fm.features.get(method)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams):
        yield from self._user_handler(types.TEXT_DOCUMENT_DID_OPEN, params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams):
        yield from self._user_handler(types.TEXT_DOCUMENT_DID_CHANGE, params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams):
        yield from self._user_handler(types.TEXT_DOCUMENT_DID_CLOSE, params)

    @lsp_method(types.EXIT)
    def lsp_exit(self, *args: Any):
        """Ends this connection; over stdio it also stops the engine and ends the process."""
        server: EmberServer = self._server  # type: ignore[assignment]
        if server.exit_process:
            # Not on_exit(): stopping the reader would end serve_stdio, whose own close_and_exit(0)
            # would race this one (LSP: exit code 1 without a shutdown before it).
            server.cancel_work()
            asyncio.ensure_future(close_and_exit(server.core, 0 if self._shutdown else 1))
        else:
            server.on_exit()
            if self.writer is not None:
                self.writer.close()
        yield from ()


async def close_and_exit(core: EmberCore, code: int, grace_s: float = 4.0) -> None:
    """Stops the engine (and its child processes), then ends the process: the stdin reader thread
    is blocked in a read, so a normal interpreter exit would wait for the editor to close the pipe."""
    threading.Timer(grace_s + 1.0, os._exit, (code,)).start()  # in case closing hangs
    try:
        async with asyncio.timeout(grace_s):
            await core.close()
    except BaseException as exc:  # noqa: BLE001 - exiting regardless
        log.warning("engine did not close cleanly: %r", exc)
    finally:
        kill_children()
        logging.shutdown()
        os._exit(code)


def kill_children() -> None:
    """Whatever the engine left behind (its core process, a resource tracker) dies with us: an
    orphaned engine would hold gigabytes after the editor quit."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    if children:
        log.info("killed %d leftover child processes", len(children))
        psutil.wait_procs(children, timeout=1.0)


class EmberServer(LanguageServer):
    def __init__(self, core: EmberCore, *, token: str | None = None, exit_process: bool = True) -> None:
        super().__init__("ember", VERSION, protocol_cls=EmberProtocol)
        self.core = core
        self.settings = core.settings
        self.rate_limit = RateLimit(core.settings.max_requests_per_second, tokens=core.settings.max_requests_per_second)
        self.documents: dict[str, Document] = {}
        self.required_token = token
        self.exit_process = exit_process
        self.authorized = token is None
        self._warmups: dict[str, asyncio.Task[Any]] = {}
        self._snippets: tuple[Any, tuple[Snippet, ...]] = (None, ())
        self._messages_shown: set[str] = set()

    def cancel_work(self) -> None:
        """Stops this session's generations and warm-ups (shutdown); the session still reads exit."""
        self.core.completer.cancel_all(id(self))
        for task in self._warmups.values():
            task.cancel()

    def on_exit(self) -> None:
        self.cancel_work()
        if self._stop_event is not None:
            self._stop_event.set()

    def report_server_error(self, error: Exception, source: Any) -> None:
        """A body that is not JSON (or not UTF-8) gets JSON-RPC's Parse error (-32700, id null,
        since its id cannot be read) as well as pygls' message to the user."""
        if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
            # A plain dict: lsprotocol's converter would drop the null id.
            self.protocol._send_data(
                {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": f"ember: parse error: {error}"}}
            )
        super().report_server_error(error, source)

    def notify_user(self, message: str, kind: types.MessageType = types.MessageType.Error) -> None:
        """Shows a message once per distinct text, so a dead engine does not spam the editor."""
        log.log(logging.ERROR if kind == types.MessageType.Error else logging.WARNING, "%s", message)
        if message in self._messages_shown:
            return
        self._messages_shown.add(message)
        self.window_show_message(types.ShowMessageParams(type=kind, message=f"ember: {message}"))

    # ------------------------------------------------------------------ documents and positions

    def document(self, uri: str) -> Document:
        doc = self.documents.get(uri)
        if doc is None:
            raise UnknownDocument(f"unknown document {uri!r}: it was not opened with textDocument/didOpen")
        return doc

    def to_utf16(self, doc: Document, line: int, character: int) -> tuple[int, int]:
        """Positions arrive in the negotiated encoding; documents count UTF-16 units."""
        capabilities = self.protocol.server_capabilities
        return utf16_position(doc, line, character, capabilities.position_encoding if capabilities else None)

    def offset_of(self, doc: Document, position: types.Position) -> int:
        line, character = self.to_utf16(doc, position.line, position.character)
        try:
            return doc.offset_at(line, character)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"{doc.uri}: {exc}") from exc

    def schedule_warmup(self, doc: Document, offset: int, delay_s: float) -> None:
        """After a pause in typing (no further change for ``delay_s``), prefill the stable part of
        the prompt at the last edit so the next request only prefills its tail."""
        previous = self._warmups.pop(doc.uri, None)
        if previous is not None:
            previous.cancel()
        if not self.settings.warmup:
            return

        async def later() -> None:
            await asyncio.sleep(delay_s)
            if self.core.ready and self.documents.get(doc.uri) is doc:
                await self.core.completer.warm(doc, offset, self.settings, self.other_files(doc))

        self._warmups[doc.uri] = asyncio.ensure_future(later())

    def other_files(self, current: Document) -> tuple[Snippet, ...]:
        """Context from the other open documents (what the current file imports first), in a
        stable order so that it stays in the engine's prefix cache."""
        if not self.settings.cross_file or len(self.documents) < 2:
            return ()
        others = tuple((uri, doc.version) for uri, doc in self.documents.items() if uri != current.uri)
        key = (current.uri, others, import_lines(current.text))
        if self._snippets[0] != key:
            texts = [(uri, self.documents[uri].text[:SNIPPET_SOURCE_CHARS]) for uri, _ in others]
            self._snippets = (key, select_snippets(current.text, current.language_id, texts, SNIPPET_CHARS))
        return self._snippets[1]

    # ------------------------------------------------------------------ completion

    async def complete(self, uri: str, position: types.Position, on_text: Callable[[str], None] | None = None) -> str:
        """Generated text for the cursor; a newer request for the same document supersedes this one
        (which then answers "") unless it continues what this one is generating."""
        doc = self.document(uri)
        offset = self.offset_of(doc, position)
        self.rate_limit.rate = self.settings.max_requests_per_second
        if not self.rate_limit.allow():
            self.core.metrics.record(RequestMetrics(outcome="rate_limited", uri=uri))
            self.notify_user(
                f"more than {self.settings.max_requests_per_second:g} completion requests per second from this "
                "editor (maxRequestsPerSecond); the extra requests get empty answers",
                types.MessageType.Warning,
            )
            return ""
        if len(doc.text) > self.settings.max_document_bytes:
            self.notify_user(f"{uri} is larger than maxDocumentBytes ({self.settings.max_document_bytes}); no completions", types.MessageType.Warning)
            return ""
        if not self.core.ready:
            if self.core.engine_error:
                self.notify_user(f"the engine is not available: {self.core.engine_error}")
            return ""
        result = await self.core.completer.complete(
            (id(self), uri), doc, offset, self.settings, snippets=self.other_files(doc), on_text=on_text
        )
        if result.metrics.outcome == "error":
            self.notify_user("the engine failed to generate; see the log", types.MessageType.Warning)
        return result.text


_WORD_TAIL = re.compile(r"[A-Za-z0-9_$]+$")


def word_before(ls: EmberServer, uri: str, position: types.Position) -> str:
    """The identifier the user is typing at the cursor (ASCII, so its length is the same in every
    position encoding)."""
    doc = ls.documents.get(uri)
    if doc is None or not 0 <= position.line < doc.line_count:
        return ""
    line, character = ls.to_utf16(doc, position.line, position.character)
    start = doc.offset_at(line, 0)
    match = _WORD_TAIL.search(doc.text[start : doc.offset_at(line, character, clamp=True)])
    return match.group(0) if match else ""


def completion_item(text: str, position: types.Position, word: str = "") -> types.CompletionItem:
    """Replaces the word being typed with itself plus the generated text: clients filter items by
    the word at the cursor, and would drop an item that does not start with it."""
    first_line = text.split("\n", 1)[0].strip() or text.strip()
    start = types.Position(line=position.line, character=position.character - len(word))
    return types.CompletionItem(
        label=(word + first_line)[:80],
        kind=types.CompletionItemKind.Text,
        detail="ember",
        insert_text=word + text,
        insert_text_format=types.InsertTextFormat.PlainText,
        text_edit=types.TextEdit(range=types.Range(start=start, end=position), new_text=word + text),
        sort_text="0",
        filter_text=word + (first_line or text),
    )


def build_server(core: EmberCore, *, token: str | None = None, exit_process: bool = True) -> EmberServer:
    server = EmberServer(core, token=token, exit_process=exit_process)

    @server.feature(types.INITIALIZE)
    def initialize(ls: EmberServer, params: types.InitializeParams) -> None:
        """Reads settings from initializationOptions; checks the token of TCP servers that need one."""
        options = params.initialization_options
        if ls.required_token is not None:
            given = options.get("token") if isinstance(options, dict) else None
            if not isinstance(given, str) or not hmac.compare_digest(given.encode(), ls.required_token.encode()):
                log.warning("refused a connection: missing or wrong token")
                ls.on_exit()
                if ls.protocol.writer is not None:
                    asyncio.get_running_loop().call_later(0.05, ls.protocol.writer.close)
                raise JsonRpcInvalidParams("ember: missing or wrong token in initializationOptions")
            ls.authorized = True
        try:
            ls.settings = merge_settings(core.settings, options, source="initializationOptions")
        except ConfigError as exc:
            ls.settings = core.settings
            ls.notify_user(f"{exc}; using defaults")

    @server.feature(types.INITIALIZED)
    async def initialized(ls: EmberServer, params: types.InitializedParams) -> None:
        """Starts loading the model and shows its progress."""
        core.start_engine(ls.settings)
        ignored = [name for name, key in STARTUP_SETTINGS.items() if getattr(ls.settings, key) != getattr(core.engine_settings, key)]
        if ignored:
            # A shared engine (TCP server, daemon) was started before this editor connected.
            ls.notify_user(
                f"this ember's engine was already started with its own {', '.join(ignored)}; "
                "the ones in your settings are not used (pass them where ember is started)",
                types.MessageType.Warning,
            )
        await report_loading(ls)

    @server.feature(types.SHUTDOWN)
    def shutdown(ls: EmberServer, params: Any) -> None:
        ls.cancel_work()

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: EmberServer, params: types.DidOpenTextDocumentParams) -> None:
        item = params.text_document
        doc = ls.documents[item.uri] = Document(item.uri, item.language_id, item.text, item.version)
        ls.schedule_warmup(doc, len(doc.text), delay_s=0.0)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: EmberServer, params: types.DidChangeTextDocumentParams) -> None:
        doc = ls.documents.get(params.text_document.uri)
        if doc is None:
            log.warning("didChange for unknown document %s ignored", params.text_document.uri)
            return
        if params.text_document.version <= doc.version:
            # Changes arrive in order over one connection, so they still describe the editor's
            # text: apply them (dropping them would leave ember out of sync for good).
            log.warning(
                "didChange for %s has version %d, not above %d; applied in the order received",
                params.text_document.uri, params.text_document.version, doc.version,
            )
        for change in params.content_changes:
            if isinstance(change, types.TextDocumentContentChangePartial):
                start = ls.to_utf16(doc, change.range.start.line, change.range.start.character)
                end = ls.to_utf16(doc, change.range.end.line, change.range.end.character)
                doc.apply_change(change.text, (start, end), params.text_document.version)
            else:
                doc.apply_change(change.text, None, params.text_document.version)
        last = params.content_changes[-1] if params.content_changes else None
        if isinstance(last, types.TextDocumentContentChangePartial):
            start = ls.to_utf16(doc, last.range.start.line, last.range.start.character)
            typed_end = doc.offset_at(*start, clamp=True) + len(last.text)
            ls.schedule_warmup(doc, min(typed_end, len(doc.text)), delay_s=WARMUP_PAUSE_S)

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: EmberServer, params: types.DidCloseTextDocumentParams) -> None:
        ls.documents.pop(params.text_document.uri, None)
        core.completer.forget((id(ls), params.text_document.uri))

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    def did_change_configuration(ls: EmberServer, params: types.DidChangeConfigurationParams) -> None:
        settings = params.settings
        if isinstance(settings, dict) and isinstance(settings.get("ember"), dict):
            settings = settings["ember"]
        try:
            new = merge_settings(ls.settings, settings, source="settings")
        except ConfigError as exc:
            ls.notify_user(str(exc))
            return
        if any(getattr(new, key) != getattr(ls.settings, key) for key in STARTUP_SETTINGS.values()) and core.engine is not None:
            ls.notify_user("changing model, engineUrl or engineArgs takes effect after restarting ember", types.MessageType.Warning)
        ls.settings = new

    @server.feature(
        types.TEXT_DOCUMENT_COMPLETION,
        types.CompletionOptions(trigger_characters=[".", "(", " ", "\n"], resolve_provider=False),
    )
    async def completion(ls: EmberServer, params: types.CompletionParams) -> types.CompletionList:
        """One item that inserts the generated text at the cursor (Helix and older clients)."""
        token = params.partial_result_token
        word = word_before(ls, params.text_document.uri, params.position)

        def on_text(text: str) -> None:
            if token is not None and text:
                ls.progress(types.ProgressParams(token=token, value=[completion_item(text, params.position, word)]))

        text = await ls.complete(params.text_document.uri, params.position, on_text)
        items = [completion_item(text, params.position, word)] if text else []
        return types.CompletionList(is_incomplete=True, items=items)

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: EmberServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
        """Ghost text (LSP 3.18): VS Code, Neovim 0.12."""
        text = await ls.complete(params.text_document.uri, params.position)
        if not text:
            return types.InlineCompletionList(items=[])
        position = params.position
        return types.InlineCompletionList(
            items=[types.InlineCompletionItem(insert_text=text, range=types.Range(start=position, end=position))]
        )

    @server.feature(STATS_METHOD)
    def stats(ls: EmberServer, params: Any) -> dict[str, Any]:
        """Aggregated metrics (p50/p95), the last request's metrics, and the engine's state; with
        ``{"uri": U}`` also ``last_for_uri``, the latest request for that document (clients with
        several requests in flight cannot rely on ``last``)."""
        summary = core.metrics.summary()
        uri = params.get("uri") if isinstance(params, dict) else getattr(params, "uri", None)
        if isinstance(uri, str):
            found = core.metrics.last_for(uri)
            summary["last_for_uri"] = found.as_dict() if found else None
        engine = core.engine if core.ready else None
        state: dict[str, Any] = {
            "ready": core.ready,
            "error": core.engine_error,
            "warning": core.engine_warning,
            "model": engine.model.name if engine is not None else None,
            "restarts": core.restarts,
            "restarting": core.restarting,
            "starts": core.engine_starts,
            # What the prompt budgets of this editor's requests are shares of.
            "max_model_len": engine.model.max_model_len if engine is not None else None,
            "budget": budget_stats(ls.settings, engine.model.max_model_len) if engine is not None else None,
            "long_lived": core.long_lived,
        }
        engine_args = getattr(engine, "engine_args", None)
        if isinstance(engine_args, dict):
            state["engine_args"] = engine_args
        engine_stats = getattr(core.engine, "engine_stats", None)
        if callable(engine_stats):
            state["stats"] = engine_stats()
        summary["engine"] = state
        summary["process"] = {"pid": os.getpid(), **process_memory(core)}
        summary["daemon"] = core.host_info() if core.host_info is not None else None
        return summary

    return server


def budget_stats(settings: Settings, max_model_len: int) -> dict[str, int]:
    budget = prompt_budget(settings, max_model_len)
    return {
        "context_tokens": budget.prefix_tokens,
        "suffix_tokens": budget.suffix_tokens,
        "header_tokens": budget.header_tokens,
        "cross_file_tokens": budget.snippet_tokens,
    }


def process_memory(core: EmberCore) -> dict[str, Any]:
    """Resident memory of this process; with ``EMBER_DEBUG_MEMORY=1`` (tracemalloc started at
    launch, slow) also the source lines whose allocations grew most since the first call."""
    memory: dict[str, Any] = {"rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1)}
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        if core.memory_baseline is None or not core.ready:
            core.memory_baseline = snapshot  # growth is counted from the first call once the engine is up
        top = snapshot.compare_to(core.memory_baseline, "lineno")[:15]
        memory["growth"] = [f"{stat.size_diff / 1024:+.0f} KiB {stat.count_diff:+d} {stat.traceback}" for stat in top]
    return memory


async def report_loading(ls: EmberServer) -> None:
    """Work-done progress while the model downloads and loads (when the client supports it); then,
    once per editor, why the engine is not available, or what did not go as asked: a fallback
    model stands in for the code model, engine arguments that vLLM refused."""
    core = ls.core
    if not core.ready:
        await show_loading_progress(ls)
    if not core.ready:
        if core.engine_error:
            ls.notify_user(f"the engine is not available: {core.engine_error}")
        return
    reason = core.load_progress.current().fallback_reason
    if reason:
        ls.notify_user(reason, types.MessageType.Warning)
    if core.engine_warning:
        ls.notify_user(core.engine_warning, types.MessageType.Warning)


async def show_loading_progress(ls: EmberServer) -> None:
    """One indeterminate progress for getting the model ready (its message names the stage), and
    while the model downloads a second one with bytes and a percentage: LSP lets a client ignore
    percentages in reports unless the begin had one, and the load as a whole has none to give.
    Returns when the engine is loaded or failed to load."""
    core = ls.core
    window = ls.client_capabilities.window if ls.client_capabilities else None
    if not (window and window.work_done_progress):
        await core.wait_ready()
        return
    token = await new_progress_token(ls, "ember-load")
    if token is None:
        await core.wait_ready()
        return
    shown = core.load_progress.current()
    ls.work_done_progress.begin(token, types.WorkDoneProgressBegin(title="ember", message=shown.describe()))
    download: str | None = None
    waiting = asyncio.ensure_future(core.wait_ready())
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=PROGRESS_REPORT_S)
        state = core.load_progress.current()
        if state == shown or waiting.done():
            continue
        if state.stage == "downloading" and download is not None:
            ls.work_done_progress.report(download, types.WorkDoneProgressReport(message=state.describe(), percentage=state.percent()))
        elif state.stage == "downloading" and shown.stage != "downloading":
            ls.work_done_progress.report(token, types.WorkDoneProgressReport(message=f"downloading {state.model}"))
            download = await new_progress_token(ls, "ember-download")
            if download is not None:
                begin = types.WorkDoneProgressBegin(title="ember", message=state.describe(), percentage=state.percent() or 0)
                ls.work_done_progress.begin(download, begin)
        elif state.stage != "downloading":
            if download is not None:
                ls.work_done_progress.end(download, types.WorkDoneProgressEnd(message=f"downloaded {shown.model}"))
                download = None
            ls.work_done_progress.report(token, types.WorkDoneProgressReport(message=state.describe()))
        shown = state
    ready = waiting.result()
    if download is not None:
        ls.work_done_progress.end(download, types.WorkDoneProgressEnd(message="download stopped"))
    message = "model ready" if ready else f"engine failed: {core.engine_error}"
    ls.work_done_progress.end(token, types.WorkDoneProgressEnd(message=message))


async def new_progress_token(ls: EmberServer, prefix: str) -> str | None:
    """A work-done progress token the client agreed to (``window/workDoneProgress/create``)."""
    token = f"{prefix}-{uuid.uuid4().hex[:8]}"
    try:
        await ls.work_done_progress.create_async(token)
    except Exception as exc:
        log.debug("client refused progress token: %s", exc)
        return None
    return token
