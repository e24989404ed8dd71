"""Where completions end: ember's cutter before a change, after it, and the plain baseline, on
the same greedy generations of the dev sets.

    .venv/bin/python bench/stops.py --model qwen-coder --base ../wt-base         # generate, cut, score
    .venv/bin/python bench/stops.py --model qwen-coder --base ../wt-base --cut-only  # reuse the generations

A cutter is a function of the streamed text: given the same prompt, greedy decoding streams the
same tokens whoever cuts them, and a cutter that stops early only stops reading. So the model runs
once per case and the cutters read its stream afterwards, each as the server would:

1. Generate (real vLLM, ember's ``EmbeddedEngine`` and model settings): for every HumanEval
   infilling and SAFIM dev case, the prompt the server builds (``promptStrategy`` ``ast``,
   ``crossFile`` off, the case as one document) is streamed to ``--max-tokens`` (48, as
   ``quality.py``) with the prompt's stop strings; the chunks, the finish reason and the
   prompt's ``healed`` text go to ``bench/.cache/stops-<model>.jsonl``. Also the prompt of the
   ``plain`` baseline (``quality.py``'s: the last-lines prompt without healing), generated only
   when its text differs from the first.
2. Cut: each checkout's ``context`` (this one, "after", and ``--base``, "before", in a subprocess
   with that checkout first on ``sys.path``) builds the case's ``CompletionSite`` (its mode) and
   feeds the chunks to its ``SyntaxCutter`` one by one until ``feed`` says stop, then ``finish``;
   the plain baseline's ``PlainCutter`` reads the plain prompt's stream.
3. Score as ``quality.py`` does (``exact_line``, ``exact``, ``edit_sim``, ``syntax_ok``, empty),
   per source and language, and the counts issue 16 names: single-line answers whose first line
   is right but not the whole, SAFIM control answers that are the right condition plus more text
   or a cut inside it (and of those, the ones whose insertion breaks the parse: where the tree
   shows the node's end).

Writes ``bench/results/stops-<model>.json`` (the commits, the summary, every completion).
``bench/quality.py`` measures the same through the real LSP server; ``--compare-server
QUALITY_JSON`` checks that it agrees: how many of a ``quality.py --strategy ast`` run's
completions (of this checkout) equal the ``after`` ones, stored in the results file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EVAL = ROOT.parent / "shared" / "eval"
DEV_SETS = ("humaneval_infilling_dev.jsonl", "safim_dev.jsonl")


def dev_cases(limit: int | None) -> list[dict[str, Any]]:
    """The dev cases, ``limit`` per file (the first ones of a fixed shuffle, stratified by source)."""
    sys.path.insert(0, str(ROOT))
    from bench.quality import load_cases, sample

    picked = []
    for name in DEV_SETS:
        picked += [vars(c) for c in sample(load_cases(EVAL / name), limit)]
    return picked


def case_uri(case: dict[str, Any], index: int) -> str:
    from bench.quality import EXTENSIONS
    from context.source.languages import normalize_language_id

    return f"file:///stops/case{index}{EXTENSIONS.get(normalize_language_id(case['language']), '.txt')}"


# ------------------------------------------------------------------------------------ generate


def generated_keys(raw_path: Path) -> set[str]:
    """The cases ``raw_path`` already has (a run picks up where an interrupted one stopped)."""
    if not raw_path.exists():
        return set()
    return {json.loads(line)["key"] for line in raw_path.read_text().splitlines() if line.strip()}


async def generate(cases: list[dict[str, Any]], model_path: str, max_tokens: int, concurrency: int, raw_path: Path) -> None:
    """Streams every case's prompts through the embedded engine; one jsonl line per case."""
    sys.path.insert(0, str(ROOT))
    from context.prompt.fim import choose_template
    from context.prompt.site import site_at
    from context.prompt.strategy import strategy
    from context.source.document import Document
    from engine.base import GenerationParams
    from engine.embedded import EmbeddedConfig, EmbeddedEngine
    from lsp.completer import prompt_budget
    from lsp.config import Settings

    engine = EmbeddedEngine(EmbeddedConfig(model_path=model_path, model_name=Path(model_path).name))
    started = time.monotonic()
    await engine.start()
    print(f"engine ready in {time.monotonic() - started:.0f} s", flush=True)
    settings = Settings(max_tokens=max_tokens)
    template = choose_template(engine.model.special_tokens, engine.model.name)
    budget = prompt_budget(settings, engine.model.max_model_len)
    done = await asyncio.to_thread(generated_keys, raw_path)
    gate = asyncio.Semaphore(concurrency)
    out = await asyncio.to_thread(raw_path.open, "a", encoding="utf-8")
    count = 0

    async def stream(text: str, stop: tuple[str, ...], request_id: str) -> dict[str, Any]:
        chunks: list[str] = []
        finish = None
        prompt_tokens = None
        async for chunk in engine.stream(text, GenerationParams(max_tokens, 0.0, stop), request_id):
            chunks.append(chunk.text)
            finish = chunk.finish_reason or finish
            prompt_tokens = chunk.prompt_tokens or prompt_tokens
        return {"chunks": chunks, "finish": finish, "prompt_tokens": prompt_tokens}

    async def one(index: int, case: dict[str, Any]) -> None:
        nonlocal count
        key = f"{case['source']}|{case['id']}"
        if key in done:
            return
        async with gate:
            doc = Document(case_uri(case, index), case["language"], case["prefix"] + case["suffix"])
            site = site_at(doc, len(case["prefix"]))
            ast = strategy("ast", "syntax").prompt(site, template, engine.tokenizer, budget)
            plain = strategy("naive", "plain").prompt(site, template, engine.tokenizer, budget)
            row: dict[str, Any] = {"key": key, "healed": ast.healed, "ast": await stream(ast.text, ast.stop, f"a{index}")}
            row["plain"] = "ast" if plain.text == ast.text else await stream(plain.text, plain.stop, f"p{index}")
            out.write(json.dumps(row) + "\n")
            out.flush()
            count += 1
            if count % 100 == 0:
                print(f"{count} cases generated, {time.monotonic() - started:.0f} s", flush=True)

    try:
        await asyncio.gather(*(one(i, c) for i, c in enumerate(cases)))
    finally:
        out.close()
        await engine.close()


# ----------------------------------------------------------------------------------------- cut


def cut(cases: list[dict[str, Any]], raw: dict[str, dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """Every case's completion by the ``context`` on ``sys.path``: ``kind`` "syntax" (ember's
    cutter on the ast prompt's stream) or "plain" (the baseline's, on the plain prompt's)."""
    from context.cut.postprocess import SyntaxCutter
    from context.prompt.site import site_at
    from context.prompt.strategy import PlainCutter
    from context.source.document import Document

    results = {}
    for index, case in enumerate(cases):
        key = f"{case['source']}|{case['id']}"
        row = raw.get(key)
        if row is None:
            continue
        doc = Document(case_uri(case, index), case["language"], case["prefix"] + case["suffix"])
        site = site_at(doc, len(case["prefix"]))
        stream = row["ast"] if kind == "syntax" or row["plain"] == "ast" else row["plain"]
        cutter: Any = (
            SyntaxCutter(site.prefix, site.suffix, site.language_id, site.mode, row["healed"])
            if kind == "syntax"
            else PlainCutter(site.mode)
        )
        stopped = False
        for chunk in stream["chunks"]:
            if cutter.feed(chunk):
                stopped = True
                break
        truncated = not stopped and stream["finish"] == "length"
        results[key] = {"completion": cutter.finish(truncated), "mode": site.mode, "stopped": stopped}
    return results


def cut_in(checkout: Path, raw_path: Path, cases_path: Path, kind: str) -> dict[str, dict[str, Any]]:
    """:func:`cut` with ``checkout``'s ``context`` (a subprocess, so two versions never mix)."""
    out = raw_path.with_suffix(f".{kind}.{checkout.name}.json")
    env = dict(os.environ, PYTHONPATH=str(checkout))
    subprocess.run(
        [sys.executable, __file__, "--cut-worker", str(checkout), str(raw_path), str(cases_path), kind, str(out)],
        check=True, env=env, cwd=checkout,
    )
    return json.loads(out.read_text())


def cut_worker(argv: list[str]) -> None:
    checkout, raw_path, cases_path, kind, out = argv
    sys.path.insert(0, checkout)
    sys.path.insert(1, str(ROOT))  # bench.quality's EXTENSIONS (case_uri) from this checkout
    cases = json.loads(Path(cases_path).read_text())
    raw = {json.loads(line)["key"]: json.loads(line) for line in Path(raw_path).read_text().splitlines()}
    Path(out).write_text(json.dumps(cut(cases, raw, kind)))


# --------------------------------------------------------------------------------------- score


Cuts = dict[str, dict[str, dict[str, Any]]]  # strategy -> case key -> completion, mode, stopped


def score_all(cases: list[dict[str, Any]], cuts: Cuts) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from bench.quality import edit_similarity, first_line, has_grammar, normalize
    from context.cut.postprocess import syntax_ok

    records = []
    for case in cases:
        key = f"{case['source']}|{case['id']}"
        for name, results in cuts.items():
            if key not in results:
                continue
            text = results[key]["completion"]
            grammar = has_grammar(case["language"])
            records.append({
                "key": key, "source": case["source"], "language": case["language"], "strategy": name,
                "completion": text, "mode": results[key]["mode"],
                "exact_line": first_line(text) == first_line(case["middle"]),
                "exact": normalize(text) == normalize(case["middle"]),
                "edit_sim": edit_similarity(text, case["middle"]),
                "syntax_ok": syntax_ok(case["prefix"], text, case["suffix"], case["language"]) if grammar else None,
                "more": _more(text, case["middle"]), "inside": _inside(text, case["middle"]),
            })
    return records, summarize(records)


def _more(text: str, middle: str) -> bool:
    """The right answer followed by more text."""
    got, want = text.strip(), middle.strip()
    return bool(want) and got != want and got.startswith(want)


def _inside(text: str, middle: str) -> bool:
    """A cut inside the right answer."""
    got, want = text.strip(), middle.strip()
    return bool(got) and got != want and want.startswith(got)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["strategy"], f"{r['source']} / all")].append(r)
        groups[(r["strategy"], f"{r['source']} / {r['language']}")].append(r)
        groups[(r["strategy"], "all / all")].append(r)
    summary: dict[str, Any] = defaultdict(dict)
    for (strategy, group), rows in sorted(groups.items()):
        n = len(rows)
        syntax = [r["syntax_ok"] for r in rows if r["syntax_ok"] is not None]
        summary[strategy][group] = {
            "n": n,
            "exact_line": sum(r["exact_line"] for r in rows) / n,
            "exact": sum(r["exact"] for r in rows) / n,
            "edit_sim": sum(r["edit_sim"] for r in rows) / n,
            "syntax_ok": sum(syntax) / len(syntax) if syntax else None,
            "empty": sum(not r["completion"].strip() for r in rows) / n,
            "line_right_rest_wrong": sum(r["exact_line"] and not r["exact"] for r in rows),
            "more": sum(r["more"] for r in rows),
            "inside": sum(r["inside"] for r in rows),
            "more_breaks_parse": sum(r["more"] and r["syntax_ok"] is False for r in rows),
            "inside_breaks_parse": sum(r["inside"] and r["syntax_ok"] is False for r in rows),
        }
    return dict(summary)


def print_table(summary: dict[str, Any]) -> None:
    strategies = list(summary)
    groups = sorted({g for s in strategies for g in summary[s]}, key=lambda g: (g.startswith("all"), g))
    print(
        f"{'set / language':34} {'strategy':8} {'n':>5} {'EM line':>8} {'EM':>7} {'ES':>6} {'syntax':>7} {'empty':>6}"
        f" {'line ok, rest not':>17} {'more(parse)':>12} {'inside(parse)':>13}"
    )
    for g in groups:
        for s in strategies:
            row = summary[s].get(g)
            if row is None:
                continue
            syntax = "-" if row["syntax_ok"] is None else f"{row['syntax_ok']:.1%}"
            print(
                f"{g:34} {s:8} {row['n']:>5} {row['exact_line']:>8.1%} {row['exact']:>7.1%} {row['edit_sim']:>6.3f} {syntax:>7}"
                f" {row['empty']:>6.1%} {row['line_right_rest_wrong']:>17} {row['more']:>5} ({row['more_breaks_parse']:>2})"
                f" {row['inside']:>6} ({row['inside_breaks_parse']:>2})"
            )


def compare_server(results: Path, quality_json: Path) -> dict[str, Any]:
    """How often the server's completions (a ``quality.py --strategy ast`` run of this code)
    equal this script's ``after`` ones on the cases both have, and the exact match of each."""
    ours = {r["key"]: r for r in json.loads(results.read_text())["records"] if r["strategy"] == "after"}
    served = [r for r in json.loads(quality_json.read_text())["records"] if r["strategy"] == "ast"]
    pairs = [(r, ours[f"{r['source']}|{r['id']}"]) for r in served if f"{r['source']}|{r['id']}" in ours]
    same = sum(a["completion"].rstrip() == b["completion"].rstrip() for a, b in pairs)
    report = {
        "cases": len(pairs),
        "same_completion": same,
        "server_exact": sum(a["exact"] for a, _ in pairs),
        "offline_exact": sum(b["exact"] for _, b in pairs),
        "differ": [a["source"] + "|" + a["id"] for a, b in pairs if a["completion"].rstrip() != b["completion"].rstrip()],
    }
    print(
        f"server vs offline on {report['cases']} cases: {same} same completions; exact {report['server_exact']} (server) vs"
        f" {report['offline_exact']} (offline)"
    )
    return report


def commit_of(checkout: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True).stdout.strip()

    head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "context")
    return head + ("+dirty" if dirty else "")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--cut-worker":
        cut_worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen-coder", help="qwen-coder (default), smollm2, or a model folder")
    parser.add_argument("--base", type=Path, help="a checkout of the code before the change (its cutter: 'before')")
    parser.add_argument("--limit", type=int, help="cases per dev set (stratified, fixed seed)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cut-only", action="store_true", help="only cut and score the generations already made")
    parser.add_argument("--raw", type=Path, help="the generations file (default bench/.cache/stops-<model>.jsonl)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare-server", type=Path, metavar="QUALITY_JSON",
                        help="only compare the results file (--out) with a quality.py --strategy ast run of this code")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from bench.quality import resolve

    name, model_path = resolve(args.model)
    if args.compare_server:
        results = args.out or ROOT / "bench" / "results" / f"stops-{name}.json"
        data = json.loads(results.read_text())
        data["server_check"] = {"quality_json": str(args.compare_server), **compare_server(results, args.compare_server)}
        results.write_text(json.dumps(data, indent=1))
        return
    raw_path = args.raw or ROOT / "bench" / ".cache" / f"stops-{name}.jsonl"
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    cases = dev_cases(args.limit)
    started = time.monotonic()
    if not args.cut_only:
        assert model_path is not None
        asyncio.run(generate(cases, model_path, args.max_tokens, args.concurrency, raw_path))
    generated_s: float | None = time.monotonic() - started
    cases_path = raw_path.with_suffix(".cases.json")
    cases_path.write_text(json.dumps(cases))
    cuts = {"after": cut_in(ROOT, raw_path, cases_path, "syntax")}
    if args.base:
        cuts = {"before": cut_in(args.base.resolve(), raw_path, cases_path, "syntax"), **cuts}
    cuts["plain"] = cut_in(ROOT, raw_path, cases_path, "plain")
    records, summary = score_all(cases, cuts)
    print_table(summary)
    out = args.out or ROOT / "bench" / "results" / f"stops-{name}.json"
    if args.cut_only:  # the generations are an earlier run's: keep what it took
        generated_s = json.loads(out.read_text()).get("generated_s") if out.exists() else None
    out.write_text(json.dumps({
        "command": " ".join(["python", *sys.argv]),
        "model": name,
        "max_tokens": args.max_tokens,
        "commits": {"after": commit_of(ROOT), **({"before": commit_of(args.base)} if args.base else {})},
        "generated_s": None if generated_s is None else round(generated_s, 1),
        "date": time.strftime("%Y-%m-%d"),
        "summary": summary,
        "records": records,
    }, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
