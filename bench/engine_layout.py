"""vLLM's process layout on the CPU: the model in a worker process of its own, or in the engine core,
and that engine core spawned or forked from ember's fork server.

    .venv/bin/python bench/engine_layout.py [--runs 2] [--layouts mp,inproc] [--out bench/results/engine-layout.json]

Each run is a fresh Python process that starts ember's EmbeddedEngine on the bundled model (as the
server does: ember's CPU defaults, float32 where the CPU has no bf16 arithmetic) and measures

- ``start_s``: from the process's first line to the engine ready (imports, spawns, weights, warm-up);
- ``first_request_s``: the first request (4 tokens) once ready;
- ``processes``: the process and its descendants once ready;
- ``prefill_tok_s``: prompt tokens per second of 6 prompts of ~1,000 tokens, 1 token each (median);
- ``decode_tok_s``: tokens per second after the first, 64 tokens, batch 1 (median of 3);
- ``abort_s``: closing a stream after 3 chunks of a 400-token generation, until the engine let go;
- ``first_after_abort_s``: the next request's first token after that;
- ``loop_lag_ms_max``: the event loop's worst delay on a 10 ms timer while a 1,000-token prompt
  prefills and decodes (the engine must not block the server's loop).

Every request asks for log-probabilities, as ember's completions do. Layouts alternate run by run
(and which goes first alternates): ``mp``: vLLM's default, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``;
``inproc``: ``=0``, the engine core spawned; ``fork``: ``=0``, the engine core forked from ember's
fork server (engine/core_fork.py); those three with ``TORCH_COMPILE_DISABLE=0``;
``fork+nocompile``: ember's CPU default (fork, and ``TORCH_COMPILE_DISABLE=1`` in eager mode).
Prints a table (medians, and each layout's ratio to the first) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Each layout is the environment of a fresh process (ember's own defaults fill in the rest).
LAYOUTS: dict[str, dict[str, str]] = {
    "mp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "EMBER_ENGINE_FORKSERVER": "0", "TORCH_COMPILE_DISABLE": "0"},
    "inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "EMBER_ENGINE_FORKSERVER": "0", "TORCH_COMPILE_DISABLE": "0"},
    "fork": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "EMBER_ENGINE_FORKSERVER": "1", "TORCH_COMPILE_DISABLE": "0"},
    "fork+nocompile": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "EMBER_ENGINE_FORKSERVER": "1"},
}


async def probe(started: float) -> dict[str, Any]:
    import psutil

    from engine.base import GenerationParams
    from engine.embedded import EmbeddedConfig, EmbeddedEngine
    from engine.models import resolve_bundled

    model = resolve_bundled()
    engine = EmbeddedEngine(EmbeddedConfig(model_path=model.path, model_name=model.name))
    await engine.start()
    result: dict[str, Any] = {"start_s": time.monotonic() - started}
    result["processes"] = 1 + len(psutil.Process().children(recursive=True))
    text = (ROOT / "context" / "prompt" / "builder.py").read_text()

    async def generate(prompt: str, max_tokens: int, request_id: str) -> tuple[float, float, int]:
        t0 = time.monotonic()
        first: float | None = None
        tokens = 0
        # With log-probabilities, as ember asks for every completion (the confidence gate).
        async for chunk in engine.stream(prompt, GenerationParams(max_tokens=max_tokens, logprobs=True), request_id):
            first = time.monotonic() - t0 if first is None else first
            tokens += chunk.token_count
        return first or 0.0, time.monotonic() - t0, tokens

    result["first_request_s"] = (await generate("def f(x):", 4, "warm"))[1]
    rates = []
    for i in range(6):
        prompt = text[i * 500 : i * 500 + 4000]
        _, total, _ = await generate(prompt, 1, f"prefill{i}")
        rates.append(engine.tokenizer.count(prompt) / total)
    result["prefill_tok_s"] = statistics.median(rates)
    rates = []
    for i in range(3):
        first, total, tokens = await generate(f"# {i}\nimport os\n", 64, f"decode{i}")
        rates.append((tokens - 1) / (total - first))
    result["decode_tok_s"] = statistics.median(rates)

    t0 = time.monotonic()
    stream = engine.stream("def g(y):\n", GenerationParams(max_tokens=400), "aborted")
    chunks = 0
    async for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    await stream.aclose()
    result["abort_s"] = time.monotonic() - t0
    result["first_after_abort_s"] = (await generate("class A:\n", 2, "after"))[0]

    lags: list[float] = []

    async def ticker() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t - 0.01)

    task = asyncio.create_task(ticker())
    await generate(text[:4000], 32, "lag")
    task.cancel()
    result["loop_lag_ms_max"] = max(lags) * 1000
    await engine.close()
    return result


def run_one(layout: str) -> dict[str, Any]:
    env = {**os.environ, **LAYOUTS[layout], "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--probe"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{layout} probe failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--layouts", default="mp,inproc", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine-layout.json")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(asyncio.run(probe(STARTED))), flush=True)
        return 0
    layouts = args.layouts.split(",")
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in layouts}
    for i in range(args.runs):
        for layout in layouts if i % 2 == 0 else reversed(layouts):
            runs[layout].append(run_one(layout))
            print(layout, json.dumps({k: round(v, 3) for k, v in runs[layout][-1].items()}), flush=True)
    keys = list(runs[layouts[0]][0])
    medians = {layout: {k: statistics.median(r[k] for r in rs) for k in keys} for layout, rs in runs.items()}
    first = layouts[0]
    header = "".join(f"{layout:>16}" for layout in layouts) + "".join(f"{name + '/' + first:>22}" for name in layouts[1:])
    print(f"\n{'':22}{header}")
    for key in keys:
        values = [medians[layout][key] for layout in layouts]
        ratios = [v / values[0] if values[0] else float("nan") for v in values[1:]]
        print(f"{key:22}" + "".join(f"{v:16.2f}" for v in values) + "".join(f"{r:22.2f}" for r in ratios))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "model": "bundled (SmolLM2-135M)",
              "cores": os.cpu_count(), "runs": runs, "medians": medians}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


STARTED = time.monotonic()

if __name__ == "__main__":
    sys.exit(main())
