"""What ``ember/stats`` answers: the metrics' summary, the engine's state and this editor's prompt
budget, the process's memory, the daemon and the workspace index."""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from typing import Any

import psutil

from lsp.config import Settings
from lsp.engine_host import EmberCore
from lsp.session import EmberServer

STATS_METHOD = "ember/stats"


def stats_summary(ls: EmberServer, uri: str | None) -> dict[str, Any]:
    """Aggregated metrics (p50/p95), the last request's metrics, and the engine's state; with a
    ``uri`` also ``last_for_uri``, the latest request for that document."""
    core = ls.core
    summary = core.metrics.summary()
    if uri is not None:
        found = core.metrics.last_for(uri)
        summary["last_for_uri"] = found.as_dict() if found else None
    summary["engine"] = engine_state(ls)
    summary["process"] = {"pid": os.getpid(), **process_memory(core), **process_holdings()}
    summary["daemon"] = core.host_info() if core.host_info is not None else None
    summary["workspace"] = ls.folders.stats()
    return summary


def engine_state(ls: EmberServer) -> dict[str, Any]:
    """The engine part of ember/stats (a dead engine is restarted, as on every request)."""
    core = ls.core
    ready = core.check_engine()
    engine = core.engine if ready else None
    state: dict[str, Any] = {
        "ready": ready,
        "error": core.engine_error,
        "warning": core.engine_warning,
        "model": engine.model.name if engine is not None else None,
        "restarts": core.restarts,
        # Every engine's since the start, the replaced ones' included, under the same names.
        "counters": core.engine_counters(),
        "restarting": core.restarting,
        "starts": core.engine_starts,
        # What the prompt budgets of this editor's requests are shares of.
        "max_model_len": engine.model.max_model_len if engine is not None else None,
        "budget": budget_stats(ls.settings, engine.model.max_model_len) if engine is not None else None,
        "long_lived": core.long_lived,
        # The embedded engine that serves ("vllm" | "llamacpp") and why; None for a remote server.
        "kind": core.engine_choice.kind if core.engine_choice else None,
        "why": core.engine_choice.reason if core.engine_choice else None,
        "model_why": model_why(core),
    }
    if engine is not None and engine.engine_args:  # a remote server runs with its own
        state["engine_args"] = engine.engine_args
    if core.engine is not None:
        state["stats"] = core.engine.engine_stats().as_dict()
    return state


def model_why(core: EmberCore) -> str | None:
    """Why this model serves: the user's, or the default rule's decision (llama.cpp; vLLM's default
    goes by GPU or CPU); None for a remote server, which serves its own."""
    choice, named = core.engine_choice, core.engine_settings.model
    if choice is None:
        return None
    if named:
        return "named by the user (--model / the model setting)"
    if choice.kind == "llamacpp":
        return core.load_progress.current().chosen_because or "the default rule has not chosen yet (the engine is starting)"
    return "vLLM's default for this hardware (engine.models.default_hub_model)"


def budget_stats(settings: Settings, max_model_len: int) -> dict[str, int]:
    budget = settings.budget_for(max_model_len)
    return {
        "context_tokens": budget.prefix_tokens,
        "suffix_tokens": budget.suffix_tokens,
        "header_tokens": budget.header_tokens,
        "cross_file_tokens": budget.snippet_tokens,
    }


def process_holdings() -> dict[str, int]:
    """What this process holds that a leak would grow: open descriptors (files, sockets, pipes),
    threads, and the asyncio tasks of the running loop."""
    process = psutil.Process()
    descriptors = process.num_fds() if hasattr(process, "num_fds") else process.num_handles()
    return {"descriptors": descriptors, "threads": process.num_threads(), "tasks": len(asyncio.all_tasks())}


def resident_mib() -> float:
    return round(psutil.Process().memory_info().rss / 2**20, 1)


def process_memory(core: EmberCore) -> dict[str, Any]:
    """Resident memory of this process; with ``EMBER_DEBUG_MEMORY=1`` (tracemalloc started at
    launch, slow) also the source lines whose allocations grew most since the first call."""
    memory: dict[str, Any] = {"rss_mib": resident_mib()}
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        if core.memory_baseline is None or not core.ready:
            core.memory_baseline = snapshot  # growth is counted from the first call once the engine is up
        top = snapshot.compare_to(core.memory_baseline, "lineno")[:15]
        memory["growth"] = [f"{stat.size_diff / 1024:+.0f} KiB {stat.count_diff:+d} {stat.traceback}" for stat in top]
    return memory
