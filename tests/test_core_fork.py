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
