"""Per-request metrics with the names of DESIGN.md, and their aggregates for ``ember/stats``."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass


@dataclass
class RequestMetrics:
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    engine_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_reuse: float | None = None
    cache_hit: bool = False
    streamed_tokens: int = 0
    mode: str = ""
    outcome: str = "ok"  # ok | empty | cancelled | superseded | error | loading

    def finish(self, started: float) -> RequestMetrics:
        self.latency_ms = (time.perf_counter() - started) * 1000
        if self.prompt_tokens:
            self.kv_reuse = self.cached_tokens / self.prompt_tokens
        return self

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


class Metrics:
    """A bounded window of recent requests: enough for p50/p95 without growing forever."""

    def __init__(self, window: int = 2000) -> None:
        self.recent: deque[RequestMetrics] = deque(maxlen=window)
        self.total = 0
        self.outcomes: dict[str, int] = {}

    def record(self, metrics: RequestMetrics) -> None:
        self.recent.append(metrics)
        self.total += 1
        self.outcomes[metrics.outcome] = self.outcomes.get(metrics.outcome, 0) + 1

    @property
    def last(self) -> RequestMetrics | None:
        return self.recent[-1] if self.recent else None

    def summary(self) -> dict[str, object]:
        served = [m for m in self.recent if m.outcome == "ok"]

        def dist(values: list[float]) -> dict[str, float | None]:
            return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95), "n": len(values)}

        return {
            "requests": self.total,
            "outcomes": dict(self.outcomes),
            "latency_ms": dist([m.latency_ms for m in served]),
            "ttft_ms": dist([m.ttft_ms for m in served if m.ttft_ms is not None]),
            "kv_reuse": dist([m.kv_reuse for m in served if m.kv_reuse is not None]),
            "cache_hit_rate": (sum(m.cache_hit for m in served) / len(served)) if served else None,
            "streamed_tokens": dist([float(m.streamed_tokens) for m in served]),
            "last": self.last.as_dict() if self.last else None,
        }
