"""The model ember picks when none is named, for real: a download from a model hub (a local one on
127.0.0.1, tests/hub.py, speaking the Hugging Face Hub's file API) with progress in the editor, the
Hugging Face cache on the next start, the bundled fallback when no hub answers, and a clear error
for a typo in a hub id. Each server gets its own HF_HOME; none reaches beyond 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from lsprotocol import types
from pytest_lsp import LanguageClient
from pytest_lsp.client import make_test_lsp_client

from engine.hub import HUB_TIMEOUT_S
from engine.models import BUNDLED_NAME, DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL, resolve_bundled
from tests.conftest import client_capabilities, stats, wait_ready
from tests.hub import LocalHub
from tests.test_server import inline, open_doc

HUB_ID = "ember-test/SmolLM2-135M"
TEXT = "def add(a: int, b: int) -> int:\n    return a + b\n\n\ndef mul(a: int, b: int) -> int:\n    "
URI = "file:///work/models_test.py"


def closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(hf_home: Path, **extra: str) -> dict[str, str]:
    """The test process's environment without the test default (EMBER_MODEL=bundled) and without
    any hub setting of the user's, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "EMBER_MODEL", "EMBER_DEFAULT_MODEL"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


async def start(env: dict[str, str], log_file: Path, *args: str) -> LanguageClient:
    client = make_test_lsp_client()
    await client.start_io(
        sys.executable, "-m", "lsp", "--stdio", "--daemon", "off", "--max-tokens", "8", "--log-file", str(log_file), *args, env=env
    )
    await client.initialize_session(types.InitializeParams(capabilities=client_capabilities()))
    return client


async def stop(client: LanguageClient) -> None:
    await client.shutdown_session()
    await asyncio.wait_for(client.stop(), 30)


def progress(client: LanguageClient, prefix: str) -> list[list[Any]]:
    """The work-done progress values of each token named ``prefix-...``."""
    return [values for token, values in client.progress_reports.items() if str(token).startswith(prefix)]


def load_reports(client: LanguageClient) -> list[Any]:
    reports = progress(client, "ember-load")
    assert len(reports) == 1, client.progress_reports
    return reports[0]


def fallback_messages(client: LanguageClient) -> list[str]:
    return [m.message for m in client.messages if "fallback" in m.message]


def fallback_seconds(log: str) -> float:
    """How long ember tried the hub before it fell back, from its log."""
    match = re.search(r"gave up on the hub for \S+ after ([\d.]+) s", log)
    assert match, log[-2000:]
    return float(match.group(1))


async def loading(client: LanguageClient, model: str, timeout_s: float = 120.0) -> None:
    """Waits until the editor's load progress says ``loading <model>`` (or a stage of it): the model
    is resolved and the engine is starting on it."""
    deadline = time.monotonic() + timeout_s
    messages = lambda: [getattr(r, "message", None) or "" for r in sum(progress(client, "ember-load"), [])]  # noqa: E731
    while not any(m == f"loading {model}" or m.startswith(f"loading {model}: ") for m in messages()):
        assert time.monotonic() < deadline, client.progress_reports
        await asyncio.sleep(0.1)


async def completes(client: LanguageClient) -> str:
    open_doc(client, URI, TEXT)
    items = await inline(client, URI, TEXT.count("\n"), 4)
    assert items and items[0].insert_text.strip(), items
    return items[0].insert_text


def test_the_default_is_a_fill_in_the_middle_code_model_by_hardware() -> None:
    from engine.embedded import _on_cpu
    from engine.models import default_hub_model

    env_before = os.environ.pop("EMBER_DEFAULT_MODEL", None)
    try:
        assert default_hub_model() == (DEFAULT_CPU_MODEL if _on_cpu() else DEFAULT_GPU_MODEL)
    finally:
        if env_before is not None:
            os.environ["EMBER_DEFAULT_MODEL"] = env_before
    assert (DEFAULT_CPU_MODEL, DEFAULT_GPU_MODEL) == ("Qwen/Qwen2.5-Coder-0.5B", "Qwen/Qwen2.5-Coder-1.5B")


def test_the_cpu_default_is_the_largest_model_whose_first_line_fits_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's default follows the machine's speed: the 0.5B where the 1.5B's typical first
    line would not fit the budget (2 cores), the 1.5B where it would (measured, or estimated on
    more cores); a model the user names, or $EMBER_DEFAULT_MODEL, always wins."""
    from engine.models import CPU_MODELS, FIRST_LINE_BUDGET_MS, choose_cpu_model, default_gguf_model, first_line_ms

    small, large = (m.hub_id for m in CPU_MODELS)
    assert choose_cpu_model(2).hub_id == small
    assert choose_cpu_model(16).hub_id == large
    # Measured speeds decide over the estimate, each way.
    assert choose_cpu_model(2, {large: 60.0}).hub_id == large
    assert choose_cpu_model(16, {large: 5.0}).hub_id == small
    # Nothing fits: the smallest, and the reason gives each model's cost.
    slow = choose_cpu_model(1, {small: 2.0, large: 1.0})
    assert slow.hub_id == small and "measured" in slow.reason and f"{FIRST_LINE_BUDGET_MS:.0f} ms" in slow.reason
    assert first_line_ms(CPU_MODELS[1], 2) > FIRST_LINE_BUDGET_MS > first_line_ms(CPU_MODELS[0], 2)
    monkeypatch.setenv("EMBER_DEFAULT_MODEL", "me/mine-GGUF")
    assert default_gguf_model().hub_id == "me/mine-GGUF"
    monkeypatch.delenv("EMBER_DEFAULT_MODEL")
    monkeypatch.setattr("engine.llamacpp.usable_cores", lambda: 8)
    assert default_gguf_model().hub_id == large


def test_ember_model_names_the_embedded_model_and_bundled_is_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.models import resolve_model
    from lsp.cli import parse_args, settings_from_args

    monkeypatch.setenv("EMBER_MODEL", "bundled")
    assert settings_from_args(parse_args([])).model == "bundled"
    assert settings_from_args(parse_args(["--model", "owner/name"])).model == "owner/name"
    # A remote server's model name comes from --model only.
    assert settings_from_args(parse_args(["--engine-url", "http://127.0.0.1:9/v1"])).model is None
    monkeypatch.delenv("EMBER_MODEL")
    assert settings_from_args(parse_args([])).model is None
    bundled = resolve_model("bundled")
    assert (bundled.name, bundled.source, bundled.fallback_reason) == (BUNDLED_NAME, "bundled", None)


@pytest.mark.slow
async def test_default_model_downloads_with_progress_then_starts_from_the_cache(tmp_path: Path) -> None:
    """No --model: the default hub id (pointed at the local hub) is downloaded into HF_HOME with
    byte and percent progress, then completions come from it; a second start, with the hub gone,
    serves the same model from the Hugging Face cache."""
    hf_home = tmp_path / "hf"
    env = server_env(hf_home, EMBER_DEFAULT_MODEL=HUB_ID)
    # ~3 s for the 270 MB: long enough that the editor sees several progress reports.
    with LocalHub({HUB_ID: Path(resolve_bundled().path)}, seconds_per_mib=0.01) as hub:
        env["HF_ENDPOINT"] = hub.url
        client = await start(env, tmp_path / "first.log")
        try:
            current = await wait_ready(client)
            assert current["engine"]["model"] == HUB_ID
            # The load: one progress naming each stage, from the download to ready, with the
            # percentage where each stage begins.
            reports = load_reports(client)
            stages = [r.message for r in reports[1:-1]]
            starting = f"loading {HUB_ID}: starting the engine (weights, KV cache, warm-up)"
            assert f"downloading {HUB_ID}" in stages and stages[-2:] == [f"loading {HUB_ID}: importing vLLM", starting], stages
            percents = [r.percentage for r in reports[:-1]]
            assert None not in percents and percents == sorted(percents) and percents[-1] == 65, percents
            assert isinstance(reports[-1], types.WorkDoneProgressEnd) and "ready" in reports[-1].message
            # The download: a progress of its own with megabytes and a percentage.
            (download,) = progress(client, "ember-download")
            assert isinstance(download[0], types.WorkDoneProgressBegin) and download[0].percentage is not None
            assert isinstance(download[-1], types.WorkDoneProgressEnd)
            steps = download[:-1]
            assert len(steps) >= 3, download
            megabytes = [re.fullmatch(rf"downloading {HUB_ID}: ([\d.]+) of ([\d.]+) MB", r.message or "") for r in steps]
            assert all(megabytes), steps
            done, total = [float(m.group(1)) for m in megabytes], {float(m.group(2)) for m in megabytes}
            assert done == sorted(done) and len(total) == 1 and total.pop() > 100, steps
            percents = [r.percentage for r in steps]
            assert None not in percents and percents == sorted(percents) and percents[0] < 100 and percents[-1] > 0, percents
            await completes(client)
            assert fallback_messages(client) == []
        finally:
            await stop(client)
        fetched = [r for r in hub.requests if r.startswith("GET ") and "/resolve/" in r]
        assert any(r.endswith("/model.safetensors") for r in fetched), hub.requests
    snapshots = list((hf_home / "hub" / "models--ember-test--SmolLM2-135M" / "snapshots").glob("*/model.safetensors"))
    assert len(snapshots) == 1 and snapshots[0].stat().st_size > 100_000_000
    assert f"model {HUB_ID} (hub: " in (tmp_path / "first.log").read_text()

    # The hub is gone (its port refuses connections): the cache alone gives the model, and the engine
    # loads the same snapshot the first start served completions from (so waiting for it again proves
    # nothing new).
    client = await start(env, tmp_path / "second.log")
    try:
        await loading(client, HUB_ID)
        assert not any("downloading" in (getattr(r, "message", None) or "") for r in load_reports(client))
        assert progress(client, "ember-download") == []
    finally:
        await stop(client)
    second = (tmp_path / "second.log").read_text()
    assert "found in the Hugging Face cache" in second
    resolved = next(line for line in second.splitlines() if f"model {HUB_ID} (hub: " in line)
    assert str(snapshots[0].parent) in resolved, resolved  # the snapshot the first start served from


@pytest.mark.slow
async def test_no_hub_falls_back_to_the_bundled_model_at_once(tmp_path: Path) -> None:
    """The real default (Qwen2.5-Coder) with an empty cache and a hub that refuses connections: the
    bundled model serves completions within the stated timeout, and the editor is told once, with
    what to do."""
    env = server_env(tmp_path / "hf", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    log_file = tmp_path / "ember.log"
    client = await start(env, log_file)
    try:
        current = await wait_ready(client)
        assert current["engine"]["model"] == BUNDLED_NAME
        assert fallback_seconds(log_file.read_text()) < HUB_TIMEOUT_S
        await completes(client)
        await completes(client)
        messages = fallback_messages(client)
        assert len(messages) == 1, [m.message for m in client.messages]
        assert "Qwen/Qwen2.5-Coder-" in messages[0] and "--model" in messages[0] and ".gguf" in messages[0]
        assert "could not reach" in messages[0]
    finally:
        await stop(client)


@pytest.mark.slow
async def test_hf_hub_offline_falls_back_to_the_bundled_model_at_once(tmp_path: Path) -> None:
    """HF_HUB_OFFLINE=1 with an empty cache: ember does not wait for a hub and loads the bundled
    model, saying why. From there on the path is the one above (the same resolved model, the same
    message built from the reason), which proves the completions and the one message."""
    env = server_env(tmp_path / "hf", HF_HUB_OFFLINE="1", HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    log_file = tmp_path / "ember.log"
    client = await start(env, log_file)
    try:
        await loading(client, BUNDLED_NAME)
    finally:
        await stop(client)
    log = log_file.read_text()
    assert fallback_seconds(log) < HUB_TIMEOUT_S
    gave_up = next(line for line in log.splitlines() if "gave up on the hub" in line)
    assert "HF_HUB_OFFLINE" in gave_up and f"using the bundled {BUNDLED_NAME}" in gave_up, gave_up


async def test_a_typo_in_a_hub_id_is_a_clear_error_and_the_server_keeps_answering(tmp_path: Path) -> None:
    """A named model always wins: no fallback, an error naming the id, answers still come."""
    typo = "ember-test/SmolLM2-135N"
    with LocalHub({HUB_ID: Path(resolve_bundled().path)}) as hub:
        client = await start(server_env(tmp_path / "hf", HF_ENDPOINT=hub.url), tmp_path / "ember.log", "--model", typo)
        try:
            deadline = time.monotonic() + 60
            while not (await stats(client))["engine"]["error"]:
                assert time.monotonic() < deadline, "no engine error"
                await asyncio.sleep(0.2)
            engine = (await stats(client))["engine"]
            assert not engine["ready"] and engine["model"] is None
            assert repr(typo) in engine["error"] and "not found" in engine["error"]
            for _ in range(50):
                if client.messages:
                    break
                await asyncio.sleep(0.1)
            assert any(repr(typo) in m.message and "not found" in m.message for m in client.messages), client.messages
            assert fallback_messages(client) == []
            open_doc(client, URI, TEXT)
            assert await inline(client, URI, TEXT.count("\n"), 4) == []
            assert "engine" in await stats(client)
        finally:
            await stop(client)
        assert any(f"/api/models/{typo}" in r for r in hub.requests), hub.requests


def test_a_hub_that_never_answers_costs_only_the_stated_timeout(tmp_path: Path) -> None:
    """A firewall that swallows packets, played by a loopback socket that accepts connections and
    never answers: resolution falls back to the bundled model after HUB_TIMEOUT_S, not the minutes
    a download client could wait (resolution only, in a child process: no engine starts)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        env = server_env(tmp_path / "hf", HF_ENDPOINT=f"http://127.0.0.1:{silent.getsockname()[1]}")
        code = (
            "import json, logging; logging.basicConfig(); from engine.models import resolve_model; m = resolve_model(None); "
            "print(json.dumps({'name': m.name, 'reason': m.fallback_reason}))"
        )
        root = Path(__file__).parent.parent
        done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["name"] == BUNDLED_NAME
    assert f"did not answer within {HUB_TIMEOUT_S:g} s" in result["reason"]
    assert HUB_TIMEOUT_S - 0.5 < fallback_seconds(done.stderr) < HUB_TIMEOUT_S + 1.0


def test_measured_decode_speeds_are_kept_per_model_and_cores_and_feed_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the llama.cpp engine measured on this machine chooses the next start's default: a
    measured 0.5B that decodes fast enough makes the 1.5B (scaled from it) fit on 2 cores, a slow
    one keeps the 0.5B on 8; another core count, or a corrupt file, says nothing."""
    from engine.models import CPU_MODELS, default_gguf_model
    from engine.speeds import DecodeMeter, measured_decode, record_decode, speeds_path

    small, large = (m.hub_id for m in CPU_MODELS)
    meter = DecodeMeter()
    meter.add(4, 0.1)  # too few tokens to say anything
    assert meter.median() is None and meter.completions == 0
    for seconds in (0.5, 0.6, 0.7):
        meter.add(31, seconds)
    assert meter.median() == pytest.approx(50.0) and meter.completions == 3
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EMBER_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr("engine.llamacpp.usable_cores", lambda: 2)
    assert default_gguf_model().hub_id == small and "estimated" in default_gguf_model().reason
    record_decode(small, 100.0, 2, 20)
    record_decode(small, 1.0, 4, 20)
    assert measured_decode(2) == {small: 100.0} and measured_decode(3) == {}
    fast = default_gguf_model()
    assert fast.hub_id == large, fast.reason
    assert "measured 100.0 tokens/s" in fast.reason and "scaled from" in fast.reason
    monkeypatch.setattr("engine.llamacpp.usable_cores", lambda: 8)
    assert default_gguf_model().hub_id == large  # nothing measured on 8 cores: the estimate
    record_decode(small, 20.0, 8, 20)
    assert default_gguf_model().hub_id == small
    speeds_path().write_text("{not json")
    assert measured_decode(8) == {} and default_gguf_model().hub_id == large


TOKENIZER_TEXTS = (
    "def add(a, b):\n    return a + b\n",
    "<|fim_prefix|>class A:\n    def f(self):<|fim_suffix|>\n\t\treturn 1<|fim_middle|>  x<|endoftext|>",
    "  héllo 日本語 🙂 123456789 don't 'LL \r\n\r\n   \u00a0x\t",
    "<|im_start|>user\n<file_sep>print(1)<|im_end|>",
)


def test_a_gguf_tokenizer_is_built_without_transformers_and_gives_its_token_ids() -> None:
    """The bundled GGUF's byte-level BPE tokenizer, built from the file's metadata with the
    tokenizers library alone, has the vocabulary and gives the token ids of transformers' GGUF
    loader (what ember used before; prompt budgets count these ids), special tokens whole."""
    import tokenizers
    from transformers import AutoTokenizer

    from engine.gguf import TOKENIZER_KEYS, bpe_tokenizer_json, read_metadata
    from engine.models import bundled_gguf

    gguf = bundled_gguf()
    metadata = read_metadata(gguf, TOKENIZER_KEYS)
    assert metadata["tokenizer.ggml.model"] == "gpt2" and metadata["general.architecture"] == "llama"
    mine = tokenizers.Tokenizer.from_str(json.dumps(bpe_tokenizer_json(metadata)))
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).backend_tokenizer
    assert mine.get_vocab() == theirs.get_vocab()
    source = "".join(p.read_text() for p in sorted(Path(__file__).parents[1].glob("context/**/*.py")))
    for text in (*TOKENIZER_TEXTS, source):
        assert mine.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False).ids
    assert mine.encode("<|endoftext|>", add_special_tokens=False).ids == [0]


def test_the_llama_cpp_tokenizer_loads_with_torch_and_transformers_out_of_reach(tmp_path: Path) -> None:
    """The light install's path: a GGUF ember has not seen, its tokenizer read into an empty
    cache in a process where importing transformers, torch or vllm fails."""
    script = (
        "import sys, time\n"
        "for name in ('transformers', 'torch', 'vllm'): sys.modules[name] = None\n"
        "from pathlib import Path\n"
        "from engine.gguf import gguf_tokenizer\n"
        "from engine.models import bundled_gguf\n"
        "started = time.perf_counter()\n"
        f"tokenizer = gguf_tokenizer(bundled_gguf(), Path({str(tmp_path)!r}))\n"
        "print(tokenizer.encode('def add(a, b):'), round(time.perf_counter() - started, 2))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    ids, seconds = done.stdout.rsplit(" ", 1)
    assert ids == str([1604, 803, 24, 81, 28, 278, 727]), ids
    assert list((tmp_path / "tokenizers").glob("*.json")) and float(seconds) < 10
