"""One completion, from a document and cursor to the text to insert.

The straight path: context.prompt.site.site_at (the cursor's site, once) -> the settings' strategy
(context.prompt.strategy) builds the prompt -> (caches) -> engine.stream -> the strategy's cutter stops the
stream and gives the text. Shared by every editor session of the process. What it remembers per
document lives in that session's :class:`DocumentState`: the last suggestion (typed-through reuse)
and the generation in flight (a newer request either attaches to it or supersedes it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from cachetools import LRUCache

from context.cut.confidence import Calibration, TokenTrace, Verdict, calibration_for, judge
from context.prompt.builder import Prompt
from context.prompt.fim import FimTemplate, choose_template
from context.prompt.site import CompletionSite, site_at
from context.prompt.snippets import NO_CROSS_FILE, CrossFile
from context.prompt.strategy import Cutter, Strategy, strategy
from context.source.document import Document
from engine.base import Engine, EngineError, EngineNotReady, GenerationParams
from lsp.config import Settings
from lsp.metrics import Metrics, RequestMetrics

log = logging.getLogger(__name__)

_REUSE_CONTEXT = 256


@dataclass
class Cursor:
    """The text around a cursor, to tell whether a later cursor is the same place plus typing."""

    offset: int
    before: str
    after: str

    @classmethod
    def at(cls, text: str, offset: int) -> Cursor:
        return cls(offset, text[max(0, offset - _REUSE_CONTEXT) : offset], text[offset : offset + _REUSE_CONTEXT])

    def typed_since(self, text: str, offset: int) -> str | None:
        """What the user typed at this cursor to reach ``offset`` in ``text``; None if it moved."""
        if offset < self.offset or not text[: self.offset].endswith(self.before):
            return None
        if text[offset : offset + len(self.after)] != self.after:
            return None
        return text[self.offset : offset]


@dataclass(eq=False)
class Running:
    """A generation in flight for one document."""

    state: DocumentState
    cursor: Cursor
    cutter: Cutter
    cache_key: str  # where the final text goes in the completion cache
    calibration: Calibration | None = None  # the model family's, for the confidence of what is shown
    min_confidence: float = 0.0
    on_text: Callable[[str], None] | None = None  # the request's listener for streamed text
    task: asyncio.Task[bool] = field(init=False)
    final: str | None = None  # the post-processed text once the generation ended
    confidence: float | None = None  # the final text's, once the generation ended
    why_empty: str = ""  # why the final text is empty, when it is
    cut_by_deadline: bool = False  # then the final text is not what the model would answer: not cached
    attached: int = 0  # later requests waiting on this generation
    grew: asyncio.Event = field(default_factory=asyncio.Event)  # set when the text changes
    trace: TokenTrace = field(default_factory=TokenTrace)  # the sampled tokens' log-probabilities

    def text(self) -> str:
        """The post-processed text so far, as much of it as is confident enough to show; the
        final text once the generation ended."""
        if self.final is not None:
            return self.final
        preview = self.cutter.preview()
        return self.verdict(preview).text if preview else ""

    def verdict(self, text: str) -> Verdict:
        return judge(text, self.cutter.raw, self.trace, self.calibration, self.min_confidence)

    def changed(self) -> None:
        self.grew.set()
        if self.on_text is not None:
            self.on_text(self.text())


@dataclass
class Completion:
    text: str
    metrics: RequestMetrics


@dataclass(frozen=True)
class Answer:
    """A finished generation's text, as the completion cache keeps it ("" for a hidden one,
    with why it is empty)."""

    text: str
    confidence: float | None
    why_empty: str = ""


WHY_LOADING = "the model is still loading"
WHY_SUPERSEDED = "a newer request for this document replaced it"


@dataclass
class Typing:
    last_request: float = 0.0
    interval_ms: float | None = None  # moving average of the time between requests


@dataclass(eq=False)
class DocumentState:
    """Everything ember keeps for one document one editor session has open: the document, the
    last suggestion (typed-through reuse), the generation in flight, the typing rate, the warm-up
    waiting for a pause, and the context retrieved from other files. Two sessions that open the
    same uri have a state each. :meth:`stop` ends its work (shutdown), :meth:`close` forgets it too."""

    document: Document
    suggestion: tuple[Cursor, Answer] | None = None
    running: Running | None = None
    typing: Typing = field(default_factory=Typing)
    warmup: asyncio.Task[None] | asyncio.TimerHandle | None = None  # a timer until the pause has passed
    retrieved: tuple[Hashable, CrossFile] | None = None  # (what it was retrieved for, the context)
    retrieving: asyncio.Task[CrossFile] | None = None

    def stop(self) -> None:
        for task in (self.running.task if self.running else None, self.warmup, self.retrieving):
            if task is not None:
                task.cancel()

    def close(self) -> None:
        self.stop()
        self.suggestion = self.running = self.warmup = self.retrieved = self.retrieving = None


@dataclass
class Completer:
    engine_source: Callable[[], Engine | None]
    metrics: Metrics
    cache_bytes: int = 8 << 20
    cache: LRUCache[str, Answer] = field(init=False)
    _active: set[Running] = field(init=False, default_factory=set)  # generations in flight, every document's
    _template: tuple[str, FimTemplate] | None = field(init=False, default=None)
    _warming: set[asyncio.Task[None]] = field(init=False, default_factory=set)  # warm-up prefills in flight
    _warm_turn: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        # Bounded in bytes; each entry costs its text plus a fixed overhead, so entries are bounded too.
        self.cache = LRUCache(maxsize=self.cache_bytes, getsizeof=lambda answer: len(answer.text) + 256)
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ bookkeeping

    @property
    def busy(self) -> bool:
        return any(not running.task.done() for running in self._active)

    def template_for(self, engine: Engine, override: str | None) -> FimTemplate:
        key = f"{engine.model.name}|{override}"
        if self._template is None or self._template[0] != key:
            self._template = (key, choose_template(engine.model.special_tokens, engine.model.name, override))
        return self._template[1]

    def debounce_s(self, typing: Typing, settings: Settings) -> float:
        """How long to wait before generating: up to ``debounce_ms``, shorter when the user types
        slower than that (a pause is the signal, not a fixed timer)."""
        now = time.monotonic()
        if typing.last_request:
            gap_ms = (now - typing.last_request) * 1000
            if gap_ms < 2000:
                typing.interval_ms = gap_ms if typing.interval_ms is None else 0.7 * typing.interval_ms + 0.3 * gap_ms
        typing.last_request = now
        if settings.debounce_ms <= 0:
            return 0.0
        if typing.interval_ms is None:
            return settings.debounce_ms / 1000
        return min(settings.debounce_ms, 1.2 * typing.interval_ms) / 1000

    # ------------------------------------------------------------------ completion

    async def complete(
        self,
        state: DocumentState,
        offset: int,
        settings: Settings,
        *,
        cross_file: CrossFile = NO_CROSS_FILE,
        on_text: Callable[[str], None] | None = None,
    ) -> Completion:
        """The text to insert at ``offset``; "" when there is nothing useful (engine trouble does not
        raise: the reason is in ``metrics.outcome`` and the log). Cancelling the caller's task
        cancels the generation (and the engine-side request) unless another request attached to it."""
        started = time.perf_counter()
        doc = state.document
        metrics = RequestMetrics(uri=doc.uri)
        text = doc.text
        running = state.running

        if settings.reuse:
            reused = await self._reuse(state, running, text, offset, metrics)
            if reused is not None:
                return self._done(state, Cursor.at(text, offset), reused, metrics, started)
        if running is not None:
            running.task.cancel()  # superseded by this request

        delay = self.debounce_s(state.typing, settings)
        if delay:
            await asyncio.sleep(delay)  # a newer request cancels this one meanwhile

        engine = self.engine_source()
        if engine is None or not engine.ready:
            metrics.outcome, metrics.why_empty = "loading", WHY_LOADING
            return Completion("", metrics.finish(started))

        site = site_at(doc, offset, cross_file)
        metrics.mode = site.mode
        metrics.cross_file = [snippet.path for snippet in cross_file.snippets]
        metrics.cross_file_why = [f"{snippet.path}: {reason}" for snippet in cross_file.snippets for reason in snippet.reasons]
        chosen = strategy(settings.prompt_strategy, settings.postprocess)
        prompt = self._prompt(engine, site, settings, chosen)
        if not prompt.text:  # an empty document and a prefix-only model: nothing to continue (vLLM refuses it)
            metrics.outcome, metrics.why_empty = "empty", "nothing before the cursor to continue"
            return Completion("", metrics.finish(started))
        metrics.layout = prompt.layout
        metrics.layout_fallback = settings.fim_layout == "append" and prompt.layout == "classic"
        cache_key = _cache_key(prompt, site.mode, settings, site.suffix)
        cached = self.cache.get(cache_key) if settings.reuse else None
        if cached is not None:
            metrics.cache_hit = True
            metrics.confidence, metrics.why_empty = cached.confidence, cached.why_empty
            return self._done(state, Cursor.at(text, offset), cached.text, metrics, started)

        template = self.template_for(engine, settings.fim_template)
        calibration = calibration_for(template.name, engine.model.name, *engine.model.origins)
        this = Running(
            state, Cursor.at(text, offset), chosen.cutter(site, prompt), cache_key, calibration,
            min_confidence_for(settings, calibration), on_text,
        )
        self._stop_warmups()
        this.task = asyncio.ensure_future(self._generate(engine, prompt, this, settings, metrics, started))
        state.running = this
        self._active.add(this)
        this.task.add_done_callback(lambda _: self._active.discard(this))
        early_s = settings.early_answer_ms / 1000 if site.mode == "multi" and settings.early_answer_ms > 0 else None
        return await self._answer(this, early_s, metrics, started)

    async def _answer(self, this: Running, early_s: float | None, metrics: RequestMetrics, started: float) -> Completion:
        """The generation's answer, or with ``early_s`` its complete lines once that much time passed."""
        generation_started = time.perf_counter()
        detached = False
        try:
            shown = await self._first_lines(this, early_s)
            if shown is not None:
                # Show the lines that are complete; the engine goes on and its result lands in the
                # cache and the suggestion, for typed-through reuse after the user accepts these.
                detached = True
                this.task.add_done_callback(lambda task: self._finish_late(this, shown))
                if this.on_text is not None:
                    this.on_text(shown)
                answered = dataclasses.replace(metrics)  # the generation keeps updating ``metrics``
                answered.engine_ms = (time.perf_counter() - generation_started) * 1000
                return self._done(this.state, this.cursor, shown, answered, started)
            generated = this.task.result()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                if not this.attached:
                    this.task.cancel()  # $/cancelRequest: stop the engine-side generation too
                raise
            metrics.outcome, metrics.why_empty = "superseded", WHY_SUPERSEDED
            return Completion("", metrics.finish(started))
        finally:
            if not detached and this.state.running is this:
                this.state.running = None
        if not generated:  # an engine error or not ready: recorded, so that ember/stats says why
            return self._done(this.state, this.cursor, "", metrics, started)
        final = this.text()
        self._cache(this, final)
        return self._done(this.state, this.cursor, final, metrics, started)

    def _cache(self, this: Running, final: str) -> None:
        if not this.cut_by_deadline:  # the next request may find the engine faster
            self.cache[this.cache_key] = Answer(final, this.confidence, this.why_empty)

    async def _reuse(
        self, state: DocumentState, running: Running | None, text: str, offset: int, metrics: RequestMetrics
    ) -> str | None:
        """An answer without a new generation: the rest of the last suggestion when the user typed
        its beginning, or of the generation in flight when the user typed what it is producing."""
        reused = self._typed_through(state, text, offset)
        if reused is not None:
            metrics.cache_hit = True
            metrics.confidence = reused.confidence
            return reused.text
        attached = await self._attach(running, text, offset) if running is not None else None
        if attached is not None:
            metrics.cache_hit = True
            metrics.outcome = "attached"
        return attached

    async def _first_lines(self, this: Running, early_s: float | None) -> str | None:
        """Waits for the generation; returns None when it is done. With ``early_s``, once that much
        time has passed, returns the complete lines generated so far as soon as there is one.
        Like ``asyncio.shield``: cancelling the caller does not cancel the generation."""
        if early_s is None:
            await asyncio.wait({this.task})
            return None
        done, _ = await asyncio.wait({this.task}, timeout=early_s)
        while not done:
            lines = complete_lines(this.text())
            if lines:
                return lines
            this.grew.clear()
            grew = asyncio.ensure_future(this.grew.wait())
            try:
                done, _ = await asyncio.wait({this.task, grew}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                grew.cancel()
            done.discard(grew)
        return None

    def _finish_late(self, this: Running, shown: str) -> None:
        """The generation behind an early answer ended: cache its full text, and let the shown
        suggestion grow to it unless a newer one replaced it."""
        state = this.state
        if state.running is this:
            state.running = None
        if this.task.cancelled() or this.task.exception() is not None or not this.task.result():
            return
        final = this.text()
        self._cache(this, final)
        last = state.suggestion
        if last is not None and last[1].text == shown and final.startswith(shown):
            state.suggestion = (last[0], Answer(final, this.confidence))

    def prompt_for(
        self, engine: Engine, doc: Document, offset: int, settings: Settings, cross_file: CrossFile = NO_CROSS_FILE
    ) -> Prompt:
        """The prompt a completion at ``offset`` would send (the benchmarks read it too)."""
        chosen = strategy(settings.prompt_strategy, settings.postprocess)
        return self._prompt(engine, site_at(doc, offset, cross_file), settings, chosen)

    def _prompt(self, engine: Engine, site: CompletionSite, settings: Settings, chosen: Strategy) -> Prompt:
        template = self.template_for(engine, settings.fim_template)
        budget = settings.budget_for(engine.model.max_model_len)
        return chosen.prompt(site, template, engine.tokenizer, budget, settings.fim_layout)

    async def warm(self, doc: Document, offset: int, settings: Settings, cross_file: CrossFile = NO_CROSS_FILE) -> bool:
        """Prefill the stable part of the prompt at ``offset`` (one output token) so the next real
        request only prefills its tail. Never competes with a completion: skipped while one runs,
        stopped when one starts, and one warm-up at a time (opening several documents at once
        would otherwise queue a prefill each on the engine ahead of the user's first request)."""
        engine = self.engine_source()
        if engine is None or not engine.ready or self.busy or not settings.warmup:
            return False
        prompt = self.prompt_for(engine, doc, offset, settings, cross_file)
        stable = prompt.text[: prompt.stable_chars]
        if len(stable) < 64:
            return False
        async with self._warm_turn:
            if self.busy:
                return False
            request_id = f"ember-warm-{next(self._ids)}"
            prefill = asyncio.ensure_future(self._prefill(engine, stable, request_id, prompt.key.routing_key))
            self._warming.add(prefill)
            try:
                await prefill
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
                log.debug("warm-up %s gave way to a completion", request_id)
                return False
            except EngineError as exc:
                log.debug("warm-up %s failed: %s", request_id, exc)
                return False
            finally:
                self._warming.discard(prefill)
        return True

    async def _prefill(self, engine: Engine, text: str, request_id: str, routing_key: str) -> None:
        params = GenerationParams(max_tokens=1, failover=False, warm_up=True)
        async for _ in engine.stream(text, params, request_id, routing_key=routing_key):
            pass

    def _stop_warmups(self) -> None:
        """A completion is about to reach the engine: the warm-ups in flight give it the engine
        (cancelling a stream aborts its request on the engine, embedded or remote)."""
        for prefill in self._warming:
            prefill.cancel()

    async def _attach(self, running: Running, text: str, offset: int) -> str | None:
        """When the user typed what the generation in flight is producing, wait for it instead of
        starting over, and answer with the rest."""
        typed = running.cursor.typed_since(text, offset)
        if typed is None or running.task.done() or not running.text().startswith(typed):
            return None
        running.attached += 1
        try:
            generated = await asyncio.shield(running.task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            return None
        finally:
            running.attached -= 1
        final = running.text()
        if not generated or not final.startswith(typed) or len(final) <= len(typed):
            return None
        return final[len(typed) :]

    async def _generate(
        self, engine: Engine, prompt: Prompt, this: Running, settings: Settings, metrics: RequestMetrics, started: float
    ) -> bool:
        """Streams the completion through ``this.cutter``; False when the engine gave nothing
        usable (the reason is in ``metrics.outcome``)."""
        request_id = f"ember-{next(self._ids)}"
        params = GenerationParams(
            max_tokens=settings.max_tokens, temperature=settings.temperature, stop=prompt.stop, logprobs=True
        )
        engine_started = time.perf_counter()
        try:
            async with asyncio.timeout(settings.timeout_ms / 1000):
                await self._stream(engine, prompt, params, request_id, this, metrics, started)
        except TimeoutError:
            metrics.outcome, this.cut_by_deadline = "timeout", True
            metrics.truncated = True  # cut mid-line, like a length stop
            log.warning("completion %s hit the %d ms deadline; returning what was generated", request_id, settings.timeout_ms)
        except EngineNotReady:
            metrics.outcome, metrics.why_empty = "loading", WHY_LOADING
            return False
        except EngineError as exc:
            metrics.outcome, metrics.why_empty = "error", f"the engine failed: {exc}"
            log.warning("completion %s failed: %s", request_id, exc)
            return False
        finally:
            metrics.engine_ms = (time.perf_counter() - engine_started) * 1000
        verdict = this.verdict(this.cutter.finish(metrics.truncated))
        this.final, this.confidence = verdict.text, verdict.confidence
        metrics.judged(verdict)
        if not verdict.text:
            this.why_empty = metrics.why_empty = why_empty(verdict, this, metrics, settings.timeout_ms)
            log.info("completion %s is empty: %s", request_id, this.why_empty)
            log.debug("completion %s: the model wrote %r", request_id, this.cutter.seen[:400])
        this.changed()
        return True

    @staticmethod
    async def _stream(
        engine: Engine, prompt: Prompt, params: GenerationParams, request_id: str, this: Running,
        metrics: RequestMetrics, started: float,
    ) -> None:
        stream = engine.stream(prompt.text, params, request_id, routing_key=prompt.key.routing_key)
        try:
            async for chunk in stream:
                if metrics.ttft_ms is None and chunk.text:
                    metrics.ttft_ms = (time.perf_counter() - started) * 1000
                if chunk.prompt_tokens is not None:
                    metrics.prompt_tokens = chunk.prompt_tokens
                    metrics.cached_tokens = chunk.cached_tokens or 0
                metrics.streamed_tokens += chunk.token_count
                this.trace.add(chunk.text, chunk.logprobs)
                stopped = this.cutter.feed(chunk.text)
                # A chunk that hits the token limit may also end the completion: then it is whole.
                if chunk.finish_reason == "length" and not stopped:
                    metrics.truncated = True
                if stopped:
                    break
                this.changed()
        finally:
            # Closing the stream aborts the engine-side request when we stopped early.
            await stream.aclose()

    def _done(self, state: DocumentState, cursor: Cursor, completion: str, metrics: RequestMetrics, started: float) -> Completion:
        if completion:
            state.suggestion = (cursor, Answer(completion, metrics.confidence))
        elif metrics.outcome == "ok":
            metrics.outcome = "empty"
        metrics.finish(started)
        self.metrics.record(metrics)
        log.debug("completion metrics %s", metrics.as_dict())
        return Completion(completion, metrics)

    def _typed_through(self, state: DocumentState, text: str, offset: int) -> Answer | None:
        """The rest of the last suggestion when the user has typed its beginning (with the
        suggestion's confidence)."""
        last = state.suggestion
        if last is None:
            return None
        cursor, suggestion = last
        typed = cursor.typed_since(text, offset)
        if typed is None or not suggestion.text.startswith(typed) or len(typed) >= len(suggestion.text):
            return None
        return Answer(suggestion.text[len(typed) :], suggestion.confidence)


def why_empty(verdict: Verdict, this: Running, metrics: RequestMetrics, timeout_ms: int) -> str:
    """Why a finished generation shows nothing: the deadline, the confidence gate, or the
    post-processing step that left nothing of the model's text."""
    if verdict.action == "hidden":
        return f"its confidence {verdict.confidence or 0:.2f} is below minConfidence {this.min_confidence:.2f}"
    if verdict.action == "degenerate":
        return "the model repeated itself (degenerate repetition is never shown)"
    if metrics.outcome == "timeout" and not this.cutter.seen.strip():
        return f"the engine sent no text within the {timeout_ms} ms deadline (timeoutMs)"
    return this.cutter.why_empty(metrics.truncated)


def min_confidence_for(settings: Settings, calibration: Calibration | None) -> float:
    """The user's ``minConfidence``, else the model family's calibrated default, else 0 (a model
    without a calibration shows everything but degenerate repetition)."""
    if settings.min_confidence is not None:
        return settings.min_confidence
    return calibration.min_confidence if calibration is not None else 0.0


def complete_lines(text: str) -> str:
    """``text`` up to its last line break, when that holds something to show."""
    end = text.rfind("\n")
    return text[:end] if end > 0 and text[:end].strip() else ""


def _cache_key(prompt: Prompt, mode: str, settings: Settings, suffix: str) -> str:
    """The prompt alone is not enough: post-processing trims against the text after the cursor,
    which a prefix-only prompt does not contain."""
    h = hashlib.blake2b(prompt.text.encode("utf-8", "surrogatepass"), digest_size=16)
    h.update(suffix[:_REUSE_CONTEXT].encode("utf-8", "surrogatepass"))
    h.update(prompt.healed.encode("utf-8", "surrogatepass"))  # same prompt text, other re-alignment
    h.update(f"|{mode}|{settings.max_tokens}|{settings.temperature}|{settings.postprocess}|{settings.min_confidence}".encode())
    return h.hexdigest()
