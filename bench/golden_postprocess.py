"""Post-processing unchanged? Compares context.cut.postprocess with its single-file version at a git
revision (4e3c2fc, before issue 13 split it), on every case of the dev sets.

    .venv/bin/python bench/golden_postprocess.py [--rev 4e3c2fc]

For each case: ``completion_mode``, ``syntax_ok`` of the true middle, and for five made-up
generations (the middle, the middle running on into the suffix, a leading line break, tabs for
spaces, half the middle; each with a random ending: a special token, a chat fence, blank lines),
two healed values and both modes, ``find_stop`` and ``postprocess`` truncated or not, partial or
not. Prints the number of calls and of differences (and each differing case's id); exit 1 when
any differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import context.cut.postprocess as new  # noqa: E402
from context.cut.control_tokens import strip_control_tokens  # noqa: E402

EVAL = Path(os.environ.get("EMBER_EVAL_DIR") or ROOT.parent / "shared" / "eval")
ENDINGS = ["", "<|endoftext|>", "<|file_sep|>x", "\n\n```\nThis function returns it.\n", "\n\n\n"]


def old_module(rev: str):  # noqa: ANN201 - a module object loaded from a file
    # context/cut/postprocess.py since context's rooms (issue 28), context/postprocess.py before.
    shown = [subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
             for path in ("context/cut/postprocess.py", "context/postprocess.py")]
    source = next((run for run in shown if run.returncode == 0), shown[-1])
    source.check_returncode()
    path = Path(tempfile.mkdtemp()) / "old_postprocess.py"
    path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location("old_postprocess", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_postprocess"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="4e3c2fc")
    args = parser.parse_args()
    old = old_module(args.rev)
    rng = random.Random(3)
    rows = [json.loads(line) for name in ("humaneval_infilling_dev.jsonl", "safim_dev.jsonl", "crossfile_dev.jsonl")
            for line in (EVAL / name).read_text().splitlines()]
    calls = differences = 0
    for case in rows:
        prefix, suffix, lang, middle = case["prefix"][-8000:], case["suffix"][:8000], case["language"], case["middle"]
        same = old.completion_mode(prefix, suffix, lang) == new.completion_mode(prefix, suffix, lang)
        same &= old.syntax_ok(prefix, middle, suffix, lang) == new.syntax_ok(prefix, middle, suffix, lang)
        for generated in (middle, middle + suffix[:300], "\n" + middle, middle.replace("    ", "\t"), middle[: len(middle) // 2]):
            generated += rng.choice(ENDINGS)
            text = strip_control_tokens(generated)
            for healed in ("", " "):
                for mode in ("single", "multi"):
                    calls += 1
                    same &= old.find_stop(generated, prefix, suffix, lang, mode, healed=healed) == new.find_stop(
                        generated, prefix, suffix, lang, mode, healed=healed
                    )
                    for truncated in (False, True):
                        for partial in (False, True):
                            calls += 1
                            options = {"healed": healed, "truncated": truncated, "partial": partial}
                            same &= old.postprocess(text, prefix, suffix, lang, mode, **options) == new.postprocess(
                                text, prefix, suffix, lang, mode, **options
                            )
        if not same:
            differences += 1
            print("differs:", case["source"], case["id"])
    print(f"{calls} calls over {len(rows)} cases against {args.rev}: {differences} cases differ")
    return 1 if differences else 0


if __name__ == "__main__":
    raise SystemExit(main())
