"""Several editors typing at once over TCP against one ember process: the driver that
tests/test_load.py asserts on (it lives here because tests never import bench; bench may import
tests: bench/soak.py takes its source files).

Each session owns every ``sessions``-th of the documents, cut from real source files (this
repository's own Python, so that a run needs nothing fetched), and opens them all first. In each
document a stretch after a seeded line start is removed and typed back one key at a time: one
incremental ``didChange`` per key, then ``textDocument/inlineCompletion``, then a pause after the
answer, like an editor that asks on every key. Every second the resident memory of the ember
process and the PSS of ember with all its child processes are sampled.

Also here, for tests/conftest.py and bench/harness.py to share rather than copy: :func:`start_tcp`,
:func:`wait_ready`, :func:`plain`, :func:`chance` and :func:`utf16_position`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from lsprotocol import types
from pygls.lsp.client import LanguageClient

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("lsp", "context", "engine", "bench", "tests")
REQUEST_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 900.0
MIB = 1024 * 1024


def free_port() -> int:
    """A loopback port nothing listens on right now (here, not in conftest.py: benchmarks import
    it, and conftest.py sets the test suite's environment when imported)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chance(seed: int, *where: object) -> random.Random:
    """A random stream that depends only on the seed and the place, not on what happened before."""
    return random.Random(":".join(map(str, (seed, *where))))


def utf16_position(text: str, offset: int) -> types.Position:
    """The LSP position (UTF-16 columns) of ``offset`` in ``text``."""
    line_start = text.rfind("\n", 0, offset) + 1
    line = text.count("\n", 0, line_start)
    return types.Position(line=line, character=len(text[line_start:offset].encode("utf-16-le")) // 2)


def plain(value: Any) -> Any:
    """pygls hands results of custom requests back as namedtuples; tests and reports want dicts."""
    if hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


async def wait_ready(client: LanguageClient, timeout_s: float = READY_TIMEOUT_S, where: str = "") -> float:
    """Seconds until ``ember/stats`` says the engine is ready; an engine that failed (and is not
    restarting) or took longer than ``timeout_s`` raises (``where``: e.g. the log, for the message)."""
    started = time.perf_counter()
    while True:
        engine = (await client.protocol.send_request_async("ember/stats", {})).engine
        if engine.ready:
            return time.perf_counter() - started
        if engine.error and not getattr(engine, "restarting", False):
            raise RuntimeError(f"engine failed to start: {engine.error}{where}")
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"engine not ready after {timeout_s:.0f} s{where}")
        await asyncio.sleep(0.5)


def start_tcp(args: list[str], log_path: Path, cwd: Path = ROOT) -> tuple[subprocess.Popen[bytes], tuple[str, int]]:
    """``python -m lsp *args`` (an ``--tcp`` server) and the address it reports listening on; its
    stderr goes to ``log_path`` (an unread pipe would block vLLM's logs)."""
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lsp", *args], stderr=log, stdout=subprocess.DEVNULL, cwd=cwd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(r"ember listening on \('([\d.]+)', (\d+)\)", log_path.read_text())
        if match:
            return proc, (match.group(1), int(match.group(2)))
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("ember --tcp did not report its address: " + log_path.read_text()[-2000:])


@dataclass
class LoadConfig:
    sessions: int = 8
    documents: int = 100
    requests: int = 5000
    max_tokens: int = 8
    seed: int = 11
    key_ms: tuple[int, int] = (40, 140)
    # Prompt budgets (contextTokens, suffixTokens); None: the server's defaults. ember's memory does not
    # grow with them (the completion cache is keyed by a hash and holds answers), the engine's work does.
    context_tokens: int | None = None
    suffix_tokens: int | None = None
    # An OpenAI-compatible server ember completes through (``--engine-url``); None: the bundled model
    # embedded. A server that answers at once measures ember's own process without the engine's time.
    engine_url: str | None = None


@dataclass
class MemorySample:
    t_s: float
    requests_done: int
    ember_rss_mib: float
    total_pss_mib: float
    processes: int


@dataclass
class LoadReport:
    config: LoadConfig
    requests_sent: int = 0
    answered: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    empty_answers: int = 0
    memory: list[MemorySample] = field(default_factory=list)
    server_outcomes: dict[str, int] = field(default_factory=dict)
    load_s: float = 0.0
    run_s: float = 0.0

    def memory_after(self, share: float) -> list[MemorySample]:
        """Samples taken after ``share`` of the requests were answered (the steady state)."""
        return [m for m in self.memory if m.requests_done >= share * self.config.requests]

    def summary(self) -> dict[str, Any]:
        """What the tests assert on."""
        steady = self.memory_after(0.1)
        first = steady[0] if steady else None
        return {
            "requests_sent": self.requests_sent,
            "answered": self.answered,
            "lost": self.requests_sent - self.answered,
            "errors": len(self.errors),
            "empty_answers": self.empty_answers,
            "latency_ms": {
                "mean": statistics.fmean(self.latencies_ms) if self.latencies_ms else None,
                "max": max(self.latencies_ms, default=None),
            },
            "ember_rss_mib": {
                "at_10pct": first.ember_rss_mib if first else None,
                "max": max((m.ember_rss_mib for m in self.memory), default=None),
                "end": self.memory[-1].ember_rss_mib if self.memory else None,
                "growth_after_10pct": (max(m.ember_rss_mib for m in steady) - first.ember_rss_mib) if first else None,
            },
            "total_pss_mib_max": max((m.total_pss_mib for m in self.memory), default=None),
            "server_outcomes": self.server_outcomes,
            "load_s": self.load_s,
            "run_s": self.run_s,
        }


# ------------------------------------------------------------------------------------ documents


@dataclass
class Task:
    uri: str
    text: str  # the whole file, as it will be when the stretch has been typed back
    start: int  # where typing starts
    keys: int


def source_files() -> list[Path]:
    # context/ keeps its modules in rooms (context/source/, ...): one level of sub-packages is read.
    found = [p for folder in SOURCES for pattern in ("*.py", "*/*.py") for p in sorted((ROOT / folder).glob(pattern))]
    files = [p for p in found if not any(part.startswith(".") for part in p.relative_to(ROOT).parts) and p.stat().st_size > 3000]
    if not files:
        raise RuntimeError("no source files found under " + ", ".join(SOURCES))
    return files


def make_tasks(config: LoadConfig) -> list[list[Task]]:
    """``config.documents`` typing tasks, dealt to the sessions round-robin."""
    files = source_files()
    keys = config.requests // config.documents
    sessions: list[list[Task]] = [[] for _ in range(config.sessions)]
    for d in range(config.documents):
        path = files[d % len(files)]
        text = path.read_text()
        rnd = chance(config.seed, "load", d)
        starts = [m.start() for m in re.finditer(r"(?m)^ +\S", text) if m.start() < len(text) - keys - 1]
        start = rnd.choice(starts) if starts else 0
        session = d % config.sessions
        uri = f"file:///load/s{session}/d{d}/{path.name}"
        sessions[session].append(Task(uri, text, start, keys + (d < config.requests % config.documents)))
    return sessions


# -------------------------------------------------------------------------------------- sessions


async def connect(address: tuple[str, int], options: dict[str, Any]) -> LanguageClient:
    client = LanguageClient("ember-load", "0.1")
    await client.start_tcp(*address)
    await client.initialize_async(
        types.InitializeParams(capabilities=types.ClientCapabilities(), initialization_options=options)
    )
    client.initialized(types.InitializedParams())
    return client


async def disconnect(client: LanguageClient) -> None:
    await client.shutdown_async(None)
    client.exit(None)
    with contextlib.suppress(ConnectionError):
        await client.stop()


def open_document(client: LanguageClient, task: Task) -> None:
    text = task.text[: task.start] + task.text[task.start + task.keys :]
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=task.uri, language_id="python", version=0, text=text)
        )
    )


async def type_document(client: LanguageClient, task: Task, config: LoadConfig, report: LoadReport) -> None:
    text = task.text[: task.start] + task.text[task.start + task.keys :]
    rnd = chance(config.seed, "keys", task.uri)
    for i in range(task.keys):
        offset = task.start + i
        key = task.text[offset]
        at = utf16_position(text, offset)
        text = text[:offset] + key + text[offset:]
        client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=task.uri, version=i + 1),
                content_changes=[
                    types.TextDocumentContentChangePartial(range=types.Range(start=at, end=at), text=key)
                ],
            )
        )
        report.requests_sent += 1
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(
                client.text_document_inline_completion_async(
                    types.InlineCompletionParams(
                        text_document=types.TextDocumentIdentifier(uri=task.uri),
                        position=utf16_position(text, offset + 1),
                        context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic),
                    )
                ),
                REQUEST_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            report.errors.append(f"{task.uri}@{offset}: {type(exc).__name__}: {exc}"[:300])
            continue
        report.latencies_ms.append((time.perf_counter() - started) * 1000)
        report.answered += 1
        items = result.items if isinstance(result, types.InlineCompletionList) else (result or [])
        if not items or not items[0].insert_text:
            report.empty_answers += 1
        await asyncio.sleep(rnd.uniform(*config.key_ms) / 1000)


async def run_session(address: tuple[str, int], tasks: list[Task], config: LoadConfig, report: LoadReport) -> None:
    options: dict[str, Any] = {"maxTokens": config.max_tokens}
    if config.context_tokens is not None:
        options["contextTokens"] = config.context_tokens
    if config.suffix_tokens is not None:
        options["suffixTokens"] = config.suffix_tokens
    client = await connect(address, options)
    try:
        # Every document is open from the start, like an editor with many tabs: memory that grows
        # after that grows with requests, not with documents.
        for task in tasks:
            open_document(client, task)
        for task in tasks:
            await type_document(client, task, config, report)
    finally:
        await disconnect(client)


# -------------------------------------------------------------------------------- server, memory


def family(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def sample_memory(pid: int, t_s: float, done: int) -> MemorySample:
    rss = psutil.Process(pid).memory_info().rss
    pss = 0
    processes = 0
    for proc in family(pid):
        try:
            pss += proc.memory_full_info().pss
            processes += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return MemorySample(t_s, done, rss / MIB, pss / MIB, processes)


async def sample_until(stop: asyncio.Event, pid: int, report: LoadReport, started: float) -> None:
    while not stop.is_set():
        sample = await asyncio.to_thread(sample_memory, pid, time.perf_counter() - started, report.answered)
        report.memory.append(sample)
        if len(report.memory) % 15 == 0:
            print(f"  {sample.t_s:5.0f} s  {report.answered}/{report.config.requests} answered, "
                  f"ember RSS {sample.ember_rss_mib:.0f} MiB, total PSS {sample.total_pss_mib:.0f} MiB", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


def start_server(log_path: Path, max_tokens: int, engine_url: str | None = None) -> tuple[subprocess.Popen[bytes], tuple[str, int]]:  # noqa: E501
    """``ember --tcp 127.0.0.1:0`` on the bundled model (or ``engine_url``)."""
    # Compiled mode would add 40-120 s of start-up to the embedded engine.
    engine = ["--engine-url", engine_url] if engine_url else ["--model", "bundled", "--engine-arg", "enforce_eager=true"]
    return start_tcp(["--tcp", "127.0.0.1:0", *engine, "--max-tokens", str(max_tokens), "--log-level", "WARNING"], log_path)


async def run_load(config: LoadConfig, log_path: Path) -> LoadReport:
    """Starts the server, waits for the engine, runs all sessions at once, stops the server."""
    proc, address = start_server(log_path, config.max_tokens, config.engine_url)
    try:
        return await load_server(config, address, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


async def load_server(config: LoadConfig, address: tuple[str, int], pid: int) -> LoadReport:
    """Runs all sessions at once against the ``ember --tcp`` at ``address`` (process ``pid``, whose
    memory is sampled), once its engine is ready; every session sets ``config``'s budgets."""
    report = LoadReport(config)
    probe = await connect(address, {})
    try:
        report.load_s = await wait_ready(probe)
        started = time.perf_counter()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_until(stop, pid, report, started))
        await asyncio.gather(*(run_session(address, tasks, config, report) for tasks in make_tasks(config)))
        report.run_s = time.perf_counter() - started
        stop.set()
        await sampler
        report.memory.append(sample_memory(pid, report.run_s, report.answered))
        stats = await probe.protocol.send_request_async("ember/stats", {})
        report.server_outcomes = dict(stats.outcomes._asdict()) if hasattr(stats.outcomes, "_asdict") else dict(stats.outcomes)
        for line in getattr(stats.process, "growth", None) or ():
            print("  grew:", line)
    finally:
        await disconnect(probe)
    return report
