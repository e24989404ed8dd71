"""What every benchmark shares, written once.

- **Launching ember as an editor does**: :class:`Ember` starts ``python -m lsp --stdio`` (from this
  checkout or another one) over pygls' ``LanguageClient``, drains its stderr to a log, initializes
  it, waits until ``ember/stats`` says the engine is ready, reads its stats and stops it.
  ``--tcp`` servers: :func:`start_tcp` (tests/load_driver.py's, shared with the tests).
- **Models and engines, taken the same way by every script**: :func:`add_model_args` adds
  ``--model`` and ``--engine auto|vllm|llamacpp`` (and ``--engine-arg``); :func:`resolve_model` maps
  the benchmark models ``smollm2`` / ``qwen-coder`` (bench/models.py, no hub needed) to what
  ``ember --model`` takes for that engine.
- **Numbers**: :func:`percentile`, the one percentile of bench/: linear interpolation between the
  closest ranks (numpy's default, ``statistics.quantiles(method="inclusive")``), so the p50 is the
  median (the mean of the middle two of an even sample); :func:`fmt` and :func:`table`.
- **Results**: :func:`write_results` writes JSON with the date, the commit, the machine and the
  settings (the script's arguments).

Scripts run as files (``python bench/demo.py``): their first import, ``bootstrap``, puts the
checkout on ``sys.path`` so that ``bench``, ``tests``, ``lsp`` and friends import from it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil
from lsprotocol import types
from pygls.lsp.client import LanguageClient

from tests.load_driver import chance, plain, start_tcp, utf16_position, wait_ready

__all__ = [
    "CACHE", "EVAL", "RESULTS", "ROOT", "Ember", "add_model_args", "chance", "commit", "fmt", "machine", "percentile",
    "plain", "resolve_model", "start_tcp", "table", "utf16_position", "wait_ready", "write_results",
]  # fmt: skip

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / "bench" / ".cache"  # git-ignored: models, fetched sources, logs
# The public eval sets: ../shared/eval beside the checkout, or $EMBER_EVAL_DIR.
EVAL = Path(os.environ.get("EMBER_EVAL_DIR") or ROOT.parent / "shared" / "eval")
ENGINES = ("auto", "vllm", "llamacpp")
BENCH_MODELS = ("smollm2", "qwen-coder", "qwen-coder-1.5b")


# ---------------------------------------------------------------------------- models and engines


def add_model_args(parser: argparse.ArgumentParser, model: str | None = None, engine_args: bool = True) -> None:
    """``--model`` (default ``model``), ``--engine`` and, with ``engine_args``, ``--engine-arg``."""
    parser.add_argument(
        "--model", default=model,
        help="smollm2 / qwen-coder (bench/models.py), bundled, or what ember --model takes (default: %s)" % (model or "ember's"),
    )  # fmt: skip
    parser.add_argument("--engine", choices=ENGINES, help="the embedded engine, as `ember --engine` (default: ember's choice)")
    if engine_args:
        parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                            help="an engine argument (repeatable), as `ember --engine-arg`")


def resolve_model(name: str | None, engine: str | None = None) -> tuple[str, str | None]:
    """(a label for results files, the value for ``ember --model``). ``smollm2``, ``qwen-coder`` and
    ``qwen-coder-1.5b`` are bench/models.py's: the GGUF file for ``--engine llamacpp``, else the converted folder (which
    vLLM serves); any other name goes to ``--model`` as it is; None: ember's default model."""
    if name in BENCH_MODELS:
        from bench import models

        if name == "smollm2":
            return name, "bundled" if engine == "llamacpp" else str(models.smollm2())
        gguf = models.GGUFS[name]
        return name, str(models.chunked_gguf(gguf, CACHE / gguf.folder) if engine == "llamacpp" else models.MODELS[name]())
    return model_label(name), name


def model_label(name: str | None) -> str:
    """The name results files carry for ``--model name`` (resolving nothing)."""
    return "default" if name is None else name if name in BENCH_MODELS else Path(name).name.removesuffix(".gguf")


def ember_command(
    model: str | None = None, engine: str | None = None, engine_args: Sequence[str] = (), *extra: str,
    daemon: str | None = "off", log_level: str | None = "WARNING",
) -> list[str]:
    """``python -m lsp --stdio`` with these settings (``extra``: more ember flags). ``daemon`` and
    ``log_level`` None: ember's defaults (``$EMBER_DAEMON``, ``$EMBER_LOG_LEVEL``), as for an editor."""
    command = [sys.executable, "-m", "lsp", "--stdio"]
    command += ["--daemon", daemon] if daemon else []
    command += ["--log-level", log_level] if log_level else []
    if model:
        command += ["--model", model]
    if engine and engine != "auto":
        command += ["--engine", engine]
    for arg in engine_args:
        command += ["--engine-arg", arg]
    return command + list(extra)


# ------------------------------------------------------------------------------------ launching


class Ember:
    """One ember process over stdio, as an editor launches it, and the LSP client talking to it."""

    def __init__(
        self, command: Sequence[str], options: dict[str, Any] | None = None, log_path: Path | None = None,
        cwd: Path = ROOT, env: dict[str, str] | None = None, name: str = "ember-bench",
    ) -> None:  # fmt: skip
        self.command = list(command)
        self.options = dict(options or {})
        self.log_path = log_path  # None: stderr is not kept (still drained)
        self.cwd = cwd  # `python -m lsp` imports this checkout's code
        self.env = env
        self.client = LanguageClient(name, "0.1")
        self.messages: list[str] = []  # window/showMessage
        self.process: asyncio.subprocess.Process | None = None
        self.pid: int | None = None
        self._drain: asyncio.Task[None] | None = None
        self.client.feature(types.WINDOW_SHOW_MESSAGE)(lambda params: self.messages.append(params.message))

    def refusals(self) -> list[str]:
        """Messages in which the server refused its initializationOptions."""
        return [m for m in self.messages if "initializationOptions" in m]

    async def launch(self, root: Path | None = None) -> None:
        """The process started and initialized (``root``: the workspace folder); the engine loads in
        the background."""
        await self.client.start_io(*self.command, cwd=str(self.cwd), env=self.env)
        # pygls keeps the process it launched in a private field: read here, the one place in bench/.
        self.process = process = self.client._server
        self.pid = process.pid if process else None
        # The server's stderr is a pipe nobody else reads: drained (to the log), or vLLM's start-up
        # logging fills it and blocks the server.
        self._drain = asyncio.create_task(self._drain_stderr(process.stderr if process else None))
        folder = {}
        if root is not None:
            folder = {"root_uri": root.as_uri(), "workspace_folders": [types.WorkspaceFolder(root.as_uri(), root.name)]}
        await self.client.initialize_async(
            types.InitializeParams(capabilities=types.ClientCapabilities(), initialization_options=self.options, **folder)
        )
        self.client.initialized(types.InitializedParams())

    async def start(self, root: Path | None = None) -> float:
        """Launched, initialized and ready: the seconds it took. Refused settings raise."""
        started = time.perf_counter()
        await self.launch(root)
        await self.wait_ready()
        if self.refusals():
            raise RuntimeError(f"the server refused the settings: {self.refusals()[0]}")
        return time.perf_counter() - started

    async def wait_ready(self) -> float:
        return await wait_ready(self.client, where=f" (log: {self.log_path})" if self.log_path else "")

    async def _drain_stderr(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        if self.log_path is not None:  # a fresh clone has no bench/.cache yet
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with (self.log_path or Path(os.devnull)).open("wb") as log:
            while chunk := await stream.read(65536):
                log.write(chunk)
                log.flush()

    async def stats(self, uri: str | None = None) -> dict[str, Any]:
        """``ember/stats`` as plain dicts (with ``uri``: ``last_for_uri`` is that document's)."""
        return plain(await self.client.protocol.send_request_async("ember/stats", {"uri": uri} if uri else {}))

    def open(self, uri: str, text: str, language: str = "python", version: int = 1) -> None:
        item = types.TextDocumentItem(uri=uri, language_id=language, version=version, text=text)
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(text_document=item))

    def close(self, uri: str) -> None:
        self.client.text_document_did_close(types.DidCloseTextDocumentParams(text_document=types.TextDocumentIdentifier(uri=uri)))

    async def complete(self, uri: str, position: types.Position, invoked: bool = True) -> str:
        """The first inline completion's text ("" for none)."""
        kind = types.InlineCompletionTriggerKind.Invoked if invoked else types.InlineCompletionTriggerKind.Automatic
        reply = await self.client.text_document_inline_completion_async(
            types.InlineCompletionParams(
                text_document=types.TextDocumentIdentifier(uri=uri), position=position,
                context=types.InlineCompletionContext(trigger_kind=kind),
            )
        )  # fmt: skip
        items = reply.items if isinstance(reply, types.InlineCompletionList) else (reply or [])
        text = items[0].insert_text if items else ""
        return text if isinstance(text, str) else text.value

    async def stop(self) -> None:
        """shutdown/exit; then SIGTERM (ember closes its engine on it); SIGKILL as the last resort."""
        process = self.process
        try:
            await asyncio.wait_for(self.client.shutdown_async(None), 15)
            self.client.exit(None)
        except Exception:  # noqa: BLE001 - a server that does not answer is stopped below
            pass
        if process is not None:
            for sig, wait_s in ((None, 15), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                if process.returncode is not None:
                    break
                if sig is not None:
                    process.send_signal(sig)
                try:
                    await asyncio.wait_for(process.wait(), wait_s)
                except TimeoutError:
                    continue
        with contextlib.suppress(Exception):  # the process is gone; the client's own clean-up may complain
            await asyncio.wait_for(self.client.stop(), 10)
        if self._drain:  # the rest of the log, once the process is gone
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drain, 5)


# ----------------------------------------------------------------------------------- numbers


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation between the closest ranks (numpy's default,
    ``statistics.quantiles(method="inclusive")``): p50 is the median; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def fmt(value: Any, spec: str = ".0f", scale: float = 1) -> str:
    """``value * scale`` formatted by ``spec``; "-" for a missing value (``spec`` "": str)."""
    if value is None:
        return "-"
    return format(value * scale if scale != 1 else value, spec)


def table(header: Sequence[Any], rows: Iterable[Sequence[Any]], right_from: int = 1) -> str:
    """A markdown table; the columns from ``right_from`` on (the numbers) right-aligned; cells made
    safe for markdown (``|`` escaped, line breaks as spaces)."""

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return "\n".join([line(header), "| " + " | ".join(align) + " |", *(line(row) for row in rows)])


# ----------------------------------------------------------------------------------- results


def commit(checkout: Path = ROOT) -> str:
    """HEAD of ``checkout``, with "+changes" when tracked files differ from it ("" outside git)."""
    try:
        git = {"cwd": checkout, "capture_output": True, "text": True, "timeout": 10}
        head = subprocess.run(["git", "rev-parse", "HEAD"], **git).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+changes" if head and dirty else "")


def machine() -> dict[str, Any]:
    """The CPU model, cores, memory, platform, Python and load average of this machine."""
    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return {
        "cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "platform": platform.platform(),
        "python": platform.python_version(), "load_average": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip


def settings(args: argparse.Namespace | dict[str, Any] | None) -> dict[str, Any]:
    """The script's arguments, as JSON takes them (paths as strings)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    return json.loads(json.dumps(values, default=str))


def write_results(path: Path, data: dict[str, Any], args: argparse.Namespace | dict[str, Any] | None = None) -> Path:
    """``data`` as JSON at ``path``, with the date, the command, the commit, the machine and the
    settings first (a key ``data`` has itself wins)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(["python", *sys.argv]), "commit": commit(),
        "machine": machine(), "settings": settings(args),
    }  # fmt: skip
    path.write_text(json.dumps({**header, **data}, indent=1, default=str))
    return path
