"""Does cross-file context (open tabs, the workspace index) make completions more exact? Measured
through the real LSP server, each package laid out as the workspace.

    .venv/bin/python bench/crossfile.py --model qwen-coder --base ../wt-base
    .venv/bin/python bench/crossfile.py --model smollm2 --limit 1 --configs current@base,tab@base,current,tab --base ../wt-base

Cases: ``../shared/eval/crossfile_dev.jsonl`` beside the checkout (or ``$EMBER_EVAL_DIR``): 496 lines
cut from fifteen pinned packages, each a line inside a function that calls or reads a name imported
from a sibling module, the cursor just before that name. The packages are unpacked under ``--repos`` as ``name-version/`` (the layout of
``../shared/eval/fetch-crossfile-repos.sh``). The file on disk holds the author's text; the editor's
document is ``prefix + suffix`` under the real file's URI, so that an index that prefers an open
document's live text over the disk never sees the middle.

Configurations (``--configs``):
  current:   crossFile "open", only the case's file open;
  tab:       crossFile "open", the defining module (``defined_in``, its disk text) opened first as a
             second document, closed after the case;
  workspace: crossFile "workspace", only the case's file open;
  oracle:    crossFile "open" with a tab at the defining module's URI that holds only the cut name's
             own definition (whole up to the snippet limit, else its signature): what the model
             gains from exactly the right context, rendered as the block renders it (the ceiling);
  NAME@base: NAME run from the checkout ``--base`` (as bench/replay.py does: ``python -m lsp`` with
             that checkout as its working directory). A checkout whose lsp/config.py still declares
             ``cross_file: bool`` gets crossFile true for "open" (and no crossFileTokens).
One server per (checkout, crossFile mode), started together and reused for all packages: each is
initialized with rootUri / workspaceFolders = the first package's folder and moved to the next
package with ``workspace/didChangeWorkspaceFolders``; after a move the script waits (at most 60 s)
for ``ember/stats`` ``workspace.scan_done`` (code without an index has no such key). Requests go
one at a time, the configurations taking turns case by case (which one goes first rotates), so
the machine's load drift hits all alike.

Score: the first non-blank line of the completion, stripped, against ``middle`` stripped: exact
match (EM) and edit similarity. Per case the record keeps the server's ``prompt_tokens``,
``latency_ms`` and ``cross_file`` (``ember/stats`` ``last_for_uri``), the client's ms and any error.
Prints a table per package and overall, and the ratios of issue 14's targets; writes
bench/results/crossfile-<model>.json (rewritten every 30 s while running, so a stopped run keeps
its data).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
from lsprotocol import types

from bench.harness import (
    CACHE,
    EVAL,
    RESULTS,
    ROOT,
    add_model_args,
    commit,
    fmt,
    machine,
    percentile,
    resolve_model,
    settings,
    write_results,
)  # fmt: skip
from bench.quality import SEED, Case, Server, edit_similarity, first_line

CASES = EVAL / "crossfile_dev.jsonl"
DEFAULT_CONFIGS = "current,tab,workspace,oracle"
MODES = {"current": "open", "tab": "open", "workspace": "workspace", "oracle": "open"}
SCAN_WAIT_S = 60.0
SAVE_EVERY_S = 30.0
REQUEST_TIMEOUT_S = 60.0  # the server's own timeoutMs; the client waits a minute longer


@dataclass
class CrossCase:
    id: str
    repo: str  # "name==version"
    path: str  # relative to the package folder (its import root)
    defined_in: str
    name: str
    prefix: str
    middle: str
    suffix: str

    @property
    def package(self) -> str:
        """The package's folder name under --repos: click==8.1.8 -> click-8.1.8."""
        return self.repo.replace("==", "-")


@dataclass
class Record:
    id: str
    repo: str
    config: str
    completion: str
    exact: bool
    edit_sim: float
    prompt_tokens: int | None
    latency_ms: float | None
    client_ms: float
    cross_file: Any
    outcome: str | None
    error: str | None


@dataclass(frozen=True)
class Checkout:
    label: str  # "new" (this checkout) or "base"
    root: Path
    legacy: bool  # crossFile is still true/false there


@dataclass(frozen=True)
class Config:
    name: str  # as given: "tab@base"
    kind: str  # current / tab / workspace
    checkout: Checkout

    @property
    def mode(self) -> str:
        return MODES[self.kind]

    @property
    def server_key(self) -> tuple[str, str]:
        return (self.checkout.label, self.mode)


# ---------------------------------------------------------------------------------------- cases


def load_cases(path: Path) -> list[CrossCase]:
    fields = CrossCase.__dataclass_fields__
    with path.open(encoding="utf-8") as f:
        return [CrossCase(**{k: v for k, v in json.loads(line).items() if k in fields}) for line in f if line.strip()]


def select(cases: list[CrossCase], per_package: int | None, seed: int = SEED) -> dict[str, list[CrossCase]]:
    """Cases grouped by package (in name order); with ``per_package``, that many from each, the
    same ones on every run (ids sorted, then shuffled with a fixed seed)."""
    by_package: dict[str, list[CrossCase]] = defaultdict(list)
    for case in sorted(cases, key=lambda c: c.id):
        by_package[case.package].append(case)
    if per_package is not None:
        for package, pool in by_package.items():
            random.Random(f"{seed}:{package}").shuffle(pool)
            by_package[package] = sorted(pool[:per_package], key=lambda c: c.id)
    return dict(sorted(by_package.items()))


def score(case: CrossCase, config: str, completion: str, last: dict[str, Any], client_ms: float, error: str | None) -> Record:
    got, want = first_line(completion).strip(), case.middle.strip()
    return Record(
        id=case.id,
        repo=case.repo,
        config=config,
        completion=completion,
        exact=got == want,
        edit_sim=edit_similarity(got, want),
        prompt_tokens=last.get("prompt_tokens"),
        latency_ms=last.get("latency_ms"),
        client_ms=round(client_ms, 1),
        cross_file=last.get("cross_file"),
        outcome=last.get("outcome"),
        error=error,
    )


# ---------------------------------------------------------------------------------- the servers


def folder_item(folder: Path) -> types.WorkspaceFolder:
    return types.WorkspaceFolder(uri=folder.as_uri(), name=folder.name)


def knows_modes(checkout: Path) -> bool:
    """Whether that checkout's crossFile takes "off"/"open"/"workspace" (today's code: a bool)."""
    config = (checkout / "lsp" / "config.py").read_text(encoding="utf-8")
    return re.search(r"^\s*cross_file:\s*bool\b", config, re.M) is None


class WorkspaceServer(Server):
    """quality.Server run from a given checkout, with a workspace folder that can move."""

    def __init__(
        self, model_path: str | None, options: dict[str, Any], log_path: Path, checkout: Path, folder: Path | None,
        engine: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(model_path, options, log_path, engine)
        self.cwd = self.checkout = checkout
        self.folder = folder  # None: no workspace folder at initialize (one may be added later)

    def refusals(self) -> list[str]:
        return [m for m in self.messages if "initializationOptions" in m]

    async def start(self) -> float:
        """Seconds until the engine is ready and the first folder scanned."""
        started = time.perf_counter()
        await self.launch_in_checkout()
        await self.wait_ready()
        if self.refusals():
            raise RuntimeError(f"the server refused the settings: {self.refusals()[0]}")
        await self.wait_scan()
        return time.perf_counter() - started

    async def launch_in_checkout(self) -> None:
        """The process started and initialized (the engine loads in the background)."""
        await super().launch(self.folder)
        await asyncio.sleep(0.5)  # the refusal is a showMessage sent while initializing: fail before the model loads
        if self.refusals():
            raise RuntimeError(f"the server refused the settings: {self.refusals()[0]}")

    async def wait_scan(self, timeout_s: float = SCAN_WAIT_S) -> dict[str, Any] | None:
        """The ``workspace`` stats once the background scan of the current folder is done (None
        where the server has no index), waiting at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            workspace = (await self.stats()).get("workspace")
            if not isinstance(workspace, dict):
                return None
            roots = workspace.get("roots")
            # Until the server has handled the folder change it may still report the old scan; no
            # roots at all: this server indexes nothing (crossFile "open").
            moved = (
                not isinstance(roots, list)
                or not roots
                or any(isinstance(r, str) and self.folder and r in (str(self.folder), self.folder.as_uri()) for r in roots)
            )
            if moved and workspace.get("scan_done", True):
                return workspace
            if time.monotonic() > deadline:
                print(
                    f"  warning: workspace scan of {self.folder} not done after {timeout_s:.0f} s: {workspace}",
                    file=sys.stderr,
                )
                return workspace
            await asyncio.sleep(0.25)

    def change_folder(self, folder: Path) -> None:
        """The editor's workspace is ``folder`` now (didChangeWorkspaceFolders; old code ignores it)."""
        removed = [folder_item(self.folder)] if self.folder else []
        event = types.WorkspaceFoldersChangeEvent(added=[folder_item(folder)], removed=removed)
        self.client.workspace_did_change_workspace_folders(types.DidChangeWorkspaceFoldersParams(event=event))
        self.folder = folder

    async def move_to(self, folder: Path) -> dict[str, Any] | None:
        self.change_folder(folder)
        return await self.wait_scan()


def server_options(args: argparse.Namespace, mode: str, legacy: bool) -> dict[str, Any]:
    """initializationOptions as bench/quality.py's, with crossFile for ``mode``."""
    options: dict[str, Any] = {
        "maxTokens": args.max_tokens,
        "timeoutMs": int(REQUEST_TIMEOUT_S * 1000),
        "promptStrategy": "ast",
        "postprocess": "syntax",
        "earlyAnswerMs": 0,
        "maxRequestsPerSecond": 0,
        "reuse": False,  # cases of one file share a prefix: no answers from another case's cache
        "warmup": False,
        # Today's code takes a bool; "workspace" is passed through there so that it refuses it.
        "crossFile": {"open": True, "off": False}.get(mode, mode) if legacy else mode,
    }
    if args.cross_file_tokens is not None and not legacy:
        options["crossFileTokens"] = args.cross_file_tokens
    return options


def parse_configs(names: str, args: argparse.Namespace) -> list[Config]:
    checkouts = {"new": Checkout("new", ROOT, not knows_modes(ROOT))}
    if args.base is not None:
        checkouts["base"] = Checkout("base", args.base, not knows_modes(args.base))
    configs = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        kind, _, where = name.partition("@")
        if kind not in MODES or where not in ("", "base"):
            raise SystemExit(f"unknown configuration {name!r} (current, tab, workspace, oracle, NAME@base)")
        if where and args.base is None:
            print(f"error: {name} needs --base DIR (a checkout of today's code); skipped", file=sys.stderr)
            continue
        configs.append(Config(name, kind, checkouts["base" if where else "new"]))
    return configs


def build_servers(
    configs: list[Config], args: argparse.Namespace, model: tuple[str, str | None], folder: Path
) -> dict[tuple[str, str], WorkspaceServer]:
    """One server (not started) per (checkout, crossFile mode)."""
    name, model_path = model
    logs = CACHE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    servers: dict[tuple[str, str], WorkspaceServer] = {}
    for config in configs:
        if config.server_key not in servers:
            label, mode = config.server_key
            options = server_options(args, mode, config.checkout.legacy)
            log = logs / f"crossfile-{name}-{label}-{mode}.log"
            servers[config.server_key] = WorkspaceServer(model_path, options, log, config.checkout.root, folder, args.engine)
    return servers


async def start_servers(servers: dict[tuple[str, str], WorkspaceServer]) -> dict[str, Any]:
    """Starts them all at once; the ones that fail are stopped, removed and reported."""
    results = await asyncio.gather(*(s.start() for s in servers.values()), return_exceptions=True)
    info: dict[str, Any] = {"load_s": {}, "errors": {}, "options": {}}
    for (key, server), result in zip(list(servers.items()), results, strict=True):
        label = "/".join(key)
        info["options"][label] = server.options
        if isinstance(result, BaseException):
            info["errors"][label] = f"{type(result).__name__}: {result}"
            print(f"error: the {label} server did not start: {result}; its configurations are skipped", file=sys.stderr)
            await server.stop()
            del servers[key]
        else:
            info["load_s"][label] = round(result, 1)
    return info


# ----------------------------------------------------------------------------------------- runs


async def run_case(server: WorkspaceServer, config: Config, case: CrossCase, folder: Path) -> Record:
    uri = (folder / case.path).as_uri()
    tab_uri = (folder / case.defined_in).as_uri() if config.kind in ("tab", "oracle") else None
    if tab_uri:
        text = (folder / case.defined_in).read_text(encoding="utf-8")
        text = oracle_text(text, case, folder) if config.kind == "oracle" else text
        server.client.text_document_did_open(
            types.DidOpenTextDocumentParams(types.TextDocumentItem(uri=tab_uri, language_id="python", version=1, text=text))
        )
    document = Case(case.id, "crossfile-line", "python", case.prefix, case.suffix, case.middle)
    try:
        completion, last, client_ms, error = await server.complete(document, uri, REQUEST_TIMEOUT_S + 60)
    finally:
        if tab_uri:
            server.client.text_document_did_close(
                types.DidCloseTextDocumentParams(text_document=types.TextDocumentIdentifier(uri=tab_uri))
            )
    return score(case, config.name, completion, last, client_ms, error)


def oracle_text(module: str, case: CrossCase, folder: Path | None = None, hops: int = 3) -> str:
    """The cut name's own definition in its module, as the cross-file block shows a definition
    (whole up to the snippet limit, else its signature); where the name is the module itself
    (``_compat.term_len(...)``), the definitions of the attributes the author's line reads; empty
    when the module does not define it at its top level (a definition under ``if``, an alias).
    A re-export (``from .headers import Headers`` in an ``__init__``) is followed into the module
    it names, ``hops`` times at most, when ``folder`` (the package's import root) is given."""
    from context.source.definitions import FULL_LIMIT, definitions, python_imports

    path = Path(case.defined_in)
    is_module = case.name in (path.stem, path.parent.name if path.stem == "__init__" else None)
    wanted = set(re.findall(rf"\b{re.escape(case.name)}\.(\w+)", case.middle)) if is_module else {case.name}
    shown = [found.full if len(found.full) <= FULL_LIMIT else found.signature
             for found in definitions(module, "python", case.defined_in, private=True) if found.name in wanted]
    if shown or folder is None or hops == 0:
        return "\n".join(shown) + "\n" if shown else ""
    package = path.parent.parts
    for spec, names in python_imports(module).items():
        if case.name not in names:
            continue
        dots = len(spec) - len(spec.lstrip("."))
        parts = (*package[: len(package) - (dots - 1)], *spec.lstrip(".").split(".")) if dots else tuple(spec.split("."))
        for candidate in (Path(*parts).with_suffix(".py"), Path(*parts) / "__init__.py"):
            if (folder / candidate).is_file():
                moved = CrossCase(case.id, case.repo, case.path, str(candidate), case.name, case.prefix, case.middle, case.suffix)
                return oracle_text((folder / candidate).read_text(encoding="utf-8"), moved, folder, hops - 1)
    return ""


def offline_recall(cases: list[CrossCase], repos: Path) -> dict[str, Any]:
    """Without a model: how often the cross-file block holds the cut name's definition (the first
    line of the oracle's text), for the tab (crossFile "open", the defining module open) and the
    workspace index (crossFile "workspace"), built by this checkout's own selection at the default
    budgets (2048 tokens). A selection that leaves the definition out cannot lift the case."""
    from context.prompt.retrieval import Cursor, OpenFile, WorkspaceView, workspace_context
    from context.prompt.snippets import select_snippets
    from context.source.workspace import WorkspaceIndex
    from lsp.config import Settings

    budgets = {mode: Settings(cross_file=mode).budget_for(2048).snippet_chars for mode in ("open", "workspace")}
    indexes: dict[Path, WorkspaceIndex] = {}
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"cases": 0, "oracle": 0, "tab": 0, "workspace": 0})
    for case in cases:
        folder = repos / case.package
        module = (folder / case.defined_in).read_text(encoding="utf-8")
        oracle = oracle_text(module, case, folder)
        text, offset, path = case.prefix + case.suffix, len(case.prefix), str(folder / case.path)
        if folder not in indexes:
            indexes[folder] = WorkspaceIndex([str(folder)])
            indexes[folder].scan()
        view = WorkspaceView(indexes[folder], {path: OpenFile(text, "python")})
        blocks = {
            "tab": select_snippets(text, "python", [((folder / case.defined_in).as_uri(), module[:200_000])], budgets["open"]),
            "workspace": workspace_context(view, Cursor(path, text, offset, "python"), budgets["workspace"]).snippets,
        }
        for repo in (case.repo, "ALL"):
            counts[repo]["cases"] += 1
            counts[repo]["oracle"] += bool(oracle)
            for name, snippets in blocks.items():
                block = "\n".join(s.text for s in snippets)
                counts[repo][name] += bool(oracle) and oracle.split("\n", 1)[0].strip() in block
    return dict(counts)


class Run:
    """The records so far and the results file they are saved to."""

    def __init__(self, out: Path, meta: dict[str, Any], configs: list[Config]) -> None:
        self.out = out
        self.meta = meta
        self.configs = configs
        self.records: list[Record] = []
        self.saved_at = time.monotonic()

    def add(self, record: Record) -> None:
        self.records.append(record)
        if time.monotonic() - self.saved_at > SAVE_EVERY_S:
            self.save(done=False)

    def save(self, done: bool) -> dict[str, Any]:
        summary = summarize_run(self.records, [c.name for c in self.configs])
        payload = {**self.meta, "complete": done, "summary": summary, "records": [asdict(r) for r in self.records]}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        tmp.replace(self.out)
        self.saved_at = time.monotonic()
        return summary


async def run_packages(
    run: Run, servers: dict[tuple[str, str], WorkspaceServer], packages: dict[str, list[CrossCase]], repos: Path
) -> None:
    turn = 0
    configs = [c for c in run.configs if c.server_key in servers]
    for index, (package, cases) in enumerate(packages.items()):
        folder = repos / package
        if index > 0:
            scans = await asyncio.gather(*(s.move_to(folder) for s in servers.values()))
            run.meta.setdefault("workspace", {})[package] = {"/".join(k): w for k, w in zip(servers, scans, strict=True)}
        print(f"{package}: {len(cases)} cases x {len(configs)} configurations", file=sys.stderr)
        for case in cases:
            order = configs[turn % len(configs) :] + configs[: turn % len(configs)]
            turn += 1
            for config in order:
                run.add(await run_case(servers[config.server_key], config, case, folder))
        done = [r for r in run.records if r.repo == cases[0].repo]
        line = ", ".join(f"{c.name} {sum(r.exact for r in done if r.config == c.name)}" for c in configs)
        print(f"  exact matches: {line}", file=sys.stderr)


# ------------------------------------------------------------------------------------- reports


def summarize(records: list[Record]) -> dict[str, Any]:
    n = len(records)
    tokens = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    latencies = [r.latency_ms for r in records if r.latency_ms is not None]
    return {
        "n": n,
        "exact": sum(r.exact for r in records) / n if n else None,
        "edit_sim": sum(r.edit_sim for r in records) / n if n else None,
        "prompt_tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        "latency_p50_ms": percentile(latencies, 0.5),
        "latency_p95_ms": percentile(latencies, 0.95),
        "client_p50_ms": percentile([r.client_ms for r in records], 0.5),
        "errors": sum(r.error is not None for r in records),
    }


def gains_and_losses(records: list[Record], configs: list[str], against: str = "current") -> dict[str, dict[str, int]]:
    """Per configuration, the cases it gets right and ``against`` does not (gained), and the other way."""
    right = {(r.config, r.id): r.exact for r in records}
    result: dict[str, dict[str, int]] = {}
    for config in configs:
        ids = {r.id for r in records if r.config == config} & {r.id for r in records if r.config == against}
        result[config] = {
            "gained": sum(right[(config, i)] and not right[(against, i)] for i in ids),
            "lost": sum(right[(against, i)] and not right[(config, i)] for i in ids),
        }
    return result


def issue29_targets(overall: dict[str, dict[str, Any]], changes: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """Issue 29's targets: workspace EM at least tab EM and 1.25x current EM, one loss against
    current at most for every three gains."""

    def em(name: str) -> float | None:
        return (overall.get(name) or {}).get("exact")

    workspace, current, tab = em("workspace"), em("current"), em("tab")
    change = changes.get("workspace") or {}
    return {
        "workspace EM - tab EM": {"value": None if workspace is None or tab is None else workspace - tab, "goal": 0.0},
        "workspace EM / current EM": {"value": workspace / current if workspace is not None and current else None, "goal": 1.25},
        "workspace gained / lost vs current": {"value": f"+{change.get('gained')} -{change.get('lost')}", "goal": "lost <= gained / 3"},
    }


def targets(overall: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 14's targets, from the overall exact match of each configuration."""

    def em(name: str) -> float | None:
        return (overall.get(name) or {}).get("exact")

    def check(value: float | None, goal: float) -> dict[str, Any]:
        return {"value": value, "goal": goal, "ok": None if value is None else value >= goal}

    workspace, current_base, tab_base, tab = em("workspace"), em("current@base"), em("tab@base"), em("tab")
    ratio = workspace / current_base if workspace is not None and current_base else None
    return {
        "workspace EM / current@base EM": check(ratio, 1.4),
        "workspace EM - tab@base EM": check(None if workspace is None or tab_base is None else workspace - tab_base, 0.0),
        "tab EM - tab@base EM": check(None if tab is None or tab_base is None else tab - tab_base, 0.0),
    }


def summarize_run(records: list[Record], configs: list[str]) -> dict[str, Any]:
    per_package: dict[str, dict[str, Any]] = {}
    for repo in sorted({r.repo for r in records}):
        per_package[repo] = {c: summarize([r for r in records if r.repo == repo and r.config == c]) for c in configs}
    overall = {c: summarize([r for r in records if r.config == c]) for c in configs}
    changes = gains_and_losses(records, configs) if "current" in configs else {}
    for repo, rows in per_package.items():
        repo_changes = gains_and_losses([r for r in records if r.repo == repo], configs) if changes else {}
        for config, row in rows.items():
            row.update(repo_changes.get(config, {}))
    for config, row in overall.items():
        row.update(changes.get(config, {}))
    return {"per_package": per_package, "overall": overall, "targets": targets(overall),
            "issue29_targets": issue29_targets(overall, changes)}


def print_tables(summary: dict[str, Any]) -> None:
    sections = {**summary["per_package"], "ALL": summary["overall"]}
    for title, rows in sections.items():
        print(f"\n{title}")
        print(f"  {'config':14} {'n':>4} {'EM':>6} {'edit sim':>8} {'vs current':>10} {'prompt tok':>10} {'p50 ms':>8} {'errors':>6}")
        for config, s in rows.items():
            if s["n"]:
                change = f"+{s['gained']} -{s['lost']}" if "gained" in s else "-"
                print(
                    f"  {config:14} {s['n']:>4} {fmt(s['exact'], '.3f'):>6} {fmt(s['edit_sim'], '.3f'):>8} {change:>10} "
                    f"{fmt(s['prompt_tokens_mean'], '.0f'):>10} {fmt(s['latency_p50_ms'], '.0f'):>8} {s['errors']:>6}"
                )
    print("\ntargets (issue 14):")
    for name, t in summary["targets"].items():
        verdict = "-" if t["ok"] is None else "ok" if t["ok"] else "MISS"
        print(f"  {name:32} {fmt(t['value'], '+.3f' if '-' in name else '.3f'):>8}  (goal >= {t['goal']})  {verdict}")
    print("\ntargets (issue 29):")
    for name, t in summary["issue29_targets"].items():
        value = t["value"] if isinstance(t["value"], str) else fmt(t["value"], "+.3f" if " - " in name else ".3f")
        print(f"  {name:36} {value:>10}  (goal: {t['goal']})")


# ----------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, "qwen-coder", engine_args=False)
    parser.add_argument("--limit", type=int, help="N cases per package (fixed seed); default all 496")
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help=f"comma list of current, tab, workspace, oracle, NAME@base (default {DEFAULT_CONFIGS})"
    )
    parser.add_argument(
        "--base", type=Path, help="another checkout (today's code, a git worktree) for the NAME@base configurations"
    )
    parser.add_argument(
        "--repos",
        type=Path,
        default=CACHE / "crossfile-repos",
        help="the unpacked packages, as name-version/ (default bench/.cache/crossfile-repos)",
    )
    parser.add_argument("--cases", type=Path, default=CASES)
    parser.add_argument("--packages", help="comma list of package names to run (click,flask; default all fifteen)")
    parser.add_argument("--recall", action="store_true",
                        help="no model: how often the tab's and the workspace's blocks hold the cut name's definition")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--cross-file-tokens", type=int, help="crossFileTokens for the new code's servers (default: the server's)"
    )
    parser.add_argument("--out", type=Path, help="default bench/results/crossfile-<model>.json")
    args = parser.parse_args(argv)
    if args.base is not None:
        args.base = args.base.resolve()
        if not (args.base / "lsp" / "config.py").is_file():
            parser.error(f"--base {args.base}: not an ember checkout (no lsp/config.py)")
    # One spelling of every path: the index resolves symlinks (bench/.cache is often one).
    args.repos = args.repos.resolve()
    return args


async def run(args: argparse.Namespace) -> int:
    model = resolve_model(args.model, args.engine)
    configs = parse_configs(args.configs, args)
    packages = select(load_cases(args.cases), args.limit)
    if args.packages:
        wanted = {p.strip() for p in args.packages.split(",")}
        packages = {p: cs for p, cs in packages.items() if p.rsplit("-", 1)[0] in wanted}
    if not packages:
        print("error: no cases selected", file=sys.stderr)
        return 2
    missing = [p for p in packages if not (args.repos / p).is_dir()]
    if missing or not configs:
        print(
            f"error: packages missing under {args.repos}: {missing}" if missing else "error: no configurations", file=sys.stderr
        )
        return 2
    cases = [c.id for cs in packages.values() for c in cs]
    meta: dict[str, Any] = {
        "model": model[0],
        "model_path": model[1],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": {"new": commit(ROOT), "base": commit(args.base) if args.base else None},
        "machine": machine(),
        "settings": settings(args),
        "configs": [c.name for c in configs],
        "cases": {"file": str(args.cases), "limit_per_package": args.limit, "seed": SEED, "n": len(cases), "ids": cases},
        "repos": str(args.repos),
    }
    run_ = Run(args.out or RESULTS / f"crossfile-{model[0]}.json", meta, configs)
    print(f"{len(cases)} cases x {len(configs)} configurations, model {model[0]} ({model[1]})", file=sys.stderr)
    servers = build_servers(configs, args, model, args.repos / next(iter(packages)))
    try:
        meta.update(await start_servers(servers))
        run_.configs = [c for c in configs if c.server_key in servers]
        if servers:
            await run_packages(run_, servers, packages, args.repos)
    except asyncio.CancelledError:
        meta["interrupted"] = True
        raise
    finally:
        for key, server in servers.items():
            if server.messages:
                meta.setdefault("server_messages", {})["/".join(key)] = server.messages[:20]
            await server.stop()
        summary = run_.save(done=not meta.get("interrupted"))
    print(
        f"\nmodel {model[0]}, max_tokens {args.max_tokens}, {len(cases)} cases, "
        f"commit {(meta['commit']['new'] or {}).get('head')}"
        f" vs base {(meta['commit']['base'] or {}).get('head')}"
    )
    print_tables(summary)
    for label, error in (meta.get("errors") or {}).items():
        skipped = [c.name for c in configs if "/".join(c.server_key) == label]
        print(f"\nnot run: {', '.join(skipped)}: the {label} server did not start: {error}")
    print(f"\nwrote {run_.out}")
    return 1 if meta.get("errors") or not servers else 0


async def run_until_signal(args: argparse.Namespace) -> int:
    """SIGTERM/SIGINT cancel the run so that the servers (and their engines) are stopped and the
    records so far written."""
    task = asyncio.ensure_future(run(args))
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        print("stopped; partial results written", file=sys.stderr)
        return 130


def print_recall(args: argparse.Namespace) -> int:
    cases = load_cases(args.cases)
    counts = offline_recall(cases, args.repos)
    print(f"{'package':28} {'cases':>5} {'oracle':>6} {'in tab':>6} {'in workspace':>12}  (the definition's first line in the block)")
    for repo, c in sorted(counts.items(), key=lambda item: (item[0] == "ALL", item[0])):
        print(f"{repo:28} {c['cases']:>5} {c['oracle']:>6} {c['tab']:>6} {c['workspace']:>12}")
    out = args.out or RESULTS / "crossfile-recall.json"
    print(f"wrote {write_results(out, {'counts': counts}, args)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recall:
        return print_recall(args)
    return asyncio.run(run_until_signal(args))


if __name__ == "__main__":
    sys.exit(main())
