"""How often are ember's completions right? Measured through its real LSP server over stdio.

    .venv/bin/python bench/quality.py --limit 150 --strategy ast --strategy naive
    .venv/bin/python bench/quality.py --model qwen-coder --limit 100
    .venv/bin/python bench/quality.py --no-dev --repo-cuts --limit 60

Each case (a jsonl line with id/source/language/prefix/suffix/middle, like
../shared/eval/*.jsonl beside the checkout, or $EMBER_EVAL_DIR) is opened as a document holding ``prefix + suffix`` with the right
languageId and extension, completed with ``textDocument/inlineCompletion`` at the cursor, then
closed. The completion is compared with ``middle``:

* ``exact_line``: the first non-blank lines are equal (trailing whitespace ignored);
* ``exact``: the whole texts are equal (line endings and trailing whitespace ignored);
* ``edit_sim``: 1 - Levenshtein / max length over the whole (normalized) texts;
* ``syntax_ok``: :func:`context.cut.postprocess.syntax_ok` (no new tree-sitter ERROR/MISSING node);
  ``-`` for languages without a grammar (C# here), where it would say True for anything;
* latency: the server's ``latency_ms`` for the request (``ember/stats`` ``last_for_uri``), p50/p95.

One server runs per strategy (``--strategy`` repeated compares them on the same cases): ``ast``
(ember as built), ``classic`` (ember with ``fimLayout: "classic"``: a prefix-suffix-middle model
gets everything before the cursor before the suffix, the layout before "append"), ``naive`` (the last-lines prompt, ember's post-processing: what the prompt
buys) and ``plain`` (the naive prompt and the model's text cut at line breaks only: what
post-processing by syntax buys). The servers run side by side and take turns case by case, so
that their latencies see the same load. ``--concurrency N`` keeps N cases in flight per server
(the engine batches them): a full dev-set run takes a fraction of the time, the scores are those
of greedy decoding all the same, but latencies include queueing.
``--typed K`` moves each cursor K characters into the first line of code of its middle (past its
indentation, where the line is longer than that), as if the user had typed them: cursors inside
words and after operators, where the end of the prompt meets the model's first token.
``--repo-cuts`` adds cases cut from pinned releases of real projects (PyPI sdists of requests and
flask, the npm tarball of express), like llm-ls's testbed: one line cut at its first non-blank
character (``repo-line``), and multi-line function bodies (``repo-body``).

ember's completion cache / typed-through reuse and its warm-up are off unless ``--reuse`` /
``--warmup``: each case is opened once, and with a prefix-only model two cases sharing a prefix
would otherwise get one cached answer. ``--limit`` applies to each input (jsonl file, repo cuts).
SAFIM ids repeat across its sources: a record is identified by (source, id).

Prints tables and writes bench/results/quality-<model>.json (per-case records included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
from lsprotocol import types

from bench.harness import (
    CACHE,
    EVAL,
    RESULTS,
    Ember,
    add_model_args,
    commit,
    ember_command,
    fmt,
    machine,
    percentile,
    resolve_model,
    settings,
)  # fmt: skip
from context.cut.postprocess import syntax_ok
from context.source.languages import grammar_for, normalize_language_id, parser_for
from lsp.config import parse_engine_arg

# The public eval sets: ../shared/eval beside the checkout, or $EMBER_EVAL_DIR.
DEV_FILES = [EVAL / "humaneval_infilling_dev.jsonl", EVAL / "safim_dev.jsonl"]
SEED = 20240607
PCT = (".1f", 100)  # fmt() of a share as a percentage
STOP = threading.Event()  # set by SIGTERM

EXTENSIONS = {
    "python": ".py",
    "cpp": ".cpp",
    "c": ".c",
    "java": ".java",
    "csharp": ".cs",
    "javascript": ".js",
    "typescript": ".ts",
    "go": ".go",
    "rust": ".rs",
}

# Pinned releases for --repo-cuts: (name, how to fetch, language, which files inside the archive).
REPOS: list[tuple[str, str, str, str]] = [
    ("requests", "pypi:requests==2.32.3", "python", r"^requests-2\.32\.3/src/requests/[^/]+\.py$"),
    ("flask", "pypi:flask==3.0.3", "python", r"^flask-3\.0\.3/src/flask/[^/]+\.py$"),
    ("express", "npm:express@4.19.2", "javascript", r"^package/(index|lib/.*)\.js$"),
]


@dataclass
class Case:
    id: str
    source: str
    language: str
    prefix: str
    suffix: str
    middle: str
    group: str = ""  # the input it came from (file stem or "repo-cuts"), for sampling and tables


@dataclass
class Record:
    id: str
    source: str
    language: str
    strategy: str
    completion: str
    exact_line: bool
    exact: bool
    edit_sim: float
    syntax_ok: bool | None
    latency_ms: float | None
    ttft_ms: float | None
    client_ms: float
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    streamed_tokens: int | None = None
    cache_hit: bool | None = None
    outcome: str | None = None
    mode: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # The confidence gate's view of the answer (ember/stats; bench/confidence.py fits on these).
    confidence: float | None = None
    shown: str | None = None
    kept_tokens: int | None = None
    logprob_min: float | None = None
    logprob_mean: float | None = None
    layout: str | None = None
    layout_fallback: bool | None = None


# ---------------------------------------------------------------------------------------- cases


def load_cases(path: Path) -> list[Case]:
    cases = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                cases.append(
                    Case(d["id"], d["source"], d["language"], d["prefix"], d["suffix"], d["middle"], path.stem)
                )
    return cases


def typed_into(case: Case, k: int) -> Case:
    """``case`` with its cursor ``k`` characters into the middle's first line of code, past that
    line's indentation (unchanged where the line has no more than ``k`` characters of code)."""
    first = case.middle.split("\n", 1)[0]
    code = first.lstrip(" \t")
    if len(code.rstrip()) <= k:
        return case
    cut = len(first) - len(code) + k
    return replace(case, prefix=case.prefix + case.middle[:cut], middle=case.middle[cut:])


def sample(cases: list[Case], limit: int | None, seed: int = SEED) -> list[Case]:
    """``limit`` cases, stratified by source (proportional, largest remainder, at least one per
    source when the limit allows), the same ones on every run: ids are sorted before shuffling."""
    if limit is None or limit >= len(cases):
        return cases
    by_source: dict[str, list[Case]] = defaultdict(list)
    for case in sorted(cases, key=lambda c: c.id):
        by_source[case.source].append(case)
    sources = sorted(by_source)
    total = len(cases)
    exact = {s: limit * len(by_source[s]) / total for s in sources}
    counts = {s: int(exact[s]) for s in sources}
    if limit >= len(sources):
        for s in sources:
            counts[s] = max(counts[s], 1)
    for s in sorted(sources, key=lambda s: exact[s] - int(exact[s]), reverse=True):
        if sum(counts.values()) >= limit:
            break
        counts[s] += 1
    while sum(counts.values()) > limit:  # the "at least one" rule overshot: take from the biggest
        biggest = max(sources, key=lambda s: counts[s])
        counts[biggest] -= 1
    picked: list[Case] = []
    for s in sources:
        pool = list(by_source[s])
        random.Random(f"{seed}:{s}").shuffle(pool)
        picked.extend(pool[: counts[s]])
    return picked


# ------------------------------------------------------------------------------------ repo cuts


def fetch_repo(spec: str, dest: Path) -> Path:
    """The release archive of ``pypi:name==version`` (sdist, via pip) or ``npm:name@version``
    (via npm pack), downloaded once into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    kind, _, what = spec.partition(":")
    if kind == "pypi":
        name, version = what.split("==")
        found = [p for p in dest.glob(f"{name}-{version}.tar.gz")]
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                 "-d", str(dest), what],
                check=True,
            )
            found = [p for p in dest.glob(f"{name}-{version}.tar.gz")]
    elif kind == "npm":
        name, version = what.rsplit("@", 1)
        found = [p for p in dest.glob(f"{name}-{version}.tgz")]
        if not found:
            subprocess.run(["npm", "pack", "--silent", what], cwd=dest, check=True, stdout=subprocess.DEVNULL)
            found = [p for p in dest.glob(f"{name}-{version}.tgz")]
    else:
        raise ValueError(f"unknown repo spec {spec!r}")
    if not found:
        raise RuntimeError(f"could not fetch {spec}")
    return found[0]


def archive_sources(archive: Path, pattern: str, max_bytes: int = 100_000) -> Iterator[tuple[str, str]]:
    """(path, text) of the matching files of a .tar.gz/.tgz, in name order."""
    regex = re.compile(pattern)
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and regex.search(m.name)), key=lambda m: m.name)
        for member in members:
            if member.size > max_bytes:
                continue
            handle = tar.extractfile(member)
            if handle is None:
                continue
            try:
                yield member.name, handle.read().decode("utf-8")
            except UnicodeDecodeError:
                continue


_FUNCTIONS = {
    "python": {"function_definition"},
    "javascript": {
        "function_declaration", "function_expression", "function", "method_definition",
        "arrow_function", "generator_function_declaration", "generator_function",
    },
}
_SKIP_LINE = re.compile(r"^(?:#|//|/\*|\*|[)\]}]+[;,)]*$|else\b|\"\"\"|''')")


def _in_string_or_comment(node: Any) -> bool:
    while node is not None:
        if "string" in node.type or "comment" in node.type or node.type == "template_string":
            return True
        node = node.parent
    return False


def _walk(node: Any) -> Iterator[Any]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(current.children))


def cut_lines(path: str, text: str, language: str) -> list[Case]:
    """Every code line as a case: cursor after its indentation, the rest of the line is the middle."""
    parser = parser_for(language)
    data = text.encode("utf-8")
    tree = parser.parse(data) if parser else None
    cases = []
    offset = 0
    for row, line in enumerate(text.split("\n")):
        start = offset
        offset += len(line) + 1
        stripped = line.strip()
        if not (6 <= len(stripped) <= 100) or _SKIP_LINE.match(stripped):
            continue
        indent = len(line) - len(line.lstrip())
        if tree is not None:
            column = len(line[:indent].encode("utf-8"))
            node = tree.root_node.descendant_for_point_range((row, column), (row, column))
            if _in_string_or_comment(node):
                continue
        cursor = start + indent
        cases.append(
            Case(
                id=f"{path}:L{row + 1}:line",
                source="repo-line",
                language=language,
                prefix=text[:cursor],
                suffix=text[cursor + len(line.rstrip()) - indent :],
                middle=line.rstrip()[indent:],
                group="repo-cuts",
            )
        )
    return cases


def cut_bodies(path: str, text: str, language: str, min_lines: int = 2, max_lines: int = 12) -> list[Case]:
    """Function bodies of ``min_lines``..``max_lines`` lines as cases: the cursor at the first
    statement (after the docstring in Python), the middle up to the end of the last statement's line."""
    parser = parser_for(language)
    if parser is None:
        return []
    data = text.encode("utf-8")
    tree = parser.parse(data)
    cases = []
    for node in _walk(tree.root_node):
        if node.type not in _FUNCTIONS.get(language, ()):
            continue
        body = node.child_by_field_name("body")
        if body is None or body.type not in ("block", "statement_block"):
            continue
        statements = [c for c in body.named_children]
        if language == "python" and statements and _is_docstring(statements[0]):
            statements = statements[1:]
        if not statements or statements[0].start_point[0] <= node.start_point[0]:
            continue  # empty, or the body starts on the header's line
        if language == "python" and any(c.type == "comment" for c in statements[:1]):
            continue
        first, last = statements[0], statements[-1]
        end = data.find(b"\n", last.end_byte)
        end = len(data) if end < 0 else end
        lines = data[first.start_byte : end].count(b"\n") + 1
        if not (min_lines <= lines <= max_lines):
            continue
        # The cursor sits where the editor's auto-indent leaves it: after the first line's indent.
        prefix = data[: first.start_byte].decode("utf-8")
        cases.append(
            Case(
                id=f"{path}:L{first.start_point[0] + 1}:body",
                source="repo-body",
                language=language,
                prefix=prefix,
                suffix=data[end:].decode("utf-8"),
                middle=data[first.start_byte : end].decode("utf-8"),
                group="repo-cuts",
            )
        )
    return cases


def _is_docstring(node: Any) -> bool:
    return node.type == "expression_statement" and node.named_child_count == 1 and node.named_children[0].type == "string"


def repo_cases(per_repo: int, seed: int = SEED) -> tuple[list[Case], list[str]]:
    """``per_repo`` line cuts and ``per_repo`` body cuts from each pinned release (fixed seed)."""
    cases: list[Case] = []
    used: list[str] = []
    for name, spec, language, pattern in REPOS:
        archive = fetch_repo(spec, CACHE / "repos")
        used.append(spec)
        lines: list[Case] = []
        bodies: list[Case] = []
        for path, text in archive_sources(archive, pattern):
            short = f"{name}/{path.split('/', 1)[1]}"
            lines.extend(cut_lines(short, text, language))
            bodies.extend(cut_bodies(short, text, language))
        for pool in (lines, bodies):
            random.Random(f"{seed}:{name}:{pool[0].source if pool else ''}").shuffle(pool)
            cases.extend(pool[:per_repo])
    return cases, used


# ------------------------------------------------------------------------------------- metrics


def normalize(text: str) -> str:
    """Line endings unified, trailing whitespace of every line and of the whole text dropped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).rstrip()


def first_line(text: str) -> str:
    for line in normalize(text).split("\n"):
        if line.strip():
            return line
    return ""


def levenshtein(a: str, b: str) -> int:
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def edit_similarity(a: str, b: str) -> float:
    a, b = normalize(a), normalize(b)
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def has_grammar(language: str) -> bool:
    return grammar_for(normalize_language_id(language)) is not None


def lsp_position(prefix: str) -> types.Position:
    """Where the cursor is: lines split at \\r\\n, \\r and \\n (LSP); characters in UTF-16 units."""
    parts = re.split(r"\r\n|\r|\n", prefix)
    last = parts[-1]
    return types.Position(line=len(parts) - 1, character=len(last.encode("utf-16-le", "surrogatepass")) // 2)


def score(case: Case, completion: str, strategy: str, last: dict[str, Any], client_ms: float, error: str | None) -> Record:
    return Record(
        id=case.id,
        source=case.source,
        language=case.language,
        strategy=strategy,
        completion=completion,
        exact_line=first_line(completion) == first_line(case.middle),
        exact=normalize(completion) == normalize(case.middle),
        edit_sim=edit_similarity(completion, case.middle),
        syntax_ok=syntax_ok(case.prefix, completion, case.suffix, case.language) if has_grammar(case.language) else None,
        latency_ms=last.get("latency_ms"),
        ttft_ms=last.get("ttft_ms"),
        client_ms=client_ms,
        prompt_tokens=last.get("prompt_tokens"),
        cached_tokens=last.get("cached_tokens"),
        streamed_tokens=last.get("streamed_tokens"),
        cache_hit=last.get("cache_hit"),
        outcome=last.get("outcome"),
        mode=last.get("mode"),
        error=error,
        confidence=last.get("confidence"),
        shown=last.get("shown"),
        kept_tokens=last.get("kept_tokens"),
        logprob_min=last.get("logprob_min"),
        logprob_mean=last.get("logprob_mean"),
        layout=last.get("layout"),
        layout_fallback=last.get("layout_fallback"),
    )


def summarize(records: list[Record]) -> dict[str, Any]:
    n = len(records)
    syntax = [r.syntax_ok for r in records if r.syntax_ok is not None]
    latencies = [r.latency_ms for r in records if r.latency_ms is not None]
    outcomes: dict[str, int] = defaultdict(int)
    for r in records:
        outcomes[r.error and "client-error" or r.outcome or "unknown"] += 1
    return {
        "n": n,
        "exact_line": sum(r.exact_line for r in records) / n if n else None,
        "exact": sum(r.exact for r in records) / n if n else None,
        "edit_sim": sum(r.edit_sim for r in records) / n if n else None,
        "syntax_ok": sum(syntax) / len(syntax) if syntax else None,
        "empty": sum(not r.completion.strip() for r in records) / n if n else None,
        "latency_p50_ms": percentile(latencies, 0.5),
        "latency_p95_ms": percentile(latencies, 0.95),
        "outcomes": dict(outcomes),
    }


def groups(records: list[Record]) -> dict[str, list[Record]]:
    """Per source+language, per source, and all."""
    out: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        out[f"{r.source} / {r.language}"].append(r)
    by_source: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_source[r.source].append(r)
    for source, rs in by_source.items():
        if len({r.language for r in rs}) > 1:
            out[f"{source} / all"] = rs
    out["ALL"] = list(records)
    return dict(sorted(out.items(), key=lambda kv: (kv[0] == "ALL", kv[0])))


# ---------------------------------------------------------------------------------- the server


class Server(Ember):
    """ember over stdio with one strategy's initializationOptions (harness.Ember), completing cases."""

    def __init__(self, model_path: str | None, options: dict[str, Any], log_path: Path, engine: str | None = None) -> None:
        super().__init__(ember_command(model_path, engine), options, log_path, name="ember-quality")

    async def complete(self, case: Case, uri: str, timeout_s: float) -> tuple[str, dict[str, Any], float, str | None]:
        """(completion, the server's metrics for it, client-side ms, error)."""
        self.open(uri, case.prefix + case.suffix, normalize_language_id(case.language))
        t0 = time.perf_counter()
        error = None
        completion = ""
        try:
            completion = await asyncio.wait_for(super().complete(uri, lsp_position(case.prefix)), timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failing case is a data point, not the end of the run
            error = f"{type(exc).__name__}: {exc}"
        client_ms = (time.perf_counter() - t0) * 1000
        # Found by uri: with --concurrency other requests finish in between.
        last = (await self.stats(uri)).get("last_for_uri") or {}
        self.close(uri)
        return completion, last, client_ms, error


def case_uri(case: Case, strategy: str, index: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.id)[-80:]
    ext = EXTENSIONS.get(normalize_language_id(case.language), ".txt")
    return f"file:///ember-bench/{strategy}/{index:05d}_{safe}{ext}"


# ------------------------------------------------------------------------------------- reports


def table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Rows: group x strategy; columns: the metrics."""
    header = ["group", "strategy", "n", "EM line%", "EM%", "ES%", "syntax%", "empty%", "p50 ms", "p95 ms"]
    rows = [header]
    strategies = list(summary)
    names = list(next(iter(summary.values())).keys()) if summary else []
    for name in names:
        for strategy in strategies:
            s = summary[strategy].get(name)
            if not s:
                continue
            rows.append(
                [
                    name, strategy, str(s["n"]), fmt(s["exact_line"], *PCT), fmt(s["exact"], *PCT),
                    fmt(s["edit_sim"], *PCT), fmt(s["syntax_ok"], *PCT), fmt(s["empty"], *PCT),
                    fmt(s["latency_p50_ms"]), fmt(s["latency_p95_ms"]),
                ]
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven if neither side is
    better (ties left out)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(records: dict[str, list[Record]]) -> dict[str, dict[str, Any]]:
    """The first strategy against each other one, case by case: where exactly one of the two is
    right (``exact``, ``exact_line``, ``syntax_ok``), and whether the two prompts had the same
    length in tokens (the same prompt, as a rule: a difference there is the engine's batching,
    not the strategy). Totals can differ by a few cases that are noise; these counts say so."""
    strategies = list(records)
    if len(strategies) < 2:
        return {}
    first = {(r.source, r.id): r for r in records[strategies[0]]}
    out: dict[str, dict[str, Any]] = {}
    for other in strategies[1:]:
        row: dict[str, Any] = {"cases": 0, "same_prompt_length": 0}
        for r in records[other]:
            a = first.get((r.source, r.id))
            if a is None:
                continue
            row["cases"] += 1
            same = a.prompt_tokens is not None and a.prompt_tokens == r.prompt_tokens
            row["same_prompt_length"] += same
            for metric in ("exact", "exact_line", "syntax_ok"):
                x, y = getattr(a, metric), getattr(r, metric)
                if x is None or y is None or bool(x) == bool(y):
                    continue
                key = f"{metric}:{strategies[0] if x else other}" + (":same_prompt_length" if same else "")
                row[key] = row.get(key, 0) + 1
        for metric in ("exact", "exact_line", "syntax_ok"):
            wins = sum(v for k, v in row.items() if k.startswith(f"{metric}:{strategies[0]}"))
            losses = sum(v for k, v in row.items() if k.startswith(f"{metric}:{other}"))
            row[f"{metric}_split"] = [wins, losses]
            row[f"{metric}_sign_p"] = round(sign_test(wins, losses), 3)
        out[f"{strategies[0]} vs {other}"] = row
    return out


def paired_table(pairs: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, row in pairs.items():
        first, other = name.split(" vs ")
        lines.append(f"{name}, case by case ({row['cases']} cases, {row['same_prompt_length']} with prompts of equal length):")
        for metric in ("exact_line", "exact", "syntax_ok"):
            wins, losses = row[f"{metric}_split"]
            noise = row.get(f"{metric}:{first}:same_prompt_length", 0) + row.get(f"{metric}:{other}:same_prompt_length", 0)
            lines.append(
                f"  {metric:10s} only {first} right {wins:4d}, only {other} right {losses:4d}"
                f" (sign test p = {row[f'{metric}_sign_p']:.2f}; {noise} of these with prompts of equal length)"
            )
    return "\n".join(lines)


PLOT_METRICS = (("exact_line", "EM line"), ("exact", "EM"), ("edit_sim", "edit sim"), ("syntax_ok", "syntax ok"))


def plot(results: Path) -> Path | None:
    """Bars per case group ("/ all" rows and ALL) and metric, one colour per strategy, from a
    results file; written next to it as .png. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    data = json.loads(results.read_text())
    summary: dict[str, dict[str, Any]] = data["summary"]
    strategies = list(summary)
    groups = list(next(iter(summary.values())))
    per_source = Counter(g.split(" / ")[0] for g in groups)
    # A source's "/ all" row, or its only row (one language): not every language of every source.
    names = [g for g in groups if g == "ALL" or g.endswith("/ all") or per_source[g.split(" / ")[0]] == 1]
    fig, axes = plt.subplots(1, len(PLOT_METRICS), figsize=(4.2 * len(PLOT_METRICS), 0.45 * len(names) * len(strategies) + 1.6), sharey=True)
    width = 0.8 / len(strategies)
    for ax, (key, label) in zip(axes, PLOT_METRICS):
        for k, strategy in enumerate(strategies):
            values = [100 * (summary[strategy].get(g, {}).get(key) or 0) for g in names]
            ax.barh([i + k * width for i in range(len(names))], values, height=width, label=strategy)
        ax.set_title(f"{label} %")
        ax.set_xlim(0, 100)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks([i + width * (len(strategies) - 1) / 2 for i in range(len(names))], names)
    axes[0].invert_yaxis()
    axes[-1].legend(loc="lower right")
    fig.suptitle(f"bench/quality.py: {data.get('model')}, max_tokens {data.get('max_tokens')} ({results.name})")
    fig.tight_layout()
    png = results.with_suffix(".png")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def write_results(path: Path, meta: dict[str, Any], records: dict[str, list[Record]], done: bool) -> None:
    summary = {strategy: {name: summarize(rs) for name, rs in groups(recs).items()} for strategy, recs in records.items() if recs}
    payload = {
        **meta,
        "complete": done,
        "summary": summary,
        "paired": paired(records),
        "records": [asdict(r) for recs in records.values() for r in recs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
    if done:
        plot(path)


# ----------------------------------------------------------------------------------------- main


def server_options(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    """ember's initializationOptions for one strategy."""
    options: dict[str, Any] = {
        "maxTokens": args.max_tokens,
        "timeoutMs": args.timeout_ms,
        "promptStrategy": "ast" if strategy in ("ast", "classic") else "naive",
        "fimLayout": "classic" if strategy == "classic" else "append",
        "postprocess": "plain" if strategy == "plain" else "syntax",
        "warmup": bool(args.warmup),
        # Off by default: with a prefix-only model, cases that share a prefix would be answered
        # from the completion cache, post-processed against another case's suffix.
        "reuse": bool(args.reuse),
        # Quality is judged on the whole completion, not on the lines shown early while it grows.
        "earlyAnswerMs": 0,
        "maxRequestsPerSecond": 0,
        # Each case is one file: with --concurrency the other cases' documents are open at the
        # same time, and cross-file context would show a case another case's answer (HumanEval
        # cuts several lines from one function).
        "crossFile": False,
    }
    if args.context_tokens:
        options["contextTokens"] = args.context_tokens
    if args.min_confidence is not None:
        options["minConfidence"] = args.min_confidence
    if args.engine_arg:
        # The engine starts with the editor's settings over stdio: engineArgs is ember --engine-arg.
        options["engineArgs"] = dict(parse_engine_arg(text) for text in args.engine_arg)
    return options


def earlier_records(out: Path, cases: list[Case], strategies: list[str], meta: dict[str, Any]) -> dict[str, list[Record]]:
    """Records of other strategies from an earlier run on exactly these cases (``--merge``)."""
    if not out.is_file():
        return {}
    old = json.loads(out.read_text())
    ids = [c.id for c in cases]
    kept: dict[str, list[Record]] = {}
    for strategy in old.get("strategies", []):
        if strategy in strategies:
            continue
        rows = [Record(**r) for r in old["records"] if r["strategy"] == strategy]
        if [r.id for r in rows] != ids:
            print(f"--merge: {out} has other cases for {strategy}; not merged", file=sys.stderr)
            continue
        kept[strategy] = rows
        for key in ("load_s", "options"):
            if strategy in old.get(key, {}):
                meta.setdefault(key, {})[strategy] = old[key][strategy]
        meta.setdefault("merged_commands", {})[strategy] = old.get("command")
    meta["strategies"] = list(kept) + [s for s in strategies if s not in kept]
    return kept


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", action="append", type=Path, help="jsonl file of cases (repeatable; default: the two dev files)")
    parser.add_argument("--no-dev", action="store_true", help="leave out the default dev files")
    parser.add_argument("--repo-cuts", action="store_true", help="add cases cut from requests, flask and express releases")
    parser.add_argument("--repo-cases", type=int, default=20, help="line cuts and body cuts per repository (default 20 each)")
    parser.add_argument("--limit", type=int, help="cases per input (each jsonl file; the repo cuts), stratified by source")
    parser.add_argument(
        "--skip", type=int, help="leave out the cases that --limit SKIP would choose (the next slice of a larger --limit)"
    )
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--typed", type=int, default=0, metavar="K",
                        help="move each cursor K characters into its middle's first line of code (default 0)")
    add_model_args(parser, "smollm2", engine_args=False)
    parser.add_argument(
        "--strategy",
        action="append",
        choices=["ast", "classic", "naive", "plain"],
        help="ast: ember as built; classic: ember with fimLayout classic; naive: the naive prompt, ember's post-processing; plain: the naive prompt and "
        "output cut at line breaks only (repeat to compare)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="cases in flight per server (default 1). More uses the engine's batching to finish sooner; "
        "latencies then include queueing and are not single-user latencies",
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--context-tokens", type=int, help="ember contextTokens (default: ember's)")
    parser.add_argument(
        "--min-confidence", type=float, help="ember minConfidence (default: ember's; 0 shows every answer, as for a calibration)"
    )
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a vLLM engine argument (repeatable), as ember --engine-arg")
    parser.add_argument("--timeout-ms", type=int, default=60000, help="ember timeoutMs (high: a slow CPU should not cut output)")
    parser.add_argument("--warmup", action="store_true", help="leave ember's warm-up on (off by default: each case is opened once)")
    parser.add_argument("--reuse", action="store_true", help="leave ember's completion cache and typed-through reuse on")
    parser.add_argument("--out", type=Path, help="results file (default bench/results/quality-<model>.json)")
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="run nothing: merge the records of earlier result files (one strategy each, e.g. runs made "
        "in parallel) into --out and print the tables",
    )
    parser.add_argument("--plot", type=Path, metavar="JSON", help="run nothing: draw JSON's tables as JSON.png")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other strategies' records already in the results file (same cases), to compare "
        "strategies measured in separate runs",
    )
    return parser.parse_args(argv)


def select_cases(args: argparse.Namespace) -> tuple[list[Case], list[str]]:
    files = [] if args.no_dev else list(DEV_FILES)
    files += args.cases or []
    selected: list[Case] = []
    inputs = []
    for path in files:
        cases = load_cases(path)
        # The stratified choice grows with the limit (each source's shuffled pool taken from its
        # start), so a smaller limit's cases are, up to rounding, a part of a larger one's.
        done = {(c.source, c.id) for c in sample(cases, args.skip, args.seed)} if args.skip else set()
        selected += [c for c in sample(cases, args.limit, args.seed) if (c.source, c.id) not in done]
        inputs.append(str(path))
    if args.typed:
        selected = [typed_into(case, args.typed) for case in selected]
    if args.repo_cuts:
        cut, used = repo_cases(args.repo_cases, args.seed)
        selected += sample(cut, args.limit, args.seed)
        inputs += used
    return selected, inputs


async def run(args: argparse.Namespace) -> int:
    name, model_path = resolve_model(args.model, args.engine)
    cases, inputs = select_cases(args)
    if not cases:
        print("no cases selected", file=sys.stderr)
        return 2
    strategies = args.strategy or ["ast"]
    out = args.out or RESULTS / f"quality-{name}.json"
    logs = CACHE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "model": name,
        "model_path": model_path,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "inputs": inputs,
        "limit": args.limit,
        "skip": args.skip,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "strategies": strategies,
        "load_s": {},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": commit() or None,
        "machine": {**machine(), "loadavg_before": list(os.getloadavg())},
        "settings": settings(args),
    }
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the venv
        tqdm = None

    print(f"{len(cases)} cases x {len(strategies)} strategies, model {name} ({model_path})", file=sys.stderr)
    records: dict[str, list[Record]] = {s: [] for s in strategies}
    if args.merge:
        records = {**earlier_records(out, cases, strategies, meta), **records}
    servers: dict[str, Server] = {}
    try:
        # All strategies' servers run side by side and take turns case by case: only one generates
        # at a time, and they see the same background load (this machine is shared), so their
        # latencies can be compared.
        for strategy in strategies:
            options = server_options(args, strategy)
            servers[strategy] = Server(model_path, options, logs / f"quality-{name}-{strategy}.log", args.engine)
            meta["load_s"][strategy] = round(await servers[strategy].start(), 1)
            meta.setdefault("options", {})[strategy] = options
        progress = tqdm(total=len(cases) * len(strategies), file=sys.stderr, dynamic_ncols=True) if tqdm else None
        meta["concurrency"] = args.concurrency
        done: dict[str, dict[int, Record]] = {s: {} for s in strategies}
        queue: asyncio.Queue[tuple[int, Case]] = asyncio.Queue()
        for item in enumerate(cases):
            queue.put_nowait(item)

        def in_order() -> dict[str, list[Record]]:
            return {**records, **{s: [rs[i] for i in sorted(rs)] for s, rs in done.items()}}

        saved = [time.monotonic()]

        async def worker() -> None:
            while not queue.empty():
                index, case = queue.get_nowait()
                for strategy, server in servers.items():
                    if STOP.is_set():
                        raise asyncio.CancelledError
                    completion, last, client_ms, error = await server.complete(
                        case, case_uri(case, strategy, index), args.timeout_ms / 1000 + 60
                    )
                    done[strategy][index] = score(case, completion, strategy, last, client_ms, error)
                    if progress:
                        progress.set_postfix(
                            {f"es_{s}": f"{sum(r.edit_sim for r in rs.values()) / len(rs):.2f}" for s, rs in done.items() if rs}
                        )
                        progress.update()
                if time.monotonic() - saved[0] > 30:
                    saved[0] = time.monotonic()
                    write_results(out, meta, in_order(), done=False)

        await asyncio.gather(*(worker() for _ in range(max(1, args.concurrency))))
        records = in_order()
        if progress:
            progress.close()
        for strategy, server in servers.items():
            if server.messages:
                meta.setdefault("server_messages", {})[strategy] = server.messages[:20]
    finally:
        for server in servers.values():
            await server.stop()

    write_results(out, meta, records, done=True)
    summary = {s: {g: summarize(rs) for g, rs in groups(recs).items()} for s, recs in records.items()}
    print()
    print(f"model {name}, max_tokens {args.max_tokens}, {len(cases)} cases ({', '.join(Path(i).name for i in inputs)})")
    print(table(summary))
    if len(summary) > 1:
        print()
        print(paired_table(paired(records)))
    print(f"\nwrote {out}")
    return 0


async def run_until_signal(args: argparse.Namespace) -> int:
    """SIGTERM cancels the run so that the ``finally`` blocks stop the server (and its engine
    processes) instead of leaving them behind."""
    task = asyncio.ensure_future(run(args))

    def stop() -> None:
        # The flag as well as the cancel: a cancel that lands while a reply arrives can be
        # swallowed (asyncio.wait_for on Python 3.11), the flag is checked before every case.
        STOP.set()
        task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
    try:
        return await task
    except asyncio.CancelledError:
        print("stopped", file=sys.stderr)
        return 130


def combine(files: list[Path], out: Path | None) -> int:
    """Merge result files; a strategy found in several files is taken from the first one."""
    merged: dict[str, list[Record]] = {}
    metas = []
    sources: dict[str, str | None] = {}  # file -> the command that measured what was taken from it
    for path in files:
        data = json.loads(path.read_text())
        metas.append(data)
        per_file: dict[str, list[Record]] = defaultdict(list)
        for row in data["records"]:
            per_file[row["strategy"]].append(Record(**row))
        for strategy, rows in per_file.items():
            if strategy in merged:
                continue
            merged[strategy] = rows
            # From an earlier combination: name the run that measured this strategy.
            earlier = {f: c for f, c in (data.get("combined_from") or {}).items() if f"--strategy {strategy}" in (c or "")}
            sources.update(earlier or {str(path): data.get("command")})
    id_sets = {s: [(r.source, r.id) for r in rows] for s, rows in merged.items()}
    common = set.intersection(*(set(v) for v in id_sets.values())) if id_sets else set()
    restricted = any(len(v) != len(common) for v in id_sets.values())
    if restricted:
        # e.g. a full run of one strategy against a --limit run of another: compare like with like.
        print(f"the strategies were run on different cases: comparing the {len(common)} they share", file=sys.stderr)
        merged = {s: [r for r in rows if (r.source, r.id) in common] for s, rows in merged.items()}
    first = metas[0]
    meta = {k: first.get(k) for k in ("model", "model_path", "inputs", "limit", "seed", "max_tokens")}
    if restricted:
        meta["common_cases"] = len(common)
    meta["commit"] = ", ".join(dict.fromkeys(str(m.get("commit")) for m in metas if m.get("commit"))) or None
    meta["concurrency"] = max(m.get("concurrency", 1) for m in metas)
    meta["strategies"] = list(merged)
    meta["combined_from"] = sources
    for key in ("load_s", "options"):
        meta[key] = {s: v for m in metas for s, v in (m.get(key) or {}).items() if s in merged}
    out = out or RESULTS / f"quality-{meta['model']}.json"
    write_results(out, meta, merged, done=all(m.get("complete") for m in metas))
    summary = {s: {g: summarize(rs) for g, rs in groups(recs).items()} for s, recs in merged.items()}
    print(f"model {meta['model']}, max_tokens {meta['max_tokens']}, combined from {', '.join(str(p) for p in files)}")
    print(table(summary))
    if len(summary) > 1:
        print()
        print(paired_table(paired(merged)))
    print(f"\nwrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        png = plot(args.plot)
        print(f"wrote {png}" if png else "no plot")
        return 0 if png else 1
    if args.combine:
        return combine(args.combine, args.out)
    return asyncio.run(run_until_signal(args))


if __name__ == "__main__":
    sys.exit(main())
