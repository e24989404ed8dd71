"""Does the main job work end to end? Start `ember --stdio`, open a real file over LSP, complete at a few
cursors (inline and classic completion), and print the model used and each completion with its
latency.

    .venv/bin/python bench/demo.py [FILE] [--engine-url URL] [--model M]

Without --model, ember's default: the code model Qwen2.5-Coder (0.5B on a CPU, 1.5B on a GPU) from
the Hugging Face cache or hub, or the bundled SmolLM2-135M when no hub answers (ember then says so,
and this prints it). Writes bench/results/demo.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
from lsprotocol import types

from bench.harness import RESULTS, ROOT, Ember, add_model_args, ember_command, write_results

ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM"}
DEFAULT_FILE = ROOT / "tests" / "data" / "inventory.py"


def cursors(text: str) -> list[tuple[str, int, int]]:
    """Places an editor would ask: the end of a def line (new body), a half-typed line."""
    lines = text.split("\n")
    picks: list[tuple[str, int, int]] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("def ") and stripped.endswith(":") and i + 1 < len(lines):
            picks.append(("body after def", i + 1, len(lines[i + 1]) - len(lines[i + 1].lstrip())))
        if stripped.startswith("return ") and len(picks) < 6:
            picks.append(("half a return line", i, len(line) - len(stripped) + len("return ")))
    return picks[:4]


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", default=str(DEFAULT_FILE))
    parser.add_argument("--engine-url", action="append", default=[])
    add_model_args(parser, engine_args=False)
    args = parser.parse_args()

    path = Path(args.file).resolve()
    text = path.read_text()
    uri = path.as_uri()
    remote = [flag for url in args.engine_url for flag in ("--engine-url", url)]
    # A short run: start-up dominates, so the daemon's engine starts eager (not compiled; vLLM only).
    eager = () if args.engine_url else ("enforce_eager=true",)
    ember = Ember(ember_command(args.model, args.engine, eager, *remote, daemon=None), {"maxTokens": 48}, name="ember-demo")
    client = ember.client
    shown = ember.messages
    started = time.perf_counter()
    await ember.launch()
    ember.open(uri, text)
    try:
        await ember.wait_ready()
        load_s = time.perf_counter() - started
    except (RuntimeError, TimeoutError) as exc:
        print(f"ember could not start its engine: {exc}")
        await ember.stop()
        return 1
    engine = (await client.protocol.send_request_async("ember/stats", {})).engine
    await asyncio.sleep(0.2)  # the fallback warning follows readiness
    served = f" on {ENGINE_NAMES.get(engine.kind, engine.kind)} ({engine.why})" if getattr(engine, "kind", None) else " on a remote server"
    print(f"model {engine.model}{served}: server up and model loaded in {load_s:.1f} s")
    for message in shown:
        print(f"    {message}")
    print()

    rows = []
    for label, line, character in cursors(text):
        position = types.Position(line=line, character=character)
        t0 = time.perf_counter()
        inline = await client.text_document_inline_completion_async(
            types.InlineCompletionParams(
                text_document=types.TextDocumentIdentifier(uri=uri),
                position=position,
                context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
            )
        )
        client_ms = (time.perf_counter() - t0) * 1000
        stats = await client.protocol.send_request_async("ember/stats", {})
        last = stats.last._asdict() if stats.last else {}
        completion = inline.items[0].insert_text if inline and inline.items else ""
        print(f"--- {path.name}:{line + 1}:{character + 1} ({label})")
        print(text.split("\n")[line][:character] + "\033[2m" + completion + "\033[0m")
        if not completion:  # what ember/stats says of it: the confidence gate, a cut, the engine
            print(f"    (empty: {last.get('why_empty') or last.get('outcome') or 'no reason recorded'})")
        print(
            f"    latency {last.get('latency_ms', 0):.0f} ms (client saw {client_ms:.0f} ms), ttft "
            f"{last.get('ttft_ms') or 0:.0f} ms, prompt {last.get('prompt_tokens')} tokens, "
            f"cached {last.get('cached_tokens')}, cache_hit {last.get('cache_hit')}\n"
        )
        rows.append({"label": label, "line": line, "character": character, "completion": completion, "client_ms": client_ms, **last})

    daemon = stats.daemon._asdict() if getattr(stats, "daemon", None) else None
    await ember.stop()
    if daemon:
        print(
            f"the engine ran in ember's shared daemon (pid {daemon['pid']}); it serves the next editor window at "
            f"once and exits after {daemon['idle_exit_s']:.0f} s without one (`.venv/bin/ember daemon stop` ends it now)"
        )
    data = {"file": str(path), "model": engine.model, "messages": shown, "load_s": load_s, "requests": rows}
    print(f"wrote {write_results(RESULTS / 'demo.json', data, args)}")
    return 0 if any(r["completion"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
