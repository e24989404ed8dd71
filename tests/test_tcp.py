"""`ember --tcp` on 127.0.0.1: real completions, and two editor sessions at once that keep their
documents and settings apart while sharing one embedded engine."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient

from tests.conftest import EAGER, client_capabilities, stats, wait_ready

SAME_URI = "file:///work/shared_name.py"


@pytest.fixture(scope="module")
def tcp_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("tcp") / "stderr.log"
    # stderr goes to a file: vLLM logs a lot, and an unread pipe would block the server.
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lsp", "--tcp", "0", "--max-tokens", "16", *EAGER], stderr=log, stdout=subprocess.DEVNULL
        )
    deadline = time.monotonic() + 120
    address = None
    while time.monotonic() < deadline and address is None and proc.poll() is None:
        match = re.search(r"ember listening on \('([\d.]+)', (\d+)\)", log_path.read_text())
        if match:
            address = (match.group(1), int(match.group(2)))
        time.sleep(0.2)
    try:
        assert address is not None, "ember --tcp did not report its address: " + log_path.read_text()[-2000:]
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=15)


async def connect(address, options=None) -> LanguageClient:
    client = LanguageClient("tcp-test", "1")
    await client.start_tcp(*address)
    await client.initialize_async(
        types.InitializeParams(capabilities=client_capabilities(), initialization_options=options or {})
    )
    client.initialized(types.InitializedParams())
    return client


async def disconnect(client: LanguageClient) -> None:
    """shutdown + exit; the server then closes the connection (a reset is the same as a close)."""
    await client.shutdown_async(None)
    client.exit(None)
    try:
        await client.stop()
    except ConnectionResetError:
        pass


async def inline(client, uri, line, character):
    result = await client.text_document_inline_completion_async(
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
        )
    )
    return [item.insert_text for item in result.items]


async def test_binds_loopback_by_default(tcp_server):
    host, _ = tcp_server
    assert host == "127.0.0.1"


async def test_two_sessions_keep_documents_apart(tcp_server, sample_text):
    first = await connect(tcp_server, {"maxTokens": 16})
    second = await connect(tcp_server, {"maxTokens": 8})
    try:
        await wait_ready(first)
        # Both open the same URI with different text: each session sees only its own.
        text_a = sample_text + "\n\ndef total_quantity(inventory: Inventory) -> int:\n    return "
        text_b = "import math\n\n\ndef circle_area(radius: float) -> float:\n    return "
        for client, text in ((first, text_a), (second, text_b)):
            client.text_document_did_open(
                types.DidOpenTextDocumentParams(types.TextDocumentItem(SAME_URI, "python", 1, text))
            )
        pos_a = (text_a.count("\n"), len(text_a.rsplit("\n", 1)[1]))
        pos_b = (text_b.count("\n"), len(text_b.rsplit("\n", 1)[1]))
        a, b = await asyncio.gather(inline(first, SAME_URI, *pos_a), inline(second, SAME_URI, *pos_b))
        assert a and a[0].strip() and b and b[0].strip(), (a, b)
        # A position valid only in the long document is an error in the short one's session.
        with pytest.raises(JsonRpcException, match="line"):
            await inline(second, SAME_URI, pos_a[0], 0)
        # Closing in one session leaves the other's document open.
        first.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(SAME_URI)))
        assert await inline(second, SAME_URI, *pos_b) == b
        with pytest.raises(JsonRpcException, match="unknown document"):
            await inline(first, SAME_URI, *pos_a)
        # Both sessions share one engine (and its metrics).
        assert (await stats(first))["requests"] == (await stats(second))["requests"]
    finally:
        for client in (first, second):
            await disconnect(client)


async def test_one_session_ending_leaves_the_server_serving(tcp_server):
    await disconnect(await connect(tcp_server))
    again = await connect(tcp_server)
    try:
        assert (await stats(again))["engine"]["ready"]
    finally:
        await disconnect(again)


async def test_tcp_server_is_long_lived_and_an_explicit_engine_arg_wins(tcp_server):
    """``--tcp`` picks compiled mode on the CPU (long-lived process); this server was started with
    ``--engine-arg enforce_eager=true``, which overrides it."""
    client = await connect(tcp_server)
    try:
        engine = (await wait_ready(client))["engine"]
        assert engine["long_lived"] is True
        assert engine["engine_args"]["enforce_eager"] is True
        assert engine["max_model_len"] == 2048 and engine["budget"]["context_tokens"] == 1024
    finally:
        await disconnect(client)


async def test_engine_settings_of_a_later_editor_are_reported_as_not_used(tcp_server):
    """The shared engine started with the server's command line; an editor's engineArgs cannot
    change it, and the editor is told so instead of silently getting another context length."""
    client = LanguageClient("tcp-test", "1")
    messages: list[str] = []
    client.feature(types.WINDOW_SHOW_MESSAGE)(lambda params: messages.append(params.message))
    await client.start_tcp(*tcp_server)
    await client.initialize_async(
        types.InitializeParams(capabilities=client_capabilities(), initialization_options={"engineArgs": {"max_model_len": 4096}})
    )
    client.initialized(types.InitializedParams())
    try:
        engine = (await wait_ready(client))["engine"]
        for _ in range(50):
            if messages:
                break
            await asyncio.sleep(0.1)
        assert any("already started with its own engineArgs" in m for m in messages), messages
        assert engine["max_model_len"] == 2048
    finally:
        await disconnect(client)
