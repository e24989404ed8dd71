"""The embedded engine's process dies: requests fail fast with a clear message, the engine is
restarted, and completions work again. Also the Prometheus endpoint."""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request

import psutil
import pytest
from lsprotocol import types
from pygls.lsp.client import LanguageClient

from tests.conftest import client_capabilities, free_port, wait_ready
from tests.test_server import inline, open_doc


def engine_core(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
            return child
    raise AssertionError("no vLLM engine core process under the server")


@pytest.mark.slow
async def test_killed_engine_fails_fast_and_is_restarted(sample_text):
    port = free_port()
    client = LanguageClient("fault-test", "1")
    messages: list[str] = []
    client.feature(types.WINDOW_SHOW_MESSAGE)(lambda params: messages.append(params.message))
    await client.start_io(sys.executable, "-m", "lsp", "--stdio", "--daemon", "off", "--max-tokens", "8", "--metrics-port", str(port))
    try:
        await client.initialize_async(types.InitializeParams(capabilities=client_capabilities()))
        client.initialized(types.InitializedParams())
        await wait_ready(client)
        uri = "file:///work/faults.py"
        text = sample_text + "\n\ndef restock(inventory: Inventory, name: str, amount: int) -> None:\n    "
        open_doc(client, uri, text)
        line, character = text.count("\n"), 4
        assert (await inline(client, uri, line, character))[0].insert_text.strip()

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "ember_requests_total 1" in metrics and 'ember_latency_ms{quantile="0.5"}' in metrics
        assert "ember_engine_requests_total" in metrics and "ember_process_descriptors" in metrics

        # On the CPU the model runs inside the engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0, ember's
        # CPU default): no worker process of its own, which would import torch and vLLM once more.
        names = [" ".join(c.cmdline()) or c.name() for c in psutil.Process(client._server.pid).children(recursive=True)]
        assert not [n for n in names if "Worker" in n], names
        before = (await client.protocol.send_request_async("ember/stats", {})).engine.counters.requests
        engine_core(client._server.pid).kill()
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        answers = [await inline(client, uri, line, character) for _ in range(2)]
        assert time.monotonic() - t0 < 5, "requests did not fail fast"
        assert answers == [[], []]
        for _ in range(50):
            if any("engine" in m for m in messages):
                break
            await asyncio.sleep(0.1)
        assert any("died" in m or "not available" in m or "failed" in m for m in messages), messages

        current = await wait_ready(client)
        assert current["engine"]["restarts"] == 1
        engine_core(client._server.pid)  # a new engine core runs
        assert (await inline(client, uri, line, character))[0].insert_text.strip()
        # The counters run from the process's start: the dead engine's are kept beside the new one's.
        engine = (await client.protocol.send_request_async("ember/stats", {})).engine
        assert engine.counters.requests == before + engine.stats.requests and engine.counters.restarts == 1
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "ember_engine_restarts_total 1" in metrics and f"ember_engine_requests_total {engine.counters.requests}" in metrics
    finally:
        await client.shutdown_async(None)
        client.exit(None)
        await asyncio.wait_for(client.stop(), 30)
