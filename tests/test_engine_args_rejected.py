"""Engine arguments that vLLM refuses: the editor is told why (window/showMessage, in vLLM's
terms), ember starts the engine with its own defaults instead, and completions work.

One real engine: ``ember --stdio --engine-arg no_such_arg=1 --engine-arg max_model_len=4096``.
The arguments apply all together or not at all, so max_model_len stays ember's 2048."""

from __future__ import annotations

import asyncio
import sys

import pytest
from lsprotocol import types
from pygls.lsp.client import LanguageClient

from tests.conftest import client_capabilities, wait_ready
from tests.test_server import inline, open_doc


@pytest.mark.slow
async def test_unknown_engine_arg_is_reported_and_ember_serves_on_its_defaults(sample_text) -> None:
    client = LanguageClient("engine-args-rejected", "1")
    messages: list[types.ShowMessageParams] = []
    client.feature(types.WINDOW_SHOW_MESSAGE)(lambda params: messages.append(params))
    await client.start_io(
        sys.executable, "-m", "lsp", "--stdio", "--daemon", "off", "--max-tokens", "8",
        "--engine-arg", "no_such_arg=1", "--engine-arg", "max_model_len=4096",
    )  # fmt: skip
    try:
        await client.initialize_async(types.InitializeParams(capabilities=client_capabilities()))
        client.initialized(types.InitializedParams())
        current = await wait_ready(client)
        for _ in range(50):
            if messages:
                break
            await asyncio.sleep(0.1)
        shown = [m for m in messages if "no_such_arg" in m.message]
        assert shown, [m.message for m in messages]
        assert shown[0].type == types.MessageType.Warning
        assert "not a field of vllm.AsyncEngineArgs" in shown[0].message
        assert "started with ember's defaults instead" in shown[0].message
        engine = current["engine"]
        assert engine["warning"] and "no_such_arg" in engine["warning"]
        assert engine["max_model_len"] == 2048 and "no_such_arg" not in engine["engine_args"]

        uri = "file:///work/rejected.py"
        text = sample_text + "\n\ndef restock(inventory: Inventory, name: str, amount: int) -> None:\n    "
        open_doc(client, uri, text)
        items = await inline(client, uri, text.count("\n"), 4)
        assert items and items[0].insert_text.strip()
    finally:
        await client.shutdown_async(None)
        client.exit(None)
        await asyncio.wait_for(client.stop(), 30)
