"""One editor connection: :class:`EmberServer` holds its documents, settings, rate limit and
warm-ups on the process' shared :class:`lsp.engine_host.EmberCore`, and turns a cursor into a
completion request for :mod:`lsp.completer`.

Handlers (:mod:`lsp.server`) call it; pygls' internals stay in :mod:`lsp.protocol`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer

from context.prompt.retrieval import Cursor, OpenFile, WorkspaceView, retrieval_key, workspace_context
from context.prompt.snippets import CrossFile, Snippet, select_snippets
from context.source.document import Document, PositionError, utf16_position
from lsp import VERSION
from lsp.completer import WHY_LOADING, Completion, DocumentState
from lsp.engine_host import EmberCore, close_and_exit
from lsp.metrics import RequestMetrics
from lsp.protocol import EmberProtocol, UnknownDocument, stop_reading
from lsp.workspaces import SessionFolders, uri_path

log = logging.getLogger(__name__)

# The context size the snippet budget assumes before an engine says its own.
DEFAULT_MAX_MODEL_LEN = 2048
SNIPPET_SOURCE_CHARS = 200_000  # how much of another open file is searched for definitions
# A request waits this long for context from the workspace (reading and parsing files the first
# time); a slower retrieval finishes in the background for the next request. The first request in
# a document, which has no earlier context to fall back on, waits longer.
RETRIEVAL_WAIT_S = 0.3
FIRST_RETRIEVAL_WAIT_S = 1.0
# Retrieved context is checked again after this long even when nothing reported a change (a file
# changed on disk without a watcher event); an unchanged result gives the same prompt.
RETRIEVAL_TTL_S = 60.0


IMPORT_STARTS = ("import ", "from ", "#include", "use ", "require(")


def import_lines(text: str) -> str:
    """The lines that decide which other files matter; the cross-file choice is redone only when
    they (or the other files) change, not on every keystroke."""
    return "\n".join(
        line for line in text[:20_000].splitlines() if line.lstrip().startswith(IMPORT_STARTS) or " require(" in line
    )


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


class EmberServer(LanguageServer):
    """One editor's session: its documents (ember's own, not pygls' workspace), settings and
    warm-ups, on the shared core."""

    protocol: EmberProtocol

    def __init__(self, core: EmberCore, *, token: str | None = None, exit_process: bool = True) -> None:
        super().__init__("ember", VERSION, protocol_cls=EmberProtocol)
        self.core = core
        self.settings = core.settings
        self.rate_limit = RateLimit(core.settings.max_requests_per_second, tokens=core.settings.max_requests_per_second)
        self.open: dict[str, DocumentState] = {}  # uri -> the document and what ember keeps for it
        self.required_token = token
        self.exit_process = exit_process
        self.authorized = token is None
        self._snippets: tuple[Any, tuple[Snippet, ...]] = (None, ())
        self.folders = SessionFolders(core.indexes)
        self.exit_task: asyncio.Task[None] | None = None
        self._messages_shown: set[str] = set()

    @property
    def documents(self) -> dict[str, Document]:
        """The open documents by uri."""
        return {uri: state.document for uri, state in self.open.items()}

    def open_document(self, doc: Document) -> DocumentState:
        """A document the editor opened (again: what was kept for the old text is dropped)."""
        self.close_document(doc.uri)
        state = self.open[doc.uri] = DocumentState(doc)
        return state

    def close_document(self, uri: str) -> None:
        """Forgets the document and everything kept for it; its work in flight stops."""
        state = self.open.pop(uri, None)
        if state is not None:
            state.close()

    def cancel_work(self) -> None:
        """Stops this session's generations, warm-ups and retrievals (shutdown); the session still reads exit."""
        for state in self.open.values():
            state.stop()

    def on_exit(self) -> None:
        self.cancel_work()
        self.folders.close()
        stop_reading(self)

    def report_server_error(self, error: Exception, source: Any) -> None:
        """A body that is not JSON (or not UTF-8) gets JSON-RPC's Parse error (-32700, id null,
        since its id cannot be read) as well as pygls' message to the user."""
        if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
            # A plain dict: lsprotocol's converter would drop the null id.
            self.protocol.send_json(
                {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": f"ember: parse error: {error}"}}
            )
        super().report_server_error(error, source)

    def end(self, *, clean: bool) -> None:
        """``exit``: ends this connection; over stdio it also stops the engine and ends the process
        (code 0 after a shutdown, else 1, as LSP says)."""
        if self.exit_process:
            # Not on_exit(): stopping the reader would end serve_stdio, whose own close_and_exit(0)
            # would race this one (LSP: exit code 1 without a shutdown before it).
            self.cancel_work()
            self.exit_task = asyncio.ensure_future(close_and_exit(self.core, 0 if clean else 1))  # the loop holds tasks weakly
        else:
            self.on_exit()
            if self.protocol.writer is not None:
                self.protocol.writer.close()

    def notify_user(self, message: str, kind: types.MessageType = types.MessageType.Error) -> None:
        """Shows a message once per distinct text, so a dead engine does not spam the editor."""
        log.log(logging.ERROR if kind == types.MessageType.Error else logging.WARNING, "%s", message)
        if message in self._messages_shown:
            return
        self._messages_shown.add(message)
        self.window_show_message(types.ShowMessageParams(type=kind, message=f"ember: {message}"))

    # ------------------------------------------------------------------ documents and positions

    def document(self, uri: str) -> Document:
        return self.state(uri).document

    def state(self, uri: str) -> DocumentState:
        state = self.open.get(uri)
        if state is None:
            raise UnknownDocument(f"unknown document {uri!r}: it was not opened with textDocument/didOpen")
        return state

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

    def schedule_warmup(self, state: DocumentState, offset: int, delay_s: float) -> None:
        """After a pause in typing (no further change for ``delay_s``), prefill the stable part of
        the prompt at the last edit so the next request only prefills its tail."""
        if state.warmup is not None:
            state.warmup.cancel()
            state.warmup = None
        if not self.settings.warmup:
            return
        # A timer, not a task that sleeps: a keystroke cancels a handle, and a session that ends
        # during the pause leaves no coroutine that never ran.
        state.warmup = asyncio.get_running_loop().call_later(delay_s, self.start_warmup, state, offset)

    def start_warmup(self, state: DocumentState, offset: int) -> None:
        async def warm() -> None:
            if self.core.check_engine():
                doc = state.document
                await self.core.completer.warm(doc, offset, self.settings, await self.cross_file(state, offset))

        state.warmup = asyncio.ensure_future(warm())

    def snippet_chars(self) -> int:
        engine = self.core.engine
        return self.settings.budget_for(engine.model.max_model_len if engine else DEFAULT_MAX_MODEL_LEN).snippet_chars

    async def cross_file(self, state: DocumentState, offset: int) -> CrossFile:
        """Context from other files for the cursor: from the workspace folder holding the document
        (crossFile "workspace"), else from the other open documents."""
        doc = state.document
        if self.settings.cross_file == "off":
            return CrossFile()
        path = uri_path(doc.uri)
        index = self.folders.index_for(path) if path and self.settings.cross_file == "workspace" else None
        if path is None or index is None:
            return CrossFile(self.other_files(doc))
        max_chars = self.snippet_chars()
        others = tuple((uri, other.document.version) for uri, other in self.open.items() if uri != doc.uri)
        key = (import_lines(doc.text), retrieval_key(doc.text, offset), others, index.generation, max_chars,
               int(time.monotonic() // RETRIEVAL_TTL_S))
        kept = state.retrieved
        if kept is not None and kept[0] == key:
            return kept[1]
        task = state.retrieving
        if task is None or task.done():
            task = state.retrieving = asyncio.ensure_future(self._retrieve(state, offset, path, index, key, max_chars))
        done, _ = await asyncio.wait({task}, timeout=RETRIEVAL_WAIT_S if kept is not None else FIRST_RETRIEVAL_WAIT_S)
        if task in done and not task.cancelled() and task.exception() is None:
            return task.result()
        return kept[1] if kept is not None else CrossFile()

    async def _retrieve(self, state: DocumentState, offset: int, path: str, index: Any, key: Any, max_chars: int) -> CrossFile:
        """Retrieval in a worker thread (it reads and parses files), remembered under ``key``."""
        doc = state.document
        open_files = {p: OpenFile(d.text, d.language_id) for p, d in self._open_paths()}
        cursor = Cursor(path, doc.text, offset, doc.language_id)
        try:
            found = await asyncio.to_thread(workspace_context, WorkspaceView(index, open_files), cursor, max_chars)
        except Exception:  # context is a help: a failure costs it, not the completion (logged)
            log.exception("workspace context for %s failed", doc.uri)
            found = CrossFile()
        state.retrieved = (key, found)
        return found

    def _open_paths(self) -> list[tuple[str, Document]]:
        found = []
        for uri, d in self.documents.items():
            path = uri_path(uri)
            if path is not None:
                found.append((path, d))
        return found

    def other_files(self, current: Document) -> tuple[Snippet, ...]:
        """Context from the other open documents (what the current file imports first), in a
        stable order so that it stays in the engine's prefix cache."""
        if len(self.documents) < 2:
            return ()
        max_chars = self.snippet_chars()
        others = tuple((uri, doc.version) for uri, doc in self.documents.items() if uri != current.uri)
        key = (current.uri, others, import_lines(current.text), max_chars)
        if self._snippets[0] != key:
            texts = [(uri, self.documents[uri].text[:SNIPPET_SOURCE_CHARS]) for uri, _ in others]
            self._snippets = (key, select_snippets(current.text, current.language_id, texts, max_chars))
        return self._snippets[1]

    # ------------------------------------------------------------------ completion

    async def complete(
        self, uri: str, position: types.Position, on_text: Callable[[str], None] | None = None
    ) -> Completion:
        """Generated text for the cursor, with its metrics (its confidence); a newer request for the
        same document supersedes this one (which then answers "") unless it continues what this one
        is generating."""
        state = self.state(uri)
        doc = state.document
        offset = self.offset_of(doc, position)
        self.rate_limit.rate = self.settings.max_requests_per_second
        if not self.rate_limit.allow():
            limited = RequestMetrics(outcome="rate_limited", uri=uri, why_empty="over maxRequestsPerSecond")
            self.core.metrics.record(limited)
            self.notify_user(
                f"more than {self.settings.max_requests_per_second:g} completion requests per second from this "
                "editor (maxRequestsPerSecond); the extra requests get empty answers",
                types.MessageType.Warning,
            )
            return Completion("", limited)
        if len(doc.text) > self.settings.max_document_bytes:
            too_large = f"{uri} is larger than maxDocumentBytes ({self.settings.max_document_bytes}); no completions"
            self.notify_user(too_large, types.MessageType.Warning)
            return Completion("", RequestMetrics(outcome="too_large", uri=uri, why_empty="larger than maxDocumentBytes"))
        if not self.core.check_engine():
            if self.core.engine_error:
                self.notify_user(f"the engine is not available: {self.core.engine_error}")
            why = f"the engine is not available: {self.core.engine_error}" if self.core.engine_error else WHY_LOADING
            return Completion("", RequestMetrics(outcome="loading", uri=uri, why_empty=why))
        result = await self.core.completer.complete(
            state, offset, self.settings, cross_file=await self.cross_file(state, offset), on_text=on_text
        )
        if result.metrics.outcome == "error":
            self.notify_user("the engine failed to generate; see the log", types.MessageType.Warning)
        return result
