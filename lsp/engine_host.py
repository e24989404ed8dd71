"""The engine host: the process-wide :class:`EmberCore` (the engine, the completion caches, the
metrics) that every editor connection of this process shares, and ending the process with it.

No pygls here: the daemon and the TCP server build one core and many sessions on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import psutil

from engine.base import Engine, EngineCounters, EngineError
from engine.loading import LoadProgress, ResolvedModel
from engine.models import EngineChoice, choose_engine
from lsp.completer import Completer
from lsp.config import Settings, vllm_flags
from lsp.metrics import Metrics
from lsp.workspaces import IndexRegistry

log = logging.getLogger(__name__)

# An engine that served this long before it died is restarted after 1 s again, not after the
# doubled wait of a crash loop (1, 2, 4 ... 60 s).
STABLE_S = 60.0


class EmberCore:
    """Process-wide state: the engine, the completion caches and the metrics.

    ``long_lived``: this process serves editors for hours (TCP server, per-user daemon), so the
    embedded engine may spend longer starting for faster decoding (compiled mode on the CPU);
    over stdio, one editor waits for the start and eager mode stays."""

    def __init__(
        self,
        settings: Settings,
        engine_factory: Callable[[Settings, LoadProgress], Engine] | None = None,
        *,
        long_lived: bool = False,
    ) -> None:
        self.settings = settings
        self.long_lived = long_lived
        self._engine_factory = engine_factory or functools.partial(default_engine_factory, long_lived=long_lived)
        # Written by the worker thread that builds the engine, read by report_loading.
        self.load_progress = LoadProgress()
        self.engine: Engine | None = None
        self.engine_error: str | None = None
        # The engine runs, but not as asked (engine arguments rejected or not applicable): shown
        # to every editor once the engine is ready, and in ember/stats.
        self.engine_warning: str | None = None
        self._start_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._engine_settings = settings
        self._backoff_s = 1.0
        self._serving_since: float | None = None  # monotonic time the engine became ready
        self.restarts = 0
        self.engine_starts = 0
        self._retired = EngineCounters()  # what the engines replaced since the start counted
        # Which embedded engine serves and why (None with an engine URL: the remote server is it).
        self.engine_choice: EngineChoice | None = None if settings.engine_url else choose_engine(settings.engine, settings.model)
        # What the process serving this core says of itself in ember/stats (the daemon sets it).
        self.host_info: Callable[[], dict[str, Any]] | None = None
        # The workspace folders' indexes, shared by the sessions (editors) that have them open.
        self.indexes = IndexRegistry()
        self.metrics = Metrics()
        self.memory_baseline: tracemalloc.Snapshot | None = None
        self.completer = Completer(lambda: self.engine, self.metrics)

    @property
    def ready(self) -> bool:
        """The engine is up and answering (a dead one is not ready; :meth:`check_engine` replaces it)."""
        return self.engine is not None and self.engine.ready and not self.engine.dead

    def check_engine(self) -> bool:
        """Whether the engine is ready; a dead engine is replaced in the background (see
        :meth:`restart_engine`), so the request path calls this rather than reading :attr:`ready`."""
        if self.engine is not None and self.engine.dead:
            self.restart_engine()
            return False
        return self.ready

    def engine_counters(self) -> dict[str, int]:
        """Every engine's counters since this process started (the replaced engines' included), and
        how often ember restarted a dead one: what ``ember/stats`` and Prometheus show."""
        current = self.engine.engine_stats().counters if self.engine is not None else EngineCounters()
        return {**dataclasses.asdict(self._retired + current), "restarts": self.restarts}

    @property
    def engine_settings(self) -> Settings:
        """The settings the engine was (or is being) started with."""
        return self._engine_settings

    @property
    def restarting(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    def restart_engine(self) -> None:
        """Replace a dead engine, waiting longer after each failure (1 s, 2 s, 4 s ... 60 s)."""
        if self._restart_task is not None and not self._restart_task.done():
            return
        dead, self.engine = self.engine, None
        self.engine_error = "the engine process died; restarting it"
        if dead is not None:
            self._retired += dead.engine_stats().counters
        if self._serving_since is not None and time.monotonic() - self._serving_since >= STABLE_S:
            self._backoff_s = 1.0  # it served a while: a kill now and then, not a crash loop
        self._serving_since = None

        log.error("engine died; restarting in %.0f s", self._backoff_s)

        async def restart() -> None:
            if dead is not None:
                await dead.close()
            await asyncio.sleep(self._backoff_s)
            self._backoff_s = min(60.0, self._backoff_s * 2)
            self._start_task = None
            await self.start_engine(self._engine_settings)
            if self.engine is not None:
                self.restarts += 1

        self._restart_task = asyncio.get_running_loop().create_task(restart())

    def start_engine(self, settings: Settings | None = None) -> asyncio.Task[None]:
        """Start loading the model once; later calls return the same task."""
        if self._start_task is None:
            self._engine_settings = settings or self.settings
            if not self._engine_settings.engine_url:
                self.engine_choice = choose_engine(self._engine_settings.engine, self._engine_settings.model)
            stage = "loading" if self._engine_settings.engine_url else "resolving"
            self.load_progress.set(stage, model_label(self._engine_settings))
            self._start_task = asyncio.get_running_loop().create_task(self._start(self._engine_settings))
        return self._start_task

    async def _start(self, settings: Settings) -> None:
        self.engine_starts += 1
        try:
            engine = await asyncio.to_thread(self._engine_factory, settings, self.load_progress)
            await engine.start()
            self.engine = engine
            self._serving_since = time.monotonic()
            self.engine_error = None
            notes = (remote_engine_args_note(settings), engine.warning)
            self.engine_warning = "; ".join(note for note in notes if note) or None
        except Exception as exc:  # noqa: BLE001 - the reason reaches the editor through progress and messages
            self.engine_error = str(exc)
            log.error("engine failed to start: %s", exc)

    async def wait_ready(self) -> bool:
        if self._restart_task is not None and not self._restart_task.done():
            await asyncio.shield(self._restart_task)
        if self._start_task is not None:
            await asyncio.shield(self._start_task)
        return self.check_engine()

    async def close(self) -> None:
        for task in (self._start_task, self._restart_task):
            if task is not None and not task.done():
                task.cancel()
        if self.engine is not None:
            await self.engine.close()


def model_label(settings: Settings) -> str:
    """What the editor is told is loading before the model is resolved."""
    if settings.engine_url:
        return ",".join(settings.engine_url)
    return settings.model or "the default code model"


def remote_engine_args_note(settings: Settings) -> str | None:
    """Engine arguments are the embedded engine's: a remote server was started with its own."""
    if not (settings.engine_url and settings.engine_args):
        return None
    return (
        "engineArgs are ignored with engineUrl: the remote server has its own; start it with "
        f"{vllm_flags(settings.engine_arg_dict())}"
    )


def default_engine_factory(settings: Settings, progress: LoadProgress, *, long_lived: bool = False) -> Engine:
    """Remote when an engine URL is configured, else the embedded engine that
    :func:`engine.models.choose_engine` picks: llama.cpp (a GGUF file, loaded as it is) or vLLM
    (resolving the model may download it or convert a GGUF file: this runs in a worker thread,
    telling ``progress``)."""
    if settings.engine_url:
        from engine.remote import RemoteEngine
        from engine.routing import RemoteConfig

        deadline_s = settings.timeout_ms / 1000
        return RemoteEngine(
            RemoteConfig(
                settings.engine_url,
                settings.model,
                # Fail over to another replica early enough to still answer within the deadline; one
                # URL (a lone server, or a router that fails over itself) may take all of it.
                first_token_timeout=max(2.0, deadline_s / 3) if len(settings.engine_url) > 1 else deadline_s,
                read_timeout=max(5.0, deadline_s / 2),
            )
        )
    choice = choose_engine(settings.engine, settings.model)
    log.info("engine: %s (%s)", choice.kind, choice.reason)
    if choice.kind == "llamacpp":
        return llamacpp_engine(settings, progress)
    from engine.embedded import EmbeddedConfig, EmbeddedEngine, eager_on_cpu, prestart
    from engine.models import resolve_model

    config = EmbeddedConfig(
        model_path="",  # resolved below
        model_name="",
        prefix_caching=settings.prefix_cache,
        long_lived=long_lived,
        engine_args=settings.engine_arg_dict(),
    )
    prestart(eager_on_cpu(config))  # the engine core's imports begin beside resolving the model
    model = resolve_reported(resolve_model, settings.model, progress, then="loading")
    config = dataclasses.replace(config, model_path=model.path, model_name=model.name)
    return EmbeddedEngine(config, on_stage=lambda stage: progress.set(stage, model.name))


def resolve_reported(
    resolve: Callable[..., ResolvedModel], spec: str | None, progress: LoadProgress, *, then: str
) -> ResolvedModel:
    """``resolve(spec)``, logged, its fallback told to the editor, and the load's next stage set."""
    started = time.monotonic()
    model = resolve(spec, progress=progress)
    log.info("model %s (%s: %s), resolved in %.1f s", model.name, model.source, model.path, time.monotonic() - started)
    if model.fallback_reason:
        progress.set_fallback(model.fallback_reason)
    if model.chosen_because:
        progress.set_chosen_because(model.chosen_because)
    progress.set(then, model.name)
    return model


def llamacpp_engine(settings: Settings, progress: LoadProgress) -> Engine:
    """llama.cpp's server on the model's GGUF file (found, or fetched from a GGUF repo; never converted)."""
    from engine.llama_build import find_server
    from engine.llamacpp import LlamaCppConfig, LlamaCppEngine
    from engine.models import resolve_gguf

    server = find_server()  # before the model: a user without a server learns it before a download
    if server.path is None:
        raise EngineError(f"{server.why}; or pass --engine vllm")
    model = resolve_reported(resolve_gguf, settings.model, progress, then="starting")
    config = LlamaCppConfig(gguf=model.path, model_name=model.name, engine_args=settings.engine_arg_dict(), server=server)
    return LlamaCppEngine(config)


async def close_and_exit(core: EmberCore, code: int, grace_s: float = 4.0) -> None:
    """Stops the engine (and its child processes), then ends the process: the stdin reader thread
    is blocked in a read, so a normal interpreter exit would wait for the editor to close the pipe."""
    threading.Timer(grace_s + 1.0, os._exit, (code,)).start()  # in case closing hangs
    try:
        async with asyncio.timeout(grace_s):
            await core.close()
    except BaseException as exc:  # noqa: BLE001 - exiting regardless
        log.warning("engine did not close cleanly: %r", exc)
    finally:
        kill_children()
        logging.shutdown()
        os._exit(code)


def kill_children() -> None:
    """Whatever the engine left behind (its core process, a resource tracker) dies with us: an
    orphaned engine would hold gigabytes after the editor quit."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if children:
        log.info("killed %d leftover child processes", len(children))
        psutil.wait_procs(children, timeout=1.0)
