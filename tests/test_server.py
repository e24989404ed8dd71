"""End to end over stdio: a real LSP client, the real server, real vLLM on SmolLM2-135M.

The order matters for the first test: it runs while the model is still loading.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient

from tests.conftest import client_capabilities, plain, stats, wait_ready

URI = "file:///work/inventory.py"


def open_doc(client, uri: str, text: str, version: int = 1) -> None:
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id="python", version=version, text=text)
        )
    )


def type_text(client, uri: str, line: int, character: int, text: str, version: int) -> int:
    """Sends one incremental didChange per character, like an editor while the user types."""
    for ch in text:
        version += 1
        client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
                content_changes=[
                    types.TextDocumentContentChangePartial(
                        range=types.Range(
                            start=types.Position(line=line, character=character),
                            end=types.Position(line=line, character=character),
                        ),
                        text=ch,
                    )
                ],
            )
        )
        if ch == "\n":
            line, character = line + 1, 0
        else:
            character += 1
    return version


async def inline(client, uri: str, line: int, character: int) -> list[types.InlineCompletionItem]:
    result = await client.text_document_inline_completion_async(
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
        )
    )
    return list(result.items) if result else []


async def complete(client, uri: str, line: int, character: int) -> list[types.CompletionItem]:
    result = await client.text_document_completion_async(
        types.CompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=character),
        )
    )
    if result is None:
        return []
    return list(result.items if isinstance(result, types.CompletionList) else result)


async def test_initialize_advertises_both_providers(client):
    caps = client.initialize_result.capabilities
    assert caps.completion_provider is not None
    assert caps.inline_completion_provider not in (None, False)
    assert caps.text_document_sync.change == types.TextDocumentSyncKind.Incremental


async def test_requests_while_loading_get_an_empty_result(sample_text):
    """A fresh server of its own: the shared one may have loaded already."""
    fresh = LanguageClient("loading-test", "1")
    await fresh.start_io(sys.executable, "-m", "lsp", "--stdio", "--daemon", "off", "--max-tokens", "8")
    try:
        await fresh.initialize_async(types.InitializeParams(capabilities=client_capabilities()))
        fresh.initialized(types.InitializedParams())
        open_doc(fresh, "file:///work/loading.py", sample_text)
        assert await inline(fresh, "file:///work/loading.py", 10, 4) == []
        assert await complete(fresh, "file:///work/loading.py", 10, 4) == []
        # Still loading afterwards: the empty answers were given while the model loaded.
        assert not (await stats(fresh))["engine"]["ready"], "the model loaded before the requests"
    finally:
        await fresh.shutdown_async(None)
        fresh.exit(None)
        await asyncio.wait_for(fresh.stop(), 30)


async def test_unknown_document_is_a_clear_error_and_the_server_keeps_serving(client):
    with pytest.raises(JsonRpcException, match="unknown document"):
        await inline(client, "file:///nowhere/missing.py", 0, 0)
    with pytest.raises(JsonRpcException, match="unknown document"):
        await complete(client, "file:///nowhere/missing.py", 0, 0)
    assert "engine" in await stats(client)


async def test_position_outside_the_document_is_a_clear_error(client, sample_text):
    uri = "file:///work/positions.py"
    open_doc(client, uri, sample_text)
    lines = sample_text.count("\n")
    with pytest.raises(JsonRpcException, match="line"):
        await inline(client, uri, lines + 50, 0)
    with pytest.raises(JsonRpcException, match="past|beyond|outside|character"):
        await complete(client, uri, 3, 500)
    assert "engine" in await stats(client)


async def test_loading_progress_was_reported(client):
    await wait_ready(client)
    reports = [r for token, r in client.progress_reports.items() if str(token).startswith("ember-load")]
    assert reports, "no work-done progress for model loading"
    kinds = [type(value).__name__ for value in reports[0]]
    assert kinds[0] == "WorkDoneProgressBegin" and kinds[-1] == "WorkDoneProgressEnd"
    assert "ready" in reports[0][-1].message


async def test_completions_after_incremental_edits_match_a_full_sync(client, sample_text):
    await wait_ready(client)
    # Start a new function at the end of the file and type its first line through didChange.
    lines = sample_text.split("\n")
    base_line = len(lines) - 1  # the empty last line
    open_doc(client, URI, sample_text)
    typed = "\n\ndef count_items(inventory: Inventory) -> int:\n    return "
    type_text(client, URI, base_line, 0, typed, version=1)
    final_text = sample_text + typed
    cursor_line = final_text.count("\n")
    cursor_char = len(final_text.rsplit("\n", 1)[1])

    items = await inline(client, URI, cursor_line, cursor_char)
    assert len(items) == 1 and items[0].insert_text.strip(), items
    inline_text = items[0].insert_text
    last = (await stats(client))["last"]
    assert last["streamed_tokens"] > 0 and not last["cache_hit"], last
    assert last["prompt_tokens"] > 100
    # The embedded engine's token log-probabilities reached the confidence gate (the bundled model's
    # default threshold is 0: everything is shown, with its calibrated probability).
    assert 0 < last["confidence"] <= 1 and last["shown"] == "shown", last

    completion_items = await complete(client, URI, cursor_line, cursor_char)
    assert len(completion_items) == 1
    assert completion_items[0].data == {"confidence": last["confidence"]}  # from the completion cache
    edit = completion_items[0].text_edit
    assert edit.new_text == inline_text
    assert edit.range.start == types.Position(line=cursor_line, character=cursor_char)

    # The same text sent whole gives the same prompt: the answer comes from the completion cache.
    client.text_document_did_close(types.DidCloseTextDocumentParams(text_document=types.TextDocumentIdentifier(uri=URI)))
    full_uri = "file:///work/full_sync.py"
    open_doc(client, full_uri, final_text)
    full_items = await inline(client, full_uri, cursor_line, cursor_char)
    assert [i.insert_text for i in full_items] == [inline_text]
    assert (await stats(client))["last"]["cache_hit"] is True
    # Clients with several requests in flight look their own up by document.
    by_uri = plain(await client.protocol.send_request_async("ember/stats", {"uri": URI}))
    assert by_uri["last_for_uri"]["uri"] == URI and by_uri["last_for_uri"]["outcome"] in ("ok", "attached")
    assert by_uri["last"]["uri"] == full_uri
    client.text_document_did_close(types.DidCloseTextDocumentParams(text_document=types.TextDocumentIdentifier(uri=full_uri)))


async def test_wrong_settings_get_a_clear_message(client):
    client.workspace_did_change_configuration(
        types.DidChangeConfigurationParams(settings={"ember": {"maxTokens": "lots"}})
    )
    for _ in range(50):
        if any("maxTokens" in m.message for m in client.messages):
            break
        await asyncio.sleep(0.1)
    assert any("maxTokens must be a number" in m.message for m in client.messages), client.messages


def test_every_setting_is_accepted_by_its_camel_case_name():
    """A field added to Settings without a validation rule would fail at initialize (seen with
    prefixCache): each one must accept a sensible value."""
    import dataclasses

    from lsp.config import Settings, merge_settings

    special = {"engine_url": ["http://127.0.0.1:8000/v1"], "model": "some/model", "fim_template": "prefix-only",
               "prompt_strategy": "naive"}
    for f in dataclasses.fields(Settings):
        camel = f.name.split("_")[0] + "".join(p.title() for p in f.name.split("_")[1:])
        value = special.get(f.name, (not f.default) if isinstance(f.default, bool) else f.default)
        merged = merge_settings(Settings(), {camel: value})
        assert getattr(merged, f.name) == (tuple(value) if isinstance(value, list) else value), f.name
