"""How fast does ember answer while a developer types, and what do its ideas buy? A replay of typing
through real files against the real server, with and without ember's speed ideas.

    .venv/bin/python bench/replay.py [--requests 60] [--files 3] [--bodies 2] [--max-tokens 32]
                                     [--configs ember,off] [--seed 7]

Sources are pinned releases (PyPI sdists of requests and flask, fetched once into
``bench/.cache/repos`` by bench/prompt_stability.py's ``fetch``). In each file a few function bodies
are picked with a fixed seed; each body is deleted (the ``def`` line stays) and typed back one key
at a time with inter-key delays (``--key-ms``, default 40-90 ms), one incremental ``didChange`` per
key (a newline and its auto-indent are one key). Like an editor with a debounce, the client asks
``textDocument/inlineCompletion`` when the user pauses: at the end of a line, at some word
boundaries (``--pause-prob``), and after moving to the emptied body. The reply is the suggestion
"shown". With probability ``--along-prob`` the user then *types along* it: when the suggestion
begins with the true next characters, the user types 1-8 of them and the editor asks again (these
"along" requests should be answered from ember's cache), up to three times in a row. After
``--type-chars`` characters of a body the rest is pasted in one edit and the next body follows.

Every decision (pauses, delays, typing along) is a function of the seed and the position in the
text, so both configurations see the same typing wherever their suggestions allow it.

Configurations, each its own ``python -m lsp --stdio`` process:
  ember: as built (anchored AST prompt, reuse, warm-up)
  classic: ember with ``fimLayout: "classic"`` (a PSM model's suffix after the cursor's text)
  off:   ``reuse: false, warmup: false, promptStrategy: "naive"`` (vLLM's own prefix cache still on,
         as vLLM defaults: its hits are what the naive prompt gets by luck)
  cold:  off, and ``prefixCache: false`` (no KV reuse at all: every request prefills its prompt)
  NAME@base: configuration NAME run from the checkout ``--base`` (the previous commit, say): the
         same replay against two versions of ember in one run; the table's "server CPU ms / request"
         is the server process's CPU time over the replay per request (the engine core's process
         not included)
  open, workspace: ember with ``crossFile: "open"`` (context from the other open documents) or
         ``"workspace"`` (from the workspace folder's files); with ``--workspace DIR`` (a package
         folder, e.g. one that ../shared/eval/fetch-crossfile-repos.sh unpacks) the servers get DIR
         as their workspace folder and its files are replayed from disk
  eager, compiled: ember with ``engineArgs: {"enforce_eager": true | false}``: vLLM's eager mode
         (stdio's default on the CPU) against compiled mode (torch.compile; the TCP server's and
         the daemon's default); the table shows each one's engine start, ttft and decode rate.
``--engine-arg KEY=VALUE`` (repeatable) is passed to every server, e.g. ``max_model_len=4096``.
By default both servers load at once and the replay alternates between them body by body (which
one goes first alternates too), so that a shared machine whose load drifts during the run affects
both alike and the models load in parallel; ``--schedule sequential`` runs one after the other.

After each reply the client reads ``ember/stats`` ``last`` (latency_ms, ttft_ms, engine_ms,
prompt_tokens, cached_tokens, kv_reuse, cache_hit, ...). Prints a table and writes
bench/results/replay.json and bench/results/replay.png (CDF of latency_ms and ttft_ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
from lsprotocol import types
from pygls.lsp.client import LanguageClient

from bench.harness import (
    RESULTS,
    ROOT,
    Ember,
    add_model_args,
    chance,
    ember_command,
    fmt,
    percentile,
    resolve_model,
    utf16_position,
    write_results,
)  # fmt: skip
from bench.prompt_stability import read_sources
from context.source.document import Document

# Files interleaved across releases, so `--files N` mixes code bases.
SOURCES: tuple[tuple[str, str], ...] = (
    ("pypi:requests==2.32.3", "src/requests/sessions.py"),
    ("pypi:flask==3.0.3", "src/flask/app.py"),
    ("pypi:requests==2.32.3", "src/requests/models.py"),
    ("pypi:flask==3.0.3", "src/flask/cli.py"),
    ("pypi:requests==2.32.3", "src/requests/utils.py"),
    ("pypi:flask==3.0.3", "src/flask/sansio/scaffold.py"),
)
CONFIGS: dict[str, dict[str, Any]] = {
    "ember": {"reuse": True, "warmup": True, "promptStrategy": "ast"},
    # ember with a prefix-suffix-middle model's prompt in the layout before "append": each
    # keystroke changes the prompt before the suffix.
    "classic": {"reuse": True, "warmup": True, "promptStrategy": "ast", "fimLayout": "classic"},
    "off": {"reuse": False, "warmup": False, "promptStrategy": "naive"},
    # off, and the engine's KV prefix cache off too: every request prefills its whole prompt.
    "cold": {"reuse": False, "warmup": False, "promptStrategy": "naive", "prefixCache": False},
    # vLLM's execution mode, over the engineArgs setting (the engine starts with the editor's).
    "eager": {"reuse": True, "warmup": True, "promptStrategy": "ast", "engineArgs": {"enforce_eager": True}},
    "compiled": {"reuse": True, "warmup": True, "promptStrategy": "ast", "engineArgs": {"enforce_eager": False}},
    # Cross-file context (with --workspace, the folder is the editor's workspace): the open
    # documents only, or the workspace folder's files.
    "open": {"reuse": True, "warmup": True, "promptStrategy": "ast", "crossFile": "open"},
    "workspace": {"reuse": True, "warmup": True, "promptStrategy": "ast", "crossFile": "workspace"},
}
FAST_CACHE_MS = 10.0
_FUNCTIONS = frozenset({"function_definition"})


# ------------------------------------------------------------------------------------ the plan


# Where a body sits decides how much suffix a prefix-suffix-middle prompt carries: after a
# mid-file body the suffix fills its budget (ember's ~235 tokens, llama.vim's 64 lines or ~250
# tokens), after a body at the end of a file there is little or none.
END_OF_FILE_CHARS = 300
MID_FILE_CHARS = 1200


@dataclass(frozen=True)
class Body:
    file: str
    name: str
    start: int  # offset of the first body line's start
    end: int  # offset of the body's end
    place: str = "mid"  # "mid" | "end" | "near-end": how much of the file follows (place_of)


def place_of(text: str, end: int) -> str:
    after = len(text[end:].strip())
    return "end" if after < END_OF_FILE_CHARS else "mid" if after >= MID_FILE_CHARS else "near-end"


def pick_bodies(path: str, text: str, count: int, seed: int, min_chars: int = 120, max_chars: int = 2500) -> list[Body]:
    """``count`` function bodies of the file, chosen with the seed (non-overlapping: no nesting)."""
    unique = function_bodies(path, text, min_chars, max_chars)
    chosen = random.Random(f"{seed}:{path}").sample(unique, min(count, len(unique)))
    return sorted(chosen, key=lambda b: b.start, reverse=True)  # later bodies first: offsets of earlier ones stay valid


def function_bodies(path: str, text: str, min_chars: int = 120, max_chars: int = 2500) -> list[Body]:
    """The file's function bodies of 3 lines or more and ``min_chars``..``max_chars``, in order,
    none inside another."""
    doc = Document(f"file:///{path}", "python", text)
    assert doc.tree is not None, "tree-sitter-python is needed"
    found: list[Body] = []
    stack = [doc.tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(reversed(node.named_children))
        if node.type not in _FUNCTIONS:
            continue
        body = node.child_by_field_name("body")
        if body is None or body.end_point[0] - body.start_point[0] < 3:
            continue
        start = doc.offset_from_byte(body.start_byte)
        start = text.rfind("\n", 0, start) + 1
        end = doc.offset_from_byte(body.end_byte)
        if min_chars <= end - start <= max_chars:
            name = node.child_by_field_name("name")
            found.append(Body(path, name.text.decode() if name is not None and name.text else "?", start, end, place_of(text, end)))
    found.sort(key=lambda b: b.start)
    return [b for i, b in enumerate(found) if i == 0 or b.start >= found[i - 1].end]


def next_key(truth: str, done: int) -> str:
    """The next keystroke typing ``truth`` from ``done``: one character, except that a newline
    carries the next line's indentation (the editor's auto-indent), as does the first line's."""
    if done == 0 or truth[done] == "\n":
        j = done + 1 if truth[done] == "\n" else done
        while j < len(truth) and truth[j] in " \t":
            j += 1
        if j > done:
            return truth[done:j]
    return truth[done]


def _ident(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


# ------------------------------------------------------------------------------------ the client


@dataclass
class Record:
    config: str
    file: str
    body: str
    offset: int
    kind: str  # open (emptied body) | pause (word boundary / end of line) | along (typed along a suggestion)
    client_ms: float
    suggestion: str
    typed_along: int = 0  # characters typed along the previous suggestion before this request
    metrics: dict[str, Any] = field(default_factory=dict)


class Editor:
    """One document in one server: keeps the text, sends incremental changes and requests."""

    def __init__(self, client: LanguageClient, uri: str, text: str, config: str, args: argparse.Namespace) -> None:
        self.client, self.uri, self.text, self.config, self.args = client, uri, text, config, args
        self.version = 1
        self.records: list[Record] = []
        self.stats_total = 0

    def open(self) -> None:
        self.client.text_document_did_open(
            types.DidOpenTextDocumentParams(types.TextDocumentItem(uri=self.uri, language_id="python", version=1, text=self.text))
        )

    def close(self) -> None:
        self.client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri=self.uri)))

    def edit(self, start: int, end: int, new: str) -> None:
        rng = types.Range(start=utf16_position(self.text, start), end=utf16_position(self.text, end))
        self.text = self.text[:start] + new + self.text[end:]
        self.version += 1
        self.client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=self.uri, version=self.version),
                content_changes=[types.TextDocumentContentChangePartial(range=rng, text=new)],
            )
        )

    async def key(self, offset: int, typed: str, delay_s: float) -> int:
        await asyncio.sleep(delay_s)
        self.edit(offset, offset, typed)
        return offset + len(typed)

    async def last_metrics(self) -> dict[str, Any]:
        """The metrics ember recorded for the request just answered (``ember/stats`` ``last``)."""
        stats = await self.client.protocol.send_request_async("ember/stats", {})
        metrics: dict[str, Any] = {}
        if stats.requests == self.stats_total + 1 and stats.last is not None:
            metrics = dict(stats.last._asdict())
        else:  # not recorded (e.g. superseded) or more than one: do not attribute it
            metrics = {"outcome": "unrecorded"}
        self.stats_total = stats.requests
        return metrics

    async def request(self, offset: int, body: Body, kind: str, along: int = 0) -> Record:
        params = types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=self.uri),
            position=utf16_position(self.text, offset),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
        )
        t0 = time.perf_counter()
        reply = await self.client.text_document_inline_completion_async(params)
        client_ms = (time.perf_counter() - t0) * 1000
        metrics = await self.last_metrics()
        items = getattr(reply, "items", None) or []
        suggestion = items[0].insert_text if items else ""
        if not isinstance(suggestion, str):
            suggestion = suggestion.value
        record = Record(self.config, body.file, body.name, offset, kind, client_ms, suggestion, along, metrics)
        self.records.append(record)
        return record


async def type_body(editor: Editor, body: Body, args: argparse.Namespace, budget: list[int]) -> None:
    """Delete ``body``, type it back (requests at pauses, typing along suggestions), paste the rest."""
    seed = args.seed
    lo, hi = args.key_ms
    truth = editor.text[body.start : body.end]
    editor.edit(body.start, body.end, "")
    offset = body.start
    await asyncio.sleep(chance(seed, body.file, body.start, "move").uniform(0.6, 1.0))  # the user moves there
    if budget[0] <= 0:
        editor.edit(offset, offset, truth)
        return
    budget[0] -= 1
    shown = (await editor.request(offset, body, "open")).suggestion
    done = 0  # characters of truth typed so far
    while done < len(truth) and done < args.type_chars and budget[0] > 0:
        # Typing along the suggestion just shown, as long as it predicts the real text.
        chain = 0
        while shown and chain < 3 and budget[0] > 0 and done < len(truth):
            rnd = chance(seed, body.file, body.start, done, "along")
            if rnd.random() >= args.along_prob:
                break
            rest = truth[done:]
            match = 0
            while match < min(len(shown), len(rest)) and shown[match] == rest[match]:
                match += 1
            if match == 0:
                break
            n = min(match, rnd.randint(1, 8))
            for ch in rest[:n]:
                offset = await editor.key(offset, ch, rnd.uniform(lo, hi) / 1000)
            done += n
            chain += 1
            await asyncio.sleep(args.debounce_ms / 1000)
            budget[0] -= 1
            shown = (await editor.request(offset, body, "along", along=n)).suggestion
        shown = ""
        if done >= len(truth) or done >= args.type_chars or budget[0] <= 0:
            break
        key = next_key(truth, done)
        rnd = chance(seed, body.file, body.start, done, "key")
        offset = await editor.key(offset, key, rnd.uniform(lo, hi) / 1000)
        done += len(key)
        end_of_line = key.startswith("\n")
        boundary = len(key) == 1 and not _ident(key) and done >= 2 and _ident(truth[done - 2])
        if end_of_line or (boundary and rnd.random() < args.pause_prob):
            await asyncio.sleep(args.debounce_ms / 1000)
            budget[0] -= 1
            shown = (await editor.request(offset, body, "pause")).suggestion
    if done < len(truth):
        editor.edit(offset, offset, truth[done:])  # paste the rest
    assert editor.text[body.start : body.start + len(truth)] == truth


@dataclass
class Server:
    name: str
    ember: Ember
    client: LanguageClient
    options: dict[str, Any]
    load_s: float
    budget: list[int]
    stats_total: int = 0
    replay_s: float = 0.0
    records: list[Record] = field(default_factory=list)
    pid: int = 0
    cpu_s_at_start: float = 0.0


def config_and_root(name: str, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """``ember@base`` is the ember configuration run from ``--base`` (another checkout)."""
    config, _, where = name.partition("@")
    if where and args.base is None:
        raise SystemExit(f"{name}: give --base DIR (the checkout to run it from)")
    return CONFIGS[config], (args.base if where else ROOT)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_server(name: str, args: argparse.Namespace) -> Server:
    config, root = config_and_root(name, args)
    options = {"maxTokens": args.max_tokens, **config}
    ember = Ember(ember_command(resolve_model(args.model, args.engine)[1], args.engine, args.engine_arg), options, cwd=root)
    load_s = await ember.start(args.workspace.resolve() if args.workspace is not None else None)
    print(f"[{name}] server up, model loaded in {load_s:.1f} s; options {options}", flush=True)
    stats = await ember.stats()
    server = Server(name, ember, ember.client, options, load_s, [args.requests], stats["requests"])
    server.pid = stats["process"]["pid"]
    server.cpu_s_at_start = process_cpu_s(server.pid)
    return server


async def stop_server(server: Server) -> dict[str, Any]:
    summary = await server.ember.stats()
    # The server process's own CPU (the embedded engine's core runs in a process of its own):
    # ember's work per request, plus the engine client's (vLLM's frontend, detokenizing).
    cpu_s = process_cpu_s(server.pid) - server.cpu_s_at_start
    await server.ember.stop()
    return {
        "load_s": server.load_s, "replay_s": server.replay_s, "server_cpu_s": cpu_s, "options": server.options,
        "server_summary": summary,
    }  # fmt: skip


def file_uri(path: str, args: argparse.Namespace) -> str:
    """A replayed file's URI: under --workspace, the file itself; else a made-up place."""
    if args.workspace is not None:
        return (args.workspace.resolve() / path).as_uri()
    return f"file:///replay/{path}"


def workspace_files(folder: Path, count: int) -> list[tuple[str, str]]:
    """(path in the folder, text) of the first ``count`` of SOURCES that the folder holds (an
    unpacked release with its import root on top: ``requests/utils.py``)."""
    found = []
    for _, wanted in SOURCES:
        path = wanted.removeprefix("src/")
        if (folder / path).is_file():
            found.append((path, (folder / path).read_text(encoding="utf-8")))
    if not found:
        raise SystemExit(f"{folder} holds none of the replayed files ({', '.join(w for _, w in SOURCES)})")
    return found[:count]


async def replay(servers: list[Server], files: list[tuple[str, str, list[Body]]], args: argparse.Namespace) -> None:
    """Type the bodies in every server. ``interleaved``: body by body, alternating which server goes
    first, so that a machine whose load changes during the run treats both alike; ``sequential``:
    one server after the other."""
    if args.schedule == "sequential":
        plan = [(s, fi, body) for s in servers for fi, (_, _, bodies) in enumerate(files) for body in bodies]
    else:
        plan = []
        for fi, (_, _, bodies) in enumerate(files):
            for bi, body in enumerate(bodies):
                order = servers if (fi + bi) % 2 == 0 else servers[::-1]
                plan += [(s, fi, body) for s in order]
    open_editor: dict[str, Editor] = {}

    def close(server: Server) -> None:
        editor = open_editor.pop(server.name, None)
        if editor is not None:
            editor.close()
            server.stats_total = editor.stats_total
            server.records += editor.records

    started = time.perf_counter()
    previous: Server | None = None
    for server, fi, body in plan:
        if args.time_limit and time.perf_counter() - started > args.time_limit:
            break
        if server.budget[0] <= 0:
            continue
        path, text, _ = files[fi]
        editor = open_editor.get(server.name)
        if editor is not None and editor.uri != file_uri(path, args):
            assert editor.text == next(f[1] for f in files if file_uri(f[0], args) == editor.uri)
            close(server)
            editor = None
        if editor is None:
            editor = open_editor[server.name] = Editor(server.client, file_uri(path, args), text, server.name, args)
            editor.stats_total = server.stats_total
            editor.open()
        if previous is not None and previous is not server:
            await asyncio.sleep(args.switch_s)  # let the other server's warm-up settle
        previous = server
        t0 = time.perf_counter()
        before = len(editor.records)
        await type_body(editor, body, args, server.budget)
        server.replay_s += time.perf_counter() - t0
        print(
            f"[{server.name}] {path}:{body.name}: {len(editor.records) - before} requests, "
            f"{args.requests - server.budget[0]} in all ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    for server in servers:
        close(server)


# ------------------------------------------------------------------------------------ report


def replayed(files: list[tuple[str, str, list[Body]]], records: dict[str, list[Any]]) -> dict[str, Any]:
    """The replayed files' bodies and every request, as the results files of the replays keep them."""
    return {
        "files": [{"path": p, "bodies": [asdict(b) for b in bs]} for p, _, bs in files],
        "requests": {name: [asdict(r) for r in recs] for name, recs in records.items()},
    }


def p50_p95(values: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95)}


def summarize(records: list[Record]) -> dict[str, Any]:
    ms = [r.metrics for r in records if r.metrics.get("outcome") != "unrecorded"]
    generated = [m for m in ms if not m.get("cache_hit") and m.get("engine_ms", 0) > 0]
    along = [r for r in records if r.kind == "along" and r.metrics.get("outcome") != "unrecorded"]
    latency = [m["latency_ms"] for m in ms]
    ttft = [m["ttft_ms"] for m in ms if m.get("ttft_ms") is not None]
    reuse = [m["kv_reuse"] for m in ms if m.get("kv_reuse") is not None]
    overhead = [m["latency_ms"] - m["engine_ms"] for m in generated]
    prefilled = [float(m["prompt_tokens"] - m["cached_tokens"]) for m in generated if m.get("prompt_tokens")]
    # The same while typing: without each body's first request, which follows the body's deletion.
    typing = [
        float(r.metrics["prompt_tokens"] - r.metrics["cached_tokens"])
        for r in records
        if r.kind != "open" and not r.metrics.get("cache_hit") and r.metrics.get("engine_ms", 0) > 0 and r.metrics.get("prompt_tokens")
    ]
    outcomes: dict[str, int] = {}
    for m in ms:
        outcomes[m.get("outcome", "?")] = outcomes.get(m.get("outcome", "?"), 0) + 1
    fast_along = [r for r in along if r.metrics.get("cache_hit") and r.metrics["latency_ms"] <= FAST_CACHE_MS]
    # Decode rate of a generation: the tokens after the first over the time after the first.
    decode = [
        (m["streamed_tokens"] - 1) / ((m["latency_ms"] - m["ttft_ms"]) / 1000)
        for m in generated
        if m.get("ttft_ms") is not None and m.get("streamed_tokens", 0) >= 4 and m["latency_ms"] > m["ttft_ms"]
    ]
    return {
        "requests": len(records),
        "recorded": len(ms),
        "generated": len(generated),
        "outcomes": outcomes,
        "latency_ms": {**p50_p95(latency), "n": len(latency)},
        "client_ms": p50_p95([r.client_ms for r in records]),
        "ttft_ms": {**p50_p95(ttft), "mean": statistics.fmean(ttft) if ttft else None, "n": len(ttft)},
        "decode_tokens_per_s": {"p50": percentile(decode, 0.5), "mean": statistics.fmean(decode) if decode else None, "n": len(decode)},
        "generated_latency_ms": p50_p95([m["latency_ms"] for m in generated]),
        "kv_reuse": {"median": percentile(reuse, 0.5), "p10": percentile(reuse, 0.10), "n": len(reuse)},
        "prompt_tokens_median": percentile([m["prompt_tokens"] for m in generated], 0.5),
        # Tokens the engine prefilled for each generated request: its prompt less its cache hits.
        "prefilled_tokens": {
            "median": percentile(prefilled, 0.5), "p90": percentile(prefilled, 0.9), "n": len(prefilled),
        },
        "prefilled_tokens_typing": {"median": percentile(typing, 0.5), "p90": percentile(typing, 0.9), "n": len(typing)},
        "layouts": {layout: sum(m.get("layout") == layout for m in generated) for layout in {m.get("layout") for m in generated}},
        "cache_hit_rate": (sum(bool(m.get("cache_hit")) for m in ms) / len(ms)) if ms else None,
        "overhead_ms": {**p50_p95(overhead), "n": len(overhead)},
        "along": {
            "requests": len(along),
            "cache_hit": sum(bool(r.metrics.get("cache_hit")) for r in along),
            "fast_cache_fraction": (len(fast_along) / len(along)) if along else None,
            "latency_ms_p50": percentile([r.metrics["latency_ms"] for r in along], 0.5),
        },
        "low_reuse": sum(1 for v in reuse if v < 0.5),
        "empty_suggestions": sum(not r.suggestion for r in records),
    }


def print_table(summaries: dict[str, dict[str, Any]]) -> None:
    names = list(summaries)
    rows = [
        ("engine start s", lambda s: fmt(s.get("load_s"), ".1f")),
        ("requests (along)", lambda s: f"{s['requests']} ({s['along']['requests']})"),
        ("latency_ms p50 / p95", lambda s: f"{fmt(s['latency_ms']['p50'], '.1f')} / {fmt(s['latency_ms']['p95'])}"),
        ("ttft_ms p50 / p95 (mean)", lambda s: f"{fmt(s['ttft_ms']['p50'])} / {fmt(s['ttft_ms']['p95'])} ({fmt(s['ttft_ms']['mean'])})"),
        ("decode tok/s p50 (mean)", lambda s: f"{fmt(s['decode_tokens_per_s']['p50'], '.1f')} ({fmt(s['decode_tokens_per_s']['mean'], '.1f')})"),
        ("requests kv_reuse < 0.5", lambda s: str(s["low_reuse"])),
        ("generated: latency p50 / p95", lambda s: f"{fmt(s['generated_latency_ms']['p50'])} / {fmt(s['generated_latency_ms']['p95'])}"),
        ("kv_reuse median (p10)", lambda s: f"{fmt(s['kv_reuse']['median'], '.3f')} ({fmt(s['kv_reuse']['p10'], '.2f')})"),
        ("prompt_tokens median", lambda s: fmt(s["prompt_tokens_median"])),
        ("prefilled tokens median / p90", lambda s: f"{fmt(s['prefilled_tokens']['median'])} / {fmt(s['prefilled_tokens']['p90'])}"),
        ("  typing (not a body's first)", lambda s: f"{fmt(s['prefilled_tokens_typing']['median'])} / {fmt(s['prefilled_tokens_typing']['p90'])}"),
        ("cache_hit rate", lambda s: fmt(s["cache_hit_rate"], ".2f")),
        ("overhead ms p50 / p95", lambda s: f"{fmt(s['overhead_ms']['p50'], '.1f')} / {fmt(s['overhead_ms']['p95'], '.1f')}"),
        ("server CPU ms / request", lambda s: fmt(s.get("server_cpu_ms_per_request"), ".1f")),
        ("along: cache <=10 ms", lambda s: fmt(s["along"]["fast_cache_fraction"], ".2f")),
        ("outcomes", lambda s: ",".join(f"{k}:{v}" for k, v in sorted(s["outcomes"].items()))),
    ]
    width = max(len(r[0]) for r in rows) + 2
    print("\n" + "".ljust(width) + "".join(n.rjust(24) for n in names))
    for label, get in rows:
        print(label.ljust(width) + "".join(get(summaries[n]).rjust(24) for n in names))


def targets(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ember = summaries.get("ember")
    if ember is None:
        return {}
    t: dict[str, Any] = {}
    kv = ember["kv_reuse"]["median"]
    t["kv_reuse_median>=0.90"] = {"value": kv, "ok": kv is not None and kv >= 0.90}
    for name in ("off", "cold"):
        base = summaries.get(name)
        if base is None or ember["ttft_ms"]["p50"] is None or not base["ttft_ms"]["p50"]:
            continue
        ratio = ember["ttft_ms"]["p50"] / base["ttft_ms"]["p50"]
        t[f"ttft_p50<={name}/4"] = {"value": ratio, "ok": ratio <= 0.25}
        t[f"(info) ttft_p95 ratio to {name}"] = {"value": ember["ttft_ms"]["p95"] / base["ttft_ms"]["p95"], "ok": True}
        t[f"(info) ttft_mean ratio to {name}"] = {"value": ember["ttft_ms"]["mean"] / base["ttft_ms"]["mean"], "ok": True}
    oh = ember["overhead_ms"]["p50"]
    t["overhead_p50<=5ms"] = {"value": oh, "ok": oh is not None and oh <= 5}
    fa = ember["along"]["fast_cache_fraction"]
    t["along_cache<=10ms>=0.60"] = {"value": fa, "ok": fa is not None and fa >= 0.60}
    return t


def plot(records: dict[str, list[Record]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, recs in records.items():
        ms = [r.metrics for r in recs if r.metrics.get("outcome") != "unrecorded"]
        for ax, key in zip(axes, ("latency_ms", "ttft_ms")):
            values = sorted(m[key] for m in ms if m.get(key) is not None)
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step([max(v, 0.1) for v in values], ys, where="post", label=f"{name} (n={len(values)})")
    for ax, key in zip(axes, ("latency_ms (all requests)", "ttft_ms (requests that generated)")):
        ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.axvline(FAST_CACHE_MS, color="grey", ls=":", lw=1)
        ax.legend(loc="lower right")
    fig.suptitle("ember replay: typing through pinned requests/flask sources")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60, help="completion requests per configuration (default 60)")
    parser.add_argument("--files", type=int, default=3, help="source files replayed (default 3)")
    parser.add_argument("--bodies", type=int, default=2, help="function bodies retyped per file (default 2)")
    parser.add_argument("--type-chars", type=int, default=220, help="characters typed per body before the rest is pasted")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--key-ms", type=lambda s: tuple(float(x) for x in s.split(":")), default=(40.0, 90.0), help="inter-key delay range LO:HI ms")
    parser.add_argument("--debounce-ms", type=float, default=100.0, help="client debounce: idle time before a request")
    parser.add_argument("--pause-prob", type=float, default=0.35, help="chance of a pause (request) at a word boundary")
    parser.add_argument("--along-prob", type=float, default=0.7, help="chance of typing along a matching suggestion")
    parser.add_argument("--time-limit", type=float, default=0, help="stop starting new bodies after S seconds of replay (0: no limit)")
    parser.add_argument("--schedule", choices=("interleaved", "sequential"), default="interleaved",
                        help="interleaved (default): both servers up at once, bodies alternate between them; "
                        "sequential: one server after the other")
    parser.add_argument("--switch-s", type=float, default=1.5, help="pause when the replay switches servers")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--configs", default="ember,off",
                        help="comma-separated: ember, off, cold, eager, compiled, open, workspace; NAME@base runs NAME from --base")
    parser.add_argument("--base", type=Path, help="another checkout (e.g. a git worktree of the previous commit) for NAME@base")
    add_model_args(parser, "bundled")
    parser.add_argument("--workspace", type=Path,
                        help="a package folder (e.g. bench/.cache/crossfile-repos/requests-2.32.3, laid out by "
                        "../shared/eval/fetch-crossfile-repos.sh) that is the editor's workspace: its files are replayed")
    parser.add_argument("--out", default=str(RESULTS / "replay.json"))
    args = parser.parse_args()

    files: list[tuple[str, str, list[Body]]] = []
    if args.workspace is not None:
        for path, text in workspace_files(args.workspace, args.files):
            files.append((path, text, pick_bodies(path, text, args.bodies, args.seed)))
    for spec, wanted in SOURCES[: args.files] if args.workspace is None else ():
        for path, text in read_sources(spec, (wanted,)):
            files.append((path, text, pick_bodies(path, text, args.bodies, args.seed)))
    for path, _, bodies in files:
        print(f"{path}: bodies {', '.join(b.name for b in bodies)}")

    names = args.configs.split(",")
    records: dict[str, list[Record]] = {}
    runs: dict[str, Any] = {}
    if args.schedule == "sequential":
        for name in names:  # each server alone on the machine
            server = await start_server(name, args)
            await replay([server], files, args)
            records[name], runs[name] = server.records, await stop_server(server)
    else:
        servers = list(await asyncio.gather(*(start_server(name, args) for name in names)))
        await replay(servers, files, args)
        for server in servers:
            records[server.name], runs[server.name] = server.records, await stop_server(server)
    summaries = {
        name: {"load_s": runs[name]["load_s"], **summarize(recs), "server_cpu_ms_per_request": 1000 * runs[name]["server_cpu_s"] / max(1, len(recs))}
        for name, recs in records.items()
    }
    print_table(summaries)
    checks = targets(summaries)
    if checks:
        print("\ntargets (ember):")
        for key, check in checks.items():
            print(f"  {key:34} {fmt(check['value'], '.3f'):>8}  {'' if key.startswith('(') else 'ok' if check['ok'] else 'MISS'}")

    out = Path(args.out)
    png = out.with_suffix(".png")
    plotted = plot(records, png)
    write_results(out, {"runs": runs, "summary": summaries, "targets": checks, **replayed(files, records)}, args)
    print(f"\nwrote {out}" + (f" and {png}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
