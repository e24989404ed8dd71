"""The LSP edge: one short, typed handler per feature, registered by :func:`build_server`.

Handlers are plain functions of the session (:class:`lsp.session.EmberServer`) and the params;
they delegate to the session, and through it to :mod:`lsp.completer`. An
:class:`lsp.engine_host.EmberCore` (engine, caches, metrics) lives once per process; each editor
connection gets its own session (documents, settings), so TCP sessions stay apart while vLLM
batches their requests. pygls' internals are fenced off in :mod:`lsp.protocol`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections.abc import Callable
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams

from context.source.document import Document
from lsp.completion_items import completion_item, word_before
from lsp.config import ConfigError, merge_settings, startup_changes
from lsp.engine_host import EmberCore
from lsp.progress import report_loading
from lsp.session import EmberServer
from lsp.stats import STATS_METHOD, stats_summary
from lsp.workspaces import folder_paths, uri_path

log = logging.getLogger(__name__)

# Settings that only take effect when the engine starts (setting name -> Settings field).
WARMUP_PAUSE_S = 0.4


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
        ls.settings = merge_settings(ls.core.settings, options, source="initializationOptions")
    except ConfigError as exc:
        ls.settings = ls.core.settings
        ls.notify_user(f"{exc}; using defaults")
    ls.folders.add(folder_paths(params))


async def initialized(ls: EmberServer, params: types.InitializedParams) -> None:
    """Starts loading the model and shows its progress."""
    core = ls.core
    core.start_engine(ls.settings)
    ignored = startup_changes(core.engine_settings, ls.settings)
    if ignored:
        # A shared engine (TCP server, daemon) was started before this editor connected.
        ls.notify_user(
            f"this ember's engine was already started with its own {', '.join(ignored)}; "
            "the ones in your settings are not used (pass them where ember is started)",
            types.MessageType.Warning,
        )
    await watch_files(ls)
    await report_loading(ls)


async def watch_files(ls: EmberServer) -> None:
    """Asks the editor to report file changes under the workspace folders (dynamic registration,
    where the client allows it); didSave and mtime checks keep the index fresh otherwise."""
    capabilities = ls.client_capabilities.workspace
    watched = capabilities.did_change_watched_files if capabilities else None
    if not ls.folders.indexes() or watched is None or not watched.dynamic_registration:
        return
    options = types.DidChangeWatchedFilesRegistrationOptions(watchers=[types.FileSystemWatcher(glob_pattern="**/*")])
    registration = types.Registration(str(uuid.uuid4()), types.WORKSPACE_DID_CHANGE_WATCHED_FILES, options)
    try:
        await asyncio.wait_for(ls.client_register_capability_async(types.RegistrationParams([registration])), 10)
    except Exception as exc:  # noqa: BLE001 - the editor said no or never answered: didSave and mtimes still work
        log.info("the editor did not register the file watcher: %s", exc)


def did_change_workspace_folders(ls: EmberServer, params: types.DidChangeWorkspaceFoldersParams) -> None:
    """Folders added to or removed from the editor's workspace."""
    ls.folders.remove(p for p in (uri_path(f.uri) for f in params.event.removed) if p)
    ls.folders.add(p for p in (uri_path(f.uri) for f in params.event.added) if p)


async def did_change_watched_files(ls: EmberServer, params: types.DidChangeWatchedFilesParams) -> None:
    """Files created, changed or deleted on disk (by the editor's watcher)."""
    for change in params.changes:
        path = uri_path(change.uri)
        if path is not None:
            await ls.folders.file_changed(path, deleted=change.type == types.FileChangeType.Deleted)


async def did_save(ls: EmberServer, params: types.DidSaveTextDocumentParams) -> None:
    """The saved text is on disk now: the index reads it again."""
    path = uri_path(params.text_document.uri)
    if path is not None:
        await ls.folders.file_changed(path, deleted=False)


def shutdown(ls: EmberServer, params: Any) -> None:
    """Stops this session's work; pygls then answers every later request but exit."""
    ls.cancel_work()


def did_open(ls: EmberServer, params: types.DidOpenTextDocumentParams) -> None:
    """ember keeps the document (not pygls' workspace) and warms the engine up for it."""
    item = params.text_document
    state = ls.open_document(Document(item.uri, item.language_id, item.text, item.version))
    ls.schedule_warmup(state, len(item.text), delay_s=0.0)


def did_change(ls: EmberServer, params: types.DidChangeTextDocumentParams) -> None:
    """Applies the changes in the order received; a warm-up follows a pause after the last edit."""
    state = ls.open.get(params.text_document.uri)
    if state is None:
        log.warning("didChange for unknown document %s ignored", params.text_document.uri)
        return
    doc = state.document
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
        ls.schedule_warmup(state, min(typed_end, len(doc.text)), delay_s=WARMUP_PAUSE_S)


def did_close(ls: EmberServer, params: types.DidCloseTextDocumentParams) -> None:
    """Forgets the document and everything kept for it."""
    ls.close_document(params.text_document.uri)


def did_change_configuration(ls: EmberServer, params: types.DidChangeConfigurationParams) -> None:
    """New settings for this session (under "ember" or at the top); engine settings wait for a restart."""
    settings = params.settings
    if isinstance(settings, dict) and isinstance(settings.get("ember"), dict):
        settings = settings["ember"]
    try:
        new = merge_settings(ls.settings, settings, source="settings")
    except ConfigError as exc:
        ls.notify_user(str(exc))
        return
    if startup_changes(ls.settings, new) and ls.core.engine is not None:
        ls.notify_user("changing model, engineUrl or engineArgs takes effect after restarting ember", types.MessageType.Warning)
    ls.settings = new


async def completion(ls: EmberServer, params: types.CompletionParams) -> types.CompletionList:
    """One item that inserts the generated text at the cursor (Helix and older clients)."""
    token = params.partial_result_token
    word = word_before(ls, params.text_document.uri, params.position)

    def on_text(text: str) -> None:
        if token is not None and text:
            ls.progress(types.ProgressParams(token=token, value=[completion_item(text, params.position, word)]))

    result = await ls.complete(params.text_document.uri, params.position, on_text)
    items = [completion_item(result.text, params.position, word, result.metrics.confidence)] if result.text else []
    return types.CompletionList(is_incomplete=True, items=items)


async def inline_completion(ls: EmberServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
    """Ghost text (LSP 3.18): VS Code, Neovim 0.12."""
    text = (await ls.complete(params.text_document.uri, params.position)).text
    if not text:
        return types.InlineCompletionList(items=[])
    position = params.position
    return types.InlineCompletionList(
        items=[types.InlineCompletionItem(insert_text=text, range=types.Range(start=position, end=position))]
    )


def stats(ls: EmberServer, params: Any) -> dict[str, Any]:
    """Aggregated metrics (p50/p95), the last request's metrics, and the engine's state; with
    ``{"uri": U}`` also ``last_for_uri``, the latest request for that document (clients with
    several requests in flight cannot rely on ``last``)."""
    uri = params.get("uri") if isinstance(params, dict) else getattr(params, "uri", None)
    return stats_summary(ls, uri if isinstance(uri, str) else None)


# (method, handler, options): what build_server registers on every session, in this order.
FEATURES: tuple[tuple[str, Callable[..., Any], Any], ...] = (
    (types.INITIALIZE, initialize, None),
    (types.INITIALIZED, initialized, None),
    (types.SHUTDOWN, shutdown, None),
    (types.TEXT_DOCUMENT_DID_OPEN, did_open, None),
    (types.TEXT_DOCUMENT_DID_CHANGE, did_change, None),
    (types.TEXT_DOCUMENT_DID_CLOSE, did_close, None),
    (types.WORKSPACE_DID_CHANGE_CONFIGURATION, did_change_configuration, None),
    (types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS, did_change_workspace_folders, None),
    (types.WORKSPACE_DID_CHANGE_WATCHED_FILES, did_change_watched_files, None),
    (types.TEXT_DOCUMENT_DID_SAVE, did_save, None),
    (
        types.TEXT_DOCUMENT_COMPLETION,
        completion,
        types.CompletionOptions(trigger_characters=[".", "(", " ", "\n"], resolve_provider=False),
    ),
    (types.TEXT_DOCUMENT_INLINE_COMPLETION, inline_completion, types.InlineCompletionOptions()),
    (STATS_METHOD, stats, None),
)


def build_server(core: EmberCore, *, token: str | None = None, exit_process: bool = True) -> EmberServer:
    """A session on ``core`` with ember's handlers. ``token``: the secret a TCP client must send
    in initializationOptions; ``exit_process``: exit ends the process (stdio), not just the connection."""
    server = EmberServer(core, token=token, exit_process=exit_process)
    for method, handler, options in FEATURES:
        server.feature(method, options)(handler)
    return server


