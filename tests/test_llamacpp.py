"""The llama.cpp engine with its real server (ember's own build, the bundled SmolLM2 GGUF): the
engine alone, under the engine host, through ``ember --stdio`` and through the daemon.

The build is made by the README's set-up (``bash .ci/setup``); a missing build fails these tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any
from pathlib import Path

import httpx
import psutil
import pytest
from lsprotocol import types

from context.cut import postprocess
from engine.base import EngineError, GenerationParams
from engine.llama_build import SERVER_ENV, server_binary
from engine.llamacpp import LlamaCppConfig, LlamaCppEngine, SlotTable, engine_args_problem, server_flags
from engine.gguf import pick_gguf
from engine.models import BUNDLED_NAME, bundled_gguf, choose_engine, resolve_gguf
from engine.remote import RemoteEngine
from engine.routing import RemoteConfig, parse_prometheus
from lsp.config import Settings
from lsp.engine_host import EmberCore
from tests.conftest import DATA, wait_ready
from tests.load_driver import LoadConfig, connect, disconnect, load_server, plain, start_tcp
from tests.test_daemon import Window, daemon_processes
from tests.test_server import inline, type_text

ROOT = Path(__file__).resolve().parents[1]
CODE = (DATA / "inventory.py").read_text()
# A prompt the bundled model goes on with for as long as it may (no stop, no end of text soon).
RAMBLE = CODE + "\n\n# A list of one hundred product names, one per line:\n# 1."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[LlamaCppEngine]:
    served = LlamaCppEngine(LlamaCppConfig(gguf=str(bundled_gguf()), model_name=BUNDLED_NAME))
    await served.start()
    try:
        yield served
    finally:
        await served.close()


async def metrics(engine: LlamaCppEngine) -> dict[str, float]:
    """The server's own counters (llama.cpp's Prometheus names, prefix dropped)."""
    assert engine.socket_path is not None
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=engine.socket_path)) as http:
        text = (await http.get("http://llama-server/metrics")).text
    return {sample.name.removeprefix("llamacpp:"): sample.value for sample in parse_prometheus(text)}


async def idle(engine: LlamaCppEngine, timeout_s: float = 10.0) -> dict[str, float]:
    """The server's counters once it processes no request (a cancellation lands at the next
    token step, which takes a while on two busy cores)."""
    deadline = time.monotonic() + timeout_s
    while (current := await metrics(engine))["requests_processing"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert current["requests_processing"] == 0, "the server still processes a cancelled request"
    return current


async def collect(engine: LlamaCppEngine, prompt: str, request_id: str, key: str | None = None, **params: object) -> list:
    generation = GenerationParams(**params)  # type: ignore[arg-type]
    return [chunk async for chunk in engine.stream(prompt, generation, request_id, routing_key=key)]


# ------------------------------------------------------------------------------ the engine alone


async def test_streams_text_with_log_probabilities_and_reports_the_reused_prefix(engine: LlamaCppEngine) -> None:
    prompt = CODE + "\n\ndef total_value(items):\n    return "
    first = await collect(engine, prompt, "first", max_tokens=12, logprobs=True)
    texts = [c for c in first if c.text]
    assert texts and sum(c.token_count for c in first) <= 12
    assert all(len(c.logprobs) == c.token_count and all(lp <= 0 for lp in c.logprobs) for c in texts), texts
    final = first[-1]
    assert final.finish_reason in ("length", "stop") and final.prompt_tokens == engine.tokenizer.count(prompt)
    # The same prompt with a few more characters typed: everything before them is in the slot's KV.
    second = await collect(engine, prompt + "sum(", "second", max_tokens=4)
    assert second[-1].prompt_tokens is not None and second[-1].cached_tokens is not None
    assert second[-1].cached_tokens >= final.prompt_tokens - 2, second[-1]
    assert engine.model.max_model_len == 2048 and "<|endoftext|>" in engine.model.special_tokens


async def test_streams_that_run_to_their_end_give_their_connections_back(engine: LlamaCppEngine) -> None:
    """A stream the server ends ([DONE]) returns its connection to the pool: cancelling the reader
    while httpx closed the response left the connection checked out for good, and after as many
    completions as the pool holds (64) every request failed (PoolTimeout). A pool of two here."""
    assert engine.socket_path is not None
    config = RemoteConfig(("http://llama-server",), BUNDLED_NAME, uds=engine.socket_path, max_connections=2,
                          first_token_timeout=60.0, read_timeout=30.0)  # fmt: skip
    client = RemoteEngine(config, tokenizer=engine.tokenizer)
    await client.start()
    try:
        for i in range(8):
            chunks = [c async for c in client.stream(f"def f{i}(x):\n    return", GenerationParams(max_tokens=4), f"pool-{i}")]
            assert chunks[-1].finish_reason in ("length", "stop"), chunks
    finally:
        await client.close()


async def test_no_connection_is_reused_after_a_streamed_answer(engine: LlamaCppEngine) -> None:
    """llama-server closes the connection after each streamed answer without saying so (no
    ``Connection: close``). A request that took such a connection from the pool before the close
    arrived failed (``Server disconnected``) and took the replica out for a second: 5 times in 168
    requests of a cross-file run. So the engine's client keeps no idle connection; this fails
    when llama.cpp starts keeping them (then pooling could come back)."""
    assert engine._client is not None and engine._client.config.keepalive_expiry == 0
    body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 2, "stream": True}).encode()
    reader, writer = await asyncio.open_unix_connection(engine.socket_path)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: llama-server\r\nContent-Type: application/json\r\n")
        writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        async with asyncio.timeout(60):
            answer = await reader.readuntil(b"\r\n0\r\n\r\n")  # the last chunk
        assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
        assert b"connection: close" not in answer.lower()
        async with asyncio.timeout(1.0):  # not the 5 s an idle connection is kept
            assert await reader.read(1) == b""
    finally:
        writer.close()
    # A burst through a pool of two, where each request takes the connection its predecessor
    # left at once: with connections kept, 2-4 of 60 such streams failed.
    config = dataclasses.replace(engine._client.config, max_connections=2, connect_timeout=60.0)  # a queue of 58 waits
    client = RemoteEngine(config, tokenizer=engine.tokenizer)
    await client.start()
    try:
        async def answer(i: int) -> list:
            return [c async for c in client.stream(f"def f{i}(x):", GenerationParams(max_tokens=2), f"burst-{i}")]

        answers = await asyncio.gather(*(answer(i) for i in range(60)))
        assert all(chunks[-1].finish_reason in ("length", "stop") for chunks in answers)
        assert client.replicas[0].failures == 0 and client.replicas[0].last_error is None, client.replicas[0].last_error
    finally:
        await client.close()


async def test_cancelling_mid_stream_stops_the_decode(engine: LlamaCppEngine) -> None:
    chunks = engine.stream(RAMBLE, GenerationParams(max_tokens=400), "cancelled")
    seen = 0
    async for chunk in chunks:
        seen += chunk.token_count
        if seen >= 3:
            break
    await chunks.aclose()
    settled = await idle(engine)
    await asyncio.sleep(1.0)
    later = await metrics(engine)
    assert later["n_decode_total"] == settled["n_decode_total"], "the server kept decoding after the cancel"
    assert later["tokens_predicted_total"] < 400


async def test_abort_by_request_id_ends_the_stream(engine: LlamaCppEngine) -> None:
    received: list[int] = []

    async def consume() -> None:
        async for chunk in engine.stream(RAMBLE, GenerationParams(max_tokens=400), "by-id"):
            received.append(chunk.token_count)

    task = asyncio.create_task(consume())
    while sum(received) < 2:
        await asyncio.sleep(0.01)
    await engine.abort("by-id")
    await asyncio.wait_for(task, 10)
    assert sum(received) < 400
    await idle(engine)


async def test_decoding_is_measured_and_kept_for_the_next_starts_choice_of_model(
    engine: LlamaCppEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every streamed completion's decode speed is measured; ember/stats shows the median and the
    next start reads it back (engine.speeds) to choose the default model."""
    from engine.llamacpp import usable_cores
    from engine.speeds import measured_decode

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    before = engine.decode.completions
    chunks = await collect(engine, RAMBLE, "measured", max_tokens=16)
    assert sum(c.token_count for c in chunks) >= 8, chunks
    assert engine.decode.completions == before + 1
    rate = engine.engine_stats().detail["decode_tokens_s"]
    assert rate > 1.0, rate
    await engine.keep_decode_speed()
    assert measured_decode(usable_cores()) == {BUNDLED_NAME: pytest.approx(rate, abs=0.1)}


async def test_two_documents_keep_their_own_cached_prefixes(engine: LlamaCppEngine) -> None:
    first_doc = CODE + "\n\ndef restock(item, count):\n    "
    other_doc = (DATA / "inventory.py").read_text().replace("Item", "Product").replace("item", "product") * 2 + "\n# "
    a = await collect(engine, first_doc, "doc-a", "a.py#0", max_tokens=2)
    await collect(engine, other_doc, "doc-b", "b.py#0", max_tokens=2)
    # b.py's warm-up (a prefix of the text of a.py, which the server would match to a.py's slot)
    await collect(engine, first_doc[: len(first_doc) // 2], "doc-b-warm", "b.py#0", max_tokens=1)
    again = await collect(engine, first_doc + "item", "doc-a-again", "a.py#0", max_tokens=2)
    assert again[-1].cached_tokens is not None and a[-1].prompt_tokens is not None
    assert again[-1].cached_tokens >= a[-1].prompt_tokens - 2, (a[-1], again[-1])


async def long_request(engine: LlamaCppEngine, request_id: str, key: str) -> tuple[asyncio.Task[None], list[int]]:
    """A 300-token request under way (two tokens in): its task and the token counts it received."""
    tokens: list[int] = []

    async def consume() -> None:
        async for chunk in engine.stream(RAMBLE, GenerationParams(max_tokens=300), request_id, routing_key=key):
            tokens.append(chunk.token_count)

    task = asyncio.create_task(consume())
    while sum(tokens) < 2:
        await asyncio.sleep(0.01)
    return task, tokens


async def test_a_request_for_another_document_runs_beside_a_long_one(engine: LlamaCppEngine) -> None:
    """A request that is still generating does not hold the next one (another document, another
    window) back: the server's slots decode both together."""
    task, old_tokens = await long_request(engine, "long", "long.py#0")
    newest = await collect(engine, CODE + "\n\ndef newest():\n    return ", "newest", "new.py#0", max_tokens=6)
    assert any(c.text for c in newest)
    assert not task.done() and sum(old_tokens) < 300, "the newest request waited for the old one to finish"
    await engine.abort("long")
    await asyncio.wait_for(task, 10)


async def test_a_superseding_request_reuses_the_superseded_ones_prefix(engine: LlamaCppEngine) -> None:
    """The completer aborts a document's running request and sends the new one: it goes to the
    same slot once the abort lands, and finds the prompt there."""
    task, old_tokens = await long_request(engine, "old", "same.py#0")
    await engine.abort("old")
    newest = await collect(engine, RAMBLE + " Apple", "superseding", "same.py#0", max_tokens=4)
    await asyncio.wait_for(task, 10)
    assert sum(old_tokens) < 300 and any(c.text for c in newest)
    assert newest[0].cached_tokens >= newest[0].prompt_tokens - 4, newest[0]


def test_slots_follow_keys_least_recently_used_first() -> None:
    table = SlotTable(2)
    assert [table.slot_for(k) for k in ("a#1", "b#1", "a#7")] == [0, 1, 0]  # a moved its anchor: same slot
    assert table.slot_for("c#1") == 1 and table.slot_for("b#1") == 0  # b lost its slot to c, then took a's
    assert table.slot_for(None) is None
    table.filled(1, "def f():\n    return 1")
    assert table.holds(1, "def f():\n") and not table.holds(1, "def g") and not table.holds(0, "def f")
    table.filled(1, None)  # cancelled before its prompt was in: unknown
    assert not table.holds(1, "def f():\n")


async def test_a_warm_up_of_what_the_slot_holds_leaves_its_prompt_in_place(engine: LlamaCppEngine) -> None:
    """On llama.cpp a warm-up of a prefix would cut the slot back to that prefix: it ends at once."""
    full = CODE + "\n\ndef most_expensive(items):\n    return "
    first = await collect(engine, full, "full", "warm.py#3", max_tokens=3)
    warm = await collect(engine, full[: len(full) // 2], "warm", "warm.py#3", max_tokens=1, warm_up=True)
    assert [(c.text, c.finish_reason) for c in warm] == [("", "cached")]
    again = await collect(engine, full + "max(", "again", "warm.py#3", max_tokens=2)
    assert again[0].cached_tokens >= first[-1].prompt_tokens - 2, again[0]
    # A warm-up of something the slot does not hold goes to the server.
    other = await collect(engine, CODE.replace("Item", "Thing"), "other-warm", "warm.py#3", max_tokens=1, warm_up=True)
    assert other[-1].finish_reason != "cached" and other[-1].prompt_tokens


def test_flags_pass_the_users_engine_arguments_and_keep_embers_own() -> None:
    config = LlamaCppConfig(gguf="/m.gguf", model_name="m", threads=3, engine_args={"max_model_len": 4096, "flash_attn": "on", "mlock": True})
    flags = server_flags(config, "/run/s.sock")
    assert flags[flags.index("--ctx-size") + 1] == str(4 * 4096) and flags[flags.index("--threads") + 1] == "3"
    assert flags[flags.index("--flash-attn") + 1] == "on" and "--mlock" in flags and "--host" in flags
    assert engine_args_problem({"port": 8080}) == "port is ember's to set" and engine_args_problem({"flash_attn": "on"}) is None


async def test_arguments_the_server_refuses_fall_back_to_embers_defaults_with_a_warning() -> None:
    served = LlamaCppEngine(LlamaCppConfig(gguf=str(bundled_gguf()), model_name=BUNDLED_NAME, engine_args={"no_such_flag": 1}))
    try:
        await served.start()
        assert served.ready and served.warning is not None and "no_such_flag" in served.warning
        assert "--no-such-flag" not in served.engine_args["flags"]
    finally:
        await served.close()


def fake_server(path: Path, version: str, help_text: str, served: Path) -> Path:
    """A script that answers --version and --help like a llama-server and notes being served."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --version) echo "{version}" >&2;; --help) echo "{help_text}";; *) touch {served};; esac\n'
    )
    path.chmod(0o755)
    return path


def test_a_llama_server_on_path_is_used_when_ember_knows_it_and_refused_when_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order is $EMBER_LLAMA_SERVER, ember's own build, PATH. One on PATH runs when its
    --version names ember's llama.cpp commit and its --help every flag ember passes (a copy of
    ember's own build here); another commit, or a missing flag, is refused with what differs, and
    the engine says so without running it."""
    from engine.llama_build import KNOWN_COMMIT, NEEDED_FLAGS, find_server

    own = server_binary()
    assert own is not None
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))  # no build of ember's own there
    monkeypatch.delenv(SERVER_ENV, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert find_server().path is None and "ember setup" in find_server().why
    (bin_dir / "llama-server").symlink_to(own)
    chosen = find_server()
    assert chosen.path == bin_dir / "llama-server" and chosen.why.startswith("on PATH"), chosen
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "gone"))  # names nothing: the next in the order
    chosen = find_server()
    assert chosen.path == bin_dir / "llama-server" and "not an executable file" in chosen.why, chosen
    monkeypatch.delenv(SERVER_ENV)

    (bin_dir / "llama-server").unlink()
    served = tmp_path / "served"
    fake_server(bin_dir / "llama-server", "version: 7000 (build 7000, commit deadbee)", " ".join(NEEDED_FLAGS), served)
    refused = find_server()
    assert refused.path is None and "deadbee" in refused.why and KNOWN_COMMIT in refused.why, refused
    with pytest.raises(EngineError, match="deadbee"):
        asyncio.run(LlamaCppEngine(LlamaCppConfig(gguf=str(bundled_gguf()), model_name="m")).start())
    fake_server(bin_dir / "llama-server", f"version: 1 (build 1, commit {KNOWN_COMMIT})", "--alias --metrics", served)
    lacking = find_server()
    assert lacking.path is None and "lacks --threads-batch" in lacking.why, lacking
    assert not served.exists(), "a refused llama-server was run"
    monkeypatch.setenv(SERVER_ENV, str(bin_dir / "llama-server"))  # named: run as it is
    assert find_server().path == bin_dir / "llama-server"


def test_ember_setup_without_cmake_says_how_to_get_it(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty), "EMBER_CACHE_DIR": str(tmp_path / "cache"), "CXX": ""}
    env.pop(SERVER_ENV, None)
    done = subprocess.run([sys.executable, "-m", "lsp", "setup"], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert done.returncode == 1, done
    assert "needs cmake (`pip install cmake ninja`" in done.stderr and "a C++ compiler" in done.stderr, done.stderr


def test_a_second_build_waits_for_the_first_and_steps_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two embers never build at once: the second waits on the lock and finds the first's binary.
    A build's output gives a line per step."""
    import threading

    from engine import llama_build

    monkeypatch.setattr(llama_build, "missing_tools", lambda: [])
    target = llama_build.cached_server(tmp_path)
    holding = threading.Event()

    def first_build() -> None:
        with llama_build.build_lock(tmp_path, said=lambda line: None):
            holding.set()
            time.sleep(0.5)
            target.parent.mkdir(parents=True)
            target.write_text("#!/bin/sh\n")
            target.chmod(0o755)

    first = threading.Thread(target=first_build)
    first.start()
    holding.wait(5)
    said: list[str] = []
    started = time.monotonic()
    assert llama_build.build(tmp_path, said=said.append) == target
    first.join()
    assert time.monotonic() - started >= 0.3 and any("waiting" in line for line in said) and "built meanwhile" in said[-1], said
    steps: list[str] = []
    script = "print('-- configuring'); print('[1/3] Building CXX a.o'); print('[2/3] b.o'); print('[3/3] Linking llama-server')"
    llama_build._run([sys.executable, "-c", script], steps.append, steps=True)
    assert steps == ["llama-server: step 1/3 Building CXX a.o", "llama-server: step 2/3 b.o", "llama-server: step 3/3 Linking llama-server"]
    with pytest.raises(llama_build.SetupError, match="exit 3"):
        llama_build._run([sys.executable, "-c", "raise SystemExit(3)"], steps.append, steps=True)


def test_the_engine_follows_the_hardware_and_the_model(tmp_path: Path) -> None:
    assert choose_engine("auto", None, cuda=True).kind == "vllm"
    assert choose_engine("auto", None, cuda=False).kind == "llamacpp"
    assert choose_engine("auto", "bundled", cuda=False).kind == "llamacpp"
    assert choose_engine("auto", "Qwen/Qwen2.5-Coder-1.5B", cuda=False).kind == "vllm"
    assert choose_engine("auto", "ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF", cuda=False).kind == "llamacpp"
    assert choose_engine("llamacpp", None, cuda=True).kind == "llamacpp"
    (tmp_path / "config.json").write_text("{}")
    assert choose_engine("auto", str(tmp_path), cuda=False).kind == "vllm"


def test_gguf_files_are_found_as_they_are(tmp_path: Path) -> None:
    assert resolve_gguf("bundled").path == str(bundled_gguf()) and resolve_gguf("bundled").source == "bundled"
    assert pick_gguf(["m-q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-f16.gguf", "README.md"]) == "m-Q4_K_M.gguf"
    (tmp_path / "m-q8_0.gguf").symlink_to(bundled_gguf())
    found = resolve_gguf(str(tmp_path))
    assert found.path == str(bundled_gguf()) and found.name == "m-q8_0"
    (tmp_path / "m-q8_0.gguf").unlink()
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception, match="holds no .gguf file"):
        resolve_gguf(str(tmp_path))


# ------------------------------------------------------------------------------ under the engine host


async def test_a_killed_server_is_reported_and_restarted() -> None:
    core = EmberCore(Settings(model="bundled", engine="llamacpp"))
    try:
        await core.start_engine()
        assert core.ready and core.engine_choice is not None and core.engine_choice.kind == "llamacpp"
        engine = core.engine
        assert isinstance(engine, LlamaCppEngine) and engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        for _ in range(100):
            if engine.dead:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(EngineError, match="llama-server died"):
            await collect(engine, "def f():\n    ", "after-kill", max_tokens=2)
        assert not core.check_engine() and core.restarting and "died" in (core.engine_error or "")
        assert await asyncio.wait_for(core.wait_ready(), 60)
        assert core.restarts == 1 and core.engine is not engine and not psutil.pid_exists(engine.pid or 0)
        assert any(c.text for c in await collect(core.engine, "def f():\n    return ", "restarted", max_tokens=4))  # type: ignore[arg-type]
    finally:
        await core.close()


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(ROOT)!r})
        from engine.llamacpp import LlamaCppConfig, LlamaCppEngine
        from engine.models import bundled_gguf
        async def main():
            engine = LlamaCppEngine(LlamaCppConfig(gguf=str(bundled_gguf()), model_name="m"))
            await engine.start()
            print(engine.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert psutil.Process(server_pid).name().startswith("llama-server")
        owner.kill()  # no clean-up runs in the owner
        owner.wait()
        deadline = time.monotonic() + 10
        while psutil.pid_exists(server_pid) and psutil.Process(server_pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "llama-server outlived the process that started it"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            owner.kill()


# ------------------------------------------------------------------------------ through ember --stdio


@pytest.fixture(scope="module")
def llama_window_args() -> tuple[str, ...]:
    return ("--engine", "llamacpp", "--model", "bundled", "--max-tokens", "16", "--timeout-ms", "60000")


async def test_an_editor_gets_completions_reused_prefixes_and_typed_through_answers(tmp_path: Path, llama_window_args: tuple[str, ...]) -> None:
    window = Window(tmp_path, "--daemon", "off", *llama_window_args)
    try:
        await window.open()
        ready = await wait_ready(window.client, 120)
        assert ready["engine"]["kind"] == "llamacpp" and ready["engine"]["why"].startswith("asked for")
        assert ready["engine"]["stats"]["engine"] == "llama.cpp" and ready["engine"]["max_model_len"] == 2048
        uri = "file:///proj/inventory.py"
        text = CODE + "\n\ndef cheapest(items):\n    return "
        window.did_open(text)
        first = await window.complete_at_end(text)
        last = (await window.stats())["last_for_uri"]
        assert first, last
        assert last["prompt_tokens"] > 100 and last["streamed_tokens"] > 0 and last["confidence"] is not None, last
        # Typing what the suggestion says: answered from it, no generation.
        line, character = text.count("\n"), len(text.rsplit("\n", 1)[1])
        typed = first[:2]
        type_text(window.client, uri, line, character, typed, version=1)
        again = await window.complete_at_end(text + typed)
        last = (await window.stats())["last_for_uri"]
        assert again == first[2:] and last["cache_hit"] is True and last["streamed_tokens"] == 0, last
        # Typing something else: a new generation whose prompt's front is in the KV cache.
        edited = window.type_at_end("min(", text + typed, 2 + len(typed))
        await window.complete_at_end(edited)
        last = (await window.stats())["last_for_uri"]
        assert not last["cache_hit"] and last["kv_reuse"] >= 0.9, last
    finally:
        await window.close()


async def test_the_light_install_serves_a_completion_with_vllm_torch_and_transformers_out_of_reach(tmp_path: Path) -> None:
    """What `bash .ci/setup` (without --test) installs: on a machine without CUDA ember picks
    llama.cpp, reads the GGUF's tokenizer into an empty cache and completes, and nothing on the
    way imports vLLM, torch or transformers (each is a package here that notes the attempt and
    fails as a missing one does)."""
    stubs, tried = tmp_path / "stubs", tmp_path / "tried"
    for name in ("vllm", "torch", "transformers"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(
            f"open({str(tried)!r}, 'a').write({name!r} + '\\n')\nraise ImportError('{name} is not installed')\n"
        )
    window = Window(
        tmp_path, "--daemon", "off", "--model", "bundled", "--max-tokens", "16", "--timeout-ms", "60000",
        PYTHONPATH=str(stubs), EMBER_ENGINE="", CUDA_VISIBLE_DEVICES="", EMBER_CACHE_DIR=str(tmp_path / "cache"),
        **{SERVER_ENV: str(server_binary())},  # the build stays where it is; the cache starts empty
    )  # fmt: skip
    try:
        await window.open()
        ready = await wait_ready(window.client, 120)
        assert ready["engine"]["kind"] == "llamacpp" and ready["engine"]["why"].startswith("no CUDA GPU"), ready["engine"]
        text = CODE + "\n\ndef cheapest(items):\n    return "
        window.did_open(text)
        assert await window.complete_at_end(text), (await window.stats())["last_for_uri"]
        assert list((tmp_path / "cache" / "tokenizers").glob("*.json"))
    finally:
        await window.close()
    assert not tried.exists(), f"imported on the way: {tried.read_text()}"


async def test_typing_mid_file_prefills_only_what_was_typed_in_the_append_layout(
    tmp_path: Path, llama_window_args: tuple[str, ...]
) -> None:
    """A prefix-suffix-middle template (Qwen's, rendered for the bundled model) typed mid-file,
    a request every few keys: with the append layout the engine prefills only the typed tail
    (its own counts: prompt_tokens - cached_tokens), with the classic one the suffix each time."""
    window = Window(tmp_path, "--daemon", "off", *llama_window_args)
    uri = "file:///proj/inventory.py"
    options = {"fimTemplate": "qwen2.5-coder", "reuse": False, "warmup": False, "crossFile": "off"}
    try:
        await window.open(options)
        await wait_ready(window.client, 120)
        window.did_open(CODE)
        version, prefilled = 1, {}
        # A new line after `return self.price * self.quantity` (0-based line 16), then another
        # after `self.items[item.name] = item` (line 27, one line further down by then).
        for layout, line in (("append", 16), ("classic", 28)):
            window.client.workspace_did_change_configuration(
                types.DidChangeConfigurationParams(settings={"ember": {**options, "fimLayout": layout}})
            )
            text_line = CODE.split("\n")[line if layout == "append" else line - 1]
            version = type_text(window.client, uri, line, len(text_line), "\n", version)
            typed, counts = "", []
            for chunk in ("        co", "st = ", "self.p", "rice * ", "2 + sel", "f.quan"):
                version = type_text(window.client, uri, line + 1, len(typed), chunk, version)
                typed += chunk
                await inline(window.client, uri, line + 1, len(typed))
                last = (await window.stats())["last_for_uri"]
                assert not last["cache_hit"] and last["prompt_tokens"] > 150, last
                assert last["layout"] == layout and not last["layout_fallback"], last
                counts.append(last["prompt_tokens"] - last["cached_tokens"])
            prefilled[layout] = counts[1:]  # the first request of each prefills the new line's context
        assert max(prefilled["append"]) <= 8, prefilled
        assert min(prefilled["classic"]) >= 100, prefilled
        assert (await window.stats())["layouts"] == {"append": 6, "classic": 6}
    finally:
        await window.close()


# Issue 44's probes: the demo's cursors in inventory.py (0-based line, character): a new body line
# before existing code, the middle of a return line, a body before an `if`, a body after `def`.
PROBES = [(16, 8), (16, 15), (21, 8), (24, 8)]
CUTTER_REASONS = {value for name, value in vars(postprocess).items() if name.startswith("WHY_")}


async def test_an_empty_answer_says_which_step_emptied_it(tmp_path: Path, llama_window_args: tuple[str, ...]) -> None:
    """At each probe ember answers text, or nothing with ``why_empty`` naming the step (issue 44:
    the bundled model's empty answers had no reason); the classic completion says the same."""
    window = Window(tmp_path, "--daemon", "off", *llama_window_args)
    uri = "file:///proj/inventory.py"
    try:
        await window.open({"reuse": False})
        await wait_ready(window.client, 120)
        window.did_open(CODE)

        async def inline(position: types.Position) -> str:
            answer = await window.client.text_document_inline_completion_async(
                types.InlineCompletionParams(
                    text_document=types.TextDocumentIdentifier(uri=uri), position=position,
                    context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
                )
            )
            return answer.items[0].insert_text if answer and answer.items else ""

        answers = []
        for line, character in PROBES:
            position = types.Position(line=line, character=character)
            text = await inline(position)
            last = (await window.stats())["last_for_uri"]
            answers.append((text, last["outcome"], last["why_empty"]))
            if text:
                assert last["outcome"] == "ok" and last["why_empty"] == "", last
            else:
                assert last["outcome"] == "empty" and last["why_empty"] in CUTTER_REASONS, last
            classic = await window.client.text_document_completion_async(
                types.CompletionParams(text_document=types.TextDocumentIdentifier(uri=uri), position=position)
            )
            assert bool(classic and classic.items) == bool(text)
            assert (await window.stats())["last_for_uri"]["why_empty"] == last["why_empty"]
        assert any(not text for text, _, _ in answers), answers  # the demo's empty answers, now explained
        # A threshold no answer passes: hidden, and the confidence is the reason.
        window.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(settings={"ember": {"minConfidence": 1.0}}))
        line, character = next(PROBES[i] for i, (text, _, _) in enumerate(answers) if text)
        hidden = await inline(types.Position(line=line, character=character))
        last = (await window.stats())["last_for_uri"]
        assert hidden == "" and last["outcome"] == "hidden" and last["why_empty"].startswith("its confidence"), last
    finally:
        await window.close()


async def test_two_hundred_completions_leave_nothing_checked_out_or_open(tmp_path: Path) -> None:
    """Completions that run to their end ([DONE]) once left their connection checked out of the
    pool, and after 64 of them ember answered nothing (issue 46); requests stopped at the wrong
    moment did the same (issue 54). 200 completions through the real llama-server, two editors
    typing at once: every one answered, none an error, and connections in use, tasks and
    descriptors back to their level after the first completions."""
    proc, address = start_tcp(
        ["--tcp", "127.0.0.1:0", "--engine", "llamacpp", "--model", "bundled", "--max-tokens", "8", "--log-level", "WARNING"],
        tmp_path / "ember.log",
    )
    probe = await connect(address, {})
    try:
        await wait_ready(probe, 120)
        first = await load_server(LoadConfig(sessions=1, documents=2, requests=30, max_tokens=8), address, proc.pid)
        assert first.answered == 30 and not first.errors, first.errors[:3]
        before = await idle_holdings(probe)
        report = await load_server(LoadConfig(sessions=2, documents=6, requests=200, max_tokens=8, seed=3), address, proc.pid)
        assert report.answered == 200 and not report.errors, report.errors[:3]
        after = await idle_holdings(probe)
        assert after["connections_in_use"] == 0 and after["errors"] == 0, after
        assert after["requests"] >= before["requests"] + 80, (before, after)  # generated, not all typed through or cached
        assert after["descriptors"] <= before["descriptors"] + 2 and after["tasks"] <= before["tasks"] + 2, (before, after)
    finally:
        await disconnect(probe)
        proc.terminate()
        proc.wait(timeout=15)


async def idle_holdings(client: Any, timeout_s: float = 10.0) -> dict[str, int]:
    """Descriptors, tasks, connections in use and the engine's counters, once no generation runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = plain(await client.protocol.send_request_async("ember/stats", {}))
        held = {**stats["process"], "connections_in_use": stats["engine"]["stats"]["connections_in_use"], **stats["engine"]["counters"]}
        if held["connections_in_use"] == 0 or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.2)


async def test_a_frozen_server_is_answered_within_the_deadline_and_serves_again_after_the_thaw(tmp_path: Path) -> None:
    """A SIGSTOPped llama-server is not dead (its process runs on), so nothing restarts it: each
    request is answered within timeoutMs, empty, saying why; once a /health has gone unanswered
    for 2 s nothing more is sent (each would wait in the server and be prefilled at the thaw,
    ahead of the user's next); after SIGCONT completions come back at once, without a restart."""
    window = Window(tmp_path, "--daemon", "off", "--engine", "llamacpp", "--model", "bundled", "--max-tokens", "8", "--timeout-ms", "1500")
    try:
        await window.open({"reuse": False})
        ready = await wait_ready(window.client, 120)
        text = CODE + "\n\ndef cheapest(items):\n    return "
        window.did_open(text)
        await window.complete_at_end(text)
        pid = (await window.stats())["engine"]["stats"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        whys = []
        try:
            current, version = text, 1
            while not any("has not answered" in why for why in whys) and version < 10:
                version += 1
                current = window.type_at_end(" x", current, version)
                started = time.monotonic()
                assert await window.complete_at_end(current) == ""
                assert time.monotonic() - started < 1.5 + 1.0
                whys.append((await window.stats())["last_for_uri"]["why_empty"])
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "deadline" in whys[0] and "has not answered" in whys[-1] and len(whys) <= 5, whys
        current = window.type_at_end(" + min(", current, version + 1)
        thawed = time.monotonic()
        await window.complete_at_end(current)
        stats = await window.stats()
        assert stats["last_for_uri"]["streamed_tokens"] > 0, stats["last_for_uri"]  # the engine answered
        assert time.monotonic() - thawed < 1.5 + 1.0, ready
        assert stats["engine"]["restarts"] == 0 and stats["engine"]["stats"]["pid"] == pid, stats["engine"]
    finally:
        await window.close()


async def test_two_windows_share_the_daemons_one_llama_server(runtime: Path, llama_window_args: tuple[str, ...]) -> None:
    first, second = Window(runtime, *llama_window_args), Window(runtime, *llama_window_args)
    text = CODE + "\n\ndef heaviest(items):\n    return "
    try:
        await first.open()
        ready = await wait_ready(first.client, 120)
        assert ready["daemon"]["serving"]["kind"] == "llamacpp"
        await second.open()
        joined = await wait_ready(second.client, 120)
        assert joined["daemon"]["pid"] == ready["daemon"]["pid"] and joined["engine"]["starts"] == 1
        assert joined["engine"]["stats"]["pid"] == ready["engine"]["stats"]["pid"]
        first.did_open(text)
        second.did_open(text.replace("heaviest", "lightest"))
        answers = await asyncio.gather(first.complete_at_end(text), second.complete_at_end(text.replace("heaviest", "lightest")))
        assert all(answers), answers
        servers = [p for p in psutil.Process(ready["daemon"]["pid"]).children(recursive=True) if p.name().startswith("llama-server")]
        assert len(servers) == 1
    finally:
        await first.close()
        await second.close()
    assert len(daemon_processes(runtime)) <= 1


async def test_status_of_the_daemon_names_the_engine(runtime: Path, llama_window_args: tuple[str, ...]) -> None:
    window = Window(runtime, *llama_window_args)
    try:
        await window.open()
        await wait_ready(window.client, 120)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
        status = subprocess.run(
            [sys.executable, "-m", "lsp", "daemon", "status"], env=env, capture_output=True, text=True, timeout=30, cwd=ROOT
        )
        assert status.returncode == 0 and '"llamacpp"' in status.stdout, status.stdout + status.stderr
    finally:
        await window.close()



async def test_the_default_gguf_model_comes_from_a_hub_repo_and_loads_as_it_is(tmp_path: Path) -> None:
    """No --model on llama.cpp: the default GGUF repo (pointed at the local hub) is downloaded, one
    quantization of it, and llama-server loads that file; nothing is converted."""
    from tests.hub import LocalHub
    from tests.test_models import completes, server_env, start, stop

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "tiny-q8_0.gguf").symlink_to(bundled_gguf())
    (repo / "tiny-f16.gguf").write_bytes(b"GGUF not this one")
    (repo / "README.md").write_text("a GGUF repo\n")
    hub_id = "ember-test/Tiny-GGUF"
    hf_home = tmp_path / "hf"
    binary = server_binary()
    assert binary is not None
    env = server_env(
        hf_home, EMBER_DEFAULT_MODEL=hub_id, EMBER_ENGINE="llamacpp", EMBER_CACHE_DIR=str(tmp_path / "cache"),
        EMBER_LLAMA_SERVER=str(binary),  # the build lives in the real cache
    )
    with LocalHub({hub_id: repo}) as hub:
        env["HF_ENDPOINT"] = hub.url
        client = await start(env, tmp_path / "server.log")
        try:
            current = await wait_ready(client, 120)
            assert current["engine"]["model"] == hub_id and current["engine"]["kind"] == "llamacpp"
            assert current["engine"]["model_why"] == "$EMBER_DEFAULT_MODEL", current["engine"]  # the choice made at start
            await completes(client)
        finally:
            await stop(client)
        fetched = [r for r in hub.requests if r.startswith("GET ") and "/resolve/" in r]
        assert fetched and all(r.endswith("/tiny-q8_0.gguf") for r in fetched), hub.requests
    assert not (tmp_path / "cache" / "models").exists(), "a GGUF file was converted"
    assert (tmp_path / "cache" / "tokenizers").is_dir()
