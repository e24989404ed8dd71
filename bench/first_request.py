"""Does a freshly started remote vLLM server's first completion through ember answer, and how fast?
(issue 44's first empty answer)

    .venv/bin/python bench/first_request.py [--revs REV,REV] [--runs N] [--out FILE]

For each ember (this checkout, or each commit of ``--revs`` in a temporary worktree, alternating): a fresh vLLM OpenAI server on the bundled model, started as the issue's user did
(eager, prefix caching, and no ``TORCH_COMPILE_DISABLE``), then ``ember --stdio --engine-url``;
as soon as ember is ready, an inline completion at the end of a ~3,000-character document ending
in ``def parse_port(text):\\n    ``; then a one-word edit and a second request. Prints each
request's time, text and ember/stats' outcome and why_empty; writes bench/results/first-request.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401  (the checkout on sys.path)
import httpx
from lsprotocol import types

from bench.harness import RESULTS, ROOT, Ember, ember_command, fmt, table, write_results
from tests.load_driver import free_port

SERVED = "smol"

DOCUMENT = '''"""Reading the service's settings from the environment and from INI-style files."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
_SECTION = re.compile(r"^\\[(?P<name>[^\\]]+)\\]$")
_PAIR = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_.-]*)\\s*=\\s*(?P<value>.*)$")


class SettingsError(ValueError):
    """A setting that cannot be read: the message names the file, the line and the key."""


@dataclass
class Section:
    name: str
    values: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key.lower(), default)


@dataclass
class Settings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    debug: bool = False
    sections: dict[str, Section] = field(default_factory=dict)

    def section(self, name: str) -> Section:
        if name not in self.sections:
            raise SettingsError(f"no section [{name}]")
        return self.sections[name]


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"not a boolean: {text!r}")


def read_sections(path: Path) -> dict[str, Section]:
    sections: dict[str, Section] = {}
    current = Section("default")
    sections[current.name] = current
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if match := _SECTION.match(line):
            current = sections.setdefault(match["name"], Section(match["name"]))
            continue
        if match := _PAIR.match(line):
            current.values[match["key"].lower()] = match["value"].strip()
            continue
        raise SettingsError(f"{path}:{number}: cannot read {raw!r}")
    return sections


def from_environment(settings: Settings, environ: dict[str, str] | None = None) -> Settings:
    environ = dict(os.environ if environ is None else environ)
    if "SERVICE_HOST" in environ:
        settings.host = environ["SERVICE_HOST"]
    if "SERVICE_PORT" in environ:
        settings.port = parse_port(environ["SERVICE_PORT"])
    if "SERVICE_DEBUG" in environ:
        settings.debug = parse_bool(environ["SERVICE_DEBUG"])
    return settings


def load(path: Path | None = None) -> Settings:
    settings = Settings()
    if path is not None:
        settings.sections = read_sections(path)
        server = settings.sections.get("server")
        if server is not None:
            settings.host = server.get("host", settings.host) or settings.host
            settings.port = parse_port(server.get("port", str(settings.port)) or str(settings.port))
    return from_environment(settings)


def parse_port(text):
    '''


def server_command(model_dir: str, port: int) -> list[str]:
    """The issue's command line."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--enforce-eager", "--block-size", "32", "--enable-prefix-caching", "--max-model-len", "2048",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip


async def start_server(model_dir: str, logs: Path, label: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    # An empty compile cache, as on the fresh machine where the issue was seen (a warm one in
    # /tmp/torchinductor_$USER makes the first request with log-probabilities 2 s, not 14 s).
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-", dir=logs)
    log_path = logs / f"{label}-vllm.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(server_command(model_dir, port), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2.0) as client:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health")).status_code == 200:
                    return proc, url
            await asyncio.sleep(0.5)
    raise RuntimeError("vLLM not healthy after 300 s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    proc.wait(timeout=30)


async def request_at_end(ember: Ember, uri: str, text: str) -> dict[str, Any]:
    """An inline completion at the end of ``text``: its time, text and what ember/stats says of it."""
    started = time.perf_counter()
    completion = await ember.complete(uri, types.Position(line=text.count("\n"), character=len(text.rsplit("\n", 1)[1])), invoked=False)
    ms = (time.perf_counter() - started) * 1000
    last = (await ember.stats(uri))["last_for_uri"] or {}
    keys = ("outcome", "why_empty", "ttft_ms", "prompt_tokens", "cached_tokens", "confidence")
    return {"ms": ms, "text": completion, **{key: last.get(key) for key in keys}}


async def one_run(label: str, tree: Path, model_dir: str, logs: Path) -> dict[str, Any]:
    """A fresh server, ember from ``tree`` on it: ready, the first request, a one-word edit, the second."""
    proc, url = await start_server(model_dir, logs, label)
    command = ember_command(SERVED, None, (), "--engine-url", f"{url}/v1", log_level="INFO")
    ember = Ember(command, log_path=logs / f"{label}-ember.log", cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
    try:
        ready_s = await ember.start()
        uri = "file:///project/service_settings.py"
        ember.open(uri, DOCUMENT)
        first = await request_at_end(ember, uri, DOCUMENT)
        edited = DOCUMENT.replace("return settings\n\n\ndef load", "return settings\n\n\ndef read", 1)
        ember.client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
                content_changes=[types.TextDocumentContentChangeWholeDocument(text=edited)],
            )
        )
        second = await request_at_end(ember, uri, edited)
    finally:
        await ember.stop()
        stop_server(proc)
    return {"ember": label, "ready_s": ready_s, "requests": [first, second]}


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="ember-rev-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True, capture_output=True)
    return path


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revs", help="run ember at these commits (comma-separated; temporary worktrees) instead of this checkout")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "first-request.json")
    args = parser.parse_args()
    from engine.models import resolve_bundled

    model_dir = resolve_bundled().path
    logs = Path(tempfile.mkdtemp(prefix="ember-first-request-"))
    revs = args.revs.split(",") if args.revs else []
    trees = [(rev, worktree(rev)) for rev in revs] or [("checkout", ROOT)]
    runs = []
    try:
        for run in range(args.runs):
            for label, tree in trees:
                runs.append({"run": run, **await one_run(label, tree, model_dir, logs)})
    finally:
        for _, tree in trees[: len(revs)]:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    rows = [
        [row["ember"], row["run"], i + 1, fmt(row["ready_s"], ".1f"), fmt(request["ms"]), request["outcome"], repr(request["text"][:32]), request["why_empty"] or ""]
        for row in runs for i, request in enumerate(row["requests"])
    ]  # fmt: skip
    print(table(["ember", "run", "request", "ready s", "ms", "outcome", "text", "why_empty"], rows, right_from=1))
    write_results(args.out, {"model": "SmolLM2-135M (bundled, bf16 on vLLM-CPU)", "runs": runs}, args)
    print(f"wrote {args.out} (logs in {logs})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
