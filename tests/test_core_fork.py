"""engine/core_fork.py: vLLM's engine core forked from a fork server that imported vLLM early.

The fence around vLLM's private ``get_mp_context`` fails here first when vLLM changes; the fork
server's environment handling runs in a child interpreter of its own (a fork server is
process-wide); the session's real servers show that their engine cores were forked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import core_fork

ROOT = Path(__file__).resolve().parents[1]


def test_vllm_starts_its_engine_core_with_the_context_of_get_mp_context() -> None:
    """What :func:`engine.core_fork.install` replaces is still what vLLM's engine-core manager
    asks for its process (if this fails, vLLM changed: the engine core would be spawned again).
    Read from vLLM's source rather than imported: importing vLLM here would cost the suite ~15 s."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "engine" / "utils.py").read_text()
    assert "from vllm.utils.system_utils import get_mp_context" in source
    manager = source[source.index("class CoreEngineProcManager") :]
    manager = manager[: manager.index("\nclass ")]
    assert "context = get_mp_context()" in manager and "context.Process(" in manager


def test_the_preload_is_vllms_own_for_a_cpu() -> None:
    """torch's OpenMP runtime is preloaded as vLLM's CPU platform does it; one already preloaded is kept."""
    preload = core_fork.cpu_ld_preload("")
    libgomp = [part for part in preload.split(":") if "libgomp" in part]
    assert len(libgomp) == 1 and Path(libgomp[0]).is_file() and "torch" in libgomp[0]
    assert "libgomp" not in core_fork.cpu_ld_preload("/opt/intel/libiomp5.so").replace("/opt/intel/libiomp5.so", "")


CHILD = """
import json, os, sys, multiprocessing.forkserver as fs
from engine import core_fork

def report(path):
    with open(path, "w") as f:
        json.dump({"marker": os.environ.get("EMBER_TEST_MARKER"), "parent": os.getppid()}, f)

if __name__ == "__main__":
    core_fork.PRELOAD[:] = ["engine.core_fork"]  # vLLM's modules are not needed to fork a function
    assert core_fork.prestart()
    os.environ["EMBER_TEST_MARKER"] = "set after the fork server started"
    results = []
    for name in ("forked", "spawned"):
        if name == "spawned":
            os.environ["LD_PRELOAD"] = "/nonexistent/libchanged.so"  # as if vLLM added a library
        process = core_fork.engine_core_context().Process(target=report, args=(sys.argv[1] + name,))
        process.start()
        process.join(60)
        with open(sys.argv[1] + name) as f:
            results.append({"name": name, **json.load(f), "exitcode": process.exitcode})
    print(json.dumps({"script": os.getpid(), "children": results}))
"""


def test_the_engine_core_gets_the_environment_of_start_and_spawns_when_ld_preload_changed(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), core_fork.SWITCH: "1"}
    env.pop("LD_PRELOAD", None)
    command = [sys.executable, str(script), str(tmp_path / "out-")]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    forked, spawned = out["children"]
    # Both see the variable set after the fork server started, as a spawned process would.
    assert forked["marker"] == spawned["marker"] == "set after the fork server started"
    assert forked["exitcode"] == spawned["exitcode"] == 0
    # The forked one is the fork server's child; the spawned one (LD_PRELOAD changed) the script's.
    assert forked["parent"] != out["script"] and spawned["parent"] == out["script"]


def test_switched_off_or_without_the_cpu_build_nothing_is_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(core_fork.SWITCH, "0")
    assert not core_fork.wanted()
    monkeypatch.setenv(core_fork.SWITCH, "1")
    assert core_fork.wanted() == core_fork.cpu_build()


@pytest.mark.slow
async def test_the_session_servers_engine_core_was_forked_from_the_fork_server(tcp_ember) -> None:
    """The session's ``ember --tcp``, once its engine is ready: the engine core's parent is the
    fork server, not the server (a fallback to spawn, for instance with a preload that differs
    from vLLM's, fails here), and it is called VLLM::EngineCore as a spawned one is."""
    from tests.conftest import wait_ready
    from tests.test_engine_faults import engine_core
    from tests.test_tcp import connect, disconnect

    client = await connect(tcp_ember.address)
    try:
        await wait_ready(client)
    finally:
        await disconnect(client)
    core = engine_core(tcp_ember.pid)
    assert "EngineCore" in core.name()
    fork_server = core.parent()
    assert fork_server is not None and fork_server.pid != tcp_ember.pid and "forkserver" in " ".join(fork_server.cmdline())
    assert fork_server.ppid() == tcp_ember.pid


TOKENIZERS_CHILD = """
import json, sys, threading, types
from engine import core_fork
from engine.models import resolve_bundled
import vllm.tokenizers.hf as hf
import vllm.tokenizers.detokenizer_utils as detokenizer_utils
import vllm.v1.structured_output as structured_output
from transformers import AutoTokenizer

folder = resolve_bundled().path
plain = AutoTokenizer.from_pretrained(folder)
text = "def total_weight(items):\\n    return sum(i.weight for i in items)"

# The renderer's pool: empty until an engine core was started, then vLLM's number of copies.
# Qwen2's tokenizer keeps its vocabulary and merges as Python tables too; SmolLM2's is given some.
tables = AutoTokenizer.from_pretrained(folder)
tables._vocab, tables._merges = tables.get_vocab(), [("a", "b")] * 1000
pooled = core_fork.deferred_tokenizer_pool(hf.maybe_make_thread_pool)(tables, 2)
pool, original = core_fork._pool_of(pooled)
before = pool.qsize()
marker_before = getattr(pooled, detokenizer_utils._CACHED_MARKER_KEY, "absent")
same_while_empty = pooled.encode(text) == plain.encode(text)  # a borrower makes its own copy
core_fork._core_started.set()
for _ in range(200):
    if pool.qsize() >= 3:
        break
    threading.Event().wait(0.05)

# The marker from the pre-tokenizer alone is vLLM's from the whole tokenizer, for a byte-level BPE
# (SmolLM2's: None) and for a SentencePiece-style Metaspace one.
from tokenizers import Tokenizer, models, pre_tokenizers
metaspace = Tokenizer(models.BPE())
metaspace.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(replacement="▁")])
markers = []
for backend in (plain.backend_tokenizer, metaspace):
    ours, theirs = types.SimpleNamespace(backend_tokenizer=backend), types.SimpleNamespace(backend_tokenizer=backend)
    core_fork.cache_leading_space_marker(ours)
    markers.append([getattr(ours, detokenizer_utils._CACHED_MARKER_KEY), detokenizer_utils.get_leading_space_marker(theirs)])
after = pool.qsize()
copy_shares = sum(pool.get().__dict__.get("_vocab") is original._vocab for _ in range(after))

# The engine core's tokenizer: loaded once, by the prefetch, and handed to the manager's call.
loads = []
load = structured_output.cached_tokenizer_from_config
def counted(model_config, **kwargs):
    loads.append(threading.current_thread().name)
    return load(model_config=model_config, **kwargs)
structured_output.cached_tokenizer_from_config = counted
model_config = types.SimpleNamespace(
    tokenizer=folder, runner_type="generate", tokenizer_mode="auto", tokenizer_revision=None,
    trust_remote_code=False, skip_tokenizer_init=False, hf_config=None,
)
core_fork.prefetch_tokenizer(types.SimpleNamespace(model_config=model_config))
given = structured_output.cached_tokenizer_from_config(model_config=model_config)
print(json.dumps({
    "before": before, "after": after, "marker_before": marker_before,
    "marker_after": getattr(pooled, detokenizer_utils._CACHED_MARKER_KEY, "absent"), "same_while_empty": same_while_empty,
    "same_after": pooled.encode(text) == plain.encode(text), "original": type(original).__name__,
    "loads": loads, "prefetched_encodes": given.encode(text) == plain.encode(text),
    "markers": markers, "copy_shares": copy_shares,
}))
"""


def test_the_tokenizer_copies_and_the_engine_cores_tokenizer_are_made_off_the_way_to_ready(tmp_path: Path) -> None:
    """The two tokenizer patches work on the vLLM installed (if this fails, vLLM changed the
    renderer's pool or the structured-output manager's loader: the cold start pays them again, or
    worse). In a child interpreter: importing vLLM's tokenizers here would cost the suite's process."""
    script = tmp_path / "tokenizers_child.py"
    script.write_text(TOKENIZERS_CHILD)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # Empty at first (a borrower made one copy and gave it back), filled to the two copies asked for;
    # the space marker vLLM's first log-probabilities need is worked out by then (None: a byte-level BPE).
    assert out["before"] == 0 and out["after"] == 3
    assert out["marker_before"] == "absent" and out["marker_after"] is None
    # The two copies made off the way share the vocabulary (the borrower's own copy, vLLM's, does not).
    assert out["markers"] == [[None, None], ["▁", "▁"]] and out["copy_shares"] == 2
    assert out["same_while_empty"] and out["same_after"] and out["original"] != "NoneType"
    # One load, in the prefetch thread; the manager's call got its result.
    assert out["loads"] == ["ember-tokenizer-prefetch"] and out["prefetched_encodes"]


def test_the_patched_vllm_functions_are_where_ember_replaces_them() -> None:
    """The names ember replaces are the ones vLLM calls (read from vLLM's source, not imported)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    vllm_dir = Path(spec.origin).parent
    renderer = (vllm_dir / "renderers" / "hf.py").read_text()
    assert "from vllm.tokenizers.hf import HfTokenizer, maybe_make_thread_pool" in renderer
    assert "maybe_make_thread_pool(\n                self.tokenizer," in renderer
    detokenizer = (vllm_dir / "tokenizers" / "detokenizer_utils.py").read_text()
    assert "marker = get_leading_space_marker(tokenizer)" in detokenizer
    assert "setattr(tokenizer, _CACHED_MARKER_KEY, result)" in detokenizer
    output = (vllm_dir / "v1" / "engine" / "async_llm.py").read_text()
    assert "self.output_processor = OutputProcessor(\n            renderer.tokenizer," in output
    manager = (vllm_dir / "v1" / "structured_output" / "__init__.py").read_text()
    assert "from vllm.tokenizers import cached_tokenizer_from_config" in manager
    assert "self.tokenizer = cached_tokenizer_from_config(\n                model_config=self.vllm_config.model_config" in manager
