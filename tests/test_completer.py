"""The completer's concurrency with a scripted engine: fast, no model, no server.

Covers what happens between requests for the same document while a generation runs: a request
at another cursor supersedes it (the engine-side stream is cancelled), one that typed what is being
generated attaches to it, ``$/cancelRequest`` stops the generation unless someone attached, the
early answer in multi-line mode (and the generation finishing into the cache behind it),
typed-through reuse, engine trouble ("loading", "error"), two documents generating at once, warm-ups
that give way to a completion and take turns, and the confidence gate (a hidden answer cached, a
block shortened, the preview gated). That cancelling a stream aborts its request on a real engine is
checked in test_remote.py (a vLLM server) and test_latency.py (the embedded engine).

The :class:`ScriptedEngine` below yields only the chunks a test sends, when it sends them, so
each test decides the interleaving. The same behaviour against the real engine is checked in
test_server.py and test_latency.py (minutes each); these run in milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from context.cut import confidence
from context.cut.confidence import Calibration
from context.prompt.window import ApproxCounter
from context.source.document import Document
from engine.base import Chunk, Engine, EngineCounters, EngineError, EngineStats, GenerationParams, ModelInfo
from lsp.completer import Completer, Completion, DocumentState
from lsp.config import Settings
from lsp.metrics import Metrics, prometheus_text

WAIT_S = 2.0  # a wait that takes longer is a bug (the test fails instead of hanging)
# Qwen2.5-Coder's FIM tokens: choose_template picks a real FIM template for the scripted model.
FIM_TOKENS = frozenset({"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"})
SETTINGS = Settings(debounce_ms=0, early_answer_ms=0)

# Cursor at the end of ``return width``: text before it on its line, so single-line mode.
AREA = "def area(width, height):\n    return width\n"
AREA_CURSOR = AREA.index("width\n") + len("width")
# Two functions, a single-line cursor at the end of each body.
SHAPES = AREA + "\n\ndef perimeter(width, height):\n    return width\n"
PERIMETER_CURSOR = SHAPES.rindex("width\n") + len("width")
# Cursor on the indented empty line of a function body: multi-line mode.
TOTAL = "def total(items):\n    \n"
TOTAL_CURSOR = TOTAL.index("    \n") + 4
SURE = math.log(0.95)
UNSURE = math.log(0.05)
# P(exact) = sigmoid(4 + 4 * min): 0.88 for a line of sure tokens, 0.01 with an unsure one.
CALIBRATION = Calibration(
    bias=4.0, min_weight=4.0, mean_weight=0.0, length_weight=0.0, min_confidence=0.5, line_logprob=math.log(0.2)
)


@dataclass
class StreamCall:
    """One ``Engine.stream`` call: what was asked, and how the consumer left the stream."""

    prompt: str
    params: GenerationParams
    request_id: str
    closed: bool = False  # the consumer closed it before its end (aclose: GeneratorExit)
    cancelled: bool = False  # the consuming task was cancelled while it waited for a chunk
    finished: bool = False  # the generator is done, however it ended
    asks: int = 0  # how often the consumer asked for the next chunk
    sent: int = 0
    _queue: asyncio.Queue[Chunk | EngineError | None] = field(default_factory=asyncio.Queue)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def aborted(self) -> bool:
        return self.closed or self.cancelled

    async def send(self, text: str, finish_reason: str | None = None, logprobs: tuple[float, ...] = ()) -> None:
        """Hands the consumer one chunk (with its tokens' ``logprobs``) and returns once it has
        dealt with it (it asked for the next one, or it closed the stream)."""
        self.sent += 1
        self._queue.put_nowait(Chunk(text, token_count=1, finish_reason=finish_reason, logprobs=logprobs))
        await self._wait_for(lambda: self.asks > self.sent or self.finished)

    async def fail(self, error: EngineError) -> None:
        """The engine fails mid-stream."""
        self._queue.put_nowait(error)
        await self._wait_for(lambda: self.finished)

    async def end(self) -> None:
        """The model stops (end of text)."""
        self._queue.put_nowait(None)
        await self._wait_for(lambda: self.finished)

    async def wait_finished(self) -> None:
        await self._wait_for(lambda: self.finished)

    async def _wait_for(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT_S):
            while not condition():
                self._changed.clear()
                await self._changed.wait()

    async def chunks(self) -> AsyncIterator[Chunk]:
        try:
            while True:
                self.asks += 1
                self._changed.set()
                item = await self._queue.get()
                if item is None:
                    return
                if isinstance(item, EngineError):
                    raise item
                yield item
        except GeneratorExit:
            self.closed = True
            raise
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.finished = True
            self._changed.set()


class ScriptedEngine:
    """An :class:`engine.base.Engine` whose streams yield what the test sends them."""

    def __init__(self) -> None:
        self.calls: list[StreamCall] = []
        self.is_ready = True
        self.engine_args: dict[str, object] = {}
        self.warning: str | None = None
        self._handed = 0  # calls already returned by next_call
        self._called = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self.is_ready

    @property
    def dead(self) -> bool:
        return False

    @property
    def model(self) -> ModelInfo:
        return ModelInfo("scripted-coder", max_model_len=2048, special_tokens=FIM_TOKENS)

    def engine_stats(self) -> EngineStats:
        return EngineStats("scripted", EngineCounters(requests=len(self.calls)))

    @property
    def tokenizer(self) -> ApproxCounter:
        return ApproxCounter()

    async def start(self) -> None:
        self.is_ready = True

    def stream(
        self, prompt: str, params: GenerationParams, request_id: str, *, routing_key: str | None = None
    ) -> AsyncIterator[Chunk]:
        call = StreamCall(prompt, params, request_id)
        self.calls.append(call)
        self._called.set()
        return call.chunks()

    async def abort(self, request_id: str) -> None:
        """Unused: the completer aborts a request by closing or cancelling its stream."""

    async def close(self) -> None:
        pass

    async def next_call(self) -> StreamCall:
        """The next stream call not handed out yet, once the completer has made it."""
        async with asyncio.timeout(WAIT_S):
            while len(self.calls) <= self._handed:
                self._called.clear()
                await self._called.wait()
        self._handed += 1
        return self.calls[self._handed - 1]


async def settle(rounds: int = 10) -> None:
    """Lets the tasks that can run go to their next wait (no time passes)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@dataclass
class EditorCompleter(Completer):
    """The completer with one editor session's open documents (an EmberServer's ``open``)."""

    states: dict[str, DocumentState] = field(default_factory=dict)

    def state(self, doc: Document) -> DocumentState:
        """The document's state, its text now ``doc``'s (the editor typed)."""
        state = self.states.setdefault(doc.uri, DocumentState(doc))
        state.document = doc
        return state


@pytest.fixture
def completer(engine: ScriptedEngine) -> EditorCompleter:
    return EditorCompleter(lambda: engine, Metrics())


def start(
    completer: EditorCompleter, text: str, offset: int, settings: Settings = SETTINGS, uri: str = "file:///shapes.py"
) -> asyncio.Task[Completion]:
    state = completer.state(Document(uri, "python", text))
    return asyncio.create_task(completer.complete(state, offset, settings))


def typed(text: str, offset: int, typing: str) -> tuple[str, int]:
    """The document after the user typed ``typing`` at ``offset``, and the cursor after it."""
    return text[:offset] + typing + text[offset:], offset + len(typing)


async def result(task: asyncio.Task[Completion]) -> Completion:
    async with asyncio.timeout(WAIT_S):
        return await task


def test_scripted_engine_is_an_engine(engine: ScriptedEngine) -> None:
    assert isinstance(engine, Engine)


async def test_completion_streams_from_a_fim_prompt(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    task = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    # The append layout: the cursor's lines after the middle token, the suffix before them.
    assert call.prompt.startswith("<|fim_prefix|>") and call.prompt.endswith("<|fim_middle|>    return width")
    await call.send(" *")
    await call.send(" height")
    await call.send("\nprint(area(2, 3))\n")  # the line ends: the completer stops reading
    done = await result(task)
    assert done.text == " * height"
    assert done.metrics.mode == "single" and done.metrics.outcome == "ok"
    assert call.closed and not call.cancelled  # closed early, which aborts the engine-side request


async def test_a_block_complete_at_the_token_limit_keeps_its_last_line(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    """The chunk that hits the token limit may also complete the block (the cutter stops on it):
    the text is then whole, and its last line is not dropped as cut short."""
    text = "def total(xs):\n    t = 0\n    \n"
    task = start(completer, text, text.index("    \n") + 4)
    call = await engine.next_call()
    await call.send("for x in xs:\n        t += x\n")
    await call.send("    return t\nprint(1)\n", finish_reason="length")
    done = await result(task)
    assert done.text == "for x in xs:\n        t += x\n    return t"
    assert done.metrics.mode == "multi" and not done.metrics.truncated


async def test_request_at_another_cursor_supersedes(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    first = start(completer, SHAPES, AREA_CURSOR)
    first_call = await engine.next_call()
    await first_call.send(" *")

    second = start(completer, SHAPES, PERIMETER_CURSOR)
    second_call = await engine.next_call()
    await first_call.wait_finished()
    assert first_call.cancelled
    superseded = await result(first)
    assert superseded.text == "" and superseded.metrics.outcome == "superseded"
    assert superseded.metrics.why_empty == "a newer request for this document replaced it"

    await second_call.send(" * 2 + height * 2")
    await second_call.end()
    answered = await result(second)
    assert answered.text == " * 2 + height * 2"
    assert answered.metrics.mode == "single" and answered.metrics.outcome == "ok"
    assert not second_call.aborted


async def test_typing_what_is_generated_attaches(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    first = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    await call.send(" *")
    await call.send(" hei")

    text, offset = typed(AREA, AREA_CURSOR, " * h")
    second = start(completer, text, offset)
    await settle()
    assert not second.done()  # waits for the generation in flight
    await call.send("ght")
    await call.end()

    assert (await result(first)).text == " * height"
    attached = await result(second)
    assert attached.text == "eight"
    assert attached.metrics.outcome == "attached" and attached.metrics.cache_hit
    assert len(engine.calls) == 1


async def test_typing_something_else_does_not_attach(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    first = start(completer, AREA, AREA_CURSOR)
    first_call = await engine.next_call()
    await first_call.send(" *")

    text, offset = typed(AREA, AREA_CURSOR, " +")
    second = start(completer, text, offset)
    second_call = await engine.next_call()
    await first_call.wait_finished()
    assert first_call.cancelled
    assert (await result(first)).metrics.outcome == "superseded"
    await second_call.send(" height")
    await second_call.end()
    assert (await result(second)).text == " height"


async def test_cancel_request_stops_the_generation(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    task = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    await call.send(" *")

    task.cancel()  # what pygls does on $/cancelRequest
    with pytest.raises(asyncio.CancelledError):
        await result(task)
    await call.wait_finished()
    assert call.cancelled
    assert not completer.busy


async def test_cancel_request_spares_a_generation_someone_attached_to(
    completer: EditorCompleter, engine: ScriptedEngine
) -> None:
    first = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    await call.send(" * h")
    text, offset = typed(AREA, AREA_CURSOR, " * h")
    second = start(completer, text, offset)
    await settle()

    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await result(first)
    await settle()
    assert not call.finished  # still generating for the request that attached
    await call.send("eight")
    await call.end()

    attached = await result(second)
    assert attached.text == "eight" and attached.metrics.outcome == "attached"
    assert not call.aborted
    assert len(engine.calls) == 1


async def test_early_answer_waits_for_its_time(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    early_ms = 150
    settings = dataclasses.replace(SETTINGS, early_answer_ms=early_ms)
    task = start(completer, TOTAL, TOTAL_CURSOR, settings)
    call = await engine.next_call()
    await call.send("total = 0\n    for item in items:")  # a complete line at once
    await settle()
    assert not task.done()  # a few milliseconds in: too early to answer

    shown = await result(task)
    assert shown.text == "total = 0" and shown.metrics.mode == "multi"
    assert shown.metrics.latency_ms >= early_ms - 1
    await call.end()


async def test_early_answer_shows_complete_lines_and_the_rest_follows(
    completer: EditorCompleter, engine: ScriptedEngine
) -> None:
    early_ms = 50
    settings = dataclasses.replace(SETTINGS, early_answer_ms=early_ms)
    task = start(completer, TOTAL, TOTAL_CURSOR, settings)
    call = await engine.next_call()
    await call.send("total = 0")
    await asyncio.sleep(2 * early_ms / 1000)  # the early-answer time passes (a timer: no event to wait on)
    assert not task.done()  # no complete line yet

    await call.send("\n    for item in items:")
    shown = await result(task)
    assert shown.text == "total = 0"
    assert shown.metrics.mode == "multi" and shown.metrics.outcome == "ok"

    assert not call.finished  # the generation goes on behind the answer
    await call.send("\n        total += item")
    await call.send("\n    return total\n")
    await call.end()
    await settle()
    rest = "\n    for item in items:\n        total += item\n    return total"
    assert "total = 0" + rest in [answer.text for answer in completer.cache.values()]

    text, offset = typed(TOTAL, TOTAL_CURSOR, "total = 0")  # the user accepts the shown line
    accepted = await result(start(completer, text, offset, settings))
    assert accepted.text == rest and accepted.metrics.cache_hit
    assert len(engine.calls) == 1


async def test_typing_through_a_suggestion_reuses_its_rest(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    first = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    await call.send(" * height")
    await call.end()
    assert (await result(first)).text == " * height"

    text, offset = typed(AREA, AREA_CURSOR, " * ")
    reused = await result(start(completer, text, offset))
    assert reused.text == "height"
    assert reused.metrics.cache_hit and reused.metrics.outcome == "ok"
    assert len(engine.calls) == 1


async def test_engine_not_ready_answers_loading(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    engine.is_ready = False
    loading = await result(start(completer, AREA, AREA_CURSOR))
    assert loading.text == "" and loading.metrics.outcome == "loading"
    assert loading.metrics.why_empty == "the model is still loading"
    assert engine.calls == []

    no_engine = EditorCompleter(lambda: None, Metrics())
    assert (await result(start(no_engine, AREA, AREA_CURSOR))).metrics.outcome == "loading"


async def test_engine_error_mid_stream_then_the_next_request_is_served(
    completer: EditorCompleter, engine: ScriptedEngine
) -> None:
    failing = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    await call.send(" *")
    await call.fail(EngineError("the engine died"))
    failed = await result(failing)
    assert failed.text == "" and failed.metrics.outcome == "error"
    assert failed.metrics.why_empty == "the engine failed: the engine died"

    retry = start(completer, AREA, AREA_CURSOR)
    retry_call = await engine.next_call()
    await retry_call.send(" * height")
    await retry_call.end()
    served = await result(retry)
    assert served.text == " * height" and served.metrics.outcome == "ok"


async def test_every_empty_answer_says_why(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    """The deadline with nothing generated and the cutter's steps reach ``why_empty`` (the
    engine's trouble and the confidence gate: the tests above); an answer with text has none."""
    late = await asyncio.gather(result(start(completer, AREA, AREA_CURSOR, dataclasses.replace(SETTINGS, timeout_ms=100))),
                                engine.next_call())
    assert late[0].text == "" and late[0].metrics.outcome == "timeout"
    assert late[0].metrics.why_empty == "the engine sent no text within the 100 ms deadline (timeoutMs)"
    again = start(completer, AREA, AREA_CURSOR)  # what the deadline cut is not cached: asked again
    call = await engine.next_call()
    await call.send(" * height\n")
    answered = await result(again)
    assert answered.text == " * height" and answered.metrics.why_empty == ""

    repeat = start(completer, "def f(x):\n    \n    return x\n", len("def f(x):\n    "), uri="file:///repeat.py")
    call = await engine.next_call()
    await call.send("return x\n")
    await call.end()
    repeated = await result(repeat)
    assert repeated.text == "" and repeated.metrics.outcome == "empty"
    assert repeated.metrics.why_empty == "the model's first line repeats the line after the cursor"



async def test_two_documents_generate_at_once(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    area = start(completer, AREA, AREA_CURSOR, uri="file:///area.py")
    area_call = await engine.next_call()
    shapes = start(completer, SHAPES, PERIMETER_CURSOR, uri="file:///shapes.py")
    shapes_call = await engine.next_call()

    await area_call.send(" *")
    await shapes_call.send(" * 2")
    await area_call.send(" height")
    await shapes_call.send(" + height * 2")
    assert completer.busy
    await shapes_call.end()
    await area_call.end()

    assert (await result(area)).text == " * height"
    assert (await result(shapes)).text == " * 2 + height * 2"
    assert not area_call.aborted and not shapes_call.aborted


# ------------------------------------------------------------------ warm-ups give way


def module(name: str) -> str:
    """A document long enough for a warm-up (a stable prompt front of 64 characters or more)."""
    return "".join(f"def {name}_{i}(width, height):\n    return width * height + {i}\n\n\n" for i in range(8))


def warm(completer: EditorCompleter, uri: str) -> asyncio.Task[bool]:
    doc = Document(uri, "python", module(uri.rsplit("/", 1)[-1][:-3]))
    return asyncio.create_task(completer.warm(doc, len(doc.text), SETTINGS))


async def test_a_completion_stops_the_warm_up_in_flight(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    """A prefill for a document just opened must not stand between the user and the first answer."""
    warming = warm(completer, "file:///opened.py")
    warm_call = await engine.next_call()
    assert warm_call.request_id.startswith("ember-warm-") and warm_call.params.max_tokens == 1

    task = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    await warm_call.wait_finished()
    assert warm_call.cancelled  # its engine-side request is aborted
    async with asyncio.timeout(WAIT_S):
        assert await warming is False
    await call.send(" * height")
    await call.end()
    assert (await result(task)).text == " * height"


async def test_warm_ups_take_turns_and_none_starts_beside_a_completion(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    first = warm(completer, "file:///first.py")
    second = warm(completer, "file:///second.py")
    first_call = await engine.next_call()
    await settle()
    assert len(engine.calls) == 1  # the second waits its turn
    await first_call.send("x")
    await first_call.end()
    second_call = await engine.next_call()
    assert "second_0" in second_call.prompt
    async with asyncio.timeout(WAIT_S):
        assert await first is True

    task = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    third = warm(completer, "file:///third.py")
    async with asyncio.timeout(WAIT_S):
        assert await second is False and await third is False  # gave way; skipped while busy
    await settle()
    assert len(engine.calls) == 3
    await call.send(" * height")
    await call.end()
    assert (await result(task)).text == " * height"


async def test_cancelling_a_warm_up_cancels_its_caller(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    """An edit replaces the document's pending warm-up: that cancellation is the caller's own and
    must not be taken for a warm-up that gave way."""
    warming = warm(completer, "file:///edited.py")
    warm_call = await engine.next_call()
    warming.cancel()
    await warm_call.wait_finished()
    assert warm_call.cancelled
    with pytest.raises(asyncio.CancelledError):
        await warming


# ------------------------------------------------------------------ the confidence gate
# (its pure functions: test_confidence.py)


async def test_logprobs_reach_the_gate_and_a_hidden_answer_is_cached(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    settings = dataclasses.replace(SETTINGS, min_confidence=0.5)
    task = start(completer, AREA, AREA_CURSOR, settings)
    call = await engine.next_call()
    assert call.params.logprobs  # ember asks the engine for them
    await call.send(" *", logprobs=(SURE,))
    await call.send(" height", logprobs=(UNSURE,))
    await call.end()
    hidden = await result(task)
    assert hidden.text == "" and hidden.metrics.outcome == "hidden" and hidden.metrics.shown == "hidden"
    assert hidden.metrics.why_empty == "its confidence 0.22 is below minConfidence 0.50"
    assert hidden.metrics.confidence == pytest.approx(math.sqrt(0.95 * 0.05))
    assert hidden.metrics.kept_tokens == 2 and hidden.metrics.logprob_min == pytest.approx(UNSURE)
    again = await result(start(completer, AREA, AREA_CURSOR, settings))
    assert again.text == "" and again.metrics.cache_hit and len(engine.calls) == 1  # no second generation
    assert again.metrics.why_empty == hidden.metrics.why_empty  # the cached empty answer keeps its reason
    shown_anyway = start(completer, AREA, AREA_CURSOR, dataclasses.replace(settings, min_confidence=0.0))
    call = await engine.next_call()  # another threshold: another cache entry
    await call.send(" * height", logprobs=(UNSURE,))
    await call.end()
    assert (await result(shown_anyway)).text == " * height"
    assert completer.metrics.gate == {"hidden": 1, "shown": 1}
    assert completer.metrics.summary()["gate"] == {"hidden": 1, "shown": 1}
    exported = prometheus_text(completer.metrics)
    assert 'ember_suggestions_total{gate="hidden"} 1' in exported and 'ember_suggestions_total{gate="shown"} 1' in exported


async def test_a_calibrated_model_shortens_a_block(
    completer: EditorCompleter, engine: ScriptedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted = confidence.CalibratedFamily(frozenset({"qwen2.5-coder"}), re.compile("scripted-coder"), CALIBRATION)
    monkeypatch.setattr(confidence, "CALIBRATIONS", (scripted,))
    task = start(completer, TOTAL, TOTAL_CURSOR)
    call = await engine.next_call()
    await call.send("total = 0\n", logprobs=(SURE,))
    await call.send("    for item in items:\n", logprobs=(SURE,))
    await call.send("        total += item.prize\n", logprobs=(UNSURE,))
    await call.send("    return total\n", logprobs=(SURE,))
    await call.end()
    done = await result(task)
    assert done.text == "total = 0\n    for item in items:"
    assert done.metrics.shown == "shortened" and done.metrics.confidence == pytest.approx(CALIBRATION.probability([SURE, SURE]))


async def test_a_calibrated_family_hides_by_its_default_unless_the_user_sets_a_threshold(
    completer: EditorCompleter, engine: ScriptedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted = confidence.CalibratedFamily(frozenset({"qwen2.5-coder"}), re.compile("scripted-coder"), CALIBRATION)
    monkeypatch.setattr(confidence, "CALIBRATIONS", (scripted,))
    assert SETTINGS.min_confidence is None  # the user set none: the family's default (0.5) applies
    task = start(completer, AREA, AREA_CURSOR)
    call = await engine.next_call()
    await call.send(" * height", logprobs=(UNSURE,))
    await call.end()
    hidden = await result(task)
    assert hidden.text == "" and hidden.metrics.shown == "hidden"
    assert hidden.metrics.why_empty == f"its confidence {CALIBRATION.probability([UNSURE]):.2f} is below minConfidence 0.50"
    shown = start(completer, AREA, AREA_CURSOR, dataclasses.replace(SETTINGS, min_confidence=0.0))  # the user's wins
    call = await engine.next_call()
    await call.send(" * height", logprobs=(UNSURE,))
    await call.end()
    assert (await result(shown)).text == " * height"


async def test_the_streamed_preview_is_gated_too(completer: EditorCompleter, engine: ScriptedEngine) -> None:
    uri = "file:///total.py"
    previews: list[str] = []
    settings = dataclasses.replace(SETTINGS, min_confidence=0.5)
    state = completer.state(Document(uri, "python", TOTAL))
    task = asyncio.create_task(completer.complete(state, TOTAL_CURSOR, settings, on_text=previews.append))
    call = await engine.next_call()
    await call.send("total = 0\n", logprobs=(SURE,))
    await call.send("    for item in items:\n", logprobs=(SURE,))
    assert previews and previews[-1].startswith("total = 0")  # confident so far: shown while it grows
    await call.send("        total += item.prize\n", logprobs=(UNSURE, UNSURE, UNSURE))
    assert previews[-1] == ""  # no longer: the preview goes
    await call.end()
    assert (await result(task)).text == ""


# ------------------------------------------------------------------------------ one state per document


async def test_closing_a_document_or_shutting_down_leaves_nothing_behind(engine: ScriptedEngine) -> None:
    """A session keeps one state per open document (suggestion, generation, typing, warm-up,
    retrieval): didClose is one call that stops and forgets all of it, shutdown one that stops
    every document's work; two sessions that open the same uri keep their own."""
    from lsprotocol import types

    from lsp.engine_host import EmberCore
    from lsp.server import build_server, did_close, did_open, shutdown
    from tests.test_pygls_fence import INITIALIZE, Sink, feed

    core = EmberCore(Settings(debounce_ms=0, early_answer_ms=0, cross_file="open"), lambda settings, progress: engine)
    await core.start_engine()
    first, second = build_server(core, exit_process=False), build_server(core, exit_process=False)
    for ls in (first, second):
        ls.protocol.set_writer(Sink())
        feed(ls, INITIALIZE)

    def opened(ls: object, uri: str) -> None:
        did_open(ls, types.DidOpenTextDocumentParams(types.TextDocumentItem(uri=uri, language_id="python", version=1, text=AREA)))  # type: ignore[arg-type]

    position = types.Position(line=1, character=len("    return width"))
    opened(first, "file:///area.py")
    opened(second, "file:///area.py")
    state = first.open["file:///area.py"]
    assert state is not second.open["file:///area.py"]
    assert state.warmup is not None  # the open's warm-up, waiting for the engine to be free
    asking = asyncio.create_task(first.complete("file:///area.py", position))
    call = await engine.next_call()
    while call.params.warm_up:  # the warm-up reached the engine first: the completion stops it
        call = await engine.next_call()
    await call.send(" *")
    assert state.running is not None and core.completer.busy

    did_close(first, types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri="file:///area.py")))
    assert first.open == {} and "file:///area.py" in second.open
    await call.wait_finished()
    assert call.aborted and state.warmup is None and state.running is None and state.suggestion is None
    assert (await result(asking)).text == ""
    await settle()
    assert not core.completer.busy

    opened(first, "file:///shapes.py")
    asking = asyncio.create_task(first.complete("file:///shapes.py", position))
    call = await engine.next_call()
    while call.params.warm_up:
        call = await engine.next_call()
    shutdown(first, None)
    await call.wait_finished()
    assert call.aborted
    await asyncio.gather(asking, return_exceptions=True)
    await settle()
    assert not core.completer.busy
    assert all(task is None or (task.cancelled() if isinstance(task, asyncio.TimerHandle) else task.done())
               for s in first.open.values() for task in (s.warmup, s.retrieving))


def test_a_session_ending_during_the_typing_pause_leaves_no_coroutine_that_never_ran(engine: ScriptedEngine) -> None:
    """The warm-up waits for a pause in typing; when the editor goes away first (the loop stops
    right after the document opened and was typed in), nothing is left that Python reports as
    never awaited."""
    import gc
    import warnings

    from lsprotocol import types

    from lsp.engine_host import EmberCore
    from lsp.server import WARMUP_PAUSE_S, build_server, did_open
    from tests.test_pygls_fence import INITIALIZE, Sink, feed

    loop = asyncio.new_event_loop()

    def opened_then_gone() -> None:
        core = EmberCore(Settings(debounce_ms=0, early_answer_ms=0), lambda settings, progress: engine)
        ls = build_server(core, exit_process=False)
        ls.protocol.set_writer(Sink())
        feed(ls, INITIALIZE)
        item = types.TextDocumentItem(uri="file:///area.py", language_id="python", version=1, text=AREA)
        did_open(ls, types.DidOpenTextDocumentParams(item))  # type: ignore[arg-type]
        ls.schedule_warmup(ls.open["file:///area.py"], AREA_CURSOR, delay_s=WARMUP_PAUSE_S)
        loop.stop()  # the loop ends after this callback: what it scheduled never runs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.call_soon(opened_then_gone)
        loop.run_forever()
        loop.close()
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_every_engines_counters_and_restarts_reach_prometheus() -> None:
    """Every engine's counters are exported under the same names (llama.cpp's resumes and retries
    too, with or without a router), with ember's restarts, the connections in use and what the
    process holds beside them."""
    engine = EngineStats("llama.cpp", EngineCounters(requests=7, resumed=2, retried=3), connections_in_use=1, detail={"pid": 1})
    counters = {**dataclasses.asdict(engine.counters), "restarts": 4}
    exported = prometheus_text(Metrics(), engine, counters, {"descriptors": 12, "tasks": 3})
    assert "ember_engine_resumed_total 2" in exported and "ember_engine_retried_total 3" in exported
    assert "ember_engine_requests_total 7" in exported and "ember_engine_reconnected_total 0" in exported
    assert "ember_engine_restarts_total 4" in exported and "ember_engine_behind_router" not in exported
    assert "ember_engine_connections_in_use 1" in exported and "ember_process_descriptors 12" in exported
    assert "ember_engine_resumed_total" not in prometheus_text(Metrics())  # no engine yet: nothing to say


async def test_the_counters_of_a_replaced_engine_are_kept() -> None:
    """An engine that died and was replaced took its counters with it; ember/stats and Prometheus
    count from the process's start, so the core keeps them and adds the new engine's."""
    from lsp.engine_host import EmberCore

    first, second = ScriptedEngine(), ScriptedEngine()
    engines = iter([first, second])
    core = EmberCore(Settings(debounce_ms=0, early_answer_ms=0), lambda settings, progress: next(engines))
    await core.start_engine()
    first.stream("a", GenerationParams(), "r1")
    first.stream("b", GenerationParams(), "r2")
    assert core.engine_counters()["requests"] == 2
    core.restart_engine()  # as check_engine() does when the engine is dead
    async with asyncio.timeout(5):  # the first restart waits 1 s
        while core.restarting:
            await asyncio.sleep(0.05)
    assert core.engine is second and core.restarts == 1
    second.stream("c", GenerationParams(), "r3")
    assert core.engine_counters() == {**dataclasses.asdict(EngineCounters(requests=3)), "restarts": 1}


async def test_an_engine_that_served_a_while_is_restarted_at_once_a_crash_loop_waits_longer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each quick death doubles the wait before the next start (no restart storm); an engine that
    served STABLE_S before it died is restarted after 1 s again (six kills over a soak waited 32 s
    for the sixth restart before)."""
    from lsp import engine_host

    monkeypatch.setattr(engine_host, "STABLE_S", 0.3)
    engines = iter([ScriptedEngine() for _ in range(4)])
    core = engine_host.EmberCore(Settings(debounce_ms=0, early_answer_ms=0), lambda settings, progress: next(engines))
    await core.start_engine()

    async def die_and_come_back() -> None:
        core.restart_engine()
        async with asyncio.timeout(10):
            while core.restarting:
                await asyncio.sleep(0.02)

    with caplog.at_level(logging.ERROR, logger="lsp.engine_host"):
        await die_and_come_back()  # at once: 1 s
        await die_and_come_back()  # at once again: a crash loop, 2 s
        await asyncio.sleep(0.4)
        await die_and_come_back()  # after serving STABLE_S: 1 s again
    waits = [r.getMessage() for r in caplog.records if "restarting in" in r.getMessage()]
    assert waits == ["engine died; restarting in 1 s", "engine died; restarting in 2 s", "engine died; restarting in 1 s"], waits
    assert core.restarts == 3


async def test_ember_stats_counts_what_the_process_holds(tmp_path: object) -> None:
    """Descriptors, threads and tasks, the numbers a leak grows, follow what the process opens."""
    import pathlib
    import threading

    from lsp.stats import process_holdings

    before = process_holdings()
    files = [open(pathlib.Path(str(tmp_path)) / f"f{i}", "w") for i in range(5)]  # noqa: SIM115
    waiting = asyncio.ensure_future(asyncio.sleep(60))
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        during = process_holdings()
        assert during["descriptors"] == before["descriptors"] + 5
        assert during["tasks"] == before["tasks"] + 1 and during["threads"] == before["threads"] + 1
    finally:
        release.set()
        thread.join()
        waiting.cancel()
        for f in files:
            f.close()
    assert process_holdings()["descriptors"] == before["descriptors"]
