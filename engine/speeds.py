"""Decode speeds seen on this machine, kept between starts: llama.cpp's default model is then
chosen by what this machine did (:func:`engine.models.choose_cpu_model`), not by an estimate
from its cores alone.

The llama.cpp engine measures every completion it streams (:class:`DecodeMeter`) and writes the
median to ``decode-speeds.json`` in ember's cache folder (after :data:`FIRST_SAVE` completions,
and again at close), under the model's name and the cores it ran on; a start on the same number
of cores reads it back (:func:`measured_decode`).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

from engine.loading import default_cache_dir

log = logging.getLogger(__name__)

SPEEDS_FILE = "decode-speeds.json"
# A completion with fewer tokens says more about its first token's wait than about decoding.
MIN_TOKENS = 8
KEPT = 50  # completions the median is taken over
# Completions after which a first measurement is written (not only at the engine's close, which a
# killed ember never reaches).
FIRST_SAVE = 10


class DecodeMeter:
    """Decode tokens/s of one engine's recent completions: tokens after the first over the time
    from the first to the last (the prompt's prefill is not in it)."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=KEPT)
        self.completions = 0  # measured, in all

    def add(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_TOKENS and seconds > 0:
            self._rates.append((tokens - 1) / seconds)
            self.completions += 1

    def median(self) -> float | None:
        return statistics.median(self._rates) if self._rates else None


def speeds_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / SPEEDS_FILE


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring the decode speeds in %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def record_decode(model: str, tokens_s: float, cores: int, completions: int, cache_dir: Path | None = None) -> None:
    """Keeps ``model``'s decode speed on ``cores`` cores (blocking: call it off the event loop)."""
    path = speeds_path(cache_dir)
    data = _read(path)
    data.setdefault("models", {}).setdefault(model, {})[str(cores)] = {
        "decode_tokens_s": round(tokens_s, 2), "completions": completions, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".speeds-", delete=False) as out:
            json.dump(data, out, indent=1)
        os.replace(out.name, path)  # a reader never sees half a file
    except OSError as exc:
        log.warning("could not keep the decode speed of %s in %s: %s", model, path, exc)


def measured_decode(cores: int, cache_dir: Path | None = None) -> dict[str, float]:
    """Decode tokens/s seen on ``cores`` cores, by model name (another core count says nothing)."""
    models = _read(speeds_path(cache_dir)).get("models")
    found: dict[str, float] = {}
    for name, by_cores in (models if isinstance(models, dict) else {}).items():
        entry = by_cores.get(str(cores)) if isinstance(by_cores, dict) else None
        rate = entry.get("decode_tokens_s") if isinstance(entry, dict) else None
        if isinstance(rate, int | float) and rate > 0:
            found[name] = float(rate)
    return found
