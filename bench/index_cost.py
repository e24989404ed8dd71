"""What the workspace index costs on a real tree: background indexing time, memory, and completion
latency while indexing against after, in one run.

    .venv/bin/python bench/index_cost.py                      # the django sdist, SmolLM2 (bundled)
    .venv/bin/python bench/index_cost.py --tree fastapi
    .venv/bin/python bench/index_cost.py --tree-dir ~/src/myproject --file pkg/core.py

The tree is a PyPI sdist (``--tree NAME``: downloaded once with ``pip download --no-binary :all:``
into bench/.cache/repos, unpacked into bench/.cache/index-trees/NAME/) or any folder
(``--tree-dir``). One server of this checkout starts with ``crossFile: "workspace"`` and rootUri =
the tree; one file of the tree is opened (its disk text). As soon as the engine is ready the client
asks for completions at fixed positions of that file (ends of single-line statements in function
bodies, chosen with a fixed seed, cycled), one at a time, while a second task polls ``ember/stats``
every 0.5 s (``workspace``: roots, files, scan_done, cap_hit, summaries, summary_bytes, skipped,
scan_s; ``process.rss_mib``). After each answer the client reads ``last_for_uri`` (latency_ms,
prompt_tokens, cross_file). ``workspace.scan_done`` is read just before each request and right
after its answer: a request during which the scan was not done (at either end) is "indexing"; the
same number of requests after the scan (at least ``--min-after``) are "after". Before them,
``--warmup`` requests (default 2) on a scratch document that imports nothing take the engine's
first-request cost out of both phases. The model is the index's neighbour, not the subject: the
small bundled one by default. vLLM's prefix cache is off (``--prefix-cache`` turns it on) so that
the after phase, which asks at the same positions in the same order as the indexing phase, is not
answered from the indexing phase's KV blocks.

The scan may well finish before the engine is ready (listing django takes seconds, loading a model
a minute): then no request falls in the indexing phase, and the script says so. ``--late-root``
makes the scan run under load: the server is initialized without a workspace folder and the tree
is added with ``workspace/didChangeWorkspaceFolders`` once the engine is ready and warmed up, as
when a user adds a folder to an open editor. Prints files listed, scan seconds,
summary bytes, rss at ready / at scan end / at the end, latency p50/p95 per phase and their ratio;
writes bench/results/index-cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lsprotocol import types

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make `bench` and `context` importable
    sys.path.insert(0, str(ROOT))

from bench.crossfile import WorkspaceServer, git_head, knows_modes, server_options  # noqa: E402
from bench.quality import CACHE, RESULTS, SEED, lsp_position, percentile, resolve  # noqa: E402
from context.source.languages import parser_for  # noqa: E402

TREES = CACHE / "index-trees"
ARCHIVES = CACHE / "repos"
DEFAULT_FILES = {"django": "django/db/models/query.py", "fastapi": "fastapi/routing.py"}
POLL_S = 0.5
WARMUP_TEXT = 'def greet(name):\n    message = "hello " + name\n    return message\n\n\ndef add(a, b):\n    total = a + b\n'


@dataclass
class Sample:
    t_s: float  # since the server was launched
    ready: bool
    rss_mib: float | None
    workspace: dict[str, Any] | None


@dataclass
class Request:
    index: int
    line: int
    t_s: float
    phase: str  # "indexing" or "after"
    latency_ms: float | None
    client_ms: float
    prompt_tokens: int | None
    cross_file: Any
    scan_done_at_start: bool | None  # ember/stats workspace.scan_done just before the request (None: no index)
    scan_done: bool | None  # and right after its answer
    error: str | None


# ------------------------------------------------------------------------------------ the tree


def download_sdist(name: str) -> Path:
    """The newest ``name-*.tar.gz`` in bench/.cache/repos, fetched with pip when there is none."""
    ARCHIVES.mkdir(parents=True, exist_ok=True)
    found = sorted(ARCHIVES.glob(f"{name}-[0-9]*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(ARCHIVES), name],
            check=True,
        )
        found = sorted(ARCHIVES.glob(f"{name}-[0-9]*.tar.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"pip download {name} left no {name}-*.tar.gz in {ARCHIVES}")
    return found[-1]


def prepare_tree(name: str) -> Path:
    """bench/.cache/index-trees/NAME: the sdist's top folder, unpacked once."""
    dest = TREES / name
    if dest.is_dir() and any(dest.iterdir()):
        return dest
    archive = download_sdist(name)
    staging = TREES / f".{name}.unpacking"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")  # no links out, no absolute paths, no devices
    tops = list(staging.iterdir())
    (tops[0] if len(tops) == 1 and tops[0].is_dir() else staging).rename(dest)
    shutil.rmtree(staging, ignore_errors=True)
    print(f"unpacked {archive.name} into {dest}", file=sys.stderr)
    return dest


def pick_file(tree: Path, name: str | None, wanted: str | None) -> Path:
    """``--file``, else the tree's known busy module, else its largest Python file under 100 kB."""
    relative = wanted or DEFAULT_FILES.get(name or "")
    if relative:
        path = tree / relative
        if not path.is_file():
            raise SystemExit(f"{path}: no such file in the tree")
        return path
    candidates = [p for p in tree.rglob("*.py") if p.stat().st_size < 100_000]
    if not candidates:
        raise SystemExit(f"{tree}: no Python file to open")
    return max(candidates, key=lambda p: p.stat().st_size)


def statement_ends(text: str, count: int, seed: int = SEED) -> list[types.Position]:
    """Ends of single-line statements inside function bodies (a fixed-seed sample, in file order):
    where a user pauses after a line and the next one is asked for."""
    parser = parser_for("python")
    if parser is None:
        raise SystemExit("no Python grammar")
    tree = parser.parse(text.encode("utf-8"))
    lines = text.split("\n")
    rows: set[int] = set()
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        body = node.child_by_field_name("body") if node.type == "function_definition" else None
        for statement in body.named_children if body is not None else ():
            docstring = (
                statement.type == "expression_statement"
                and statement.named_children[:1]
                and statement.named_children[0].type == "string"
            )
            if statement.start_point[0] == statement.end_point[0] and statement.type != "comment" and not docstring:
                rows.add(statement.start_point[0])
    picked = sorted(random.Random(seed).sample(sorted(rows), min(count, len(rows))))
    if not picked:
        raise SystemExit("no statement lines in function bodies to complete at")
    return [lsp_position("\n".join(lines[: row + 1])) for row in picked]


# ----------------------------------------------------------------------------------------- run


async def poll(server: WorkspaceServer, samples: list[Sample], launched: float, stop: asyncio.Event) -> None:
    """ember/stats every POLL_S seconds until ``stop``."""
    while not stop.is_set():
        try:
            stats = await server.stats()
        except Exception as exc:  # noqa: BLE001 - the server went away: the requests loop will say so
            print(f"stats poll failed: {exc}", file=sys.stderr)
            return
        workspace = stats.get("workspace")
        samples.append(
            Sample(
                t_s=round(time.monotonic() - launched, 2),
                ready=bool((stats.get("engine") or {}).get("ready")),
                rss_mib=(stats.get("process") or {}).get("rss_mib"),
                workspace=workspace if isinstance(workspace, dict) else None,
            )
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)


@dataclass
class Answer:
    last: dict[str, Any]  # ember/stats last_for_uri
    client_ms: float
    error: str | None
    workspace_before: Any  # ember/stats workspace, read just before the request
    workspace: Any  # and right after the answer


async def ask(server: WorkspaceServer, uri: str, position: types.Position, timeout_s: float, before: Any = None) -> Answer:
    """One request; ``before``: the workspace stats the caller read just before it."""
    params = types.InlineCompletionParams(
        text_document=types.TextDocumentIdentifier(uri=uri),
        position=position,
        context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
    )
    t0 = time.perf_counter()
    error = None
    try:
        await asyncio.wait_for(server.client.text_document_inline_completion_async(params), timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        error = f"{type(exc).__name__}: {exc}"
    client_ms = (time.perf_counter() - t0) * 1000
    stats = await server.stats(uri)
    return Answer(stats.get("last_for_uri") or {}, client_ms, error, before, stats.get("workspace"))


def record(answer: Answer, index: int, position: types.Position, launched: float, phase: str | None = None) -> Request:
    """The request's record. Its phase: "indexing" when the scan was not done as it was sent or
    as it was answered (it ran, at least in part, beside the scan), else "after" (no index: "after")."""

    def done(workspace: Any) -> bool | None:
        return workspace.get("scan_done") if isinstance(workspace, dict) else None

    scan_done_at_start, scan_done = done(answer.workspace_before), done(answer.workspace)
    return Request(
        index=index,
        line=position.line + 1,
        t_s=round(time.monotonic() - launched, 2),
        phase=phase or ("indexing" if False in (scan_done_at_start, scan_done) else "after"),
        latency_ms=answer.last.get("latency_ms"),
        client_ms=round(answer.client_ms, 1),
        prompt_tokens=answer.last.get("prompt_tokens"),
        cross_file=answer.last.get("cross_file"),
        scan_done_at_start=scan_done_at_start,
        scan_done=scan_done,
        error=answer.error,
    )


async def warm_up(server: WorkspaceServer, count: int, launched: float, timeout_s: float) -> list[Request]:
    """``count`` requests on a scratch document outside the tree that imports nothing: an engine's
    first requests are slow whatever the index does, and would land in whichever phase comes first."""
    uri = (Path(tempfile.gettempdir()) / "ember-index-cost-warmup.py").as_uri()
    text = WARMUP_TEXT.rstrip("\n")
    server.client.text_document_did_open(
        types.DidOpenTextDocumentParams(types.TextDocumentItem(uri=uri, language_id="python", version=1, text=text))
    )
    position = lsp_position(text)
    done = [record(await ask(server, uri, position, timeout_s), i, position, launched, "warmup") for i in range(count)]
    server.client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri=uri)))
    return done


async def request_loop(
    server: WorkspaceServer, uri: str, positions: list[types.Position], launched: float, args: argparse.Namespace
) -> list[Request]:
    """Requests until the scan is done, then as many again (at least ``--min-after``)."""
    requests: list[Request] = []
    deadline = time.monotonic() + args.max_s
    while time.monotonic() < deadline:
        indexing = sum(r.phase == "indexing" for r in requests)
        after = len(requests) - indexing
        if after >= max(indexing, args.min_after) or indexing >= args.max_requests:
            break
        before = (await server.stats()).get("workspace")
        # The after phase asks at the same positions, in the same order, as the indexing phase.
        scanning = isinstance(before, dict) and before.get("scan_done") is False
        position = positions[(indexing if scanning else after) % len(positions)]
        answer = await ask(server, uri, position, args.timeout_ms / 1000 + 60, before)
        requests.append(record(answer, len(requests), position, launched))
    return requests


# ------------------------------------------------------------------------------------- reports


def phase_summary(requests: list[Request]) -> dict[str, Any]:
    latencies = [r.latency_ms for r in requests if r.latency_ms is not None]
    tokens = [r.prompt_tokens for r in requests if r.prompt_tokens is not None]
    return {
        "n": len(requests),
        "latency_p50_ms": percentile(latencies, 0.5),
        "latency_p95_ms": percentile(latencies, 0.95),
        "prompt_tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        "errors": sum(r.error is not None for r in requests),
    }


def scan_finished(sample: Sample, since_s: float) -> bool:
    """The scan of the tree is done in this sample (an empty root list before --late-root adds
    the tree says done too: it is not that scan)."""
    w = sample.workspace
    return bool(w and sample.t_s >= since_s and w.get("scan_done") and w.get("roots", [True]))


def summarize(samples: list[Sample], requests: list[Request], ready_s: float, root_added_s: float | None) -> dict[str, Any]:
    workspace = next((s.workspace for s in reversed(samples) if s.workspace), None) or {}
    scanned = next((s for s in samples if scan_finished(s, root_added_s or 0.0)), None)
    at_ready = next((s for s in samples if s.ready), None)
    phases = {p: phase_summary([r for r in requests if r.phase == p]) for p in ("indexing", "after")}

    def ratio(key: str) -> float | None:
        a, b = phases["indexing"][key], phases["after"][key]
        return a / b if a is not None and b else None

    return {
        "workspace": workspace,  # the last stats seen: files, summaries, summary_bytes, skipped, cap_hit, scan_s
        "scan_s": workspace.get("scan_s"),
        "scan_done_seen_at_s": scanned.t_s if scanned else None,  # by the 0.5 s poll, since launch
        "engine_ready_s": round(ready_s, 2),
        "root_added_s": root_added_s,  # --late-root: when the tree became a workspace folder
        "rss_mib": {
            "at_ready": at_ready.rss_mib if at_ready else None,
            "at_scan_done": scanned.rss_mib if scanned else None,
            "at_end": samples[-1].rss_mib if samples else None,
            "max": max((s.rss_mib for s in samples if s.rss_mib is not None), default=None),
        },
        "phases": phases,
        # The first request in the tree's file: summaries of what it imports are parsed on demand.
        "first_request": asdict(requests[0]) if requests else None,
        "latency_p50_ratio_indexing_to_after": ratio("latency_p50_ms"),
        "latency_p95_ratio_indexing_to_after": ratio("latency_p95_ms"),
    }


def fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(summary: dict[str, Any], tree: Path) -> None:
    w, rss, phases = summary["workspace"], summary["rss_mib"], summary["phases"]
    if not w:
        print('the server reported no workspace stats: no index on this code (is crossFile "workspace" implemented?)')
    print(f"tree {tree}")
    print(
        f"  files listed {w.get('files', '-')}, summaries {w.get('summaries', '-')}, "
        f"summary bytes {w.get('summary_bytes', '-')}, skipped {w.get('skipped', '-')}, cap hit {w.get('cap_hit', '-')}"
    )
    print(
        f"  scan {fmt(summary['scan_s'], '.2f')} s (server); done seen at {fmt(summary['scan_done_seen_at_s'])} s, "
        f"engine ready at {fmt(summary['engine_ready_s'])} s, tree added at {fmt(summary['root_added_s'])} s (since launch)"
    )
    print(
        f"  rss MiB: at ready {fmt(rss['at_ready'])}, at scan done {fmt(rss['at_scan_done'])}, "
        f"at end {fmt(rss['at_end'])}, max {fmt(rss['max'])}"
    )
    print(f"  {'phase':9} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'prompt tok':>10} {'errors':>6}")
    for name, p in {"warmup": summary["warmup"], **phases}.items():
        print(
            f"  {name:9} {p['n']:>4} {fmt(p['latency_p50_ms'], '.0f'):>8} {fmt(p['latency_p95_ms'], '.0f'):>8} "
            f"{fmt(p['prompt_tokens_mean'], '.0f'):>10} {p['errors']:>6}"
        )
    print(
        f"  latency ratio indexing/after: p50 {fmt(summary['latency_p50_ratio_indexing_to_after'], '.2f')}, "
        f"p95 {fmt(summary['latency_p95_ratio_indexing_to_after'], '.2f')}"
    )
    first = summary["first_request"]
    if first:
        print(
            f"  first request in the file: {fmt(first['latency_ms'], '.0f')} ms ({first['phase']}), "
            f"{len(first['cross_file']) if isinstance(first['cross_file'], list) else '-'} cross-file snippets"
        )
    if w and not phases["indexing"]["n"]:
        hint = "" if summary["root_added_s"] is not None else " (try --late-root)"
        print(f"  no request ran while indexing: the scan finished before the first request was sent{hint}")


# ----------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--tree", default="django", help="a PyPI sdist to index (default django; fastapi is smaller)")
    where.add_argument("--tree-dir", type=Path, help="index this folder instead of an sdist")
    parser.add_argument("--file", help="the file to open, relative to the tree (default: a busy module of the tree)")
    parser.add_argument("--model", default="smollm2", help="smollm2 (default, bundled), qwen-coder, or a model path")
    parser.add_argument("--positions", type=int, default=40, help="completion positions in the file, cycled (default 40)")
    parser.add_argument("--min-after", type=int, default=20, help="requests after the scan at least (default 20)")
    parser.add_argument("--max-requests", type=int, default=400, help="at most this many requests while indexing")
    parser.add_argument("--max-s", type=float, default=900, help="stop asking after this many seconds of requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout-ms", type=int, default=60000)
    parser.add_argument("--cross-file-tokens", type=int, help="crossFileTokens (default: the server's)")
    parser.add_argument(
        "--cross-file",
        choices=("workspace", "open", "off"),
        default="workspace",
        help="crossFile (default workspace; the others have no index: a check of the script itself)",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="requests on a scratch document first (default 2; not in the phases)"
    )
    parser.add_argument(
        "--late-root",
        action="store_true",
        help="initialize without a workspace folder and add the tree (didChangeWorkspaceFolders) once "
        "the engine is ready and warm: the scan then runs while requests are answered",
    )
    parser.add_argument("--prefix-cache", action="store_true", help="keep vLLM's prefix cache on")
    parser.add_argument("--out", type=Path, default=RESULTS / "index-cost.json")
    parser.add_argument("--prepare-only", action="store_true", help="download and unpack the tree, then stop")
    return parser.parse_args(argv)


def options_for(args: argparse.Namespace) -> dict[str, Any]:
    options = server_options(args, args.cross_file, legacy=not knows_modes(ROOT))
    options["timeoutMs"] = args.timeout_ms
    options["prefixCache"] = bool(args.prefix_cache)
    return options


async def measure(args: argparse.Namespace, tree: Path, path: Path, text: str) -> dict[str, Any]:
    name, model_path = resolve(args.model)
    positions = statement_ends(text, args.positions)
    (CACHE / "logs").mkdir(parents=True, exist_ok=True)
    log = CACHE / "logs" / f"index-cost-{name}.log"
    server = WorkspaceServer(model_path, options_for(args), log, ROOT, None if args.late_root else tree)
    samples: list[Sample] = []
    stop = asyncio.Event()
    launched = time.monotonic()
    poller: asyncio.Task[None] | None = None
    try:
        await server.launch_in_checkout()
        poller = asyncio.create_task(poll(server, samples, launched, stop))
        await server.wait_ready()
        ready_s = time.monotonic() - launched
        if server.refusals():
            raise RuntimeError(f"the server refused the settings: {server.refusals()[0]}")
        warmups = await warm_up(server, args.warmup, launched, args.timeout_ms / 1000 + 60)
        root_added_s = None
        if args.late_root:  # the user adds the folder to the workspace now: the scan starts under load
            server.change_folder(tree)
            root_added_s = round(time.monotonic() - launched, 2)
        uri = path.as_uri()
        server.client.text_document_did_open(
            types.DidOpenTextDocumentParams(types.TextDocumentItem(uri=uri, language_id="python", version=1, text=text))
        )
        requests = await request_loop(server, uri, positions, launched, args)
    finally:
        stop.set()
        if poller is not None:
            await poller
        await server.stop()
    return {
        "model": name,
        "model_path": model_path,
        "options": server.options,
        "positions": [p.line + 1 for p in positions],
        "server_messages": server.messages[:20],
        "summary": {**summarize(samples, requests, ready_s, root_added_s), "warmup": phase_summary(warmups)},
        "samples": [asdict(s) for s in samples],
        "requests": [asdict(r) for r in warmups + requests],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tree = (args.tree_dir or prepare_tree(args.tree)).resolve()  # the index resolves symlinks: one spelling
    path = pick_file(tree, None if args.tree_dir else args.tree, args.file)
    print(f"tree {tree}, file {path.relative_to(tree)}", file=sys.stderr)
    if args.prepare_only:
        return 0
    if args.cross_file == "workspace" and not knows_modes(ROOT):
        print('warning: this checkout\'s crossFile is still true/false; the server will refuse "workspace"', file=sys.stderr)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        result = asyncio.run(measure(args, tree, path, path.read_text(encoding="utf-8")))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    payload = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        "commit": git_head(ROOT),
        "tree": str(tree),
        "file": str(path.relative_to(tree)),
        **result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"model {result['model']}, max_tokens {args.max_tokens}, commit {(payload['commit'] or {}).get('head')}")
    print_report(result["summary"], tree)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
