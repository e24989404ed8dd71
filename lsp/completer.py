"""One completion, from a document and cursor to the text to insert.

document -> context.build_prompt -> (caches) -> engine.stream -> context.postprocess. Shared by every
editor session of the process; per-document state is the last shown suggestion (typed-through reuse).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cachetools import LRUCache

from context.document import Document
from context.fim import FimTemplate, choose_template, strip_control_tokens
from context.postprocess import completion_mode, find_stop, postprocess
from context.prompt import Prompt, PromptBudget, Snippet, build_prompt
from engine.base import Engine, EngineError, EngineNotReady, GenerationParams
from lsp.config import Settings
from lsp.metrics import Metrics, RequestMetrics

log = logging.getLogger(__name__)

# How much text around the cursor post-processing looks at (it needs lines, not the file).
_AROUND = 8000
_REUSE_CONTEXT = 256


@dataclass
class Suggestion:
    """What was last offered for a document, to answer from it while the user types it."""

    offset: int
    before: str  # text just before the cursor at the time
    after: str  # text just after the cursor at the time
    text: str


@dataclass
class Completion:
    text: str
    metrics: RequestMetrics


class Completer:
    def __init__(self, engine_source: Callable[[], Engine | None], metrics: Metrics, cache_bytes: int = 8 << 20) -> None:
        self._engine_source = engine_source
        self.metrics = metrics
        # Bounded in bytes; each entry costs its text plus a fixed overhead, so entries are bounded too.
        self.cache: LRUCache[str, str] = LRUCache(maxsize=cache_bytes, getsizeof=lambda text: len(text) + 256)
        self._suggestions: LRUCache[str, Suggestion] = LRUCache(maxsize=1024)
        self._ids = itertools.count(1)
        self._template: tuple[str, FimTemplate] | None = None

    def forget(self, uri: str) -> None:
        self._suggestions.pop(uri, None)

    def template_for(self, engine: Engine, override: str | None) -> FimTemplate:
        key = f"{engine.model.name}|{override}"
        if self._template is None or self._template[0] != key:
            self._template = (key, choose_template(engine.model.special_tokens, engine.model.name, override))
        return self._template[1]

    async def complete(
        self,
        doc: Document,
        offset: int,
        settings: Settings,
        *,
        snippets: tuple[Snippet, ...] = (),
        on_text: Callable[[str], None] | None = None,
    ) -> Completion:
        """The text to insert at ``offset``; "" when there is nothing useful (never raises for engine
        trouble: the reason is in ``metrics.outcome`` and the log)."""
        started = time.perf_counter()
        metrics = RequestMetrics()
        text = doc.text
        prefix = text[max(0, offset - _AROUND) : offset]
        suffix = text[offset : offset + _AROUND]
        mode = completion_mode(prefix, suffix, doc.language_id)
        metrics.mode = mode

        reused = self._typed_through(doc.uri, text, offset)
        if reused:
            metrics.cache_hit = True
            return self._done(doc.uri, offset, text, reused, metrics, started)

        engine = self._engine_source()
        if engine is None or not engine.ready:
            metrics.outcome = "loading"
            return Completion("", metrics.finish(started))

        template = self.template_for(engine, settings.fim_template)
        prompt = build_prompt(
            text,
            offset,
            uri=doc.uri,
            language_id=doc.language_id,
            tree=doc.tree,
            cursor_byte=doc.byte_offset(offset) if doc.tree is not None else None,
            template=template,
            counter=engine.tokenizer,
            budget=PromptBudget(prefix_tokens=settings.context_tokens, suffix_tokens=settings.suffix_tokens),
            snippets=snippets,
        )
        cache_key = _cache_key(prompt, mode, settings)
        cached = self.cache.get(cache_key)
        if cached is not None:
            metrics.cache_hit = True
            return self._done(doc.uri, offset, text, cached, metrics, started)

        raw = await self._generate(engine, prompt, prefix, suffix, doc.language_id, mode, settings, metrics, on_text, started)
        if raw is None:
            return Completion("", metrics.finish(started))
        final = postprocess(strip_control_tokens(raw), prefix, suffix, doc.language_id, mode)
        self.cache[cache_key] = final
        return self._done(doc.uri, offset, text, final, metrics, started)

    async def _generate(
        self,
        engine: Engine,
        prompt: Prompt,
        prefix: str,
        suffix: str,
        language_id: str,
        mode: str,
        settings: Settings,
        metrics: RequestMetrics,
        on_text: Callable[[str], None] | None,
        started: float,
    ) -> str | None:
        request_id = f"ember-{next(self._ids)}"
        params = GenerationParams(max_tokens=settings.max_tokens, temperature=settings.temperature, stop=prompt.stop)
        raw = ""
        engine_started = time.perf_counter()
        try:
            async with asyncio.timeout(settings.timeout_ms / 1000):
                stream = engine.stream(prompt.text, params, request_id, routing_key=prompt.key.routing_key)
                try:
                    async for chunk in stream:
                        if metrics.ttft_ms is None:
                            metrics.ttft_ms = (time.perf_counter() - started) * 1000
                        if chunk.prompt_tokens is not None:
                            metrics.prompt_tokens = chunk.prompt_tokens
                            metrics.cached_tokens = chunk.cached_tokens or 0
                        metrics.streamed_tokens += chunk.token_count
                        raw += chunk.text
                        cut = find_stop(raw, prefix, suffix, language_id, mode)
                        if cut is not None:
                            raw = raw[:cut]
                            break
                        if on_text is not None:
                            on_text(postprocess(strip_control_tokens(raw), prefix, suffix, language_id, mode))
                finally:
                    # Closing the stream aborts the engine-side request when we stopped early.
                    await stream.aclose()
        except TimeoutError:
            metrics.outcome = "timeout"
            log.warning("completion %s hit the %d ms deadline; returning what was generated", request_id, settings.timeout_ms)
        except EngineNotReady:
            metrics.outcome = "loading"
            return None
        except EngineError as exc:
            metrics.outcome = "error"
            log.warning("completion %s failed: %s", request_id, exc)
            return None
        finally:
            metrics.engine_ms = (time.perf_counter() - engine_started) * 1000
        return raw

    def _done(self, uri: str, offset: int, text: str, completion: str, metrics: RequestMetrics, started: float) -> Completion:
        if completion:
            self._suggestions[uri] = Suggestion(
                offset=offset,
                before=text[max(0, offset - _REUSE_CONTEXT) : offset],
                after=text[offset : offset + _REUSE_CONTEXT],
                text=completion,
            )
        elif metrics.outcome == "ok":
            metrics.outcome = "empty"
        metrics.finish(started)
        self.metrics.record(metrics)
        log.debug("completion metrics %s", metrics.as_dict())
        return Completion(completion, metrics)

    def _typed_through(self, uri: str, text: str, offset: int) -> str | None:
        """The rest of the last suggestion when the user has typed its beginning."""
        last = self._suggestions.get(uri)
        if last is None or offset < last.offset:
            return None
        typed = text[last.offset : offset]
        if not last.text.startswith(typed) or len(typed) >= len(last.text):
            return None
        if not text[: last.offset].endswith(last.before):
            return None
        if text[offset : offset + len(last.after)] != last.after:
            return None
        return last.text[len(typed) :]


def _cache_key(prompt: Prompt, mode: str, settings: Settings) -> str:
    h = hashlib.blake2b(prompt.text.encode("utf-8", "surrogatepass"), digest_size=16)
    h.update(f"|{mode}|{settings.max_tokens}|{settings.temperature}".encode())
    return h.hexdigest()
