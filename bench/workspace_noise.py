"""Does the workspace index add anything to single-file prompts, and are the other modes' prompts
today's? Every case of the HumanEval and
SAFIM dev sets is laid out as a workspace folder holding only its file, and its prompt is built
with ``crossFile: "workspace"`` (retrieval through a real WorkspaceIndex) and without cross-file
context; with ``--base DIR`` also by the checkout in DIR (today's code, without cross-file
context, through the ``build_prompt`` API both share). Identical prompts give identical greedy
completions, so a count of 0 differing prompts means the dev quality cannot move.

With ``--base`` it also builds the cross-file dev set's prompts (../shared/eval/crossfile_dev.jsonl)
as ``crossFile: "open"`` does with only the current file open and with the defining module open as
a tab (``select_snippets`` + ``build_prompt``, in both checkouts): bench/crossfile.py then needs
to run only the three configurations on this checkout, today's numbers being the same prompts.

    .venv/bin/python bench/workspace_noise.py [--base /path/to/checkout] [--limit N]

Prompts: the anchored AST prompt, Qwen2.5-Coder's template, the default budgets at 2048 tokens,
ember's character-based token estimate. Writes bench/results/workspace-noise.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from context.prompt.builder import PromptBudget, PromptRequest, anchored_prompt, build_prompt  # noqa: E402
from context.prompt.fim import TEMPLATES  # noqa: E402
from context.prompt.retrieval import Cursor, OpenFile, WorkspaceView, workspace_context  # noqa: E402
from context.prompt.snippets import select_snippets  # noqa: E402
from context.source.document import Document  # noqa: E402
from context.source.languages import normalize_language_id  # noqa: E402
from context.source.workspace import WorkspaceIndex  # noqa: E402

EVAL = Path(os.environ.get("EMBER_EVAL_DIR") or ROOT.parent / "shared" / "eval")
SETS = ("humaneval_infilling_dev.jsonl", "safim_dev.jsonl")
EXTENSIONS = {"python": ".py", "cpp": ".cpp", "java": ".java", "csharp": ".cs", "c_sharp": ".cs"}
BUDGET = PromptBudget.for_model(2048, 48)
# crossFile "workspace" budgets its context apart (lsp/completer.py:prompt_budget).
WORKSPACE_BUDGET = PromptBudget.for_model(2048, 48, snippet_tokens=2048 // 4)

# Run inside the --base checkout: the md5 of each case's prompt, from the shared build_prompt API.
BASE_SCRIPT = """
import hashlib, json, sys
sys.path.insert(0, ".")
try:  # context's rooms (issue 28), else the flat layout before them
    from context.source.document import Document
    from context.prompt.fim import TEMPLATES
    from context.prompt.builder import PromptBudget, build_prompt
    from context.prompt.snippets import select_snippets
except ImportError:
    from context.document import Document
    from context.fim import TEMPLATES
    from context.prompt import PromptBudget, build_prompt, select_snippets
cases = json.load(sys.stdin)
budget = PromptBudget.for_model(2048, 48)
out = []
for uri, language, text, offset, tabs in cases:
    doc = Document(uri, language, text, 1)
    snippets = select_snippets(text, language, [tuple(t) for t in tabs], budget.snippet_chars) if tabs else ()
    prompt = build_prompt(text, offset, uri=uri, language_id=language, tree=doc.tree,
                          template=TEMPLATES["qwen2.5-coder"], budget=budget, heal=True, snippets=snippets)
    out.append(hashlib.md5(prompt.text.encode("utf-8", "surrogatepass")).hexdigest())
json.dump(out, sys.stdout)
"""
REPOS = ROOT / "bench" / ".cache" / "crossfile-repos"


def md5(text: str) -> str:
    return hashlib.md5(text.encode("utf-8", "surrogatepass")).hexdigest()


def load(limit: int | None) -> list[dict]:
    cases = []
    for name in SETS:
        rows = [json.loads(line) for line in (EVAL / name).read_text().splitlines() if line.strip()]
        cases += rows[:limit] if limit else rows
    return cases


def base_prompts(base: Path, inputs: list) -> list[str]:
    run = subprocess.run([sys.executable, "-c", BASE_SCRIPT], cwd=base, input=json.dumps(inputs),
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def crossfile_prompts(base: Path, limit: int | None) -> tuple[list[str], list[str], list[str]]:
    """(label, md5 here, md5 in ``base``) of each cross-file case's prompt with the current file
    only and with the defining module as a tab, as crossFile "open" builds them."""
    rows = [json.loads(line) for line in (EVAL / "crossfile_dev.jsonl").read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    budget = BUDGET
    labels, ours, inputs = [], [], []
    for row in rows:
        name, _, version = row["repo"].partition("==")
        folder = REPOS / f"{name.lower()}-{version}"
        path = folder / row["path"]
        defining = folder / row["defined_in"]
        text, offset = row["prefix"] + row["suffix"], len(row["prefix"])
        doc = Document(path.as_uri(), "python", text, 1)
        for config, tabs in (("current", []), ("tab", [(defining.as_uri(), defining.read_text()[:200_000])])):
            snippets = select_snippets(text, "python", tabs, budget.snippet_chars) if tabs else ()
            prompt = build_prompt(text, offset, uri=doc.uri, language_id="python", tree=doc.tree,
                                  template=TEMPLATES["qwen2.5-coder"], budget=budget, heal=True, snippets=snippets)
            labels.append(f"{row['id']}:{config}")
            ours.append(md5(prompt.text))
            inputs.append((doc.uri, "python", text, offset, tabs))
    return labels, ours, base_prompts(base, inputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a checkout of today's code to compare prompts with")
    parser.add_argument("--limit", type=int, help="cases per set")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "workspace-noise.json")
    args = parser.parse_args()

    cases = load(args.limit)
    qwen = TEMPLATES["qwen2.5-coder"]
    plain_md5: list[str] = []
    differ, with_snippets, inputs = [], 0, []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for n, case in enumerate(cases):
            language = normalize_language_id(case["language"])
            folder = Path(tmp) / f"case{n}"
            folder.mkdir()
            path = folder / f"main{EXTENSIONS.get(language, '.txt')}"
            text = case["prefix"] + case["suffix"]
            path.write_text(text, encoding="utf-8")
            uri, offset = path.as_uri(), len(case["prefix"])
            doc = Document(uri, language, text, 1)
            inputs.append((uri, language, text, offset, []))
            plain = build_prompt(text, offset, uri=uri, language_id=language, tree=doc.tree, template=qwen, budget=BUDGET, heal=True)
            index = WorkspaceIndex([str(folder)])
            index.scan()
            view = WorkspaceView(index, {str(path): OpenFile(text, language)})
            cross = workspace_context(view, Cursor(str(path), text, offset, language), WORKSPACE_BUDGET.snippet_chars)
            with_snippets += bool(cross.snippets)
            workspace = anchored_prompt(PromptRequest(text, offset, uri=uri, language_id=language, tree=doc.tree,
                                                      template=qwen, budget=WORKSPACE_BUDGET, heal=True, cross_file=cross))
            plain_md5.append(md5(plain.text))
            if workspace.text != plain.text:
                differ.append(case["id"])
    elapsed = time.perf_counter() - started
    base_differ: list[str] | None = None
    crossfile_differ: list[str] | None = None
    if args.base is not None:
        base_md5 = base_prompts(args.base, inputs)
        base_differ = [case["id"] for case, a, b in zip(cases, plain_md5, base_md5, strict=True) if a != b]
        labels, ours, theirs = crossfile_prompts(args.base, args.limit)
        crossfile_differ = [label for label, a, b in zip(labels, ours, theirs, strict=True) if a != b]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    base_commit = (subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.base, capture_output=True, text=True).stdout.strip()
                   if args.base else None)
    print(f"{len(cases)} cases ({', '.join(SETS)}), commit {commit}, {elapsed:.1f} s")
    print(f"  workspace context found for        {with_snippets:5d} cases")
    print(f"  prompts differing, workspace vs off {len(differ):5d}")
    if base_differ is not None and crossfile_differ is not None:
        print(f"  prompts differing, HEAD vs {base_commit}    {len(base_differ):5d}")
        print(f"crossfile_dev current-file and open-tab prompts ({len(labels)}), crossFile \"open\":")
        print(f"  prompts differing, HEAD vs {base_commit}    {len(crossfile_differ):5d}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "commit": commit, "base": base_commit, "cases": len(cases), "sets": SETS, "with_snippets": with_snippets,
        "differ_workspace_vs_off": differ, "differ_head_vs_base": base_differ,
        "crossfile_open_prompts_differ_head_vs_base": crossfile_differ,
    }, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
