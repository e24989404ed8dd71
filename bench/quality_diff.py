"""Did a change alter ember's completions? Compares bench/quality.py result files case by case.

    .venv/bin/python bench/quality_diff.py BEFORE.json AFTER.json [AFTER2.json ...]
        [--rerun BEFORE_C1.json AFTER_C1.json] [--out bench/results/quality-diff.json]

BEFORE and AFTER are quality.py runs of two commits (AFTER may come in several files, e.g. one per
dev set). For the cases both ran it prints, per source, how many completions are the same, and
for the others whether a 60 s deadline was involved (``timeout`` on either side) and whether the
prompt was the same size (``prompt_tokens``, the engine's own count) and the mode the same.
Batched greedy decoding on vLLM's CPU backend is not deterministic when the batch differs, so a
difference with equal prompts is settled by ``--rerun``: the differing cases run again through
both commits one at a time (``quality.py --concurrency 1 --cases DIFF.jsonl``; ``--write-cases``
writes that file). Writes a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

EVAL = Path(os.environ.get("EMBER_EVAL_DIR") or Path(__file__).resolve().parents[2] / "shared" / "eval")
Key = tuple[str, str]


def records(paths: list[Path]) -> tuple[dict[Key, dict[str, Any]], list[str]]:
    by_key: dict[Key, dict[str, Any]] = {}
    commits = []
    for path in paths:
        data = json.loads(path.read_text())
        commits.append(str(data.get("commit")))
        for record in data["records"]:
            by_key[(record["source"], record["id"])] = record
    return by_key, commits


def compare(before: dict[Key, dict[str, Any]], after: dict[Key, dict[str, Any]]) -> dict[str, Any]:
    common = sorted(set(before) & set(after))
    rows: dict[str, Counter[str]] = defaultdict(Counter)
    differing = []
    for key in common:
        x, y = before[key], after[key]
        row = rows[key[0]]
        row["cases"] += 1
        row["same prompt_tokens"] += x["prompt_tokens"] == y["prompt_tokens"]
        row["same mode"] += x["mode"] == y["mode"]
        if x["completion"] == y["completion"]:
            row["same completion"] += 1
            continue
        differing.append(key)
        row["differ: a timeout" if "timeout" in (x["outcome"], y["outcome"]) else "differ: both answered"] += 1
    return {"common": len(common), "by_source": {s: dict(c) for s, c in sorted(rows.items())}, "differing": differing}


def print_table(by_source: dict[str, dict[str, int]]) -> None:
    columns = ["cases", "same completion", "differ: a timeout", "differ: both answered", "same prompt_tokens", "same mode"]
    print("source".ljust(24) + "".join(c.rjust(23) for c in columns))
    for source, row in by_source.items():
        print(source.ljust(24) + "".join(str(row.get(c, 0)).rjust(23) for c in columns))


def write_cases(keys: list[Key], path: Path) -> None:
    wanted = set(keys)
    with path.open("w") as out:
        for name in ("humaneval_infilling_dev.jsonl", "safim_dev.jsonl", "crossfile_dev.jsonl"):
            for line in (EVAL / name).read_text().splitlines():
                case = json.loads(line)
                if (case["source"], case["id"]) in wanted:
                    out.write(line + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path, nargs="+")
    parser.add_argument("--rerun", type=Path, nargs=2, metavar=("BEFORE_C1", "AFTER_C1"))
    parser.add_argument("--write-cases", type=Path, help="write the differing cases as jsonl (for the rerun)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "quality-diff.json")
    args = parser.parse_args()

    before, before_commits = records([args.before])
    after, after_commits = records(args.after)
    result = compare(before, after)
    print(f"before {before_commits} vs after {after_commits}: {result['common']} cases in both\n")
    print_table(result["by_source"])
    summary: dict[str, Any] = {
        "before": {"files": [str(args.before)], "commits": before_commits},
        "after": {"files": [str(p) for p in args.after], "commits": after_commits},
        **result,
    }
    if args.write_cases:
        write_cases(result["differing"], args.write_cases)
    if args.rerun:
        again_before, _ = records([args.rerun[0]])
        again_after, _ = records([args.rerun[1]])
        rerun = compare(again_before, again_after)
        same = rerun["common"] - len(rerun["differing"])
        print(f"\nrerun one at a time: {rerun['common']} of the {len(result['differing'])} differing cases, same completion {same}")
        summary["rerun"] = {"files": [str(p) for p in args.rerun], **rerun}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary["differing"] = [list(k) for k in summary["differing"]]
    if "rerun" in summary:
        summary["rerun"]["differing"] = [list(k) for k in summary["rerun"]["differing"]]
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
