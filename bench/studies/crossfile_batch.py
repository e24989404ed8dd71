"""Cross-file context variants compared cheaply: every variant's prompt for every case, built by
ember's own request path, generated in one batch on one embedded engine (greedy), and scored as
bench/crossfile.py scores the server's answers. For choosing a variant; the server run
(bench/crossfile.py) confirms the chosen one.

    .venv/bin/python bench/studies/crossfile_batch.py --model qwen-coder --repos DIR [--limit 8 [--skip N]] \
        [--variants off,tab,workspace,oracle] [--engine llamacpp --parallel 2] [--out bench/results/crossfile-batch.json]

The path per case and variant is the completer's: ``site_at`` -> ``strategy("ast", "syntax")`` ->
the prompt with the engine's tokenizer and ``Settings.budget_for`` for the variant's crossFile mode at
the engine's ``max_model_len`` -> ``engine.stream`` fed through the strategy's cutter until it
stops. Requests run concurrently (``--parallel``) so vLLM batches them; the answers are the same
text a lone request gets, up to float32 rounding.

Variants (``--variants``; ``--list`` prints them):
  off:        crossFile "off";
  tab:        "open", the defining module's disk text as a second document (bench/crossfile.py's tab);
  oracle:     "open", a tab holding only the cut name's definition (bench/crossfile.py's oracle);
  workspace:  "workspace", ``workspace_context`` over the package's folder (the index scanned once);
  and the candidates defined below (``CANDIDATES``), each a function of the case's workspace view.

Prints EM, edit similarity, gains and losses against ``off``, prompt tokens per variant, overall
and per package; writes the records and the summary as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/studies/X.py: the checkout on sys.path

from bench.crossfile import CASES, CrossCase, load_cases, oracle_text, select
from bench.harness import CACHE, RESULTS, resolve_model, write_results
from bench.quality import edit_similarity, first_line
from context.prompt.fim import choose_template
from context.prompt.retrieval import Cursor, OpenFile, WorkspaceView, workspace_context
from context.prompt.site import site_at
from context.prompt.snippets import NO_CROSS_FILE, CrossFile, select_snippets
from context.prompt.strategy import strategy
from context.source.document import Document
from context.source.workspace import WorkspaceIndex
from engine.base import Engine, GenerationParams
from engine.embedded import EmbeddedConfig, EmbeddedEngine
from engine.llamacpp import LlamaCppConfig, LlamaCppEngine
from lsp.config import Settings

MAX_TOKENS = 48  # bench/crossfile.py's maxTokens


@dataclass
class CaseView:
    """What a variant may read for one case."""

    case: CrossCase
    folder: Path
    text: str  # the editor's document: prefix + suffix
    offset: int
    view: WorkspaceView
    max_model_len: int

    def chars(self, mode: str) -> int:
        """The cross-file block's characters for ``mode`` (see :func:`settings_for`)."""
        return settings_for(mode).budget_for(self.max_model_len).snippet_chars

    @property
    def path(self) -> Path:
        return self.folder / self.case.path

    @property
    def cursor(self) -> Cursor:
        return Cursor(str(self.path), self.text, self.offset, "python")


def settings_for(mode: str) -> Settings:
    """A variant's settings: a crossFile mode, ``"workspace@1024"`` with crossFileTokens 1024."""
    name, _, tokens = mode.partition("@")
    return Settings(cross_file=name, max_tokens=MAX_TOKENS, cross_file_tokens=int(tokens) if tokens else None)


Variant = Callable[[CaseView], tuple[str, CrossFile]]  # -> (crossFile mode, the block)


def off(c: CaseView) -> tuple[str, CrossFile]:
    return "off", NO_CROSS_FILE


def tab(c: CaseView) -> tuple[str, CrossFile]:
    module = (c.folder / c.case.defined_in).read_text(encoding="utf-8")[:200_000]
    tabs = [((c.folder / c.case.defined_in).as_uri(), module)]
    return "open", CrossFile(select_snippets(c.text, "python", tabs, c.chars("open")))


def oracle(c: CaseView) -> tuple[str, CrossFile]:
    module = oracle_text((c.folder / c.case.defined_in).read_text(encoding="utf-8"), c.case, c.folder)
    tabs = [((c.folder / c.case.defined_in).as_uri(), module)] if module else []
    return "open", CrossFile(select_snippets(c.text, "python", tabs, c.chars("open")))


def workspace(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace", workspace_context(c.view, c.cursor, c.chars("workspace"))


VARIANTS: dict[str, Variant] = {"off": off, "tab": tab, "oracle": oracle, "workspace": workspace}


# ------------------------------------------------------------------------------------------------
# candidates: what the cursor can reach, rendered as a stub would


def _docstring_line(body: Any, data: bytes) -> str:
    """The first line of a body's docstring when it is short, else ""."""
    first = body.named_children[0] if body is not None and body.named_children else None
    if (
        first is None
        or first.type != "expression_statement"
        or not first.named_children
        or first.named_children[0].type != "string"
    ):
        return ""
    raw = data[first.start_byte : first.end_byte].decode("utf-8", "replace")
    line = raw.strip().lstrip("rbuRBU").strip("\"'").strip().split("\n", 1)[0].strip()
    return line if 0 < len(line) <= 100 else ""


def _line_start(data: bytes, byte: int) -> int:
    return data.rfind(b"\n", 0, byte) + 1


def stub_of(full: str, doc: bool = True, members: int = 24) -> str:
    """A top-level Python definition as a stub: decorators and header, the docstring's first line;
    a class also its short class-level assignments and its public methods' headers."""
    from context.source.languages import parser_for

    data = full.encode("utf-8", "surrogatepass")
    parser = parser_for("python")
    if parser is None:
        return full
    root = parser.parse(data).root_node
    if not root.named_children:
        return full
    top = root.named_children[0]
    node = top.named_children[-1] if top.type == "decorated_definition" else top
    body = node.child_by_field_name("body")
    if node.type not in ("function_definition", "class_definition") or body is None:
        return full if len(full) <= 300 else full.split("\n", 1)[0]
    head = data[top.start_byte : body.start_byte].decode("utf-8", "replace").rstrip()
    indent = " " * (body.start_point[1] if body.start_point[0] > node.start_point[0] else 4)
    lines = [head]
    docline = _docstring_line(body, data) if doc else ""
    if docline:
        lines.append(f'{indent}"""{docline}"""')
    if node.type == "function_definition":
        return "\n".join(lines) if docline else head + " ..."
    shown = 0
    for member in body.named_children:
        inner = member.named_children[-1] if member.type == "decorated_definition" else member
        text = data[_line_start(data, member.start_byte) : member.end_byte].decode("utf-8", "replace")
        if inner.type == "expression_statement" and inner.named_children and inner.named_children[0].type in ("assignment",):
            if "\n" not in text.strip() and len(text.strip()) <= 100 and not text.strip().startswith("_"):
                lines.append(text.rstrip())
                shown += 1
        elif inner.type in ("function_definition", "class_definition"):
            name = inner.child_by_field_name("name")
            word = data[name.start_byte : name.end_byte].decode() if name is not None else ""
            if word.startswith("_") and word != "__init__":
                continue
            inner_body = inner.child_by_field_name("body")
            end = inner_body.start_byte if inner_body is not None else inner.end_byte
            lines.append(data[_line_start(data, member.start_byte) : end].decode("utf-8", "replace").rstrip() + " ...")
            shown += 1
        if shown >= members:
            break
    if len(lines) == 1:
        return head + " ..."
    return "\n".join(lines)


_ALIAS = re.compile(r"\b(\w+)\s+as\s+(\w+)")


def _aliases(text: str) -> dict[str, str]:
    """Imported name -> the name this file calls it (``from m import parse as parse_comments``)."""
    from context.source.definitions import _PY_FROM

    found: dict[str, str] = {}
    for m in _PY_FROM.finditer(text):
        for original, local in _ALIAS.findall(m.group(2)):
            found[original] = local
    return found


def _imports_and_near(c: CaseView) -> tuple[Any, set[str], set[str]]:
    from context.prompt.retrieval import _body_text, identifiers, near_region
    from context.source.imports import resolve_imports

    imports = resolve_imports(c.view, str(c.path), c.text, "python")
    near, used = identifiers(near_region(c.text, c.offset)), identifiers(_body_text(c.text))
    for original, local in _aliases(c.text).items():  # a name counts as used under its alias
        if local in near:
            near.add(original)
        if local in used:
            used.add(original)
    return imports, near, used


def _renamed(stub: str, name: str, local: str) -> str:
    """The stub under the name the current file calls it."""
    return re.sub(rf"^((?:async\s+)?(?:def|class)\s+){re.escape(name)}\b", rf"\g<1>{local}", stub, count=1, flags=re.M)


def _stub_pieces(c: CaseView, render: Callable[[str], str], module_outline: bool) -> list[Any]:
    """Imported names' stubs, best first (near the cursor, imported but unused, the rest); with
    ``module_outline``, then the other public definitions of the modules they come from."""
    import os

    from context.prompt.retrieval import _Piece

    imports, near, used = _imports_and_near(c)
    aliases = _aliases(c.text)
    ranked: list[tuple[int, int, Any]] = []
    seen: set[tuple[str, str]] = set()
    modules: dict[str, int] = {}

    def add(tier: int, position: int, file: str, order: int, name: str, full: str) -> None:
        if (file, name) in seen:
            return
        seen.add((file, name))
        text, short = render(full), stub_of(full, members=3)
        if name in aliases:
            text, short = _renamed(text, name, aliases[name]), _renamed(short, name, aliases[name])
        ranked.append((tier, position, _Piece(file, order, text, short if short != text else "")))

    for position, resolved in enumerate(imports):
        for name, files in resolved.names.items():
            if not files:
                continue
            file = files[0]
            summary = c.view.summary(file)
            if summary is None:
                continue
            tier = 0 if name in near else 1 if name not in used else 2
            found = [(o, d) for o, d in enumerate(summary.definitions) if d.name == name]
            if found:
                add(tier, position, file, found[0][0], name, found[0][1].full)
                modules[file] = min(modules.get(file, 9), tier)
            elif os.path.splitext(os.path.basename(file))[0] in (name, "__init__"):
                for o, d in enumerate(summary.definitions):
                    if d.name in near or d.name in used:
                        add(0 if d.name in near else 2, position, file, o, d.name, d.full)
                modules[file] = min(modules.get(file, 9), tier)
        if not resolved.names:
            for file in resolved.files[:1]:
                summary = c.view.summary(file)
                for o, d in enumerate(summary.definitions if summary else ()):
                    if d.name in near or d.name in used:
                        add(0 if d.name in near else 2, position, file, o, d.name, d.full)
                modules[file] = 0
    ranked.sort(key=lambda item: (item[0], item[1]))
    pieces = [piece for _, _, piece in ranked]
    if module_outline:
        for file, _tier in sorted(modules.items(), key=lambda item: item[1]):
            summary = c.view.summary(file)
            for o, d in enumerate(summary.definitions if summary else ()):
                if not d.name.startswith("_") and (file, d.name) not in seen:
                    seen.add((file, d.name))
                    pieces.append(_Piece(file, o, render(d.full), ""))
    return pieces


def _pack(c: CaseView, pieces: list[Any], budget: int, windows: bool, repo: bool = True, best_last: bool = False) -> CrossFile:
    from context.prompt.retrieval import _covered, _Piece, _relative, _render, _similar_windows, _window_files

    if windows:
        imports, _, _ = _imports_and_near(c)
        shown = {(p.path, p.text) for p in pieces}
        pieces = pieces + [
            w for w in _similar_windows(c.view, c.cursor, _window_files(c.view, c.cursor, imports)) if not _covered(w, shown)
        ]
    chosen, left = [], budget
    for piece in pieces:
        cost = len(piece.text) + 1 + (0 if any(p.path == piece.path for p in chosen) else len(_relative(c.view, piece.path)) + 16)
        if cost <= left:
            chosen.append(piece)
            left -= cost
        elif piece.short and cost - len(piece.text) + len(piece.short) <= left:
            chosen.append(_Piece(piece.path, piece.order, piece.short, ""))
            left -= cost - len(piece.text) + len(piece.short)
    snippets = _render(c.view, chosen)
    if best_last:  # the file of the best piece nearest the cursor; a file's pieces in file order
        rank = {}
        for i, piece in enumerate(chosen):
            rank.setdefault(_relative(c.view, piece.path).replace("\\", "/"), i)
        snippets = tuple(sorted(snippets, key=lambda s: -rank.get(s.path, 0)))
    if not repo:
        return CrossFile(snippets)
    return CrossFile(snippets, c.folder.name, c.case.path)


def stubs(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace", _pack(c, _stub_pieces(c, stub_of, False), c.chars("workspace"), windows=False)


def stubs_windows(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace", _pack(c, _stub_pieces(c, stub_of, False), c.chars("workspace"), windows=True)


def stubs_modules(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace", _pack(c, _stub_pieces(c, stub_of, True), c.chars("workspace"), windows=False)


def stubs_modules_paths(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace", _pack(c, _stub_pieces(c, stub_of, True), c.chars("workspace"), windows=False, repo=False)


def stubs_modules_best_last(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace", _pack(c, _stub_pieces(c, stub_of, True), c.chars("workspace"), windows=False, best_last=True)


def stubs_modules_1k(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace@1024", _pack(c, _stub_pieces(c, stub_of, True), c.chars("workspace@1024"), windows=False)


def stubs_modules_256(c: CaseView) -> tuple[str, CrossFile]:
    return "workspace@256", _pack(c, _stub_pieces(c, stub_of, True), c.chars("workspace@256"), windows=False)


def workspace_paths(c: CaseView) -> tuple[str, CrossFile]:
    """Today's workspace block laid out with path comments instead of the repository format."""
    return "workspace", CrossFile(workspace_context(c.view, c.cursor, c.chars("workspace")).snippets)


def workspace_at(tokens: int) -> Variant:
    """Today's workspace block with crossFileTokens ``tokens`` (the budget curve)."""

    def variant(c: CaseView) -> tuple[str, CrossFile]:
        mode = f"workspace@{tokens}"
        return mode, workspace_context(c.view, c.cursor, c.chars(mode))

    return variant


def stubs_paths_256(c: CaseView) -> tuple[str, CrossFile]:
    """The imported names' stubs only, at 256 tokens, with path comments."""
    return "workspace@256", _pack(c, _stub_pieces(c, stub_of, False), c.chars("workspace@256"), windows=False, repo=False)


def oracle_stub(c: CaseView) -> tuple[str, CrossFile]:
    module = oracle_text((c.folder / c.case.defined_in).read_text(encoding="utf-8"), c.case, c.folder)
    text = "\n".join(stub_of(d.full) for d in _defs(module)) if module else ""
    tabs = [((c.folder / c.case.defined_in).as_uri(), text)] if text else []
    return "open", CrossFile(select_snippets(c.text, "python", tabs, c.chars("open")))


def _defs(module: str) -> Any:
    from context.source.definitions import definitions

    return definitions(module, "python", private=True) or ()


CANDIDATES: dict[str, Variant] = {
    "stubs": stubs,
    "stubs+windows": stubs_windows,
    "stubs+modules": stubs_modules,
    "stubs+modules:paths": stubs_modules_paths,
    "stubs+modules:best-last": stubs_modules_best_last,
    "stubs+modules@1024": stubs_modules_1k,
    "stubs+modules@256": stubs_modules_256,
    "oracle-stub": oracle_stub,
    "workspace:paths": workspace_paths,
    "stubs@256:paths": stubs_paths_256,
    **{f"workspace@{tokens}": workspace_at(tokens) for tokens in (256, 512, 1024)},
}


@dataclass
class Record:
    id: str
    repo: str
    variant: str
    completion: str
    exact: bool
    edit_sim: float
    prompt_tokens: int | None
    block: list[str]


async def run_one(
    engine: Engine, c: CaseView, name: str, variant: Variant, template: Any, gate: asyncio.Semaphore
) -> Record:
    mode, cross = variant(c)
    doc = Document(c.path.as_uri(), "python", c.text, 1)
    site = site_at(doc, c.offset, cross)
    chosen = strategy("ast", "syntax")
    budget = settings_for(mode).budget_for(engine.model.max_model_len)
    prompt = chosen.prompt(site, template, engine.tokenizer, budget)
    cutter = chosen.cutter(site, prompt)
    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=prompt.stop)
    prompt_tokens = None
    truncated = False
    async with gate:
        stream = engine.stream(prompt.text, params, f"{name}-{c.case.id}")
        try:
            async for chunk in stream:
                if chunk.prompt_tokens is not None:
                    prompt_tokens = chunk.prompt_tokens
                stopped = cutter.feed(chunk.text)
                truncated = truncated or (chunk.finish_reason == "length" and not stopped)
                if stopped:
                    break
        finally:
            await stream.aclose()
    completion = cutter.finish(truncated)
    got, want = first_line(completion).strip(), c.case.middle.strip()
    return Record(
        c.case.id,
        c.case.repo,
        name,
        completion,
        got == want,
        edit_similarity(got, want),
        prompt_tokens,
        [s.path for s in cross.snippets],
    )


def summarize(records: list[Record], names: list[str]) -> dict[str, Any]:
    by_case: dict[str, dict[str, Record]] = defaultdict(dict)
    for r in records:
        by_case[r.id][r.variant] = r

    def stats(rows: list[Record], name: str) -> dict[str, Any]:
        mine = [r for r in rows if r.variant == name]
        base = {r.id: r.exact for r in rows if r.variant == "off"}
        tokens = [r.prompt_tokens for r in mine if r.prompt_tokens is not None]
        return {
            "n": len(mine),
            "exact": sum(r.exact for r in mine) / max(1, len(mine)),
            "exact_n": sum(r.exact for r in mine),
            "edit_sim": sum(r.edit_sim for r in mine) / max(1, len(mine)),
            "prompt_tokens_mean": sum(tokens) / max(1, len(tokens)),
            "gained": sum(1 for r in mine if r.exact and base.get(r.id) is False),
            "lost": sum(1 for r in mine if not r.exact and base.get(r.id) is True),
        }

    packages = sorted({r.repo for r in records})
    return {
        "overall": {name: stats(records, name) for name in names},
        "per_package": {p: {name: stats([r for r in records if r.repo == p], name) for name in names} for p in packages},
    }


SERVER_NAMES = {"current": "off", "tab": "tab", "workspace": "workspace", "oracle": "oracle"}


def merged_records(paths: list[Path], ids: set[str]) -> list[Record]:
    """Records of earlier runs for ``ids``: this script's JSON, or bench/crossfile.py's (its
    ``current`` is ``off`` here); the server's answers and these agree (bench/README.md)."""
    found: list[Record] = []
    for path in paths:
        data = json.loads(path.read_text())
        for r in data["records"]:
            if r["id"] not in ids:
                continue
            if "variant" in r:
                found.append(Record(**r))
                continue
            name = SERVER_NAMES.get(r["config"], r["config"])
            found.append(
                Record(
                    r["id"],
                    r["repo"],
                    name,
                    r["completion"],
                    bool(r["exact"]),
                    float(r["edit_sim"]),
                    r.get("prompt_tokens"),
                    list(r.get("cross_file") or []),
                )
            )
    return found


def report(paths: list[Path], names: list[str] | None) -> int:
    """The table for the records of ``paths`` together."""
    records = merged_records(paths, {r["id"] for p in paths for r in json.loads(p.read_text())["records"]})
    names = names or list(dict.fromkeys(r.variant for r in records))
    common = set.intersection(*({r.id for r in records if r.variant == n} for n in names))
    unique = {(r.id, r.variant): r for r in reversed(records)}  # the first file's record wins
    records = [r for r in unique.values() if r.id in common and r.variant in names]
    print(f"{len(common)} cases in every variant")
    print_table(summarize(records, names), names)
    return 0


def print_table(summary: dict[str, Any], names: list[str]) -> None:
    print(f"{'variant':24} {'n':>4} {'EM':>6} {'(n)':>4} {'ES':>6} {'+':>3} {'-':>3} {'tokens':>7}  {'x off':>6}")
    base = summary["overall"].get("off", {}).get("exact") or 0
    for name in names:
        s = summary["overall"][name]
        ratio = f"{s['exact'] / base:.2f}" if base else "-"
        counts = f"{s['exact']:6.3f} {s['exact_n']:4d} {s['edit_sim']:6.3f} {s['gained']:3d} {s['lost']:3d}"
        print(f"{name:24} {s['n']:4d} {counts} {s['prompt_tokens_mean']:7.0f}  {ratio:>6}")


async def main_async(args: argparse.Namespace) -> int:
    names = args.variants.split(",")
    table = {**VARIANTS, **CANDIDATES}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: {sorted(table)}")
    label, model_path = resolve_model(args.model, args.engine)
    assert model_path is not None
    engine: Engine
    if args.engine == "llamacpp":  # the GGUF file as it is, one request per slot
        from engine.models import resolve_gguf

        gguf = resolve_gguf(model_path)
        engine = LlamaCppEngine(LlamaCppConfig(gguf=gguf.path, model_name=gguf.name, slots=args.parallel))
    else:
        engine = EmbeddedEngine(EmbeddedConfig(model_path=model_path, model_name=label, kv_cache_gib=args.kv_cache_gib))
    started = time.perf_counter()
    await engine.start()
    print(f"engine ready in {time.perf_counter() - started:.0f} s (max_model_len {engine.model.max_model_len})", flush=True)
    template = choose_template(engine.model.special_tokens, engine.model.name, None)
    selected = select(load_cases(CASES), args.limit)
    if args.skip:  # the stratified choice is prefix-stable: --limit 16 --skip 8 is the next 8
        done = {c.id for cases in select(load_cases(CASES), args.skip).values() for c in cases}
        selected = {package: [c for c in cases if c.id not in done] for package, cases in selected.items()}
    indexes: dict[Path, WorkspaceIndex] = {}
    views: list[CaseView] = []
    for package, cases in selected.items():
        folder = args.repos / package
        if folder not in indexes:
            indexes[folder] = WorkspaceIndex([str(folder)])
            indexes[folder].scan()
        for case in cases:
            text = case.prefix + case.suffix
            view = WorkspaceView(indexes[folder], {str(folder / case.path): OpenFile(text, "python")})
            views.append(CaseView(case, folder, text, len(case.prefix), view, engine.model.max_model_len))
    gate = asyncio.Semaphore(args.parallel)
    started = time.perf_counter()
    jobs = [run_one(engine, c, name, table[name], template, gate) for c in views for name in names]
    records: list[Record] = []
    for done in asyncio.as_completed(jobs):
        records.append(await done)
        if len(records) % 50 == 0:
            print(f"  {len(records)}/{len(jobs)} in {time.perf_counter() - started:.0f} s", flush=True)
    elapsed = time.perf_counter() - started
    await engine.close()
    records.sort(key=lambda r: (r.id, names.index(r.variant)))
    summary = summarize(records, names)
    print(f"{len(views)} cases x {len(names)} variants in {elapsed:.0f} s; {label}, max_model_len {engine.model.max_model_len}")
    print_table(summary, names)
    out = args.out or RESULTS / f"crossfile-batch-{label}.json"
    data = {
        "model": label, "engine": args.engine, "cases": len(views), "limit_per_package": args.limit, "skip_per_package": args.skip, "variants": names,
        "seconds": round(elapsed), "summary": summary, "records": [r.__dict__ for r in records],
    }  # fmt: skip
    print(f"wrote {await asyncio.to_thread(write_results, out, data, args)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen-coder", help="qwen-coder (default), qwen-coder-1.5b, smollm2, or a model folder / .gguf")
    parser.add_argument("--repos", type=Path, default=CACHE / "crossfile-repos")
    parser.add_argument("--limit", type=int, help="cases per package (bench/crossfile.py's stratified choice)")
    parser.add_argument("--skip", type=int, default=0, help="leave out the cases that --limit SKIP would choose")
    parser.add_argument("--variants", default="off,tab,oracle,workspace")
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), default="vllm", help="embedded vLLM (default) or llama.cpp on the GGUF")
    parser.add_argument("--parallel", type=int, default=16, help="requests in flight (vLLM batches them; llama.cpp's slots)")
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--report", type=Path, nargs="+", help="no run: the table of these result files together")
    args = parser.parse_args()
    if args.report:
        return report(args.report, args.variants.split(",") if args.variants != parser.get_default("variants") else None)
    if args.list:
        print("\n".join(sorted({**VARIANTS, **CANDIDATES})))
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
