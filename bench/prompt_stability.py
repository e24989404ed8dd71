"""How much of each prompt can the engine reuse from the previous one while the user types?

    .venv/bin/python bench/prompt_stability.py [--max-files N] [--points K] [--every C]

Replays typing through real source files of pinned releases (PyPI sdists of requests and flask,
npm tarballs of express, zod and immer; fetched once into ``bench/.cache/repos``): at a few
functions of each file the body is deleted and typed back one character at a time, the document
kept in sync incrementally as an editor would, with a completion request every ``--every``
characters (an editor's debounce). At each request the prompt is built by ember's builder
(``build_prompt``) and by the naive baseline (``build_naive_prompt``: last lines before the
cursor, next lines after), for three layouts: prefix-only (SmolLM2, ember's default model),
Qwen2.5-Coder PSM and StarCoder2 SPM. Both prompts are tokenized with the real SmolLM2 tokenizer
(for the FIM layouts the point is where the parts go, not the exact ids).

``shared`` = longest common token prefix with the previous request's prompt / tokens of the current
prompt: the fraction a prefix-caching engine (vLLM) does not prefill again. ``block32`` rounds the
shared prefix down to whole 32-token KV blocks, as vLLM on CPU caches them. ``prefill`` is the mean
number of tokens left to prefill per request.

Prints a table per strategy/layout/language and writes bench/results/prompt_stability.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path

from bench.harness import CACHE, RESULTS, ROOT, percentile, write_results
from context.prompt.builder import PromptBudget, build_naive_prompt, build_prompt
from context.prompt.fim import PREFIX_ONLY, TEMPLATES, FimTemplate
from context.source.document import Document
from context.source.languages import normalize_language_id

REPOS = CACHE / "repos"
OUT = RESULTS / "prompt_stability.json"

# (release, files inside the archive): real code of different shapes, several hundred lines each.
SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pypi:requests==2.32.3", ("src/requests/models.py", "src/requests/sessions.py", "src/requests/utils.py")),
    ("pypi:flask==3.0.3", ("src/flask/app.py", "src/flask/cli.py", "src/flask/sansio/scaffold.py")),
    ("npm:express@4.19.2", ("lib/response.js", "lib/router/index.js", "lib/application.js")),
    ("npm:zod@3.23.8", ("lib/types.js",)),
    ("npm:immer@10.1.1", ("src/core/proxy.ts", "src/plugins/patches.ts", "src/core/immerClass.ts", "src/plugins/mapset.ts")),
)
LAYOUTS: dict[str, FimTemplate] = {
    "prefix-only": PREFIX_ONLY,
    "qwen2.5-coder PSM": TEMPLATES["qwen2.5-coder"],
    "starcoder2 SPM": TEMPLATES["starcoder2"],
}
BUILDERS = {"ember": build_prompt, "naive": build_naive_prompt}
_FUNCTION_TYPES = frozenset(
    {"function_definition", "function_declaration", "method_definition", "function_expression", "arrow_function", "function"}
)


# ------------------------------------------------------------------------------------ sources


def fetch(spec: str) -> Path:
    """The release archive of ``pypi:name==version`` (sdist, via pip) or ``npm:name@version`` (via
    npm pack), downloaded once into the cache (shared with bench/quality.py)."""
    REPOS.mkdir(parents=True, exist_ok=True)
    kind, _, what = spec.partition(":")
    if kind == "pypi":
        name, version = what.split("==")
        archive = REPOS / f"{name}-{version}.tar.gz"
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", "-d", str(REPOS), what]
    else:
        name, version = what.rsplit("@", 1)
        archive = REPOS / f"{name}-{version}.tgz"
        command = ["npm", "pack", "--silent", what]
    if not archive.is_file():
        subprocess.run(command, cwd=REPOS, check=True, stdout=subprocess.DEVNULL)
    if not archive.is_file():
        raise RuntimeError(f"{spec}: {archive.name} was not downloaded")
    return archive


def read_sources(spec: str, wanted: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """(path, text) of the wanted files of a release, in the order given."""
    archive = fetch(spec)
    with tarfile.open(archive) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile() and "/" in m.name}
        for path in wanted:
            member = members.get(path)
            if member is None:
                raise RuntimeError(f"{archive.name} has no {path}")
            handle = tar.extractfile(member)
            assert handle is not None
            yield f"{archive.name.split('.t')[0]}/{path}", handle.read().decode("utf-8")


# ------------------------------------------------------------------------------------ replay


@dataclass(frozen=True)
class Point:
    """A function body to delete (``start``..``end``) and type back."""

    name: str
    start: int
    end: int


def pick_points(doc: Document, count: int, max_chars: int) -> list[Point]:
    """Up to ``count`` function bodies spread over the file (later ones first matter most for the
    anchor, so the picks are at 40%, 70% and 95% of the candidates)."""
    if doc.tree is None:
        return []
    text = doc.text
    found: list[Point] = []
    stack = [doc.tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.named_children))
        if node.type not in _FUNCTION_TYPES:
            continue
        body = node.child_by_field_name("body")
        if body is None or body.end_point[0] - body.start_point[0] < 3:
            continue
        start = doc.offset_from_byte(body.start_byte)
        end = doc.offset_from_byte(body.end_byte)
        if body.type == "block":  # python: the statements, from their line's start
            start = text.rfind("\n", 0, start) + 1
        else:  # braces: the lines between the opening and the closing brace
            start = text.index("\n", start) + 1
            end = text.rfind("\n", 0, end) + 1
        if 60 <= end - start <= max_chars:
            name = node.child_by_field_name("name")
            label = name.text.decode() if name is not None and name.text else node.type
            found.append(Point(label, start, end))
    found.sort(key=lambda p: p.start)
    unique = [p for i, p in enumerate(found) if i == 0 or p.start >= found[i - 1].end]
    if not unique:
        return []
    fractions = (0.95, 0.7, 0.4, 0.2, 0.55)[:count]
    picks = sorted({min(len(unique) - 1, int(f * len(unique))) for f in fractions})
    return [unique[i] for i in picks]


@dataclass
class Series:
    shared: list[float] = field(default_factory=list)
    block32: list[float] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in chunks first: prompts share long runs, so this is close to a memcmp.
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


def replay(
    doc: Document,
    point: Point,
    every: int,
    encode,  # texts -> token id lists (batched tokenizer call)
    counter,
    budget: PromptBudget,
    series: dict[tuple[str, str, str], Series],
    timings: dict[str, list[float]],
    language: str,
) -> int:
    """Delete the body at ``point``, type it back, build and compare prompts; returns requests."""
    typed = doc.text[point.start : point.end]
    doc.apply_change("", (doc.position_at(point.start), doc.position_at(point.end)))
    previous: dict[tuple[str, str], list[int]] = {}
    offset = point.start
    requests = 0
    for i, ch in enumerate(typed):
        pos = doc.position_at(offset)
        doc.apply_change(ch, (pos, pos))
        offset += 1
        if (i + 1) % every and i + 1 != len(typed):
            continue
        requests += 1
        cursor_byte = doc.byte_offset(offset)
        texts: list[str] = []
        keys: list[tuple[str, str]] = []
        for strategy, builder in BUILDERS.items():
            for layout, template in LAYOUTS.items():
                started = time.perf_counter()
                prompt = builder(
                    doc.text,
                    offset,
                    uri=doc.uri,
                    language_id=doc.language_id,
                    tree=doc.tree,
                    cursor_byte=cursor_byte,
                    template=template,
                    counter=counter,
                    budget=budget,
                )
                timings[strategy].append((time.perf_counter() - started) * 1000)
                texts.append(prompt.text)
                keys.append((strategy, layout))
        for key, ids in zip(keys, encode(texts)):
            before = previous.get(key)
            previous[key] = ids
            if before is None:
                continue
            shared = common_prefix(before, ids)
            s = series.setdefault((key[0], key[1], language), Series())
            s.shared.append(shared / len(ids))
            s.block32.append((shared // 32 * 32) / len(ids))
            s.prefill.append(len(ids) - shared)
            s.tokens.append(len(ids))
    return requests


# ------------------------------------------------------------------------------------ report


def summarize(s: Series) -> dict[str, float]:
    return {
        "requests": len(s.shared),
        "median": statistics.median(s.shared),
        "p10": percentile(s.shared, 0.10),
        "mean": statistics.fmean(s.shared),
        "block32_median": statistics.median(s.block32),
        "block32_mean": statistics.fmean(s.block32),
        "prefill_mean": statistics.fmean(s.prefill),
        "prompt_tokens_mean": statistics.fmean(s.tokens),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, default=2, help="function bodies retyped per file (default 2)")
    parser.add_argument("--every", type=int, default=4, help="characters typed between requests (default 4)")
    parser.add_argument("--max-body", type=int, default=1000, help="longest body retyped, in characters")
    parser.add_argument("--max-files", type=int, default=0, help="only the first N files (0: all)")
    parser.add_argument("--prefix-tokens", type=int, default=PromptBudget().prefix_tokens)
    parser.add_argument("--suffix-tokens", type=int, default=PromptBudget().suffix_tokens)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.models import resolve_bundled

    model = resolve_bundled()
    # The Rust tokenizer under the transformers wrapper: the same ids, a third of the overhead.
    backend = AutoTokenizer.from_pretrained(model.path).backend_tokenizer

    class Counter:
        def count(self, text: str) -> int:
            return len(backend.encode(text, add_special_tokens=False).ids)

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    counter = Counter()
    budget = PromptBudget(prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens)
    try:
        files = [item for spec, wanted in SOURCES for item in read_sources(spec, wanted)]
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        print(f"could not fetch the pinned sources (PyPI and npm are needed once): {exc}", file=sys.stderr)
        return 2
    if args.max_files:
        files = files[: args.max_files]

    series: dict[tuple[str, str, str], Series] = {}
    timings: dict[str, list[float]] = {name: [] for name in BUILDERS}
    per_file: list[dict[str, object]] = []
    started = time.perf_counter()
    for path, text in files:
        language = normalize_language_id("", path)
        points = pick_points(Document(f"file:///{path}", language, text), args.points, args.max_body)
        for point in points:
            doc = Document(f"file:///{path}", language, text)
            n = replay(doc, point, args.every, encode, counter, budget, series, timings, language)
            per_file.append({"file": path, "function": point.name, "chars": point.end - point.start, "requests": n, "lines": text.count("\n") + 1})
        print(f"  {path}: {len(points)} bodies, {text.count(chr(10)) + 1} lines", file=sys.stderr)
    elapsed = time.perf_counter() - started

    rows = []
    for (strategy, layout, language), s in sorted(series.items()):
        rows.append({"strategy": strategy, "layout": layout, "language": language, **summarize(s)})
    for strategy in BUILDERS:
        for layout in LAYOUTS:
            merged = Series()
            for (st, la, _), s in series.items():
                if st == strategy and la == layout:
                    merged.shared += s.shared
                    merged.block32 += s.block32
                    merged.prefill += s.prefill
                    merged.tokens += s.tokens
            if merged.shared:
                rows.append({"strategy": strategy, "layout": layout, "language": "all", **summarize(merged)})

    header = f"{'strategy':8} {'layout':18} {'language':10} {'n':>5} {'median':>7} {'p10':>6} {'mean':>6} {'blk32':>6} {'prefill':>8} {'tokens':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['strategy']:8} {row['layout']:18} {row['language']:10} {row['requests']:>5} {row['median']:>7.3f} "
            f"{row['p10']:>6.3f} {row['mean']:>6.3f} {row['block32_mean']:>6.3f} {row['prefill_mean']:>8.1f} {row['prompt_tokens_mean']:>7.0f}"
        )
    build_ms = {
        name: {"median": statistics.median(v), "p90": percentile(v, 0.9), "max": max(v)} for name, v in timings.items() if v
    }
    for name, t in build_ms.items():
        print(f"build {name}: median {t['median']:.2f} ms, p90 {t['p90']:.2f} ms (tokenizer counting included)")
    print(f"{sum(int(f['requests']) for f in per_file)} requests over {len(per_file)} bodies in {elapsed:.0f} s")

    write_results(OUT, {
        "benchmark": "prompt_stability",
        "metric": "shared = longest common token prefix with the previous request / current prompt tokens",
        "tokenizer": model.name,
        "sources": [spec for spec, _ in SOURCES],
        "config": {"every_chars": args.every, "points_per_file": args.points, "max_body_chars": args.max_body,
                   "prefix_tokens": budget.prefix_tokens, "suffix_tokens": budget.suffix_tokens},
        "results": rows, "build_ms": build_ms, "bodies": per_file, "elapsed_s": round(elapsed, 1),
    }, args)  # fmt: skip
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
