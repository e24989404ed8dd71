"""A day at the keyboard: does ember keep answering through thousands of completions, a killed or
frozen engine and servers that misbehave, and does what it holds stay level?

    .venv/bin/python bench/soak.py [--requests 10000] [--engine llamacpp|vllm] [--windows 3]
        [--fault kill@3000 --fault stop@5000 ...] [--remote fake|URL] [--out FILE]

One editor session (``ember --stdio``, as an editor launches it; ``--windows 3``: three of them
through the per-user daemon) types through real files: stretches of this repository's own Python,
removed and typed back one key at a time, the same stretches in every pass (a ``# pass N`` line just
before each stretch makes each pass's prompts new to the caches, so passes compare like with like). Per key: a
``didChange``, then ``textDocument/inlineCompletion``; most answers are waited for, the rest are
superseded (the next key comes 30-120 ms later and the open request is cancelled with
``$/cancelRequest``, as VS Code does); after each line a pause in which warm-ups run and the
completion runs to its end.

Every ``--sample-every`` requests, from ``ember/stats`` and psutil: open descriptors, connections
in use, asyncio tasks, threads, RSS of the serving process (the daemon with ``--windows``), PSS
of its engine processes, the engine's counters and the latency p50 of the last window. Bounds,
from request ``--steady-from`` on: no request outside a fault window without an answer within its
deadline (``timeoutMs`` + 1 s); descriptors, connections in use and tasks at the end within +5
of their value at ``--steady-from``; RSS growth <= 5%; the last pass's latency p50 within 15% of
the second pass's.

Faults at set request numbers (``--fault NAME@N``), each a row of the report (the time to the
next good answer, the requests without an answer in time, why the empty ones were empty, what the
editor was told): ``kill`` (SIGKILL the engine process), ``stop`` (SIGSTOP it for ``--stop-s``,
then SIGCONT), ``daemon`` (SIGKILL the daemon, with ``--windows``). With ``--remote fake`` ember
completes through tests/fake_openai.py's server in this process, which closes every connection
after a streamed answer without saying so (as llama-server does), and the faults are that
server's for ``--fault-span`` requests: ``http500``, ``malformed``, ``stall`` (after the first
token), ``endless`` (a stream that never ends). ``--remote URL``: any OpenAI-compatible server.

Prints a table and writes bench/results/soak-<name>.json and an SVG plot beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
import psutil
from lsprotocol import types

from bench.harness import CACHE, RESULTS, Ember, chance, ember_command, fmt, percentile, table, utf16_position, write_results
from tests.fake_openai import FakeServer
from tests.load_driver import source_files

ENGINE_FAULTS = ("kill", "stop", "daemon")
REMOTE_FAULTS = {"http500": "always500", "malformed": "garbage", "stall": "stall", "endless": "endless"}
SLACK_S = 1.0  # over the deadline: the wire, the editor's side


@dataclass
class Fault:
    name: str
    at: int  # the request number it is injected before
    started: float = 0.0  # perf_counter
    ended: float = 0.0  # the engine thawed, the server behaves again (kill: = started)
    first_good: float | None = None  # the first non-empty answer sent after it ended
    first_answer: float | None = None  # the first request after it ended that the engine answered (text, maybe cut to nothing)
    detail: str = ""


@dataclass
class Request:
    n: int
    uri: str
    window: int
    pass_no: int
    sent: float
    superseded: bool
    latency_ms: float | None = None  # None: no answer (yet)
    error: str = ""
    text: str = ""
    why_empty: str = ""
    streamed: bool = False  # the engine sent tokens (the answer may still be empty: cut to nothing)


@dataclass
class Sample:
    requests: int
    t_s: float
    descriptors: int
    tasks: int
    threads: int
    rss_mib: float
    connections_in_use: int | None
    engine_pss_mib: float
    window_p50_ms: float | None
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class Stretch:
    uri: str
    text: str  # the file as it is when the stretch is typed back
    start: int
    keys: int


def stretches(count: int, keys: int, seed: int, window: int) -> list[Stretch]:
    """``count`` stretches of ``keys`` characters after a line's indentation, in real files."""
    files = source_files()
    found = []
    for d in range(count):
        path = files[(d * 7 + window * 3) % len(files)]
        text = path.read_text()
        starts = [m.end() - 1 for m in re.finditer(r"(?m)^ +\S", text) if m.end() < len(text) - keys]
        start = chance(seed, "soak", window, d).choice(starts)
        found.append(Stretch(f"file:///soak/w{window}/d{d}/{path.name}", text, start, keys))
    return found


class Window:
    """One editor window typing its stretches, pass after pass."""

    def __init__(self, index: int, ember: Ember, run: Soak) -> None:
        self.index, self.ember, self.run = index, ember, run
        self.work = stretches(run.args.documents, run.args.keys, run.args.seed, index)
        self.versions: dict[str, int] = {}

    def send_text(self, stretch: Stretch, text: str) -> None:
        version = self.versions.get(stretch.uri, 0) + 1
        self.versions[stretch.uri] = version
        if version == 1:
            self.ember.open(stretch.uri, text, version=1)
            return
        self.ember.client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=stretch.uri, version=version),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=text)],
        ))  # fmt: skip

    async def type_pass(self, pass_no: int) -> None:
        for d, stretch in enumerate(self.work):
            # The pass's marker on the line before the stretch, inside the prompt's window: each
            # pass's prompts are new to the completion cache (a marker atop the file is not).
            line_start = stretch.text.rfind("\n", 0, stretch.start) + 1
            marker = stretch.text[line_start : stretch.start] + f"# pass {pass_no}\n"
            text = stretch.text[:line_start] + marker + stretch.text[line_start : stretch.start]
            text += stretch.text[stretch.start + stretch.keys :]
            self.send_text(stretch, text)
            rnd = chance(self.run.args.seed, "keys", self.index, pass_no, d)
            offset = len(marker) + stretch.start
            for i in range(stretch.keys):
                if self.run.done():
                    return
                key = stretch.text[stretch.start + i]
                at = utf16_position(text, offset)
                text = text[:offset] + key + text[offset:]
                offset += 1
                version = self.versions[stretch.uri] = self.versions[stretch.uri] + 1
                self.ember.client.text_document_did_change(types.DidChangeTextDocumentParams(
                    text_document=types.VersionedTextDocumentIdentifier(uri=stretch.uri, version=version),
                    content_changes=[types.TextDocumentContentChangePartial(range=types.Range(start=at, end=at), text=key)],
                ))  # fmt: skip
                superseded = key != "\n" and rnd.random() < self.run.args.supersede
                await self.run.ask(self, stretch.uri, utf16_position(text, offset), pass_no, superseded, rnd)
                await asyncio.sleep(rnd.uniform(0.6, 1.2) if key == "\n" else 0)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.requests: list[Request] = []
        self.samples: list[Sample] = []
        self.faults = [parse_fault(spec) for spec in args.fault]
        self.pending: set[asyncio.Task[None]] = set()
        self.started = time.perf_counter()
        self.messages: list[tuple[float, str]] = []
        self.fake: FakeServer | None = None
        self.windows: list[Window] = []

    def done(self) -> bool:
        return len(self.requests) >= self.args.requests

    @property
    def deadline_s(self) -> float:
        return self.args.deadline_ms / 1000 + SLACK_S

    async def ask(self, window: Window, uri: str, position: types.Position, pass_no: int, superseded: bool, rnd: Any) -> None:
        request = Request(len(self.requests), uri, window.index, pass_no, time.perf_counter(), superseded)
        self.requests.append(request)
        await self.before_request(request.n)
        msg_id = f"soak-{request.n}"
        params = types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri), position=position,
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
        )  # fmt: skip
        future = window.ember.client.protocol.send_request_async("textDocument/inlineCompletion", params, msg_id=msg_id)
        answer = asyncio.ensure_future(self.answer(window, request, future))
        if superseded:
            await asyncio.wait({answer}, timeout=rnd.uniform(0.03, 0.12))
            if not answer.done():
                window.ember.client.protocol.notify("$/cancelRequest", types.CancelParams(id=msg_id))
                self.pending.add(answer)
                answer.add_done_callback(self.pending.discard)
                return
        await answer
        await asyncio.sleep(rnd.uniform(0.04, 0.14))

    async def answer(self, window: Window, request: Request, future: Any) -> None:
        try:
            result = await asyncio.wait_for(future, self.deadline_s + 30)
        except Exception as exc:  # noqa: BLE001 - cancelled, an error, no answer: each is counted
            request.latency_ms = (time.perf_counter() - request.sent) * 1000
            request.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        request.latency_ms = (time.perf_counter() - request.sent) * 1000
        items = result.items if isinstance(result, types.InlineCompletionList) else (result or [])
        text = items[0].insert_text if items else ""
        request.text = text if isinstance(text, str) else text.value
        for fault in self.faults:
            if fault.started and fault.first_good is None and request.text and request.sent >= fault.ended > 0:
                fault.first_good = time.perf_counter()
        if not request.text and self.in_fault(request):
            last = (await window.ember.stats(request.uri))["last_for_uri"] or {}
            request.why_empty = str(last.get("why_empty") or "(the model's text, cut to nothing)")
            request.streamed = bool(last.get("streamed_tokens"))
        for fault in self.faults:
            if fault.started and fault.first_answer is None and (request.text or request.streamed) and request.sent >= fault.ended > 0:
                fault.first_answer = time.perf_counter()

    def in_fault(self, request: Request) -> bool:
        return any(f.started and f.started <= request.sent and (f.first_good is None or request.sent < f.first_good) for f in self.faults)

    # -- faults ------------------------------------------------------------------------------------

    async def before_request(self, n: int) -> None:
        if n % self.args.sample_every == 0:
            await self.sample()
        for fault in self.faults:
            if fault.at == n:
                await self.inject(fault)
            if self.fake is not None and fault.name in REMOTE_FAULTS and fault.at + self.args.fault_span == n:
                self.fake.behaviour = self.args.fake_base
                fault.ended = time.perf_counter()

    async def inject(self, fault: Fault) -> None:
        stats = await self.windows[0].ember.stats()
        fault.started = time.perf_counter()
        print(f"  request {fault.at}: {fault.name}", flush=True)
        if fault.name in REMOTE_FAULTS:
            assert self.fake is not None, f"{fault.name} is a fault of --remote fake"
            self.fake.behaviour = REMOTE_FAULTS[fault.name]
            return
        if fault.name == "daemon":
            pid = stats["process"]["pid"]
            fault.detail = f"daemon pid {pid}"
            os.kill(pid, signal.SIGKILL)
            fault.ended = time.perf_counter()
            return
        pid = engine_pid(stats)
        fault.detail = f"engine pid {pid}"
        if fault.name == "kill":
            os.kill(pid, signal.SIGKILL)
            fault.ended = time.perf_counter()
            return
        os.kill(pid, signal.SIGSTOP)

        async def thaw() -> None:
            await asyncio.sleep(self.args.stop_s)
            os.kill(pid, signal.SIGCONT)
            fault.ended = time.perf_counter()

        task = asyncio.create_task(thaw())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    # -- samples -----------------------------------------------------------------------------------

    async def sample(self) -> None:
        try:
            stats = await asyncio.wait_for(self.windows[0].ember.stats(), self.deadline_s + 30)
        except Exception as exc:  # noqa: BLE001 - the daemon was just killed: the next sample
            print(f"  no sample at request {len(self.requests)}: {type(exc).__name__}", flush=True)
            return
        process, engine = stats["process"], stats["engine"]
        recent = [r.latency_ms for r in self.requests[-self.args.sample_every :] if r.latency_ms is not None and not r.superseded]
        sample = Sample(
            len(self.requests), time.perf_counter() - self.started, process["descriptors"], process["tasks"], process["threads"],
            process["rss_mib"], (engine.get("stats") or {}).get("connections_in_use"), await asyncio.to_thread(engine_pss, process["pid"]),
            percentile(recent, 0.5), dict(engine.get("counters") or {}),
        )  # fmt: skip
        self.samples.append(sample)
        print(f"  {sample.t_s:6.0f} s  request {sample.requests}: fds {sample.descriptors}, tasks {sample.tasks}, "
              f"threads {sample.threads}, conns {sample.connections_in_use}, RSS {sample.rss_mib:.0f} MiB, "
              f"engine PSS {sample.engine_pss_mib:.0f} MiB, p50 {fmt(sample.window_p50_ms)} ms", flush=True)  # fmt: skip


class Told(list[str]):
    """A window's ``window/showMessage`` list that also notes when each message came."""

    def __init__(self, timed: list[tuple[float, str]]) -> None:
        super().__init__()
        self.timed = timed

    def append(self, message: str) -> None:
        super().append(message)
        self.timed.append((time.perf_counter(), message))


def parse_fault(spec: str) -> Fault:
    name, _, at = spec.partition("@")
    if name not in (*ENGINE_FAULTS, *REMOTE_FAULTS) or not at.isdigit():
        raise SystemExit(f"--fault {spec}: expected NAME@REQUEST, NAME one of {', '.join((*ENGINE_FAULTS, *REMOTE_FAULTS))}")
    return Fault(name, int(at))


def engine_pid(stats: dict[str, Any]) -> int:
    """The llama-server's pid (ember/stats), or vLLM's engine core (the serving process's child)."""
    pid = (stats["engine"].get("stats") or {}).get("pid")
    if pid:
        return int(pid)
    children = psutil.Process(stats["process"]["pid"]).children(recursive=True)
    if not children:
        raise RuntimeError("no engine process to fault")
    return children[0].pid


def engine_pss(pid: int) -> float:
    total = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += child.memory_full_info().pss
    return total / 2**20


# -------------------------------------------------------------------------------------- the run


async def launch(soak: Soak, runtime: Path) -> None:
    args = soak.args
    if args.remote == "fake":
        soak.fake = await FakeServer(args.fake_base, delay_s=0).start()
        engine: list[str] = ["--engine-url", f"{soak.fake.url}/v1"]
    elif args.remote:
        engine = ["--engine-url", args.remote]
    else:
        engine = ["--model", args.model, *(["--engine", args.engine] if args.engine else [])]
    daemon = "auto" if args.windows > 1 else "off"
    command = [*ember_command(None, None, (), "--max-tokens", str(args.max_tokens), daemon=daemon), *engine]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    options = {"timeoutMs": args.deadline_ms}
    for index in range(args.windows):
        ember = Ember(command, options, log_path=CACHE / f"soak-{args.name}-{index}.log", env=env, name=f"soak-{index}")
        ember.messages = Told(soak.messages)
        await ember.start()
        soak.windows.append(Window(index, ember, soak))


async def run(soak: Soak) -> None:
    with tempfile.TemporaryDirectory(prefix="ember-soak-") as runtime:
        await launch(soak, Path(runtime))
        try:
            soak.started = time.perf_counter()
            pass_no = 0
            while not soak.done():
                pass_no += 1
                await asyncio.gather(*(w.type_pass(pass_no) for w in soak.windows))
            await asyncio.gather(*list(soak.pending), return_exceptions=True)
            await asyncio.sleep(5.0)  # what a session holds once its last generation has ended
            await soak.sample()
        finally:
            for window in soak.windows:
                await window.ember.stop()
            if soak.fake is not None:
                await soak.fake.stop()


# ------------------------------------------------------------------------------------ the report


def fault_rows(soak: Soak) -> list[dict[str, Any]]:
    rows = []
    for fault in soak.faults:
        if not fault.started:
            continue
        end = fault.first_good or time.perf_counter()
        inside = [r for r in soak.requests if fault.started <= r.sent < end]
        late = [r for r in inside if unanswered(r, soak.deadline_s)]
        why: dict[str, int] = {}
        for r in inside:
            if not r.text and not r.error:
                reason = re.sub(r"\b\d+ s\b", "N s", r.why_empty or "?")  # 'not answered for 3 s' and '4 s' alike
                why[reason] = why.get(reason, 0) + 1
        told = sorted({m for t, m in soak.messages if fault.started <= t < end + 5})
        rows.append({
            "fault": fault.name, "at": fault.at, "detail": fault.detail,
            "lasted_s": round(fault.ended - fault.started, 2) if fault.ended else None,
            "next_good_after_start_s": round(fault.first_good - fault.started, 2) if fault.first_good else None,
            "next_good_after_end_s": round(fault.first_good - fault.ended, 2) if fault.first_good and fault.ended else None,
            "next_answer_after_end_s": round(fault.first_answer - fault.ended, 2) if fault.first_answer and fault.ended else None,
            "requests": len(inside), "without_answer_in_time": len(late), "why_empty": why, "told": told,
        })  # fmt: skip
    return rows


def unanswered(request: Request, deadline_s: float) -> bool:
    """No answer (an error, or none) within the deadline; a cancelled request's error is its answer."""
    if request.latency_ms is None or request.latency_ms > deadline_s * 1000:
        return True
    return bool(request.error) and not (request.superseded and "cancel" in request.error.lower())


def verdicts(soak: Soak) -> dict[str, Any]:
    args = soak.args
    steady = [s for s in soak.samples if s.requests >= args.steady_from]
    first, last = (steady[0], steady[-1]) if steady else (None, None)
    outside = [r for r in soak.requests[args.steady_from :] if not soak.in_fault(r)]
    late = [r.n for r in outside if unanswered(r, soak.deadline_s)]
    passes = sorted({r.pass_no for r in soak.requests})
    by_pass = {p: percentile([r.latency_ms for r in soak.requests if r.pass_no == p and not r.superseded and r.latency_ms and not r.error], 0.5) for p in passes}  # noqa: E501
    # The last pass counts only when whole; a pass cut short by --requests compares an unlike part.
    complete = [p for p in passes if sum(r.pass_no == p for r in soak.requests) >= len(soak.requests) / max(len(passes), 1) * 0.9]
    second, final = (by_pass.get(2), by_pass.get(complete[-1])) if len(complete) >= 2 else (None, None)
    result: dict[str, Any] = {"late_outside_faults": {"value": len(late), "ok": not late, "first": late[:10]}}
    if first and last:
        for name in ("descriptors", "connections_in_use", "tasks"):
            a, b = getattr(first, name), getattr(last, name)
            result[name] = {"at_steady": a, "end": b, "ok": a is None or b is None or b - a <= 5}
        growth = (last.rss_mib - first.rss_mib) / first.rss_mib
        result["rss_growth"] = {"at_steady": first.rss_mib, "end": last.rss_mib, "value": round(growth, 4), "ok": growth <= 0.05}
    if second and final:
        ratio = final / second
        result["last_pass_p50_over_second"] = {"second": second, "last": final, "value": round(ratio, 3), "ok": ratio <= 1.15}
    result["latency_p50_by_pass"] = by_pass
    return result


def summary(soak: Soak) -> dict[str, Any]:
    answered = [r for r in soak.requests if r.latency_ms is not None and not r.error]
    waited = [r.latency_ms for r in answered if not r.superseded and r.latency_ms is not None]
    cancelled = sum(r.superseded and "cancel" in r.error.lower() for r in soak.requests)
    return {
        "requests": len(soak.requests), "answered": len(answered), "cancelled": cancelled,
        "errors": sum(bool(r.error) for r in soak.requests) - cancelled,
        "superseded": sum(r.superseded for r in soak.requests), "non_empty": sum(bool(r.text) for r in soak.requests),
        "latency_ms": {f"p{q}": percentile(waited, q / 100) for q in (50, 95, 99)},
        "run_s": round(time.perf_counter() - soak.started, 1),
        "counters_end": soak.samples[-1].counters if soak.samples else {},
    }  # fmt: skip


def print_report(data: dict[str, Any]) -> None:
    s = data["summary"]
    lat = s["latency_ms"]
    print(f"\n{s['requests']} requests in {s['run_s']:.0f} s: {s['answered']} answered, {s['cancelled']} cancelled, {s['errors']} errors, "
          f"{s['superseded']} superseded, {s['non_empty']} with text; latency p50/p95/p99 "
          f"{fmt(lat['p50'])} / {fmt(lat['p95'])} / {fmt(lat['p99'])} ms; engine counters {s['counters_end']}")  # fmt: skip
    rows = [(name, v.get("at_steady", v.get("second", "")), v.get("end", v.get("last", v.get("value"))), "ok" if v["ok"] else "FAIL")
            for name, v in data["verdicts"].items() if isinstance(v, dict) and "ok" in v]  # fmt: skip
    print(table(["bound", "from", "to", "verdict"], rows))
    if data["faults"]:
        print(table(
            ["fault", "at", "lasted s", "next good after start / end s", "engine answered after end s", "requests", "late", "why empty", "told"],
            [(f["fault"], f["at"], fmt(f["lasted_s"], ".1f"), f"{fmt(f['next_good_after_start_s'], '.1f')} / {fmt(f['next_good_after_end_s'], '.1f')}",
              fmt(f.get("next_answer_after_end_s"), ".1f"),
              f["requests"], f["without_answer_in_time"], f["why_empty"], "; ".join(f["told"])[:160]) for f in data["faults"]],
        ))  # fmt: skip


def plot(samples: list[Sample], path: Path) -> None:
    """One small SVG panel per sampled quantity over requests (no plotting library needed)."""
    names = ("descriptors", "connections_in_use", "tasks", "threads", "rss_mib", "engine_pss_mib", "window_p50_ms")
    width, height, pad = 420, 120, 30
    panels = []
    for i, name in enumerate(names):
        points = [(s.requests, getattr(s, name)) for s in samples if getattr(s, name) is not None]
        if len(points) < 2:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1, y0, y1 = min(xs), max(xs) or 1, min(ys), max(ys)
        y0, y1 = (y0 - 1, y1 + 1) if y1 == y0 else (y0, y1)
        line = " ".join(f"{pad + (x - x0) / max(x1 - x0, 1) * (width - 2 * pad):.1f},{height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad):.1f}"
                        for x, y in points)  # fmt: skip
        top = i * height
        panels.append(
            f'<g transform="translate(0,{top})"><text x="{pad}" y="14" font-size="11">{name}: {y0:g} .. {y1:g} '
            f'(requests {x0} .. {x1})</text><polyline fill="none" stroke="#c0392b" points="{line}"/></g>'
        )
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height * len(panels)}" '
                    f'font-family="sans-serif">{"".join(panels)}</svg>\n')  # fmt: skip


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--model", default="bundled", help="what ember --model takes (default: the bundled model)")
    parser.add_argument("--engine", choices=("vllm", "llamacpp"), help="the embedded engine (default: ember's choice)")
    parser.add_argument("--remote", help="'fake' (tests/fake_openai.py, closing connections) or an engine URL")
    parser.add_argument("--fake-base", default="closing", help="the fake server's behaviour outside faults")
    parser.add_argument("--windows", type=int, default=1, help="editor windows; more than one go through the daemon")
    parser.add_argument("--documents", type=int, default=20, help="stretches a window types in each pass")
    parser.add_argument("--keys", type=int, default=50, help="characters typed back in each stretch")
    parser.add_argument("--supersede", type=float, default=0.3, help="share of keys that come before the answer")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--deadline-ms", type=int, default=2000, help="the editor's timeoutMs")
    parser.add_argument("--fault", action="append", default=[], metavar="NAME@REQUEST")
    parser.add_argument("--stop-s", type=float, default=20.0)
    parser.add_argument("--fault-span", type=int, default=50, help="requests a remote fault lasts")
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--steady-from", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--name", default="llamacpp")
    args = parser.parse_args()
    soak = Soak(args)
    await run(soak)
    data = {"summary": summary(soak), "verdicts": verdicts(soak), "faults": fault_rows(soak),
            "samples": [asdict(s) for s in soak.samples]}  # fmt: skip
    data["errors"] = [f"{r.n}: {r.error}" for r in soak.requests if r.error and unanswered(r, soak.deadline_s)][:50]
    print_report(data)
    out = RESULTS / f"soak-{args.name}.json"
    plot(soak.samples, out.with_suffix(".svg"))
    print(f"wrote {write_results(out, data, args)} and {out.with_suffix('.svg').name}")
    ok = all(v["ok"] for v in data["verdicts"].values() if isinstance(v, dict) and "ok" in v)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
