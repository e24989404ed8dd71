"""How sure the model was of the text ember shows, and what happens to a suggestion it was not sure of.

The engine reports the log-probability of every token it sampled; a :class:`TokenTrace` keeps them
by where their text ends in the model's output, so that the confidence is that of the text the
cutter kept, not of everything generated. A :class:`Calibration` (per model family, fitted on the
dev sets by ``bench/confidence.py``) turns the kept text's log-probabilities into the probability
that the suggestion is exactly right; :func:`judge` hides a suggestion below ``min_confidence``,
drops the lines of a block after the model's confidence falls, and never shows degenerate
repetition.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

# A run of 3-12 non-space characters repeated four or more times in a row ("foo(foo(foo(foo(").
_REPEATED_RUN = re.compile(r"(\S{3,12}?)\1{3,}")
_REPEATED_LINE_MIN_CHARS = 8  # the same line this long (non-space), three or more times in a row
_REPEATED_LINE_TIMES = 3


@dataclass
class TokenTrace:
    """The sampled tokens' log-probabilities, each with the span of the model's output that its
    chunk's text covers (a chunk is usually one token)."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    length: int = 0  # characters of output seen so far

    def add(self, text: str, logprobs: Sequence[float]) -> None:
        span = (self.length, self.length + len(text))
        self.length = span[1]
        for value in logprobs:
            self.spans.append(span)
            self.logprobs.append(value)

    def within(self, start: int, end: int) -> list[float]:
        """The log-probabilities of the tokens whose text overlaps ``[start, end)`` of the output."""
        return [value for (first, last), value in zip(self.spans, self.logprobs, strict=True) if last > start and first < end]


@dataclass(frozen=True)
class Calibration:
    """P(exact) = sigmoid(bias + min_weight * min + mean_weight * mean + length_weight * ln(1 + tokens))
    over the kept text's token log-probabilities; ``min_confidence``: the default threshold;
    ``line_logprob``: a block's lines after the first end where a line's lowest token
    log-probability falls below this (None: blocks are not shortened)."""

    bias: float
    min_weight: float
    mean_weight: float
    length_weight: float
    min_confidence: float
    line_logprob: float | None = None

    def probability(self, logprobs: Sequence[float]) -> float:
        if not logprobs:
            return 0.0
        return self.probability_of(min(logprobs), sum(logprobs) / len(logprobs), len(logprobs))

    def probability_of(self, lowest: float, mean: float, tokens: int) -> float:
        """The same from the kept text's lowest and mean log-probability and its token count
        (what ``ember/stats`` reports, so that bench/confidence.py scores recorded answers)."""
        score = self.bias + self.min_weight * lowest + self.mean_weight * mean + self.length_weight * math.log1p(tokens)
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, score))))


@dataclass(frozen=True)
class CalibratedFamily:
    """The models a calibration was fitted for: the FIM templates they are prompted with and a
    pattern that their name (a hub id, a file or folder name, a remote server's model name;
    lowercased) matches."""

    templates: frozenset[str]
    name: re.Pattern[str]
    calibration: Calibration


# Fitted by bench/confidence.py on the dev sets, each model as Q4_K_M (SmolLM2: Q4_1) on ember's
# llama.cpp engine (the commands, the curves and what each threshold hides are in bench/README.md).
# The threshold is the highest that keeps 90% of the exact answers on every dev set.
# SmolLM2 writes 4% of the dev answers exactly (none of HumanEval's: it has no FIM); keeping 90% of
# them allows no threshold above 0: its calibration reports a probability and hides nothing.
SMOLLM2_135M = Calibration(bias=4.8624, min_weight=0.9998, mean_weight=6.5034, length_weight=-1.8844, min_confidence=0.0)
QWEN25_CODER_05B = Calibration(bias=3.3385, min_weight=0.8589, mean_weight=5.0662, length_weight=-1.3862, min_confidence=0.03)
QWEN25_CODER_15B = Calibration(bias=4.7113, min_weight=0.0330, mean_weight=9.4462, length_weight=-1.7629, min_confidence=0.14)

_QWEN_TEMPLATES = frozenset({"qwen2.5-coder", "qwen2.5-coder-repo"})
# The template tells the family, the name its size: a bigger model is surer of the same text.
CALIBRATIONS: tuple[CalibratedFamily, ...] = (
    CalibratedFamily(frozenset({"prefix-only"}), re.compile(r"smollm2-135m"), SMOLLM2_135M),
    CalibratedFamily(_QWEN_TEMPLATES, re.compile(r"qwen2\.5-coder-0\.5b"), QWEN25_CODER_05B),
    CalibratedFamily(_QWEN_TEMPLATES, re.compile(r"qwen2\.5-coder-1\.5b"), QWEN25_CODER_15B),
)


def calibration_for(template: str, *names: str) -> Calibration | None:
    """The calibration of the model family that a model prompted with ``template`` belongs to, told
    by any of its ``names`` (its own, where it was loaded from); None for a model ember has none
    for (it shows everything but degenerate repetition)."""
    lowered = [name.lower() for name in names]
    families = (f for f in CALIBRATIONS if template in f.templates and any(f.name.search(name) for name in lowered))
    return next((f.calibration for f in families), None)


def uncalibrated(logprobs: Sequence[float]) -> float:
    """A model without a calibration: the geometric mean of the kept tokens' probabilities."""
    return math.exp(sum(logprobs) / len(logprobs)) if logprobs else 0.0


def degenerate(text: str) -> bool:
    """Repetition no user would keep: a run of 3-12 non-space characters (of at least two kinds)
    four or more times in a row, or the same line of eight or more non-space characters three or
    more times in a row. A repeated ``}`` or ``pass``, or a ``# -----`` rule, is code."""
    return _first_degenerate_line(text.split("\n")) is not None


def _repeated_line(lines: Sequence[str]) -> int | None:
    """The index of the first line of a run of identical long lines, if there is one."""
    run = 1
    for i in range(1, len(lines)):
        same = lines[i].strip() == lines[i - 1].strip() and len("".join(lines[i].split())) >= _REPEATED_LINE_MIN_CHARS
        run = run + 1 if same else 1
        if run >= _REPEATED_LINE_TIMES:
            return i - run + 1
    return None


@dataclass(frozen=True)
class Verdict:
    """What to show of a suggestion: ``text`` ("" hides it), its ``confidence`` (None when the
    engine reported no log-probabilities), ``action``: "shown", "shortened", "hidden" (below
    the threshold), "degenerate" (repetition, hidden or cut before it) or "" (an empty answer),
    and ``kept``: the log-probabilities the confidence was computed from (the kept text's tokens)."""

    text: str
    confidence: float | None
    action: str
    kept: tuple[float, ...] = ()


def judge(
    text: str, raw: str, trace: TokenTrace, calibration: Calibration | None, min_confidence: float
) -> Verdict:
    """The verdict on ``text``, the cutter's post-processed answer to the model's output ``raw``
    (an empty answer has nothing to judge: action "")."""
    if not text.strip():
        return Verdict(text, None, "")
    lines = text.split("\n")
    action = "shown"
    first_repeat = _first_degenerate_line(lines)
    if first_repeat is not None:
        lines, action = lines[:first_repeat], "degenerate"
        if not "".join(lines).strip():
            return Verdict("", None, "degenerate")
    spans = _line_spans(lines, raw)
    if not trace.logprobs:
        return Verdict("\n".join(lines), None, action)
    if calibration is not None and calibration.line_logprob is not None and len(lines) > 1:
        for i in range(1, len(lines)):
            span = spans[i]
            line_logprobs = trace.within(span[0], span[1]) if span is not None else []
            if line_logprobs and min(line_logprobs) < calibration.line_logprob:
                lines, action = lines[:i], action if action == "degenerate" else "shortened"
                break
    kept = _kept_logprobs(spans[: len(lines)], raw, trace)
    confidence = calibration.probability(kept) if calibration is not None else uncalibrated(kept)
    if confidence < min_confidence:
        return Verdict("", confidence, "hidden", tuple(kept))
    return Verdict("\n".join(lines), confidence, action, tuple(kept))


def _first_degenerate_line(lines: Sequence[str]) -> int | None:
    """The first line to drop for repetition: one with a repeated run, or the second of a run of
    identical lines (the first occurrence may stay)."""
    for i, line in enumerate(lines):
        if any(len(set(m.group(1))) >= 2 for m in _REPEATED_RUN.finditer(line)):
            return i
    start = _repeated_line(lines)
    return None if start is None else start + 1


def _line_spans(lines: Sequence[str], raw: str) -> list[tuple[int, int] | None]:
    """Where each shown line's content lies in the model's output, found in order (the cutter
    re-indents and trims, but keeps the model's words)."""
    spans: list[tuple[int, int] | None] = []
    cursor = 0
    for line in lines:
        content = line.strip()
        found = raw.find(content, cursor) if content else -1
        if found < 0:
            spans.append(None)
            continue
        spans.append((found, found + len(content)))
        cursor = found + len(content)
    return spans


def _kept_logprobs(spans: Sequence[tuple[int, int] | None], raw: str, trace: TokenTrace) -> list[float]:
    """The log-probabilities of the tokens up to the end of the last shown line's text in the
    output (everything, when it cannot be found there)."""
    ends = [span[1] for span in spans if span is not None]
    end = ends[-1] if ends else len(raw)
    return trace.within(0, end) or trace.logprobs
