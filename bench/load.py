"""Several editors typing at once over TCP against one ember process and its embedded engine:
is any request lost, how slow does the tail get, and does memory stay bounded?

    .venv/bin/python bench/load.py [--sessions 8] [--documents 100] [--requests 5000] [--max-tokens 8]

One ``ember --tcp 127.0.0.1:0`` process (embedded vLLM, the bundled SmolLM2-135M, 1 GiB KV cache) and
``--sessions`` editor connections (pygls clients in this process) typing into ``--documents``
documents cut from this repository's own Python, one ``didChange`` and one
``textDocument/inlineCompletion`` per key, a pause of 40-140 ms after each answer; documents stay
open (the worst case for memory), so growth after the first 10% of requests is growth per request.
The driver is tests/load_driver.py, which tests/test_load.py runs and asserts on.

Checked per request: an answer arrives (no error, no timeout). Sampled every second: the resident
memory of the ember process, and the PSS of ember plus all its child processes (vLLM's engine
core). With ``--engine-url URL`` ember completes through that OpenAI-compatible server instead (a
server that answers at once leaves only ember's own work and memory to measure). Prints a table
and writes bench/results/load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - the checkout on sys.path

from bench.harness import CACHE, RESULTS, fmt, percentile, write_results
from tests.load_driver import LoadConfig, LoadReport, run_load


def summarize(report: LoadReport) -> dict[str, Any]:
    summary = report.summary()
    summary["latency_ms"].update({f"p{q}": percentile(report.latencies_ms, q / 100) for q in (50, 95, 99)})
    return summary


def print_table(summary: dict[str, Any]) -> None:
    lat = summary["latency_ms"]
    rss = summary["ember_rss_mib"]
    rows = [
        ("requests sent / answered / lost", f"{summary['requests_sent']} / {summary['answered']} / {summary['lost']}"),
        ("errors", str(summary["errors"])),
        ("empty answers", str(summary["empty_answers"])),
        ("latency_ms p50 / p95 / p99", f"{fmt(lat['p50'])} / {fmt(lat['p95'])} / {fmt(lat['p99'])}"),
        ("ember RSS MiB at 10% / max / end", f"{fmt(rss['at_10pct'])} / {fmt(rss['max'])} / {fmt(rss['end'])}"),
        ("ember RSS growth after 10% (MiB)", fmt(rss["growth_after_10pct"])),
        ("ember + engine PSS max (MiB)", fmt(summary["total_pss_mib_max"])),
        ("server outcomes", json.dumps(summary["server_outcomes"])),
        ("model load / run (s)", f"{fmt(summary['load_s'])} / {fmt(summary['run_s'])}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--context-tokens", type=int, help="contextTokens of every session (default: the server's)")
    parser.add_argument("--suffix-tokens", type=int, help="suffixTokens of every session (default: the server's)")
    parser.add_argument("--engine-url", help="an OpenAI-compatible server to answer (default: the bundled model, embedded)")
    parser.add_argument("--out", type=Path, default=RESULTS / "load.json")
    args = parser.parse_args()
    config = LoadConfig(args.sessions, args.documents, args.requests, args.max_tokens, args.seed,
                        context_tokens=args.context_tokens, suffix_tokens=args.suffix_tokens, engine_url=args.engine_url)
    log_path = CACHE / "load-server.log"  # vLLM logs a lot: not a result
    log_path.parent.mkdir(parents=True, exist_ok=True)
    report = await run_load(config, log_path)
    summary = summarize(report)
    print_table(summary)
    memory = [asdict(m) for m in report.memory]
    data = {"config": asdict(config), "summary": summary, "errors": report.errors[:50], "memory": memory}
    print(f"wrote {write_results(args.out, data, args)}")
    return 0 if summary["lost"] == 0 and not report.errors else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
