"""llama.cpp's ``llama-server`` as ember's embedded engine on machines without a CUDA GPU.

On a CPU, decoding is bound by the bytes of weights read per token: llama.cpp decodes 4-bit GGUF
weights where vLLM's CPU build decodes bf16 ones, and loads a GGUF file in about a second.
ember runs its own build of the server (:mod:`engine.llama_build`) as a child process that listens
on a Unix socket in a private directory, and speaks to it with :class:`engine.remote.RemoteEngine`
(streaming, cancellation by closing the connection, usage with cached tokens, llama.cpp's
log-probabilities). A separate process, rather than llama-cpp-python in ours: a crash in C does
not take the editor's server down, several slots keep several documents' prompts cached, and the
server's prompt cache and cancel-on-disconnect come with it.

Each slot of the server keeps the KV of its last prompt. ember pins a prompt's routing key (its
document and anchor) to a slot, the least recently used one for a new key (:class:`SlotTable`): a
document's next request then finds its own prefix there, whatever other documents and windows
asked meanwhile, and a request that supersedes one of the same document waits in that slot only
until the cancellation lands (llama.cpp shares no KV between slots, so another slot would prefill
the whole prompt again), while requests for other documents run beside it. Prefill goes in
batches of :attr:`LlamaCppConfig.batch` tokens: a cancelled request stops at the end of the batch
it is in. Slots do not share one KV pool and idle slots are not moved out to RAM
(``--kv-unified`` with ``--cache-idle-slots`` would clear every idle slot when a request starts);
a slot given to a new key keeps its old prompt in the server's RAM prompt cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from engine.base import Chunk, EngineCounters, EngineError, EngineNotReady, EngineStats, GenerationParams, ModelInfo, counted
from engine.gguf import gguf_tokenizer
from engine.llama_build import ServerChoice, find_server
from engine.remote import RemoteEngine
from engine.routing import RemoteConfig
from engine.speeds import FIRST_SAVE, DecodeMeter, record_decode
from engine.token_counts import TokenizersTokenizer

log = logging.getLogger(__name__)

# The context of one slot unless the user sets max_model_len (as vLLM's on a CPU), capped at the
# model's own.
CONTEXT_PER_SLOT = 2048
# The server's own flags that ember sets: a user's engine arguments may not replace them.
RESERVED_FLAGS = frozenset({"model", "m", "host", "port", "alias", "api_key", "path"})
# vLLM's engine arguments that ember's own callers pass for whichever engine serves (the demo, the
# tests: eager mode for a short run) and that mean nothing to llama.cpp: left out, and logged.
VLLM_ONLY_ARGS = frozenset({
    "enforce_eager", "gpu_memory_utilization", "block_size", "kv_cache_memory_bytes", "enable_prefix_caching",
    "tensor_parallel_size", "kv_cache_dtype", "enable_chunked_prefill", "speculative_config", "quantization", "dtype",
})
START_TIMEOUT_S = 120.0
# A /health unanswered this long: the server is stopped (SIGSTOP, a suspended VM) or stuck, and
# each request sent now would wait in it and be prefilled at the thaw, ahead of the user's next.
UNANSWERED_S = 2.0


@dataclass(frozen=True)
class LlamaCppConfig:
    gguf: str  # the model file
    model_name: str
    # Threads for decoding and prefill; None: the cores this process may run on (2 here), as vLLM-CPU.
    threads: int | None = None
    # Slots: requests decoded together, each with its own cached prompt (several documents and
    # windows; a superseded request beside the newest).
    slots: int = 4
    context_per_slot: int | None = None  # None: CONTEXT_PER_SLOT (the user's max_model_len)
    # Prompt tokens per prefill batch: a cancelled request stops at the end of its batch (128: half
    # a second of Qwen2.5-Coder-0.5B on 2 cores); 512 prefilled no faster here (6.2-6.6 vs 6.4-6.9 s
    # for 1,448 tokens).
    batch: int = 128
    # RAM for prompts evicted from the slots (llama.cpp's default is 8 GiB).
    cache_ram_mib: int = 256
    # The user's engine arguments as llama-server flags (max_model_len: the slot's context).
    engine_args: dict[str, Any] = field(default_factory=dict)
    server: ServerChoice | None = None  # the binary and why (None: engine.llama_build.find_server at start)


def server_flags(config: LlamaCppConfig, socket_path: str) -> list[str]:
    """llama-server's command line (after the binary) for ``config``, listening on ``socket_path``."""
    args = {key: value for key, value in config.engine_args.items() if key not in VLLM_ONLY_ARGS}
    context = int(args.pop("max_model_len", None) or config.context_per_slot or CONTEXT_PER_SLOT)
    threads = config.threads or usable_cores()
    flags = [
        "--model", config.gguf, "--alias", config.model_name, "--host", socket_path,
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(config.slots), "--ctx-size", str(context * config.slots), "--no-kv-unified",
        "--no-cache-idle-slots", "--cache-ram", str(config.cache_ram_mib),
        "--batch-size", str(config.batch), "--ubatch-size", str(config.batch), "--no-webui", "--metrics",
    ]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def engine_args_problem(engine_args: dict[str, Any]) -> str | None:
    """Why ember refuses these engine arguments for llama.cpp before starting (ember's own flags)."""
    taken = sorted(key for key in engine_args if key.replace("-", "_") in RESERVED_FLAGS)
    return f"{', '.join(taken)} {'is' if len(taken) == 1 else 'are'} ember's to set" if taken else None


class SlotTable:
    """Which server slot serves which document, and what each slot holds: a document keeps its
    slot; a new one takes the slot used least recently. The document is the routing key less its
    anchor (``uri#line``, context.prompt.builder.PrefixKey): when the anchor moves, the slot still
    holds the prompt's front (the cross-file block, the file's header)."""

    def __init__(self, slots: int) -> None:
        self._keys: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(slots))
        self._held: dict[int, str] = {}  # the text whose KV a slot holds (prompt and generated text)

    def slot_for(self, key: str | None) -> int | None:
        if key is None:
            return None  # the server picks by prompt similarity
        key = key.rpartition("#")[0] or key
        if key in self._keys:
            self._keys.move_to_end(key)
            return self._keys[key]
        slot = self._free.pop(0) if self._free else self._keys.popitem(last=False)[1]
        self._keys[key] = slot
        return slot

    def holds(self, slot: int | None, text: str) -> bool:
        """Whether the slot's KV already covers ``text`` (a prefix of what it last held)."""
        return slot is not None and self._held.get(slot, "").startswith(text)

    def filled(self, slot: int | None, text: str | None) -> None:
        """After a request: the slot holds ``text`` (None: unknown, e.g. cancelled in its prefill)."""
        if slot is None:
            return
        if text is None:
            self._held.pop(slot, None)
        else:
            self._held[slot] = text


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills the server when ember's thread that started it
    ends (Linux), so that no server outlives ember, however ember ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LlamaCppEngine:
    """One llama-server process per ember process; restarted by the engine host when it dies."""

    kind = "llamacpp"

    def __init__(self, config: LlamaCppConfig) -> None:
        self.config = config
        self._process: subprocess.Popen[bytes] | None = None
        self._folder: Path | None = None
        self._client: RemoteEngine | None = None
        self._slots = SlotTable(config.slots)
        self._model: ModelInfo | None = None
        self._tokenizer: TokenizersTokenizer | None = None
        self.load_seconds: float | None = None
        self.engine_args: dict[str, Any] = {}  # the flags it runs with
        self.warning: str | None = None  # why the user's engine arguments were not applied
        self.decode = DecodeMeter()  # what the next start's default model is chosen by
        self.server: ServerChoice | None = None  # the llama-server binary that runs, and why
        self._keeping: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self.silent_since: float | None = None  # when a /health went unanswered, until one is answered
        self.counters = EngineCounters()  # requests and errors; the server's client counts the rest

    @property
    def ready(self) -> bool:
        return self._client is not None and self._client.ready and not self.dead

    @property
    def dead(self) -> bool:
        """The server process ended (killed, crashed): a new engine must be started."""
        return self._process is not None and self._process.poll() is not None

    @property
    def model(self) -> ModelInfo:
        if self._model is None:
            raise EngineNotReady("the model is still loading")
        return self._model

    @property
    def tokenizer(self) -> TokenizersTokenizer:
        if self._tokenizer is None:
            raise EngineNotReady("the model is still loading")
        return self._tokenizer

    async def start(self) -> None:
        started = time.monotonic()
        server: ServerChoice = self.config.server if self.config.server is not None else await asyncio.to_thread(find_server)
        if server.path is None:
            raise EngineError(f"{server.why}; or pass --engine vllm")
        self.server = server
        binary = server.path
        tokenizer = asyncio.create_task(asyncio.to_thread(gguf_tokenizer, Path(self.config.gguf)))
        try:
            await self._launch(binary)
            self._tokenizer = await tokenizer
        except BaseException:
            tokenizer.cancel()
            await self.close()
            raise
        assert self._client is not None
        served = self._client.model
        vocab = self._tokenizer.vocabulary()
        self._model = ModelInfo(
            name=self.config.model_name,
            max_model_len=served.max_model_len,
            special_tokens=frozenset(t for t in vocab if t.startswith(("<", "[", "▁<"))),
        )
        self.load_seconds = time.monotonic() - started
        log.info(
            "llama.cpp ready with %s in %.1f s (pid %d, context %d per slot, %s)",
            self.config.model_name, self.load_seconds, self.pid, served.max_model_len, " ".join(self.engine_args["flags"]),
        )

    async def _launch(self, binary: Path) -> None:
        """The server with the user's engine arguments; when it refuses them, with ember's own and
        a :attr:`warning` that says why (as the vLLM engine does)."""
        ignored = sorted(set(self.config.engine_args) & VLLM_ONLY_ARGS)
        if ignored:
            log.info("vLLM's engine arguments %s mean nothing to llama.cpp: left out", ", ".join(ignored))
        own = {k: v for k, v in self.config.engine_args.items() if k not in VLLM_ONLY_ARGS}
        problem = engine_args_problem(own)
        if own and problem is None:
            try:
                await self._run(binary, self.config)
                return
            except EngineError as exc:
                problem = str(exc)
        if own:
            shown = ", ".join(f"{k}={v!r}" for k, v in own.items())
            self.warning = f"engine arguments {shown} not applied: {problem}; started with ember's defaults instead"
            log.error("%s", self.warning)
        config = replace(self.config, engine_args={}) if own else self.config
        await self._run(binary, config)

    async def _run(self, binary: Path, config: LlamaCppConfig) -> None:
        folder = Path(tempfile.mkdtemp(prefix="ember-llama-"))  # 0700: only this user reaches the socket
        socket_path = str(folder / "server.sock")
        flags = server_flags(config, socket_path)
        logfile = (folder / "server.log").open("wb")
        # Started on the event loop's thread (a fork and exec, milliseconds): the parent-death
        # signal follows the starting thread, and this one lives as long as ember.
        process = subprocess.Popen(  # noqa: ASYNC220
            [str(binary), *flags], stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent, start_new_session=True,
        )
        logfile.close()
        self._process, self._folder = process, folder
        self.engine_args = {"binary": str(binary), "flags": flags}
        try:
            await self._wait_healthy(socket_path)
            remote = RemoteConfig(
                ("http://llama-server",), config.model_name, uds=socket_path,
                first_token_timeout=START_TIMEOUT_S, read_timeout=30.0,
                # llama-server closes the connection after each streamed answer without saying so.
                keepalive_expiry=0.0,
            )  # fmt: skip
            client = RemoteEngine(remote, tokenizer=_Pending())
            self._slots = SlotTable(config.slots)
            await client.start()
        except BaseException:
            await self._stop_process()
            raise
        self._client = client

    async def _wait_healthy(self, socket_path: str) -> None:
        """Until /health answers 200 (503 while the model loads); an exit is an error with the
        server's last words."""
        deadline = time.monotonic() + START_TIMEOUT_S
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), timeout=2.0) as http:
            while True:
                if self.dead:
                    raise EngineError(f"llama-server exited with code {self._exit_code()} while loading: {self.last_words()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("http://llama-server/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    late = f"llama-server did not load {self.config.gguf} within {START_TIMEOUT_S:.0f} s"
                    raise EngineError(f"{late}: {self.last_words()}")
                await asyncio.sleep(0.02)

    @property
    def socket_path(self) -> str | None:
        """The server's Unix socket (its own /metrics and /slots are there)."""
        return str(self._folder / "server.sock") if self._folder is not None else None

    def _exit_code(self) -> int | None:
        return self._process.poll() if self._process is not None else None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def last_words(self, lines: int = 6) -> str:
        """The end of the server's log (why it refused to start or died)."""
        if self._folder is None:
            return ""
        with contextlib.suppress(OSError):
            text = (self._folder / "server.log").read_text(errors="replace").strip().splitlines()
            return " | ".join(line.strip() for line in text[-lines:])
        return ""

    def stream(
        self, prompt: str, params: GenerationParams, request_id: str, *, routing_key: str | None = None
    ) -> AsyncGenerator[Chunk, None]:
        """The server's stream, in the document's slot. A warm-up whose prompt the slot holds
        already ends at once: sent, it would cut the slot's KV back to it (llama.cpp keeps one
        prompt per slot, where vLLM keeps every block), and the next request would prefill again
        what came after."""
        return counted(self._stream(prompt, params, request_id, routing_key), self.counters)

    async def _stream(
        self, prompt: str, params: GenerationParams, request_id: str, routing_key: str | None
    ) -> AsyncGenerator[Chunk, None]:
        if self._client is None:
            raise EngineNotReady("the model is still loading")
        if self.dead:
            raise EngineError(f"llama-server died (exit code {self._exit_code()}); ember is restarting it")
        if self.silent_since is not None:
            silent = time.monotonic() - self.silent_since
            silence = f"llama-server has not answered for {silent:.0f} s (stopped or stuck)"
            raise EngineError(f"{silence}; nothing is sent until it answers")
        slot = self._slots.slot_for(routing_key)
        if params.warm_up and self._slots.holds(slot, prompt):
            yield Chunk(text="", finish_reason="cached")
            return
        fields = {} if slot is None else {"id_slot": slot}
        text: str | None = None  # generated so far; None until the prompt was prefilled
        tokens, first, last = 0, 0.0, 0.0  # decoded tokens, when the first and the last arrived
        try:
            served = self._client.stream(prompt, params, request_id, routing_key=routing_key, fields=fields)
            async with contextlib.aclosing(served) as chunks:
                async for chunk in chunks:
                    if chunk.text or chunk.finish_reason:
                        text = (text or "") + chunk.text
                    if chunk.text:
                        last = time.perf_counter()
                        first, tokens = first or last, tokens + chunk.token_count
                    yield chunk
        except EngineError as exc:
            if self.dead:
                raise EngineError(f"llama-server died (exit code {self._exit_code()}); ember is restarting it") from exc
            raise
        finally:
            self._slots.filled(slot, None if text is None else prompt + text)
            self._measured(tokens, last - first)
            if text is None:  # ended before the server answered anything: is it answering at all?
                self._ask_health()

    def _ask_health(self) -> None:
        if self._probe is None or self._probe.done():
            with contextlib.suppress(RuntimeError):  # no loop: a stream finalised at shutdown
                self._probe = asyncio.get_running_loop().create_task(self._health())

    async def _health(self) -> None:
        """Asks /health (answered by the server's HTTP threads, beside any generation); when no
        answer comes within :data:`UNANSWERED_S`, requests are refused until one does."""
        path = self.socket_path
        if path is None:
            return
        asked = time.monotonic()
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), timeout=None) as http:
            answer = asyncio.ensure_future(http.get("http://llama-server/health"))
            try:
                while not self.dead:
                    done, _ = await asyncio.wait({answer}, timeout=UNANSWERED_S)
                    if done:
                        break
                    if self.silent_since is None:
                        self.silent_since = asked
                        log.warning("llama-server has not answered /health for %.0f s: refusing requests", UNANSWERED_S)
            finally:
                answer.cancel()
                await asyncio.gather(answer, return_exceptions=True)
        if self.silent_since is not None:
            log.warning("llama-server answers again after %.1f s", time.monotonic() - self.silent_since)
            self.silent_since = None

    def _measured(self, tokens: int, seconds: float) -> None:
        measured = self.decode.completions
        self.decode.add(tokens, seconds)
        if measured < FIRST_SAVE <= self.decode.completions and self._keeping is None:
            with contextlib.suppress(RuntimeError):  # no loop: a stream finalised at shutdown
                self._keeping = asyncio.get_running_loop().create_task(self.keep_decode_speed())

    async def keep_decode_speed(self) -> None:
        """Writes the measured decode speed for the next start's choice of the default model (only
        when the server runs on all the cores that choice counts: user-set threads measure less)."""
        rate = self.decode.median()
        if rate is not None and self.config.threads is None:
            await asyncio.to_thread(record_decode, self.config.model_name, rate, usable_cores(), self.decode.completions)

    async def abort(self, request_id: str) -> None:
        if self._client is not None:
            await self._client.abort(request_id)

    def engine_stats(self) -> EngineStats:
        """The counters (requests and errors counted here, the rest by the server's client), the
        connections to the server in use, and the process, its binary and its decode speed."""
        detail: dict[str, Any] = {"pid": self.pid, "alive": not self.dead, "socket": self.socket_path}
        detail["silent_s"] = round(time.monotonic() - self.silent_since, 1) if self.silent_since is not None else None
        if self.server is not None:
            detail.update(binary=str(self.server.path), binary_why=self.server.why)
        rate = self.decode.median()
        detail["decode_tokens_s"] = round(rate, 1) if rate is not None else None
        served = self._client.engine_stats() if self._client is not None else EngineStats("remote")
        counters = replace(served.counters, requests=self.counters.requests, errors=self.counters.errors)
        return EngineStats("llama.cpp", counters, served.connections_in_use, detail)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        if self._keeping is not None:
            await self._keeping
        if self.decode.completions >= FIRST_SAVE:  # a few completions would replace a longer record with noise
            await self.keep_decode_speed()
        await self._stop_process()

    async def _stop_process(self) -> None:
        process, folder = self._process, self._folder
        if process is not None and process.poll() is not None and process.returncode != 0:
            log.error("llama-server (pid %d) ended with code %s: %s", process.pid, process.returncode, self.last_words())
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), 3.0)
            except TimeoutError:
                process.kill()
                await asyncio.to_thread(process.wait)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


class _Pending:
    """The tokenizer slot of the server's client: ember counts with :attr:`LlamaCppEngine.tokenizer`."""

    def count(self, text: str) -> int:
        raise EngineNotReady("the tokenizer is still loading")

