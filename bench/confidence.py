"""Which confidence threshold hides wrong answers and keeps right ones? From a quality run that
showed every answer: the precision / coverage curve per dev set and the logistic fit that ember's
``CALIBRATIONS`` holds.

    .venv/bin/python bench/quality.py --model qwen-coder --limit 400 --concurrency 8 --min-confidence 0 \\
        --out bench/results/quality-confidence-qwen-coder.json
    .venv/bin/python bench/confidence.py bench/results/quality-confidence-qwen-coder.json

Each record carries what ember's gate computed the confidence from (``ember/stats``: the kept
text's token count, lowest and mean log-probability). The cases are split in two by a hash of
their id: the fit half fits P(exact) = sigmoid(b + w1 min + w2 mean + w3 ln(1 + tokens)) and
chooses the default threshold (the highest one that keeps at least ``--keep`` of every set's exact
answers); the held-out half reports the curve with those numbers, per set: the share of cursors
shown, exact match among the shown ones, the share of all exact answers kept, and the ratio of
exact-among-shown to showing everything. Degenerate repetitions among the shown answers are
counted too (ember never shows them). Last, the ceiling of the signal per set: the best ratio any
threshold reaches while keeping ``--keep`` of the exact answers, chosen with hindsight on all of
the set's cursors, for the lowest log-probability alone, the fit, and a fit of the set's own.
What ships is the last table: the fit on every answered cursor, the highest threshold keeping
``--keep`` of every set's exact answers, its precision per set and over all sets against showing
everything (the split above says how far that carries to other cases). Prints the tables and the
``Calibration(...)`` line, and
writes bench/results/confidence-<model>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
import numpy as np

from bench.harness import ROOT, fmt
from context.cut.confidence import Calibration, degenerate

THRESHOLDS = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8]


def held_out(record: dict[str, Any]) -> bool:
    """Half of the cases, by a hash of their id (the same on every run)."""
    return hashlib.blake2b(f"{record['source']}:{record['id']}".encode(), digest_size=2).digest()[0] % 2 == 1


def features(record: dict[str, Any]) -> list[float]:
    return [1.0, record["logprob_min"], record["logprob_mean"], math.log1p(record["kept_tokens"])]


def fit(
    records: list[dict[str, Any]], ridge: float = 1e-3, rounds: int = 50, features: Any = features
) -> list[float]:
    """Logistic regression by Newton's method (a little ridge for stability) on ``features(record)``
    (a leading 1.0 for the bias; by default the gate's own features)."""
    x = np.array([features(r) for r in records])
    y = np.array([1.0 if r["exact"] else 0.0 for r in records])
    w = np.zeros(x.shape[1])
    for _ in range(rounds):
        p = 1 / (1 + np.exp(-np.clip(x @ w, -60, 60)))
        gradient = x.T @ (p - y) + ridge * w
        hessian = x.T @ (x * (p * (1 - p))[:, None]) + ridge * np.eye(x.shape[1])
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return [float(v) for v in w]


def calibration(weights: list[float], threshold: float) -> Calibration:
    bias, min_weight, mean_weight, length_weight = weights
    return Calibration(bias, min_weight, mean_weight, length_weight, threshold)


def confidence_of(record: dict[str, Any], model: Calibration) -> float:
    """The gate's confidence for a recorded answer (ember's own formula)."""
    return model.probability_of(record["logprob_min"], record["logprob_mean"], record["kept_tokens"])


def point(records: list[dict[str, Any]], model: Calibration, threshold: float) -> dict[str, Any]:
    """One threshold on one set: shown share, exact among shown, share of exact kept."""
    answered = [r for r in records if r["completion"].strip()]
    shown = [r for r in answered if r["logprob_min"] is not None and confidence_of(r, model) >= threshold]
    exact_all = sum(r["exact"] for r in records)
    exact_shown = sum(r["exact"] for r in shown)
    everything = sum(r["exact"] for r in answered) / len(answered) if answered else 0.0
    precision = exact_shown / len(shown) if shown else None
    return {
        "threshold": threshold,
        "cursors": len(records),
        "shown": len(shown) / len(records) if records else None,
        "exact_among_shown": precision,
        "exact_kept": exact_shown / exact_all if exact_all else None,
        "x_all_shown": precision / everything if precision is not None and everything else None,
        "degenerate_shown": sum(degenerate(r["completion"]) for r in shown),
    }


def choose_threshold(by_set: dict[str, list[dict[str, Any]]], model: Calibration, keep: float) -> float:
    """The highest threshold that keeps at least ``keep`` of every set's exact answers."""
    best = 0.0
    for threshold in [t / 100 for t in range(96)]:
        kept = [point(rows, model, threshold)["exact_kept"] for rows in by_set.values()]
        if all(k is None or k >= keep for k in kept):
            best = threshold
    return best


def in_sample_ceiling(rows: list[dict[str, Any]], score: Any, keep: float) -> tuple[float, float]:
    """The best ratio of exact-among-shown to showing everything that any threshold on ``score``
    reaches on ``rows`` while keeping ``keep`` of their exact answers, chosen with hindsight on the
    same rows (an upper bound for this signal, not a result), and the share kept there."""
    answered = [r for r in rows if r["completion"].strip() and r["logprob_min"] is not None]
    exact_all = sum(r["exact"] for r in rows)
    if not answered or not exact_all:
        return 1.0, 1.0
    everything = sum(r["exact"] for r in answered) / len(answered)
    best = (1.0, 1.0)
    for threshold in sorted({score(r) for r in answered}):
        shown = [r for r in answered if score(r) >= threshold]
        kept = sum(r["exact"] for r in shown) / exact_all
        ratio = sum(r["exact"] for r in shown) / len(shown) / everything
        if kept >= keep and ratio > best[0]:
            best = (ratio, kept)
    return best


def ship(
    records: list[dict[str, Any]], judged: list[dict[str, Any]], keep: float
) -> tuple[list[float], float, dict[str, dict[str, Any]]]:
    """What ember ships: the fit on every answered cursor and the highest threshold that keeps
    ``keep`` of every set's exact answers, with its point per set and over the sets together."""
    weights = fit(judged)
    threshold = choose_threshold(by_source(records), calibration(weights, 0.0), keep)
    model = calibration(weights, threshold)
    points = {name: point(rows, model, threshold) for name, rows in by_source(records).items()}
    points["all sets"] = point(records, model, threshold)
    print(f"\nshipped: fit on all {len(judged)} answered cursors, threshold {threshold:.2f} (all {len(records)} cursors)")
    print("| set | cursors | shown | exact among shown | exact among all answered | x all shown | exact kept |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, p in points.items():
        everything = p["exact_among_shown"] / p["x_all_shown"] if p["exact_among_shown"] and p["x_all_shown"] else None
        print(
            f"| {name} | {p['cursors']} | {fmt(p['shown'], '.3f')} | {fmt(p['exact_among_shown'], '.3f')} "
            f"| {fmt(everything, '.3f')} | {fmt(p['x_all_shown'], '.3f')} | {fmt(p['exact_kept'], '.3f')} |"
        )
    return weights, threshold, points


def by_source(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        found[r["source"]].append(r)
    return dict(sorted(found.items()))


def print_curve(name: str, rows: list[dict[str, Any]], model: Calibration, chosen: float) -> list[dict[str, Any]]:
    curve = [point(rows, model, t) for t in sorted({*THRESHOLDS, chosen})]
    print(f"\n{name} ({len(rows)} held-out cursors)")
    print("| threshold | shown | exact among shown | exact kept | x all shown | degenerate shown |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in curve:
        mark = " (default)" if p["threshold"] == chosen else ""
        print(
            f"| {p['threshold']:.2f}{mark} | {fmt(p['shown'], '.3f')} | {fmt(p['exact_among_shown'], '.3f')} "
            f"| {fmt(p['exact_kept'], '.3f')} | {fmt(p['x_all_shown'], '.3f')} | {p['degenerate_shown']} |"
        )
    return curve


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="bench/quality.py results with minConfidence 0")
    parser.add_argument("--keep", type=float, default=0.9, help="share of each set's exact answers the default must keep")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    records: list[dict[str, Any]] = []
    models = set()
    for path in args.results:
        data = json.loads(path.read_text())
        models.add(data.get("model"))
        records += [r for r in data["records"] if r.get("strategy", "ast") == "ast"]
    judged = [r for r in records if r.get("logprob_min") is not None]
    if not judged:
        raise SystemExit("no record carries logprob_min: run bench/quality.py with this ember (ember/stats confidence)")
    fit_half = [r for r in judged if not held_out(r)]
    weights = fit(fit_half)
    model = calibration(weights, 0.0)
    fit_sets = by_source([r for r in records if not held_out(r)])
    chosen = choose_threshold(fit_sets, model, args.keep)
    model = calibration(weights, chosen)
    print(f"{len(records)} cursors ({len(judged)} answered with log-probabilities), model {sorted(map(str, models))}")
    print(
        f"fit on {len(fit_half)}: bias {weights[0]:.3f}, min {weights[1]:.3f}, mean {weights[2]:.3f}, "
        f"ln(1+tokens) {weights[3]:.3f}"
    )
    print(f"default threshold {chosen:.2f}: the highest keeping >= {args.keep:.0%} of every set's exact answers")
    held = by_source([r for r in records if held_out(r)])
    curves = {name: print_curve(name, rows, model, chosen) for name, rows in held.items()}
    # The same with the halves' roles swapped: how much the fit and the threshold depend on the split.
    swapped_weights = fit([r for r in judged if held_out(r)])
    other_sets = by_source([r for r in records if held_out(r)])
    swapped_threshold = choose_threshold(other_sets, calibration(swapped_weights, 0.0), args.keep)
    swapped = calibration(swapped_weights, swapped_threshold)
    print(f"\nhalves swapped: threshold {swapped_threshold:.2f}; on the other half, exact kept / x all shown / shown:")
    swapped_points = {}
    for name, rows in fit_sets.items():
        p = swapped_points[name] = point(rows, swapped, swapped_threshold)
        print(f"  {name}: {fmt(p['exact_kept'], '.3f')} / {fmt(p['x_all_shown'], '.3f')} / {fmt(p['shown'], '.3f')}")
    print(f"\nceiling: the best threshold per set with hindsight, all {len(judged)} answered cursors (x all shown / exact kept):")
    ceilings = {}
    for name, rows in by_source(records).items():
        own = calibration(fit([r for r in rows if r["logprob_min"] is not None]), 0.0)
        signals = {
            "min": lambda r: r["logprob_min"],
            "fit": lambda r: confidence_of(r, model),
            "own fit": lambda r, own=own: confidence_of(r, own),
        }
        ceilings[name] = {label: in_sample_ceiling(rows, score, args.keep) for label, score in signals.items()}
        print(f"  {name}: " + ", ".join(f"{label} {r:.2f} / {k:.2f}" for label, (r, k) in ceilings[name].items()))
    shipped_weights, shipped_threshold, shipped = ship(records, judged, args.keep)
    print(
        f"\nCalibration(bias={shipped_weights[0]:.4f}, min_weight={shipped_weights[1]:.4f}, "
        f"mean_weight={shipped_weights[2]:.4f}, length_weight={shipped_weights[3]:.4f}, min_confidence={shipped_threshold:.2f})"
    )
    out = args.out or ROOT / "bench" / "results" / f"confidence-{'-'.join(sorted(map(str, models)))}.json"
    out.write_text(
        json.dumps(
            {
                "command": " ".join(["python", *sys.argv]),
                "results": [str(p) for p in args.results],
                "weights": dict(zip(["bias", "min", "mean", "ln1p_tokens"], weights, strict=True)),
                "threshold": chosen,
                "keep": args.keep,
                "held_out_curves": curves,
                "swapped": {"weights": swapped_weights, "threshold": swapped_threshold, "points": swapped_points},
                "in_sample_ceiling": ceilings,
                "shipped": {"weights": shipped_weights, "threshold": shipped_threshold, "points": shipped},
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
