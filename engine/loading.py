"""Where loading a model stands and what it resolved to: the types every model source shares
(:mod:`engine.models`, :mod:`engine.hub`, :mod:`engine.gguf`), and ember's cache folder."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path


class ModelResolutionError(RuntimeError):
    """The named model cannot be found or converted; the message says what to do."""


class HubUnreachable(ModelResolutionError):
    """The hub did not answer (offline, firewall, HF_HUB_OFFLINE) and the model is not cached."""


@dataclass(frozen=True)
class ResolvedModel:
    """``path`` is what vLLM (or a tokenizer) loads: a local folder or an HF id."""

    path: str
    name: str
    source: str  # "bundled" | "gguf" | "folder" | "hub"
    # Set when the default code model could not be fetched and the bundled model stands in.
    fallback_reason: str | None = None
    chosen_because: str | None = None  # the default rule's reason, when no model was named


# Where each stage of a cold start begins, as a share of it (bench/cold_start.py, bundled model,
# 2 cores: resolving ~3 s, importing vLLM ~12 s, starting the engine ~7 s, of ~25 s to ready).
STAGE_PERCENT = {"resolving": 0, "downloading": 5, "preparing": 10, "loading": 15, "importing": 15, "starting": 65}


STAGE_WORDS = {"importing": "importing vLLM", "starting": "starting the engine (weights, KV cache, warm-up)"}


@dataclass(frozen=True)
class LoadState:
    """Where getting the model ready stands, for the editor's progress bar."""

    # "resolving" | "downloading" | "preparing" (GGUF conversion, once) | "loading" (resolved; for a
    # remote engine, connecting) | "importing" (vLLM, embedded) | "starting" (the engine core)
    stage: str
    model: str
    done_bytes: int = 0
    total_bytes: int = 0
    # Set when the default code model could not be fetched and the bundled model stands in.
    fallback_reason: str | None = None
    chosen_because: str | None = None  # why the default rule chose this model (ResolvedModel's)

    def percent(self) -> int | None:
        if self.stage != "downloading" or self.total_bytes <= 0:
            return None
        return min(100, int(100 * self.done_bytes / self.total_bytes))

    def overall_percent(self) -> int:
        """How far the whole start is, by the stage it is in (downloads have their own bar)."""
        return STAGE_PERCENT.get(self.stage, 0)

    def describe(self) -> str:
        """The progress message; the percentage travels beside it (editors print both)."""
        if self.stage == "downloading":
            return f"downloading {self.model}: {self.done_bytes / 1e6:.1f} of {self.total_bytes / 1e6:.1f} MB"
        if self.stage in STAGE_WORDS:
            return f"loading {self.model}: {STAGE_WORDS[self.stage]}"
        return f"{self.stage} {self.model}"


class LoadProgress:
    """The channel from the worker thread that resolves, downloads and loads the model to the event
    loop that reports progress: the worker writes, the loop reads a consistent snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = LoadState("resolving", "the model")

    def set(self, stage: str, model: str, done_bytes: int = 0, total_bytes: int = 0) -> None:
        with self._lock:
            self._state = replace(self._state, stage=stage, model=model, done_bytes=done_bytes, total_bytes=total_bytes)

    def set_bytes(self, done_bytes: int) -> None:
        with self._lock:
            self._state = replace(self._state, done_bytes=done_bytes)

    def set_fallback(self, reason: str) -> None:
        with self._lock:
            self._state = replace(self._state, fallback_reason=reason)

    def set_chosen_because(self, reason: str) -> None:
        with self._lock:
            self._state = replace(self._state, chosen_because=reason)

    def current(self) -> LoadState:
        with self._lock:
            return self._state


def default_cache_dir() -> Path:
    base = os.environ.get("EMBER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember"
    )
    return Path(base)
