"""Issue 29's table for the whole cross-file dev set, merged from the slices it was measured in.

    python3 bench/studies/crossfile_table.py [--out bench/results/crossfile-dev-table.json]

The 496 cases of ../shared/eval/crossfile_dev.jsonl were run in stratified slices (cases 1-8 per
package, 9-12, 13-16, ...; bench/crossfile_batch.py, one embedded engine, greedy, Qwen2.5-Coder-0.5B),
each slice with ``off``, ``tab`` (the defining module open), ``oracle`` (only the cut name's own
definition) and ``workspace`` (ember's default cross-file block) side by side. The first slice
came from earlier runs, named in SOURCES: ``off`` and ``oracle`` from the server run in
crossfile-ceiling-qwen.json, ``tab`` from batch-a, ``workspace`` from batch-c's
``workspace:paths+near`` (the default since). Prints EM, edit similarity, cases gained and lost
against ``off``, prompt tokens (and latency p50 where a server run timed the cases: the batch runner
does not), per package and overall, and a ceiling: the cases that any of the three contexts got right,
chosen per case with hindsight; writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import bootstrap  # noqa: F401 - python bench/studies/X.py: the checkout on sys.path

from bench.harness import RESULTS

VARIANTS = ("off", "tab", "oracle", "workspace")
# (file, the name of the variant in it, the variant it stands for)
SOURCES: tuple[tuple[str, str, str], ...] = (
    ("crossfile-ceiling-qwen.json", "current", "off"),
    ("crossfile-ceiling-qwen.json", "oracle", "oracle"),
    ("crossfile-batch-a.json", "tab", "tab"),
    ("crossfile-batch-c.json", "workspace:paths+near", "workspace"),
)
SLICES = ("d", "e", "f", "g", "h", "i", "j")  # crossfile-batch-X.json with all four variants


def records() -> dict[str, dict[str, dict]]:
    """variant -> case id -> record (the first found wins: a case is counted once)."""
    found: dict[str, dict[str, dict]] = defaultdict(dict)
    sources = list(SOURCES) + [(f"crossfile-batch-{s}.json", v, v) for s in SLICES for v in VARIANTS]
    for name, inner, variant in sources:
        path = RESULTS / name
        if not path.exists():
            continue
        for record in json.loads(path.read_text())["records"]:
            if record.get("variant", record.get("config")) == inner:
                found[variant].setdefault(record["id"], record)
    return found


def row(cases: list[str], found: dict[str, dict[str, dict]], variant: str) -> dict:
    recs = [found[variant][c] for c in cases]
    off = found["off"]
    exact = sum(bool(r["exact"]) for r in recs)
    latency = [r["latency_ms"] for r in recs if r.get("latency_ms") is not None]
    tokens = [r["prompt_tokens"] for r in recs if r.get("prompt_tokens") is not None]
    return {
        "n": len(recs),
        "exact": exact,
        "em": exact / len(recs) if recs else None,
        "edit_sim": statistics.fmean(r["edit_sim"] for r in recs) if recs else None,
        "gained": sum(bool(found[variant][c]["exact"]) and not off[c]["exact"] for c in cases),
        "lost": sum(not found[variant][c]["exact"] and bool(off[c]["exact"]) for c in cases),
        "prompt_tokens_mean": statistics.fmean(tokens) if tokens else None,
        "latency_ms_p50": statistics.median(latency) if latency and len(latency) == len(recs) else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "crossfile-dev-table.json"))
    args = parser.parse_args()
    found = records()
    cases = sorted(set.intersection(*(set(found[v]) for v in VARIANTS)))
    packages: dict[str, list[str]] = defaultdict(list)
    for case in cases:
        packages[case.split(":", 1)[0]].append(case)
    table = {"overall": {v: row(cases, found, v) for v in VARIANTS}}
    for package, ids in sorted(packages.items()):
        table[package] = {v: row(ids, found, v) for v in VARIANTS}
    print(f"{len(cases)} cases with all four variants\n")
    print(f"{'package':28} {'n':>4}" + "".join(f"{v:>22}" for v in VARIANTS))
    for name, rows in table.items():
        cells = "".join(
            f"{r['exact']:>4} {r['em']:.3f} +{r['gained']:<2}-{r['lost']:<2} {r['edit_sim']:.2f}".rjust(22) for r in rows.values()
        )
        print(f"{name:28} {rows['off']['n']:>4}{cells}")
    overall = table["overall"]
    print("\nprompt tokens mean: " + ", ".join(f"{v} {overall[v]['prompt_tokens_mean']:.0f}" for v in VARIANTS))
    # The batch runner does not time cases (one engine, no server); the server runs do.
    latency = ", ".join(f"{v} {overall[v]['latency_ms_p50'] or '-'}" for v in VARIANTS)
    print(f"latency p50 ms:     {latency} (timed by server runs only)")
    off = overall["off"]["exact"]
    for v in ("tab", "oracle", "workspace"):
        print(f"{v}: {overall[v]['exact'] / off:.3f}x off EM, +{overall[v]['gained']} -{overall[v]['lost']}")
    # A ceiling no selection can pass: per case, whichever of the three contexts was right, known afterwards.
    hindsight = sum(any(found[v][c]["exact"] for v in ("tab", "oracle", "workspace")) for c in cases)
    print(f"best of tab / oracle / workspace per case, with hindsight: {hindsight} ({hindsight / off:.3f}x off EM)")
    summary = {"cases": len(cases), "sources": SOURCES, "slices": SLICES, "table": table}
    Path(args.out).write_text(json.dumps({**summary, "best_context_with_hindsight": hindsight}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
