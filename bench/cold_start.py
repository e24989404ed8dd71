"""How long does the first completion of the day take, and where does the time go? From launching
``ember --stdio`` to the first non-empty answer, with no daemon running, stage by stage, this
checkout beside an older one in the same run.

    .venv/bin/python bench/cold_start.py [--runs 5] [--base WORKTREE] [--model bundled|qwen-coder] \
        [--base ANOTHER ...] [--engines vllm,llamacpp] [--daemon auto|off] [--out bench/results/cold-start-MODEL-DAEMON.json]

Each run launches ``python -m lsp --stdio`` as an editor does (this venv's Python, the checkout as
the working directory, so ``--base`` runs the older code on the same packages) in a runtime
directory of its own, so no daemon is running; initializes, opens tests/data/inventory.py with a
cursor at the end of a new line and asks ``textDocument/inlineCompletion`` every 100 ms until the
answer is non-empty. Variants (the checkouts, or with ``--engines`` this checkout on each engine:
``--engine vllm`` on the converted folder, ``--engine llamacpp`` on the GGUF file) alternate run
by run (which goes first alternates too), and every process of the run is stopped before the next.

Stages come from the log of the process that loads the engine (the daemon's log file, or with
``--daemon off`` the server's stderr), on the wall clock:

  spawn     launch -> the engine process' first log line (the forwarder, the daemon's imports);
  resolve   -> the model resolved (the hub asked, the bundled model converted once);
  import    -> vLLM's engine core says "Initializing" (vLLM imported, the engine-core process
               spawned and importing again); vLLM's own lines have whole seconds only;
  weights   -> "Loading weights took";
  engine    -> ember's "vLLM ready" (KV cache, warm-up, the client's handshake), or "llama.cpp
               ready" (llama-server loaded the GGUF: import and weights are in it);
  answer    -> the first non-empty completion (connect, prompt, generation, polling).

Prints the median per stage and in total per variant, the proportional memory (PSS) of the run's
processes once it answered, and the total's ratio to the base's; writes JSON with every run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
import psutil
from lsprotocol import types

from bench.harness import RESULTS, ROOT, Ember, commit, ember_command, model_label, resolve_model, write_results

SOURCE = ROOT / "tests" / "data" / "inventory.py"
TAIL = "\n\ndef total_weight(items):\n    return "
URI = "file:///bench/inventory.py"
STAGES = ("spawn", "resolve", "import", "weights", "engine", "answer")
# (stage, pattern): the first line matching ends the stage.
MARKERS = (
    ("resolve", re.compile(r"model .* resolved in|gave up on the hub")),
    ("import", re.compile(r"Initializing a V1 LLM engine")),
    ("weights", re.compile(r"Loading weights took")),
    ("engine", re.compile(r"vLLM ready with|llama.cpp ready with")),
)
EMBER_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
VLLM_TIME = re.compile(r"(?:INFO|WARNING|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d)[.\d]* \[")


def line_time(line: str, year: int) -> float | None:
    """The wall-clock time a log line was written (ember's lines to the millisecond, vLLM's to the second)."""
    if m := EMBER_TIME.match(line):
        return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    if m := VLLM_TIME.search(line):
        return datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()
    return None


def stages_from_log(text: str, launched: float, answered: float) -> dict[str, float | None]:
    """Seconds per stage; a stage whose line is missing is None and the next one spans both."""
    year = datetime.fromtimestamp(launched).year
    ends: dict[str, float] = {}
    for line in text.splitlines():
        at = line_time(line, year)
        if at is None:
            continue
        ends.setdefault("spawn", at)
        for stage, pattern in MARKERS:
            if stage not in ends and pattern.search(line):
                ends[stage] = at
    ends["answer"] = answered
    stages: dict[str, float | None] = {}
    previous = launched
    for stage in STAGES:
        end = ends.get(stage)
        if end is None:
            stages[stage] = None
            continue
        stages[stage] = round(max(0.0, end - previous), 2)
        previous = max(previous, end)
    return stages


async def one_run(checkout: Path, engine: str, args: argparse.Namespace) -> dict[str, Any]:
    runtime = Path(tempfile.mkdtemp(prefix="ec-"))
    stderr_path = runtime / "server.stderr"
    model = resolve_model(args.model, engine)[1]
    command = ember_command(None if model == "bundled" else model, engine, (), "--max-tokens", str(args.max_tokens),
                            daemon=args.daemon, log_level=None)  # fmt: skip
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "EMBER_LOG_LEVEL": "INFO"}
    # The server's stderr to a file: vLLM's lines are the stages.
    ember = Ember(command, {"debounceMs": 0}, log_path=stderr_path, cwd=checkout, env=env, name="bench-editor")
    text = SOURCE.read_text() + TAIL
    lines = text.split("\n")
    position = types.Position(line=len(lines) - 1, character=len(lines[-1]))
    launched = time.time()
    try:
        await ember.launch()
        ember.open(URI, text)
        deadline = time.monotonic() + args.deadline_s
        answer = ""
        while not answer:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no completion within {args.deadline_s} s")
            answer = await ember.complete(URI, position)
            if not answer:
                await asyncio.sleep(0.1)
        answered = time.time()
        first = await first_answer_metrics(ember)
        memory = pss_by_process(runtime)
    finally:
        await ember.stop()
        stop_everything(runtime)
    logs = [stderr_path.read_text(errors="replace")]
    logs += [p.read_text(errors="replace") for p in (runtime / "ember").glob("*.log")] if (runtime / "ember").is_dir() else []
    if args.keep_logs:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        (args.keep_logs / f"{checkout.name}-{int(launched)}.log").write_text("\n".join(logs))
    shutil.rmtree(runtime, ignore_errors=True)
    stages = stages_from_log("\n".join(logs[1:]) if args.daemon == "auto" else logs[0], launched, answered)
    return {"total_s": round(answered - launched, 2), "stages": stages, "answer": answer, "first": first, "pss_mib": memory}


async def first_answer_metrics(ember: Ember) -> dict[str, Any]:
    """What ember recorded for the answer (``ember/stats`` ``last``: ttft_ms, prompt_tokens, ...)."""
    try:
        last = (await asyncio.wait_for(ember.stats(), 10)).get("last") or {}
    except Exception:  # noqa: BLE001 - an older checkout without the request: no details
        return {}
    keys = ("latency_ms", "ttft_ms", "engine_ms", "prompt_tokens", "cached_tokens", "streamed_tokens")
    return {k: v for k, v in last.items() if k in keys}


def pss_by_process(runtime: Path) -> dict[str, float]:
    """MiB of proportional set size per kind of process of this run, once it answered."""
    kinds: dict[str, float] = {}
    for process in run_processes(runtime):
        try:
            title = " ".join(process.cmdline())
            kind = (
                "engine core" if "EngineCore" in title or "EngineCore" in process.name()
                else "fork server" if "forkserver" in title
                else "daemon" if " daemon serve" in title
                else "resource tracker" if "resource_tracker" in title
                else "editor's process" if "--stdio" in title
                else "llama-server" if process.name().startswith("llama-server")
                else process.name()
            )
            kinds[kind] = round(kinds.get(kind, 0.0) + process.memory_full_info().pss / 2**20, 1)
        except psutil.Error:
            continue
    return kinds


def run_processes(runtime: Path) -> list[psutil.Process]:
    """Every process whose command line or environment names this run's runtime directory, and their children."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            named = str(runtime) in " ".join(process.info["cmdline"] or ())
            if named or process.environ().get("XDG_RUNTIME_DIR") == str(runtime):
                found.append(process)
        except psutil.Error:
            continue
    for process in list(found):
        try:
            found.extend(process.children(recursive=True))
        except psutil.Error:
            continue
    return list({p.pid: p for p in found}.values())


def stop_everything(runtime: Path) -> None:
    found = run_processes(runtime)
    for process in found:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(found, timeout=15)


def medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    found: dict[str, float | None] = {"total_s": round(statistics.median(r["total_s"] for r in runs), 2)}
    for stage in STAGES:
        values = [r["stages"][stage] for r in runs if r["stages"].get(stage) is not None]
        found[stage] = round(statistics.median(values), 2) if values else None
    found["pss_mib"] = round(statistics.median(sum(r["pss_mib"].values()) for r in runs), 0)
    return found


async def main_async(args: argparse.Namespace) -> int:
    # The first --base is "base"; more are named by their folders.
    engines = args.engines.split(",")
    variants = {("base" if i == 0 else path.name): (path.resolve(), engines[0]) for i, path in enumerate(args.base or [])}
    for engine in engines:
        variants["this" if len(engines) == 1 else engine] = (ROOT, engine)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for i in range(args.runs):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            run = await one_run(*variants[name], args)
            runs[name].append(run)
            print(f"run {i + 1} {name}: {run['total_s']:.1f} s {run['stages']}", flush=True)
    summary = {name: medians(found) for name, found in runs.items()}
    print(f"\n{'variant':8} {'total s':>8} " + " ".join(f"{s:>8}" for s in STAGES) + f" {'PSS MiB':>8}  x base")
    first = "base" if "base" in summary else next(iter(summary))
    for name, row in summary.items():
        ratio = f"{row['total_s'] / summary[first]['total_s']:.2f}" if len(summary) > 1 else ""  # type: ignore[operator]
        cells = " ".join(f"{row[s]:>8.2f}" if row[s] is not None else f"{'-':>8}" for s in STAGES)
        print(f"{name:8} {row['total_s']:>8.2f} {cells} {row['pss_mib']:>8.0f}  {ratio}")
    print(f"(x: the total over {first}'s)" if len(summary) > 1 else "")
    out = args.out or RESULTS / f"cold-start-{args.label}-{args.daemon}.json"
    write_results(out, {
        "benchmark": "cold_start", "model": args.label, "model_path": args.model, "daemon": args.daemon,
        "commits": {name: commit(path) for name, (path, _) in variants.items()},
        "engines": {name: engine for name, (_, engine) in variants.items()},
        "medians": summary, "runs": runs,
    }, args)  # fmt: skip
    print(f"wrote {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--base", type=Path, action="append", help="an older checkout (a git worktree), repeatable")
    parser.add_argument("--model", default="bundled", help="bundled (ember's default model without a hub), smollm2 / qwen-coder "
                        "(bench/models.py: the GGUF for llama.cpp, the converted folder otherwise), or what ember --model takes")
    parser.add_argument("--daemon", default="auto", choices=["auto", "off"])
    parser.add_argument("--engines", default="auto", help="comma-separated: auto, vllm, llamacpp (each a variant of this checkout)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--deadline-s", type=float, default=600)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep-logs", type=Path, help="a folder for each run's logs")
    args = parser.parse_args()
    args.label = model_label(args.model)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
