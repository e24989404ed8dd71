"""How a completion's prompt is built and its stream cut: ember's way and the baselines it is measured against.

A :class:`Strategy` pairs a prompt builder with a cutter. ``strategy("ast", "syntax")`` is what
ember ships; the benchmarks swap in the baselines (``promptStrategy: "naive"``, the last lines
before and after the cursor; ``postprocess: "plain"``, the model's text cut at line breaks only)
to show what each part buys. Resolved once per settings value, so the request path never branches
on those names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from context.cut.control_tokens import strip_control_tokens
from context.cut.postprocess import WHY_NOTHING, StreamCutter, SyntaxCutter, plain_postprocess, plain_stop
from context.cut.surroundings import Mode
from context.prompt.builder import Prompt, PromptBudget, PromptRequest, anchored_prompt, naive_prompt
from context.prompt.fim import FimTemplate
from context.prompt.site import CompletionSite
from context.prompt.window import TokenCounter


class Cutter(Protocol):
    """Post-processing of one streamed completion."""

    raw: str  # the model's text so far, cut where feed() stopped it
    seen: str  # all the model's text, uncut

    def feed(self, chunk: str) -> bool:
        """Adds streamed text; True when the completion is complete (stop generating)."""
        ...

    def preview(self) -> str:
        """The text to show while the stream goes on."""
        ...

    def finish(self, truncated: bool) -> str:
        """The text to insert once the stream ended (``truncated``: by the token limit or the deadline)."""
        ...

    def why_empty(self, truncated: bool) -> str:
        """When :meth:`finish` gave ``""``: the step that left nothing of the model's text."""
        ...


class PlainCutter(StreamCutter):
    """The baseline without syntax, what a client that only cuts at line breaks does
    (:func:`context.cut.postprocess.plain_stop`)."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.raw = ""
        self._previewed = ""

    def _stop(self) -> int | None:
        return plain_stop(self.raw, self.mode)

    def preview(self) -> str:
        return plain_postprocess(strip_control_tokens(self._previewed), self.mode) if self._previewed else ""

    def finish(self, truncated: bool) -> str:
        return plain_postprocess(strip_control_tokens(self.raw), self.mode)

    def why_empty(self, truncated: bool) -> str:
        return WHY_NOTHING


PromptBuilder = Callable[[PromptRequest], Prompt]
CutterFactory = Callable[[CompletionSite, Prompt], Cutter]


def syntax_cutter(site: CompletionSite, prompt: Prompt) -> Cutter:
    return SyntaxCutter(site.prefix, site.suffix, site.language_id, site.mode, prompt.healed)


def plain_cutter(site: CompletionSite, prompt: Prompt) -> Cutter:
    return PlainCutter(site.mode)


@dataclass(frozen=True)
class Strategy:
    """One way to complete: the prompt builder and the post-processing of its output."""

    builder: PromptBuilder
    cutter: CutterFactory
    # The plain baseline sends the text as it is: re-aligning a healed prompt's output is
    # post-processing, which it goes without.
    heal: bool

    def prompt(
        self, site: CompletionSite, template: FimTemplate, counter: TokenCounter, budget: PromptBudget, layout: str = "append"
    ) -> Prompt:
        request = PromptRequest(
            site.text,
            site.offset,
            uri=site.uri,
            language_id=site.language_id,
            tree=site.tree,
            cursor_byte=site.cursor_byte,
            template=template,
            counter=counter,
            budget=budget,
            cross_file=site.cross_file,
            heal=self.heal,
            memo=site.memo,
            layout=layout,
        )
        return self.builder(request)


PROMPT_BUILDERS: dict[str, PromptBuilder] = {"ast": anchored_prompt, "naive": naive_prompt}
POSTPROCESSING: dict[str, tuple[CutterFactory, bool]] = {"syntax": (syntax_cutter, True), "plain": (plain_cutter, False)}


@lru_cache(maxsize=len(PROMPT_BUILDERS) * len(POSTPROCESSING))
def strategy(prompt_strategy: str, postprocess: str) -> Strategy:
    """The strategy for the settings' ``promptStrategy`` and ``postprocess`` (validated by the settings)."""
    cutter, heal = POSTPROCESSING[postprocess]
    return Strategy(PROMPT_BUILDERS[prompt_strategy], cutter, heal)
