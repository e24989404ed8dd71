"""Same prompts, same answers? Builds every dev case's full prompt and post-processes the same model
texts through the streaming cutter, in this checkout and in another (``--base``, e.g. a worktree of
the code before a restructuring), and diffs them text for text.

Each checkout runs the same worker in its own process (its own ``context`` and ``lsp`` on
``sys.path``), through the request path's own steps: ``site_at`` -> ``strategy(...)`` -> the
strategy's prompt (ember's ``Settings.budget_for`` at 2048 tokens, ember's character-based token estimate)
-> the strategy's cutter fed in small chunks, as a stream arrives. Per case and configuration it
records the prompt's text and prefix key and, for each of a few model texts (the author's middle
running on into the suffix, ending in a control token, or in chat), where the cutter stopped, its
preview there and the answer.

Configurations: ``ast+syntax`` with Qwen2.5-Coder's template and with the prefix-only one, and the
``naive+plain`` baselines, for HumanEval and SAFIM; for the cross-file set (when its packages are
unpacked, ``--repos``; ``../shared/eval/fetch-crossfile-repos.sh DIR``) also ``crossFile: "open"``
with the defining module as a tab and ``crossFile: "workspace"`` over the package's folder.

    .venv/bin/python bench/same_output.py --base /path/to/worktree [--repos DIR] [--limit N]

Prints the counts and the first differences (a unified diff); writes bench/results/same-output.json.
Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bootstrap  # noqa: F401 - python bench/studies/X.py: the checkout on sys.path

from bench.harness import CACHE, EVAL, RESULTS, ROOT, commit, write_results

REPOS = CACHE / "crossfile-repos"

# Runs inside a checkout (cwd): the same steps through that checkout's own modules. It knows the
# module layout before and after issue 28's rooms.
WORKER = r'''
import hashlib, json, sys
sys.path.insert(0, ".")
try:
    from context.source.document import Document
    from context.source.workspace import WorkspaceIndex
    from context.prompt.fim import TEMPLATES
    from context.prompt.site import site_at
    from context.prompt.strategy import strategy
    from context.prompt.window import ApproxCounter
    from context.prompt.snippets import NO_CROSS_FILE, CrossFile, select_snippets
    from context.prompt.retrieval import Cursor, OpenFile, WorkspaceView, workspace_context
except ImportError:
    from context.document import Document
    from context.workspace import WorkspaceIndex
    from context.fim import TEMPLATES
    from context.site import site_at
    from context.baselines import strategy
    from context.window import ApproxCounter
    from context.snippets import NO_CROSS_FILE, CrossFile, select_snippets
    from context.retrieval import Cursor, OpenFile, WorkspaceView, workspace_context
from lsp.config import Settings

job = json.load(sys.stdin)
out = open(job["out"], "w")
counter = ApproxCounter()
ENDINGS = ["<suffix>", "<|endoftext|>", "\n\n```\nThis function returns it.\n"]
STRATEGIES = {"ast+syntax:qwen": ("ast", "syntax", "qwen2.5-coder"),
              "ast+syntax:prefix-only": ("ast", "syntax", "prefix-only"),
              "naive+plain:qwen": ("naive", "plain", "qwen2.5-coder")}
def budget(mode):
    settings = Settings(cross_file=mode)
    if hasattr(settings, "budget_for"):
        return settings.budget_for(2048)
    from lsp.completer import prompt_budget  # checkouts before the budget moved to context/prompt
    return prompt_budget(settings, 2048)

budgets = {mode: budget(mode) for mode in ("off", "open", "workspace")}

def answers(site, prompt, chosen, middle, suffix):
    result = []
    for ending in ENDINGS:
        raw = middle + (suffix[:200] if ending == "<suffix>" else ending)
        cutter = chosen.cutter(site, prompt)
        stopped_at = None
        for start in range(0, len(raw), 7):
            if cutter.feed(raw[start:start + 7]):
                stopped_at = start
                break
        result.append([stopped_at, cutter.preview(), cutter.finish(stopped_at is None)])
    return result

def record(key, doc, offset, cross, names, middle, suffix):
    site = site_at(doc, offset, cross)
    for name in names:
        prompt_strategy, post, template = STRATEGIES[name]
        chosen = strategy(prompt_strategy, post)
        mode = "workspace" if key.endswith(":workspace") else "open" if cross.snippets else "off"
        prompt = chosen.prompt(site, TEMPLATES[template], counter, budgets[mode])
        out.write(json.dumps({"key": f"{key}|{name}", "prompt": prompt.text, "prefix_key": repr(prompt.key),
                              "healed": prompt.healed,
                              "answers": answers(site, prompt, chosen, middle, suffix)}) + "\n")

for case in job["cases"]:
    text, offset = case["prefix"] + case["suffix"], len(case["prefix"])
    doc = Document(case["uri"], case["language"], text, 1)
    record(case["id"], doc, offset, NO_CROSS_FILE, list(STRATEGIES), case["middle"], case["suffix"])

indexes = {}
for case in job["crossfile"]:
    text, offset = case["prefix"] + case["suffix"], len(case["prefix"])
    doc = Document(case["uri"], "python", text, 1)
    tab = (case["defining_uri"], open(case["defining_path"]).read()[:200_000])
    snippets = select_snippets(text, "python", [tab], budgets["open"].snippet_chars)
    record(case["id"] + ":open", doc, offset, CrossFile(snippets), ["ast+syntax:qwen"], case["middle"], case["suffix"])
    folder = case["folder"]
    if folder not in indexes:
        indexes[folder] = WorkspaceIndex([folder])
        indexes[folder].scan()
    view = WorkspaceView(indexes[folder], {case["path"]: OpenFile(text, "python")})
    cross = workspace_context(view, Cursor(case["path"], text, offset, "python"), budgets["workspace"].snippet_chars)
    record(case["id"] + ":workspace", doc, offset, cross, ["ast+syntax:qwen"], case["middle"], case["suffix"])
out.close()
'''


def load_cases(limit: int | None, repos: Path) -> tuple[list[dict], list[dict]]:
    single: list[dict] = []
    for name in ("humaneval_infilling_dev.jsonl", "safim_dev.jsonl"):
        rows = [json.loads(line) for line in (EVAL / name).read_text().splitlines() if line.strip()]
        for row in rows[:limit] if limit else rows:
            single.append({**row, "uri": f"file:///dev/{row['id'].replace('/', '_')}.{row['language']}"})
    crossfile: list[dict] = []
    if repos.is_dir():
        rows = [json.loads(line) for line in (EVAL / "crossfile_dev.jsonl").read_text().splitlines() if line.strip()]
        for row in rows[:limit] if limit else rows:
            name, _, version = row["repo"].partition("==")
            folder = repos / f"{name.lower()}-{version}"
            path, defining = folder / row["path"], folder / row["defined_in"]
            crossfile.append({**row, "uri": path.as_uri(), "path": str(path), "folder": str(folder),
                              "defining_uri": defining.as_uri(), "defining_path": str(defining)})
    return single, crossfile


def run_worker(checkout: Path, single: list[dict], crossfile: list[dict], out: Path) -> dict[str, dict]:
    job = {"cases": single, "crossfile": crossfile, "out": str(out)}
    subprocess.run([sys.executable, "-c", WORKER], cwd=checkout, input=json.dumps(job), text=True, check=True)
    return {record["key"]: record for record in map(json.loads, out.read_text().splitlines())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the code to compare with")
    parser.add_argument("--repos", type=Path, default=REPOS, help="the unpacked cross-file packages")
    parser.add_argument("--limit", type=int, help="cases per set")
    parser.add_argument("--out", type=Path, default=RESULTS / "same-output.json")
    args = parser.parse_args()

    single, crossfile = load_cases(args.limit, args.repos)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        ours = run_worker(ROOT, single, crossfile, Path(tmp) / "ours.jsonl")
        ours_s = time.perf_counter() - started
        theirs = run_worker(args.base.resolve(), single, crossfile, Path(tmp) / "theirs.jsonl")
        theirs_s = time.perf_counter() - started - ours_s
    keys = sorted(ours.keys() | theirs.keys())
    prompt_differ = [k for k in keys if (ours.get(k) or {}).get("prompt") != (theirs.get(k) or {}).get("prompt")]
    key_differ = [k for k in keys if (ours.get(k) or {}).get("prefix_key") != (theirs.get(k) or {}).get("prefix_key")]
    answer_differ = [k for k in keys if (ours.get(k) or {}).get("answers") != (theirs.get(k) or {}).get("answers")]
    answers = sum(len(r["answers"]) for r in ours.values())
    print(f"this checkout {commit(ROOT)} vs {commit(args.base)} ({args.base}); eval sets at {EVAL}")
    print(f"  {len(single)} HumanEval/SAFIM cases x 3 configurations, {len(crossfile)} cross-file cases x open/workspace")
    print(f"  records               {len(keys):6d} (ours {len(ours)}, theirs {len(theirs)}; {ours_s:.0f} s / {theirs_s:.0f} s)")
    print(f"  prompts differing     {len(prompt_differ):6d}")
    print(f"  prefix keys differing {len(key_differ):6d}")
    print(f"  answers differing     {len(answer_differ):6d} (of {len(keys)} records, {answers} answers)")
    for key in (prompt_differ + answer_differ)[:3]:
        for field in ("prompt", "prefix_key", "answers"):
            a = json.dumps((theirs.get(key) or {}).get(field), indent=1).replace("\\n", "\n").splitlines()
            b = json.dumps((ours.get(key) or {}).get(field), indent=1).replace("\\n", "\n").splitlines()
            diff = list(difflib.unified_diff(a, b, f"base:{key}:{field}", f"ours:{key}:{field}", lineterm="", n=1))
            print("\n".join(line[:200] for line in diff[:12]))
    write_results(args.out, {
        "base": commit(args.base), "records": len(keys), "answers": answers,
        "single_file_cases": len(single), "crossfile_cases": len(crossfile),
        "prompts_differ": prompt_differ, "prefix_keys_differ": key_differ, "answers_differ": answer_differ,
    }, args)  # fmt: skip
    print(f"wrote {args.out}")
    return 1 if prompt_differ or key_differ or answer_differ or len(ours) != len(theirs) else 0


if __name__ == "__main__":
    sys.exit(main())
