"""vLLM engine arguments (``--engine-arg``) reach the embedded engine, prompt budgets follow the
engine's max_model_len, and the choice of ember's own engine defaults (GPU, CPU, long-lived).

One real engine for the module: ``ember --stdio --engine-arg max_model_len=4096`` on the bundled
model. The arguments vLLM refuses are in tests/test_engine_args_rejected.py (its own engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lsprotocol import types
from pygls.lsp.client import LanguageClient

from context.prompt.builder import PromptBudget
from engine.embedded import EmbeddedConfig, _cpu_defaults, cpu_dtype, ember_engine_args, engine_args_problem
from lsp.config import (
    ConfigError,
    Settings,
    merge_settings,
    parse_engine_arg,
    vllm_flags,
)
from lsp.engine_host import EmberCore
from tests.conftest import client_capabilities, stats, wait_ready
from tests.test_server import inline, open_doc

ROOT = Path(__file__).resolve().parent.parent
URI = "file:///work/long_module.py"


# -- settings and budgets (no engine) -------------------------------------------------------------


def test_engine_args_parse_as_json_or_strings_and_merge_key_by_key() -> None:
    assert parse_engine_arg("max_model_len=4096") == ("max_model_len", 4096)
    assert parse_engine_arg("enforce_eager=true") == ("enforce_eager", True)
    assert parse_engine_arg("kv_cache_dtype=fp8") == ("kv_cache_dtype", "fp8")
    assert parse_engine_arg('speculative_config={"method": "ngram", "num_speculative_tokens": 4}') == (
        "speculative_config",
        {"method": "ngram", "num_speculative_tokens": 4},
    )
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_engine_arg("max_model_len")

    cli = merge_settings(Settings(), {"engineArgs": [("max-model-len", 4096), ("enforce_eager", True)]})
    editor = merge_settings(cli, {"engineArgs": {"enforce_eager": False, "kv_cache_dtype": "fp8"}})
    assert editor.engine_arg_dict() == {"max_model_len": 4096, "enforce_eager": False, "kv_cache_dtype": "fp8"}
    assert hash(editor) != hash(cli)  # Settings stays a hashable value
    with pytest.raises(ConfigError, match="model is ember's to set"):
        merge_settings(Settings(), {"engineArgs": {"model": "other"}})
    with pytest.raises(ConfigError, match="must be an object"):
        merge_settings(Settings(), {"engineArgs": "max_model_len=4096"})
    assert vllm_flags({"max_model_len": 4096, "enforce_eager": True, "speculative_config": {"method": "ngram"}}) == (
        "--max-model-len 4096 --enforce-eager --speculative-config '{\"method\": \"ngram\"}'"
    )


def test_budgets_are_shares_of_max_model_len_and_explicit_settings_win() -> None:
    # At 2048 tokens: exactly the budgets ember had before they followed the model (and before
    # context from the workspace, which takes only the room the other parts leave free).
    tabs = Settings(cross_file="open")
    assert tabs.budget_for(2048) == PromptBudget(prefix_tokens=1024, suffix_tokens=256, header_tokens=128, snippet_tokens=256)
    assert dataclasses.replace(tabs, max_tokens=24).budget_for(2048) == PromptBudget()
    assert Settings().budget_for(2048) == PromptBudget(prefix_tokens=1024, suffix_tokens=256, header_tokens=128, snippet_tokens=512)
    assert Settings().budget_for(1024) == PromptBudget(512, 128, 64, 224)  # a quarter does not fit: what is free
    assert Settings(max_tokens=600).budget_for(2048).prefix_tokens == dataclasses.replace(tabs, max_tokens=600).budget_for(2048).prefix_tokens
    long = tabs.budget_for(32768)
    assert (long.prefix_tokens, long.suffix_tokens, long.snippet_tokens) == (16384, 4096, 4096)
    chosen = Settings(context_tokens=300, suffix_tokens=40).budget_for(32768)
    assert (chosen.prefix_tokens, chosen.suffix_tokens) == (300, 40)
    # Whatever the shares and settings, the prompt and the generated tokens fit the context.
    for max_model_len, settings in [(2048, Settings(max_tokens=1500)), (512, Settings()), (2048, Settings(context_tokens=4000)),
                                    (512, tabs), (2048, Settings(max_tokens=90))]:
        budget = settings.budget_for(max_model_len)
        parts = budget.prefix_tokens + budget.suffix_tokens + budget.header_tokens + budget.snippet_tokens
        assert parts + settings.max_tokens <= max_model_len, (max_model_len, settings, budget)


def test_engine_defaults_gpu_cpu_and_long_lived() -> None:
    config = EmbeddedConfig(model_path="/m", model_name="m")
    gpu = ember_engine_args(config, on_cpu=False)
    assert gpu["enforce_eager"] is False and gpu["block_size"] == 16 and gpu["enable_prefix_caching"] is True
    assert gpu["gpu_memory_utilization"] == 0.5
    stdio = ember_engine_args(config, on_cpu=True)
    assert stdio["enforce_eager"] is True and stdio["block_size"] == 32
    # The CPU's KV cache is an engine argument (half a GiB, fractions allowed); a GPU's is a share of its memory.
    assert stdio["kv_cache_memory_bytes"] == 2**29 and "kv_cache_memory_bytes" not in gpu
    bigger = ember_engine_args(EmbeddedConfig(model_path="/m", model_name="m", kv_cache_gib=1.5), on_cpu=True)
    assert bigger["kv_cache_memory_bytes"] == 3 * 2**29
    daemon = ember_engine_args(EmbeddedConfig(model_path="/m", model_name="m", long_lived=True), on_cpu=True)
    assert daemon["enforce_eager"] is False  # compiled where the engine lives long
    assert gpu["dtype"] == "bfloat16" and stdio["dtype"] == cpu_dtype()
    assert ember_engine_args(EmbeddedConfig(model_path="/m", model_name="m", dtype="float16"), on_cpu=True)["dtype"] == "float16"


def test_cpu_dtype_follows_the_cpus_bf16_arithmetic() -> None:
    """float32 where bf16 would be emulated (AVX2 only), bfloat16 where the CPU has it."""
    avx2 = "processor\t: 0\nflags\t\t: fpu sse4_2 avx f16c avx2 fma\n"
    assert cpu_dtype(avx2) == "float32"
    assert cpu_dtype(avx2.replace("avx2", "avx2 avx512f avx512_bf16")) == "bfloat16"
    assert cpu_dtype(avx2.replace("avx2", "avx2 amx_bf16 amx_tile")) == "bfloat16"
    assert cpu_dtype("processor\t: 0\nFeatures\t: fp asimd sve bf16\n") == "bfloat16"  # Arm
    assert cpu_dtype("processor\t: 0\nFeatures\t: fp asimd\n") == "float32"
    assert cpu_dtype("") == "bfloat16"  # nothing to read: as before


def test_cpu_defaults_run_the_model_in_the_engine_core_unless_the_user_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    _cpu_defaults()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    _cpu_defaults()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_long_lived_core_builds_a_long_lived_engine_and_explicit_args_stay() -> None:
    from engine.loading import LoadProgress

    bundled = Settings(model="bundled", engine="vllm")
    settings = merge_settings(bundled, {"engineArgs": {"enforce_eager": True}})
    engine = EmberCore(settings, long_lived=True)._engine_factory(settings, LoadProgress())
    assert engine.config.long_lived is True  # type: ignore[attr-defined]
    assert engine.config.engine_args == {"enforce_eager": True}  # type: ignore[attr-defined]
    assert EmberCore(bundled)._engine_factory(bundled, LoadProgress()).config.long_lived is False  # type: ignore[attr-defined]


def test_engine_args_problem_reports_vllms_own_words() -> None:
    """Checked against vLLM's real config code (nothing is loaded or spawned)."""
    from engine.models import resolve_bundled

    base = ember_engine_args(EmbeddedConfig(model_path=resolve_bundled().path, model_name="m"), on_cpu=True)
    assert engine_args_problem({**base, "max_model_len": 4096}) is None
    unknown = engine_args_problem({**base, "max_model_lenght": 4096})
    assert unknown is not None and "'max_model_lenght'" in unknown and "max_model_len" in unknown
    too_long = engine_args_problem({**base, "max_model_len": 999999})
    assert too_long is not None and "999999" in too_long and "max_model_len" in too_long
    wrong_type = engine_args_problem({**base, "enforce_eager": "maybe"})
    assert wrong_type is not None and "enforce_eager" in wrong_type and "boolean" in wrong_type


def test_cli_refuses_engine_args_with_an_engine_url() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lsp", "--engine-url", "http://127.0.0.1:9/v1", "--engine-arg", "max_model_len=4096"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--engine-arg is for the embedded engine" in done.stderr and "--max-model-len 4096" in done.stderr


# -- a real engine started with max_model_len=4096 -------------------------------------------------


@pytest.fixture(scope="module")
async def long_context():
    client = LanguageClient("engine-args-test", "1")
    messages: list[str] = []
    client.feature(types.WINDOW_SHOW_MESSAGE)(lambda params: messages.append(params.message))
    await client.start_io(
        sys.executable, "-m", "lsp", "--stdio", "--daemon", "off", "--max-tokens", "8", "--engine-arg", "max_model_len=4096"
    )
    await client.initialize_async(
        types.InitializeParams(
            capabilities=client_capabilities(),
            initialization_options={"reuse": False, "warmup": False, "crossFile": False},
        )
    )
    client.initialized(types.InitializedParams())
    client.messages = messages  # type: ignore[attr-defined]
    try:
        yield client
    finally:
        await client.shutdown_async(None)
        client.exit(None)
        await asyncio.wait_for(client.stop(), 30)


def long_module(functions: int = 160) -> str:
    """About 5,000 tokens of code: more than a 2048-token model's budget could take."""
    body = "".join(
        f"def helper_{i}(values: list[float], scale: float) -> float:\n"
        f"    total = sum(v * scale for v in values if v > {i})\n    return total - {i * 3}\n\n\n"
        for i in range(functions)
    )
    return "import math\n\n\n" + body + "def main() -> None:\n    "


@pytest.mark.slow
async def test_max_model_len_reaches_vllm_and_stats(long_context) -> None:
    current = await wait_ready(long_context)
    engine = current["engine"]
    assert engine["max_model_len"] == 4096  # read back from vLLM's model config
    assert engine["engine_args"]["max_model_len"] == 4096
    assert engine["engine_args"]["enforce_eager"] is True  # stdio: eager, start-up dominates
    assert engine["budget"]["context_tokens"] == 2048 and engine["budget"]["suffix_tokens"] == 512
    assert engine["warning"] is None and engine["long_lived"] is False
    assert not long_context.messages


async def test_prompt_budget_follows_max_model_len_and_explicit_settings_win(long_context) -> None:
    await wait_ready(long_context)
    text = long_module()
    open_doc(long_context, URI, text)
    line, character = text.count("\n"), 4
    await inline(long_context, URI, line, character)
    first = (await stats(long_context))["last"]
    assert first["outcome"] in ("ok", "empty"), first
    # The same document and cursor with a 2048-token model's budget (1024) give a 661-token prompt
    # (the anchor snaps to a function start), with max_model_len 4096 (budget 2048) 1361.
    assert first["prompt_tokens"] > 1000, first

    long_context.workspace_did_change_configuration(
        types.DidChangeConfigurationParams(settings={"ember": {"contextTokens": 400}})
    )
    await asyncio.sleep(0.2)
    assert (await stats(long_context))["engine"]["budget"]["context_tokens"] == 400
    await inline(long_context, URI, line, character)
    second = (await stats(long_context))["last"]
    assert second["prompt_tokens"] < 400, second


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU; the CPU counterpart is test_max_model_len_reaches_vllm_and_stats")
async def test_gpu_defaults_start_with_cuda_graphs_and_small_blocks() -> None:
    from engine.embedded import EmbeddedEngine
    from engine.models import resolve_bundled

    model = resolve_bundled()
    engine = EmbeddedEngine(EmbeddedConfig(model_path=model.path, model_name=model.name, engine_args={"max_model_len": 4096}))
    await engine.start()
    try:
        assert engine.warning is None
        assert engine.engine_args["enforce_eager"] is False and engine.engine_args["block_size"] == 16
        assert engine.engine_args["gpu_memory_utilization"] == 0.5 and engine.model.max_model_len == 4096
    finally:
        await engine.close()
