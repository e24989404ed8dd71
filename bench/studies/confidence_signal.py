"""Does the margin to the runner-up token say more than the sampled tokens' own log-probabilities?

    .venv/bin/python bench/confidence_signal.py [--model qwen-coder] [--limit 200] [--parallel 8] \
        [--out bench/results/confidence-signal-qwen-coder.json]

Issue 32's gate judges the kept text by its tokens' lowest and mean log-probability and its length;
held out, that does not reach 1.25x on HumanEval single-line and SAFIM control. This asks whether a
stronger signal is there before ember pays for it on every request: the dev cursors (``--limit``
per jsonl file, stratified by source as bench/quality.py samples them) go through the completer's
path (``site_at`` -> ``strategy("ast", "syntax")`` -> the prompt at the engine's ``max_model_len``
-> the cutter, as bench/crossfile_batch.py does) on one embedded engine, greedy, with vLLM asked
for the top-2 log-probabilities of every position (``SamplingParams(logprobs=2)``: the sampled
token's and the best other one's). The kept text's features come from ember's own
:func:`context.cut.confidence.judge` (its ``kept`` tokens): the lowest and mean log-probability,
the token count, and the lowest and mean *margin* (sampled minus runner-up log-probability); and
the issue's other candidates: the first line's lowest and mean log-probability, whether the cutter
dropped model output, and the mode (a line or a block).

Per set, fitted on half of the cases (bench/confidence.py's split by a hash of the id) and scored
on the other half: the ratio of exact-among-shown to showing everything at the highest threshold
that keeps 90% of the fit half's exact answers, for the shipped features, plus the margins, plus
the shape features, and all of them; and the in-sample ceilings (hindsight) of each. Writes the records and
the table as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/studies/X.py: the checkout on sys.path
import numpy as np

from bench.confidence import fit, held_out, in_sample_ceiling
from bench.harness import RESULTS, resolve_model, write_results
from bench.quality import DEV_FILES, case_uri, load_cases, normalize, sample
from context.cut.confidence import TokenTrace, judge
from context.prompt.fim import choose_template
from context.prompt.site import site_at
from context.prompt.strategy import strategy
from context.source.document import Document
from engine.embedded import EmbeddedConfig, EmbeddedEngine
from lsp.config import Settings

MAX_TOKENS = 48  # bench/confidence.py's quality run's
KEEP = 0.9
SHIPPED = ("logprob_min", "logprob_mean", "length")
WITH_MARGIN = (*SHIPPED, "margin_min", "margin_mean")
WITH_SHAPE = (*SHIPPED, "first_min", "first_mean", "trimmed", "block")  # the other candidates
EVERYTHING = (*WITH_MARGIN, "first_min", "first_mean", "trimmed", "block")
FEATURE_SETS = {"shipped": SHIPPED, "with_margin": WITH_MARGIN, "with_shape": WITH_SHAPE, "everything": EVERYTHING}


async def one_case(engine: EmbeddedEngine, case: Any, index: int, template: Any, gate: asyncio.Semaphore) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    doc = Document(case_uri(case, "signal", index), case.language, case.prefix + case.suffix, 1)
    site = site_at(doc, len(case.prefix))
    chosen = strategy("ast", "syntax")
    prompt = chosen.prompt(site, template, engine.tokenizer, Settings().budget_for(engine.model.max_model_len))
    cutter = chosen.cutter(site, prompt)
    sampling = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop=list(prompt.stop) or None, logprobs=2,
        output_kind=RequestOutputKind.DELTA,
    )
    logprobs, margins, raw = TokenTrace(), TokenTrace(), ""
    truncated = finished = False
    async with gate:
        stream = engine._llm.generate(prompt.text, sampling, f"signal-{index}")  # a study of vLLM's own output
        try:
            async for output in stream:
                completion = output.outputs[0]
                sampled, runner_up = [], []
                for token, position in zip(completion.token_ids, completion.logprobs or [], strict=False):
                    own = position[token].logprob
                    others = [p.logprob for t, p in position.items() if t != token]
                    sampled.append(own)
                    runner_up.append(own - max(others) if others else 30.0)
                raw += completion.text
                logprobs.add(completion.text, sampled)
                margins.add(completion.text, runner_up)
                stopped = cutter.feed(completion.text)
                truncated = truncated or (completion.finish_reason == "length" and not stopped)
                finished = output.finished
                if stopped:
                    break
        finally:
            await stream.aclose()
            if not finished:
                await engine.abort(f"signal-{index}")
    text = cutter.finish(truncated)
    verdict = judge(text, raw, logprobs, None, 0.0)
    kept_margins = judge(text, raw, margins, None, 0.0).kept
    kept = verdict.kept
    first = judge(verdict.text.lstrip("\n").split("\n")[0], raw, logprobs, None, 0.0).kept if verdict.text.strip() else ()
    first = first or kept
    return {
        "id": case.id, "source": case.source, "completion": verdict.text,
        "exact": bool(verdict.text.strip()) and normalize(verdict.text) == normalize(case.middle),
        "kept_tokens": len(kept),
        "logprob_min": min(kept) if kept else None, "logprob_mean": sum(kept) / len(kept) if kept else None,
        "margin_min": min(kept_margins) if kept_margins else None,
        "margin_mean": sum(kept_margins) / len(kept_margins) if kept_margins else None,
        "first_min": min(first) if first else None, "first_mean": sum(first) / len(first) if first else None,
        "trimmed": float(len(normalize(raw)) > len(normalize(verdict.text))),  # the cutter dropped model output
        "block": float(site.mode != "single"),
    }


def row(record: dict[str, Any], names: tuple[str, ...]) -> list[float]:
    values = {**record, "length": math.log1p(record["kept_tokens"])}
    return [1.0, *(float(values[n]) for n in names)]


def fit_on(records: list[dict[str, Any]], names: tuple[str, ...]) -> np.ndarray:
    """bench/confidence.py's logistic fit on the named features."""
    return np.array(fit(records, ridge=1e-2, rounds=60, features=lambda r: row(r, names)))


def score_of(w: np.ndarray, names: tuple[str, ...]) -> Any:
    return lambda r: float(np.array(row(r, names)) @ w)


def held_out_ratio(fit_rows: list[dict[str, Any]], test_rows: list[dict[str, Any]], names: tuple[str, ...]) -> dict[str, Any]:
    """Threshold chosen on the fit half (the highest keeping KEEP of its exact answers), scored on the test half."""
    usable = [r for r in fit_rows if r["logprob_min"] is not None]
    if not any(r["exact"] for r in usable) or all(r["exact"] for r in usable):
        return {"ratio": None}
    score = score_of(fit_on(usable, names), names)
    exact_scores = sorted(score(r) for r in usable if r["exact"])
    threshold = exact_scores[math.floor((1 - KEEP) * len(exact_scores))]
    answered = [r for r in test_rows if r["logprob_min"] is not None]
    shown = [r for r in answered if score(r) >= threshold]
    exact_all = sum(r["exact"] for r in test_rows)
    everything = sum(r["exact"] for r in answered) / len(answered) if answered else 0
    precision = sum(r["exact"] for r in shown) / len(shown) if shown else 0
    return {
        "ratio": precision / everything if everything else None,
        "kept": sum(r["exact"] for r in shown) / exact_all if exact_all else None,
        "shown": len(shown) / len(test_rows) if test_rows else None,
    }


def analyse(records: list[dict[str, Any]]) -> dict[str, Any]:
    sets: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        sets.setdefault(r["source"], []).append(r)
    sets["all"] = records
    table: dict[str, Any] = {}
    for name, rows in sorted(sets.items()):
        fit_rows = [r for r in rows if not held_out(r)]
        test_rows = [r for r in rows if held_out(r)]
        usable = [r for r in rows if r["logprob_min"] is not None]
        entry: dict[str, Any] = {"cursors": len(rows), "exact": sum(r["exact"] for r in rows)}
        for label, names in FEATURE_SETS.items():
            entry[label] = held_out_ratio(fit_rows, test_rows, names)
            if usable and any(r["exact"] for r in usable) and not all(r["exact"] for r in usable):
                entry[label]["ceiling"] = in_sample_ceiling(rows, score_of(fit_on(usable, names), names), KEEP)[0]
        entry["margin_min_alone_ceiling"] = in_sample_ceiling(rows, lambda r: r["margin_min"], KEEP)[0]
        entry["logprob_min_alone_ceiling"] = in_sample_ceiling(rows, lambda r: r["logprob_min"], KEEP)[0]
        table[name] = entry
    return table


def print_table(table: dict[str, Any]) -> None:
    def cell(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else "-"

    labels = list(FEATURE_SETS)
    print(f"\nheld out: ratio (share of the test half's exact answers kept); in-sample: the ceiling at {KEEP:.0%} kept")
    print(f"{'set':22} {'cursors':>7} {'exact':>5} | " + " ".join(f"{label:>17}" for label in labels)
          + f" | {'lp min':>6} {'margin':>6} " + " ".join(f"{label[:10]:>10}" for label in labels))
    for name, e in table.items():
        held = " ".join(f"{cell(e[label]['ratio']):>9} ({cell(e[label].get('kept')):>5})" for label in labels)
        ceilings = " ".join(f"{cell(e[label].get('ceiling')):>10}" for label in labels)
        print(f"{name:22} {e['cursors']:>7} {e['exact']:>5} | {held} | {cell(e['logprob_min_alone_ceiling']):>6} "
              f"{cell(e['margin_min_alone_ceiling']):>6} {ceilings}")


async def main_async(args: argparse.Namespace) -> int:
    label, model_path = resolve_model(args.model)
    assert model_path is not None
    engine = EmbeddedEngine(EmbeddedConfig(model_path=model_path, model_name=label))
    await engine.start()
    template = choose_template(engine.model.special_tokens, engine.model.name, None)
    cases = [c for path in DEV_FILES for c in sample(load_cases(path), args.limit)]
    gate = asyncio.Semaphore(args.parallel)
    started = time.perf_counter()
    records = []
    for done in asyncio.as_completed([one_case(engine, c, i, template, gate) for i, c in enumerate(cases)]):
        records.append(await done)
        if len(records) % 50 == 0:
            print(f"  {len(records)}/{len(cases)} in {time.perf_counter() - started:.0f} s", flush=True)
    await engine.close()
    table = analyse(records)
    print(f"{len(records)} cursors in {time.perf_counter() - started:.0f} s; {label}, greedy, {MAX_TOKENS} tokens")
    print_table(table)
    out = args.out or RESULTS / f"confidence-signal-{label}.json"
    data = {"model": label, "limit": args.limit, "keep": KEEP, "table": table, "records": records}
    print(f"wrote {write_results(out, data, args)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen-coder", help="qwen-coder (default), smollm2, or a model folder (vLLM, embedded)")
    parser.add_argument("--limit", type=int, default=200, help="cursors per dev file, stratified by source")
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--out", type=Path)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
