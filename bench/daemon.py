"""What does the per-user daemon buy an editor window? Time to the first completion and memory, per window.

    .venv/bin/python bench/daemon.py [--model M] [--max-tokens 16] [--no-baseline] [--out FILE]

Each "window" is ``python -m lsp --stdio`` launched the way an editor launches it, driven over
stdio: initialize, open a file, then ask ``textDocument/inlineCompletion`` every 250 ms until the
answer is non-empty. The time from the launch to that answer is measured for

  (a) cold:    the first window, nothing running;
  (b) second:  a second window while the first is open;
  (c) restart: the only window closed and launched again (within the daemon's idle time);

each at a cursor of its own, so every measured answer is generated (not a cache hit). After (c)
one more cursor of the file reopened is completed and its ``cached_tokens`` reported: the engine's
prefix cache outlived the window. Memory: PSS of every ember process (forwarders, the daemon or
the servers, and their engine processes) with 1 and with 3 windows open.

Two configurations in the same run: ``daemon`` (``--daemon auto``, the default) and ``off``
(``--daemon off``: each window its own engine, as before; ``--no-baseline`` skips it). The daemon
runs in a runtime directory of its own and is stopped at the end. Prints a table and writes
bench/results/daemon.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
import psutil
from lsprotocol import types

from bench.harness import RESULTS, ROOT, Ember, add_model_args, ember_command, machine, write_results

SOURCE = ROOT / "tests" / "data" / "inventory.py"
# Cursors at the ends of lines that invite code; one per measured request.
CURSOR_LINES = (
    "def total_weight(items):\n    return ",
    "def restock(item, count):\n    item.quantity += ",
    "def is_empty(items):\n    return ",
    "def names(items):\n    return ",
    "def heaviest(items):\n    return ",
)


class Window:
    def __init__(self, config: str, runtime: Path, args: argparse.Namespace) -> None:
        self.config, self.runtime, self.args = config, runtime, args
        command = ember_command(args.model, args.engine, (), "--max-tokens", str(args.max_tokens),
                                daemon="auto" if config == "daemon" else "off")  # fmt: skip
        env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
        self.ember = Ember(command, {"debounceMs": 0}, env=env, name="bench-editor")
        self.client = self.ember.client
        self.uri = "file:///bench/inventory.py"
        self.text = SOURCE.read_text()

    @property
    def pid(self) -> int | None:
        return self.ember.pid

    async def launch(self) -> None:
        await self.ember.launch()
        self.ember.open(self.uri, self.text)

    def add_cursor(self, tail: str, version: int) -> types.Position:
        """Appends ``tail`` to the document (one edit) and returns the position at its end."""
        lines = self.text.split("\n")
        end = types.Position(line=len(lines) - 1, character=len(lines[-1]))
        addition = "\n\n" + tail
        self.client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=self.uri, version=version),
                content_changes=[types.TextDocumentContentChangePartial(range=types.Range(start=end, end=end), text=addition)],
            )
        )
        self.text += addition
        lines = self.text.split("\n")
        return types.Position(line=len(lines) - 1, character=len(lines[-1]))

    async def first_completion(self, position: types.Position, deadline_s: float = 900) -> tuple[str, dict[str, Any]]:
        deadline = time.monotonic() + deadline_s
        while True:
            params = types.InlineCompletionParams(
                text_document=types.TextDocumentIdentifier(uri=self.uri),
                position=position,
                context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
            )
            result = await self.client.text_document_inline_completion_async(params)
            text = result.items[0].insert_text if result and result.items else ""
            if text:
                return str(text), await self.last()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no completion within {deadline_s} s")
            await asyncio.sleep(0.25)

    async def last(self) -> dict[str, Any]:
        stats = await self.client.protocol.send_request_async("ember/stats", {"uri": self.uri})
        last = getattr(stats, "last_for_uri", None)
        return last._asdict() if last is not None else {}

    async def close(self) -> None:
        await self.ember.stop()


def ember_processes(runtime: Path, windows: list[Window]) -> list[psutil.Process]:
    """The windows' processes, the daemons of ``runtime``, and all their descendants."""
    roots = [psutil.Process(w.pid) for w in windows if w.pid and psutil.pid_exists(w.pid)]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "daemon" in cmdline and str(runtime) in " ".join(cmdline):
            roots.append(process)
    found: dict[int, psutil.Process] = {}
    for root in roots:
        for process in [root, *root.children(recursive=True)]:
            found[process.pid] = process
    return list(found.values())


def pss_mib(processes: list[psutil.Process]) -> float:
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


async def settle_pss(runtime: Path, windows: list[Window]) -> float:
    """PSS once every window's engine is ready (a loading engine is still growing)."""
    await asyncio.sleep(2.0)
    return pss_mib(ember_processes(runtime, windows))


async def measure(config: str, args: argparse.Namespace) -> dict[str, Any]:
    runtime = Path(tempfile.mkdtemp(prefix="eb-"))
    result: dict[str, Any] = {"config": config}
    windows: list[Window] = []
    try:
        async def timed(window: Window, cursor: int, version: int) -> dict[str, Any]:
            started = time.monotonic()
            await window.launch()
            position = window.add_cursor(CURSOR_LINES[cursor], version)
            text, last = await window.first_completion(position)
            elapsed = time.monotonic() - started
            return {
                "first_completion_s": round(elapsed, 2),
                # Launch to answer less the engine's time generating it: what starting costs.
                "without_generation_s": round(elapsed - (last.get("engine_ms") or 0) / 1000, 2),
                "engine_ms": last.get("engine_ms"),
                "ttft_ms": last.get("ttft_ms"),
                "streamed_tokens": last.get("streamed_tokens"),
                "text": text,
                "cache_hit": last.get("cache_hit"),
                "prompt_tokens": last.get("prompt_tokens"),
                "cached_tokens": last.get("cached_tokens"),
            }

        first = Window(config, runtime, args)
        windows.append(first)
        result["cold"] = await timed(first, 0, 2)
        result["pss_1_window_mib"] = await settle_pss(runtime, windows)
        second = Window(config, runtime, args)
        windows.append(second)
        result["second"] = await timed(second, 1, 2)
        third = Window(config, runtime, args)
        windows.append(third)
        result["third"] = await timed(third, 2, 2)
        result["pss_3_windows_mib"] = await settle_pss(runtime, windows)
        for window in windows:
            await window.close()
        windows.clear()
        await asyncio.sleep(1.0)
        again = Window(config, runtime, args)
        windows.append(again)
        result["restart"] = await timed(again, 3, 2)
        # Another cursor of the reopened file: generated, and its prompt shares the file's prefix.
        position = again.add_cursor(CURSOR_LINES[4], 3)
        _, last = await again.first_completion(position)
        result["after_restart"] = {k: last.get(k) for k in ("cache_hit", "prompt_tokens", "cached_tokens", "kv_reuse")}
    finally:
        for window in windows:
            await window.close()
        for process in ember_processes(runtime, []):
            process.terminate()
        psutil.wait_procs(ember_processes(runtime, []), timeout=15)
        shutil.rmtree(runtime, ignore_errors=True)
    result["pss_ratio_3_to_1"] = round(result["pss_3_windows_mib"] / result["pss_1_window_mib"], 2)
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    """Seconds from launch to the first completion; in brackets, the same less the engine's time
    generating it (decode speed is the engine's, the same for both configurations)."""
    def cell(case: dict[str, Any]) -> str:
        return f"{case['first_completion_s']:.2f} ({case['without_generation_s']:.2f})"

    print(f"\n{'config':<8} {'(a) cold s':>16} {'(b) second s':>16} {'(c) restart s':>16} {'PSS 1 win MiB':>14} {'PSS 3 win MiB':>14} {'3/1':>5} {'cached after (c)':>17}")
    for r in results:
        after = r["after_restart"]
        print(
            f"{r['config']:<8} {cell(r['cold']):>16} {cell(r['second']):>16} {cell(r['restart']):>16} "
            f"{r['pss_1_window_mib']:>14.0f} {r['pss_3_windows_mib']:>14.0f} {r['pss_ratio_3_to_1']:>5.2f} "
            f"{str(after.get('cached_tokens')) + '/' + str(after.get('prompt_tokens')):>17}"
        )
    print("(in brackets: less the engine's time generating the answer)")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser, "bundled", engine_args=False)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-baseline", action="store_true", help="skip --daemon off")
    parser.add_argument("--out", type=Path, default=RESULTS / "daemon.json")
    args = parser.parse_args()
    configs = ["daemon"] if args.no_baseline else ["daemon", "off"]
    load_before = list(os.getloadavg())
    results = []
    for config in configs:
        print(f"measuring {config} ...", flush=True)
        results.append(await measure(config, args))
    print_table(results)
    by_config = {r["config"]: r for r in results}
    daemon = by_config["daemon"]
    targets = {
        "second_le_1s": daemon["second"]["first_completion_s"] <= 1.0,
        "restart_le_1s": daemon["restart"]["first_completion_s"] <= 1.0,
        "second_without_generation_le_1s": daemon["second"]["without_generation_s"] <= 1.0,
        "restart_without_generation_le_1s": daemon["restart"]["without_generation_s"] <= 1.0,
        "pss_3_le_1.2x_of_1": daemon["pss_ratio_3_to_1"] <= 1.2,
        "cached_tokens_after_restart": (daemon["after_restart"].get("cached_tokens") or 0) > 0,
    }
    print("targets:", json.dumps(targets))
    write_results(args.out, {
        "benchmark": "daemon",
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": list(os.getloadavg())},
        "model": args.model, "max_tokens": args.max_tokens, "results": results, "targets": targets,
    }, args)  # fmt: skip
    print(f"wrote {args.out}")
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
