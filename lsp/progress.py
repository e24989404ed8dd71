"""Work-done progress while the model downloads and loads, and the messages an editor gets once
when the engine is not available or not as asked."""

from __future__ import annotations

import asyncio
import logging
import uuid

from lsprotocol import types

from lsp.session import EmberServer

log = logging.getLogger(__name__)

PROGRESS_REPORT_S = 0.25  # how often model download/loading progress is sent to the editor


async def report_loading(ls: EmberServer) -> None:
    """Work-done progress while the model downloads and loads (when the client supports it); then,
    once per editor, why the engine is not available, or what did not go as asked: a fallback
    model stands in for the code model, engine arguments that vLLM refused."""
    core = ls.core
    if not core.check_engine():
        await show_loading_progress(ls)
    if not core.check_engine():
        if core.engine_error:
            ls.notify_user(f"the engine is not available: {core.engine_error}")
        return
    reason = core.load_progress.current().fallback_reason
    if reason:
        ls.notify_user(reason, types.MessageType.Warning)
    if core.engine_warning:
        ls.notify_user(core.engine_warning, types.MessageType.Warning)


async def show_loading_progress(ls: EmberServer) -> None:
    """One progress for getting the model ready, its message naming the stage and its percentage
    where that stage begins in a typical cold start (:data:`engine.loading.STAGE_PERCENT`), and
    while the model downloads a second one with bytes and a percentage of the download. Returns
    when the engine is loaded or failed to load."""
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
    begin = types.WorkDoneProgressBegin(title="ember", message=shown.describe(), percentage=shown.overall_percent())
    ls.work_done_progress.begin(token, begin)
    download: str | None = None
    waiting = asyncio.ensure_future(core.wait_ready())
    while not waiting.done():
        await asyncio.wait({waiting}, timeout=PROGRESS_REPORT_S)
        state = core.load_progress.current()
        if state == shown or waiting.done():
            continue
        if state.stage == "downloading" and download is not None:
            report = types.WorkDoneProgressReport(message=state.describe(), percentage=state.percent())
            ls.work_done_progress.report(download, report)
        elif state.stage == "downloading" and shown.stage != "downloading":
            report = types.WorkDoneProgressReport(message=f"downloading {state.model}", percentage=state.overall_percent())
            ls.work_done_progress.report(token, report)
            download = await new_progress_token(ls, "ember-download")
            if download is not None:
                begin = types.WorkDoneProgressBegin(title="ember", message=state.describe(), percentage=state.percent() or 0)
                ls.work_done_progress.begin(download, begin)
        elif state.stage != "downloading":
            if download is not None:
                ls.work_done_progress.end(download, types.WorkDoneProgressEnd(message=f"downloaded {shown.model}"))
                download = None
            report = types.WorkDoneProgressReport(message=state.describe(), percentage=state.overall_percent())
            ls.work_done_progress.report(token, report)
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
    except Exception as exc:  # noqa: BLE001 - any refusal by the client means no progress, not an error
        log.debug("client refused progress token: %s", exc)
        return None
    return token
