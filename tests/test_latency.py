"""The latency pipeline end to end over stdio with the real engine: partial results, cancellation
that reaches vLLM, answers from the cache while the user types along a suggestion."""

from __future__ import annotations

import asyncio
import time

from lsprotocol import types
from pygls.exceptions import JsonRpcException

from tests.conftest import plain, stats, wait_ready
from tests.test_server import inline, open_doc, type_text

LONG_BODY = '''

def describe_inventory(inventory: Inventory) -> str:
    """Return a multi-line, human readable report of every item with its price and quantity."""
'''


def set_settings(client, **settings) -> None:
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings={"ember": settings}))


async def engine_idle(client, timeout_s: float = 60) -> None:
    """Waits until the engine runs nothing (a generation behind an early answer may still go on)."""
    deadline = time.monotonic() + timeout_s
    while (await stats(client))["engine"]["stats"].get("num_requests_running") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def test_partial_results_arrive_before_the_final_result(client, sample_text):
    await wait_ready(client)
    uri = "file:///work/partial.py"
    text = sample_text + LONG_BODY
    open_doc(client, uri, text)
    set_settings(client, maxTokens=64)
    partials: list[tuple[float, list]] = []

    def on_progress(params: types.ProgressParams) -> None:
        if params.token == "partial-1":
            partials.append((time.monotonic(), plain(params.value)))

    # pytest-lsp's own $/progress handler only knows work-done progress; partial results are lists.
    client.protocol.fm.features[types.PROGRESS] = on_progress
    line = text.count("\n")
    result = await client.text_document_completion_async(
        types.CompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=0),
            partial_result_token="partial-1",
        )
    )
    finished = time.monotonic()
    set_settings(client, maxTokens=24)
    assert result is not None and result.items, "no final result"
    assert len(partials) >= 2, f"expected several partial results, got {len(partials)}"
    assert partials[0][0] < finished
    texts = [p[1][0]["insertText"] for p in partials if p[1]]
    # Text grows as tokens stream in, and the final result is the last partial.
    assert len(texts[0]) < len(result.items[0].insert_text)
    assert texts[-1] == result.items[0].insert_text


async def test_cancel_request_stops_generation_in_the_engine(client, sample_text):
    await wait_ready(client)
    uri = "file:///work/cancel.py"
    text = sample_text + LONG_BODY
    open_doc(client, uri, text)
    # One long generation, answered only when it is done (no early answer of complete lines).
    set_settings(client, maxTokens=400, timeoutMs=60000, earlyAnswerMs=0)
    await engine_idle(client)
    before = (await stats(client))["engine"]["stats"]["generation_tokens"]
    line = text.count("\n")
    # A task: the coroutine alone would send nothing until awaited.
    request = asyncio.ensure_future(client.protocol.send_request_async(
        types.TEXT_DOCUMENT_INLINE_COMPLETION,
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=0),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
        ),
        msg_id="cancel-me",
    ))
    deadline = time.monotonic() + 30  # prefill takes a while on a loaded CPU
    while True:
        await asyncio.sleep(0.5)
        running = (await stats(client))["engine"]["stats"]
        if running["generation_tokens"] > before + 2 or time.monotonic() > deadline or request.done():
            break
    client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id="cancel-me"))
    try:
        await asyncio.wait_for(request, 10)
        answer = "a result"
    except JsonRpcException as exc:
        answer = exc.code
    await asyncio.sleep(1.0)
    after_cancel = (await stats(client))["engine"]["stats"]
    await asyncio.sleep(1.5)
    later = (await stats(client))["engine"]["stats"]
    set_settings(client, maxTokens=24, timeoutMs=15000, earlyAnswerMs=400)
    assert answer == -32800, f"expected RequestCancelled, got {answer}"
    assert running["generation_tokens"] > before, "generation had not started"
    assert later["generation_tokens"] == after_cancel["generation_tokens"], "tokens kept coming after cancel"
    assert after_cancel["generation_tokens"] - before < 300, "generation ran to its end"
    assert later["num_requests_running"] == 0


async def test_typing_along_a_suggestion_is_answered_from_cache(client, sample_text):
    await wait_ready(client)
    uri = "file:///work/typed.py"
    text = sample_text + "\n\ndef cheapest(inventory: Inventory) -> Item:\n    return "
    open_doc(client, uri, text)
    line = text.count("\n")
    character = len(text.rsplit("\n", 1)[1])
    first = await client.text_document_inline_completion_async(
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
        )
    )
    suggestion = first.items[0].insert_text
    assert len(suggestion) >= 3, suggestion
    typed = suggestion[:2]
    type_text(client, uri, line, character, typed, version=1)
    t0 = time.perf_counter()
    second = await client.text_document_inline_completion_async(
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=character + len(typed)),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
        )
    )
    client_ms = (time.perf_counter() - t0) * 1000
    last = (await stats(client))["last"]
    assert second.items[0].insert_text == suggestion[len(typed) :]
    assert last["cache_hit"] is True and last["streamed_tokens"] == 0
    assert last["latency_ms"] < 50, last  # no engine work: a lookup
    assert client_ms < 2000


async def test_multi_line_answers_with_complete_lines_then_finishes_into_the_cache(client, sample_text):
    """earlyAnswerMs: a multi-line completion is answered with the lines complete so far while the
    engine goes on; accepting them is then answered with the rest from the cache."""
    await wait_ready(client)
    uri = "file:///work/early.py"
    text = sample_text + LONG_BODY
    open_doc(client, uri, text)
    set_settings(client, maxTokens=96, earlyAnswerMs=1, timeoutMs=60000)
    line = text.count("\n")
    try:
        items = await inline(client, uri, line, 0)
        at_answer = await stats(client)
        shown = items[0].insert_text
        assert shown.strip() and not shown.endswith("\n"), shown
        assert at_answer["last"]["mode"] == "multi" and at_answer["last"]["streamed_tokens"] < 96
        await engine_idle(client)
        finished = await stats(client)
        assert finished["engine"]["stats"]["generation_tokens"] > at_answer["engine"]["stats"]["generation_tokens"], (
            "the generation stopped when the early answer went out"
        )
        # The user accepts the suggestion: one edit inserts it.
        client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
                content_changes=[
                    types.TextDocumentContentChangePartial(
                        range=types.Range(start=types.Position(line=line, character=0), end=types.Position(line=line, character=0)),
                        text=shown,
                    )
                ],
            )
        )
        end = types.Position(line=line + shown.count("\n"), character=len(shown.rsplit("\n", 1)[-1]))
        rest = await inline(client, uri, end.line, end.character)
        last = (await stats(client))["last"]
    finally:
        set_settings(client, maxTokens=24, earlyAnswerMs=400, timeoutMs=15000)
    assert last["cache_hit"] is True and last["streamed_tokens"] == 0, last
    assert rest and rest[0].insert_text.strip(), "the rest of the generation was not kept"
