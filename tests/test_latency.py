"""The latency pipeline end to end over stdio with the real engine: partial results, cancellation
that reaches vLLM, answers from the cache while the user types along a suggestion."""

from __future__ import annotations

import asyncio
import time

from lsprotocol import types

from tests.conftest import plain, stats, wait_ready
from tests.test_server import open_doc, type_text

LONG_BODY = '''

def describe_inventory(inventory: Inventory) -> str:
    """Return a multi-line, human readable report of every item with its price and quantity."""
'''


def set_settings(client, **settings) -> None:
    client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings={"ember": settings}))


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
    set_settings(client, maxTokens=400, timeoutMs=60000)
    await asyncio.sleep(0.2)
    before = (await stats(client))["engine"]["stats"]["generation_tokens"]
    line = text.count("\n")
    request = client.protocol.send_request_async(
        types.TEXT_DOCUMENT_INLINE_COMPLETION,
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=4),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
        ),
        msg_id="cancel-me",
    )
    await asyncio.sleep(1.5)
    running = (await stats(client))["engine"]["stats"]
    client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id="cancel-me"))
    try:
        await asyncio.wait_for(request, 10)
    except Exception:
        pass  # RequestCancelled is the expected answer
    await asyncio.sleep(1.0)
    after_cancel = (await stats(client))["engine"]["stats"]
    await asyncio.sleep(1.5)
    later = (await stats(client))["engine"]["stats"]
    set_settings(client, maxTokens=24, timeoutMs=15000)
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
