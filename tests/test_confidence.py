"""The confidence gate (context.cut.confidence): the confidence is that of the text ember shows,
low ones are hidden (and cached as such), a block is shortened where the model's confidence falls,
and degenerate repetition is never shown. The pure functions here; through the completer with the
scripted engine in test_completer.py (hidden and cached, shortened, the preview gated, the counts);
the real engines' log-probabilities in test_server.py (embedded) and test_remote.py (a vLLM OpenAI
server)."""

from __future__ import annotations

import pytest

from context.cut import confidence
from context.cut.confidence import TokenTrace, degenerate, judge
from lsp.config import ConfigError, Settings, merge_settings
from tests.test_completer import CALIBRATION, SURE, UNSURE


@pytest.mark.parametrize(
    "text",
    [
        "foo(foo(foo(foo(foo(",
        "x = abcabcabcabcabc",
        "    print('hello world')\n    print('hello world')\n    print('hello world')",
    ],
)
def test_degenerate_repetition_is_recognised(text: str) -> None:
    assert degenerate(text)


@pytest.mark.parametrize(
    "text",
    [
        "return x",
        "}\n}\n}\n}",  # closing brackets are code
        "pass\npass\npass",  # short lines
        "# ------------------------------------",  # a rule: one kind of character
        "print('hello world')\nprint('hello world')\nprint('goodbye')",  # twice is not three times
        "values = [0, 0, 0, 0, 0]",
    ],
)
def test_code_is_not_degenerate(text: str) -> None:
    assert not degenerate(text)


def test_trace_finds_the_tokens_of_a_span() -> None:
    trace = TokenTrace()
    trace.add(" *", [-0.1])
    trace.add(" height", [-0.2, -0.3])  # one chunk, two tokens: both end where the chunk does
    trace.add("\n", [-0.4])
    assert trace.within(0, 2) == [-0.1]
    assert trace.within(2, 3) == [-0.2, -0.3]
    assert trace.within(0, 9) == [-0.1, -0.2, -0.3]
    assert trace.within(9, 10) == [-0.4]


def test_confidence_is_of_the_kept_text_not_of_what_was_generated() -> None:
    trace = TokenTrace()
    trace.add(" * height", [SURE])
    trace.add("\nprint(area(2, 3))", [UNSURE])  # cut away by the cutter: does not count
    verdict = judge(" * height", " * height\nprint(area(2, 3))", trace, None, 0.5)
    assert verdict == confidence.Verdict(" * height", pytest.approx(0.95), "shown", (SURE,))


def test_below_the_threshold_is_hidden_and_without_logprobs_nothing_is_judged() -> None:
    trace = TokenTrace()
    trace.add(" * height", [UNSURE])
    assert judge(" * height", " * height", trace, None, 0.5) == confidence.Verdict("", pytest.approx(0.05), "hidden", (UNSURE,))
    assert judge(" * height", " * height", trace, None, 0.0).text == " * height"
    assert judge(" * height", " * height", TokenTrace(), None, 0.9) == confidence.Verdict(" * height", None, "shown")
    assert judge("", " \n", trace, None, 0.9) == confidence.Verdict("", None, "")  # nothing to judge: not "hidden"


def test_a_block_is_shortened_where_the_confidence_falls() -> None:
    raw = "    total = 0\n    for item in items:\n        total += item.prize\n    return total\n"
    trace = TokenTrace()
    for line, value in zip(raw.split("\n"), [SURE, SURE, UNSURE, SURE], strict=False):
        trace.add(line + "\n", [value])
    text = raw.rstrip("\n")
    verdict = judge(text, raw, trace, CALIBRATION, CALIBRATION.min_confidence)
    assert verdict.text == "    total = 0\n    for item in items:"
    assert verdict.action == "shortened" and verdict.confidence == pytest.approx(CALIBRATION.probability([SURE, SURE]))


def test_degenerate_repetition_is_cut_before_it_repeats_or_hidden() -> None:
    lines = ["    x = compute(a)", "    print('hello world')", "    print('hello world')", "    print('hello world')"]
    raw = "\n".join(lines)
    trace = TokenTrace()
    trace.add(raw, [SURE])
    verdict = judge(raw, raw, trace, None, 0.0)
    assert verdict.text == "\n".join(lines[:2]) and verdict.action == "degenerate"
    assert not degenerate(verdict.text)
    junk = "foo(foo(foo(foo(foo("
    assert judge(junk, junk, trace, None, 0.0) == confidence.Verdict("", None, "degenerate")


def test_min_confidence_setting_is_a_probability() -> None:
    assert merge_settings(Settings(), {"minConfidence": 0.3}).min_confidence == 0.3
    assert merge_settings(Settings(min_confidence=0.3), {"minConfidence": None}).min_confidence is None
    with pytest.raises(ConfigError, match=r"minConfidence must be between 0\.0 and 1\.0"):
        merge_settings(Settings(), {"minConfidence": 1.5})



@pytest.mark.parametrize(
    ("template", "name", "family"),
    [
        ("qwen2.5-coder", "ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF", confidence.QWEN25_CODER_05B),  # llama.cpp's default
        ("qwen2.5-coder", "Qwen/Qwen2.5-Coder-0.5B", confidence.QWEN25_CODER_05B),
        ("qwen2.5-coder", "qwen2.5-coder-0.5b-instruct-q4_k_m", confidence.QWEN25_CODER_05B),  # a .gguf file's stem
        ("qwen2.5-coder", "Qwen/Qwen2.5-Coder-1.5B", confidence.QWEN25_CODER_15B),  # vLLM's default on a GPU
        ("qwen2.5-coder", "qwen2.5-coder-1.5b-instruct-q4_k_m", confidence.QWEN25_CODER_15B),
        ("qwen2.5-coder-repo", "Qwen/Qwen2.5-Coder-1.5B", confidence.QWEN25_CODER_15B),  # other files laid out as a repo
        ("prefix-only", "SmolLM2-135M-Instruct", confidence.SMOLLM2_135M),  # the bundled model
        ("qwen2.5-coder", "Qwen/Qwen2.5-Coder-7B", None),  # not measured: everything is shown
        ("qwen2.5-coder", "Qwen/Qwen2.5-Coder-3B", None),
        ("starcoder2", "qwen2.5-coder-1.5b-as-starcoder2", None),  # prompted otherwise: not the fitted family
        ("prefix-only", "my-model", None),
    ],
)
def test_a_calibration_is_found_by_template_and_model_name(template: str, name: str, family: object) -> None:
    assert confidence.calibration_for(template, name) is family


def test_a_model_served_under_another_name_is_told_by_where_it_was_loaded_from() -> None:
    """README's recipe: ``vllm serve Qwen/Qwen2.5-Coder-1.5B --served-model-name qwen-coder``
    (``/v1/models`` lists ``qwen-coder`` with ``root`` the hub id)."""
    assert confidence.calibration_for("qwen2.5-coder", "qwen-coder") is None
    assert confidence.calibration_for("qwen2.5-coder", "qwen-coder", "Qwen/Qwen2.5-Coder-1.5B") is confidence.QWEN25_CODER_15B
