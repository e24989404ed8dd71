"""The streaming cutters (context.prompt.strategy, context.cut.postprocess.SyntaxCutter) against the string
functions they are built from, on the dev sets' cursors: fed in chunks of any size, a cutter stops
where ``find_stop`` / ``plain_stop`` stop on the text so far, previews what ``postprocess`` /
``plain_postprocess`` give for it, and finishes with their answer."""

from __future__ import annotations

import json
import random

import pytest

from context.cut import postprocess as postprocess_module
from context.cut.control_tokens import strip_control_tokens
from context.cut.postprocess import SyntaxCutter, completion_mode, find_stop, plain_postprocess, plain_stop, postprocess
from context.prompt.builder import PromptBudget
from context.prompt.fim import choose_template
from context.prompt.site import AROUND_CHARS, site_at
from context.prompt.strategy import PlainCutter, strategy
from context.prompt.window import ApproxCounter
from context.source.document import Document
from tests.conftest import EVAL

ENDINGS = ["", "<|endoftext|>", "<|file_sep|>more", "\n\n```\nThis function returns the area.\n", "\n" * 3]


def cases(n: int) -> list[dict]:
    rows: list[dict] = []
    for name in ("humaneval_infilling_dev.jsonl", "safim_dev.jsonl"):
        with open(EVAL / name) as f:
            lines = f.readlines()
        rows += [json.loads(line) for line in random.Random(7).sample(lines, n)]
    return rows


def chunks(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        step = rng.choice([1, 1, 2, 3, 5, 8, 40])
        out.append(text[i : i + step])
        i += step
    return out


def generations(case: dict, rng: random.Random) -> list[str]:
    """What a model might write at the cursor: the answer, the answer running on into the suffix
    (the model repeating what follows), a wrong indentation, each with an ending."""
    middle, suffix = case["middle"], case["suffix"]
    texts = [middle, middle + suffix[:300], "\n" + middle, middle.replace("    ", "\t")]
    return [text + rng.choice(ENDINGS) for text in texts]


def reference(raw_chunks: list[str], prefix: str, suffix: str, lang: str, mode: str, healed: str, plain: bool):
    """The completer's loop before the cutters existed: (the stopped raw text, previews, final);
    the final text of a stopped stream is post-processed as such (``stopped``)."""
    raw, previews = "", []
    stopped = False

    def finish(text: str, truncated: bool, partial: bool) -> str:
        text = strip_control_tokens(text)
        if plain:
            return plain_postprocess(text, mode)
        return postprocess(
            text, prefix, suffix, lang, mode, healed=healed, truncated=truncated, partial=partial, stopped=stopped and not partial
        )

    for chunk in raw_chunks:
        raw += chunk
        cut = plain_stop(raw, mode) if plain else find_stop(raw, prefix, suffix, lang, mode, healed=healed)
        if cut is not None:
            raw, stopped = raw[:cut], True
            break
        previews.append(finish(raw, False, partial=True))
    return raw, previews, finish(raw, True, partial=False), finish(raw, False, partial=False)


@pytest.mark.parametrize("plain", [False, True], ids=["syntax", "plain"])
def test_cutters_agree_with_the_string_functions_on_dev_set_cursors(plain: bool) -> None:
    rng = random.Random(11)
    checked = 0
    for case in cases(60):
        prefix = case["prefix"][-AROUND_CHARS:]
        suffix = case["suffix"][:AROUND_CHARS]
        lang = case["language"]
        mode = completion_mode(prefix, suffix, lang)
        healed = rng.choice(["", " ", prefix[len(prefix.rstrip(" \t")) :]])
        for generated in generations(case, rng):
            raw_chunks = chunks(generated, rng)
            cutter = PlainCutter(mode) if plain else SyntaxCutter(prefix, suffix, lang, mode, healed)
            previews = []
            for chunk in raw_chunks:
                if cutter.feed(chunk):
                    break
                previews.append(cutter.preview())
            raw, want_previews, want_truncated, want_final = reference(raw_chunks, prefix, suffix, lang, mode, healed, plain)
            assert cutter.raw == raw, case["id"]
            assert previews == want_previews, case["id"]
            assert cutter.finish(True) == want_truncated, case["id"]
            assert cutter.finish(False) == want_final, case["id"]
            checked += 1
    assert checked == 480


def test_a_cutter_stops_where_the_block_ends_and_keeps_the_preview_of_the_text_before() -> None:
    prefix, suffix = "def area(r):\n    ", "\n\nprint(area(2))\n"
    cutter = SyntaxCutter(prefix, suffix, "python", "multi")
    assert not cutter.feed("return 3.14 * r")
    assert cutter.preview() == "return 3.14 * r"
    assert not cutter.feed(" * r\n")
    assert cutter.feed("print(area(2))\n")  # the suffix's next line: the block is complete
    assert cutter.preview() == "return 3.14 * r * r"  # as of the last chunk that did not stop
    assert cutter.finish(False) == "return 3.14 * r * r"


def test_the_strategy_builds_the_prompt_from_the_site_and_picks_the_cutter() -> None:
    doc = Document("file:///a.py", "python", "import math\n\ndef area(r):\n    \n")
    site = site_at(doc, doc.offset_at(3, 4))
    assert site.mode == "multi" and site.language_id == "python" and site.prefix.endswith("def area(r):\n    ")
    template = choose_template(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"], "qwen2.5-coder")
    budget = PromptBudget.for_model(2048, 48)
    ember = strategy("ast", "syntax")
    prompt = ember.prompt(site, template, ApproxCounter(), budget)
    assert prompt.text.startswith("<|fim_prefix|>") and "def area(r):" in prompt.text
    assert isinstance(ember.cutter(site, prompt), SyntaxCutter)
    plain = strategy("naive", "plain")
    assert isinstance(plain.cutter(site, plain.prompt(site, template, ApproxCounter(), budget)), PlainCutter)
    assert strategy("ast", "syntax") is ember  # resolved once per settings value


def test_the_settings_offer_exactly_the_strategies_there_are() -> None:
    # lsp/config.py spells the names out so that the stdio forwarder need not import the pipeline.
    from context.prompt.strategy import POSTPROCESSING, PROMPT_BUILDERS
    from lsp.config import _CHOICES

    assert _CHOICES["prompt_strategy"] == tuple(PROMPT_BUILDERS)
    assert _CHOICES["postprocess"] == tuple(POSTPROCESSING)


# ------------------------------------------------------------------------------ why an answer is empty

EXPLAINED = [
    # (before the cursor, after it, mode, the model's text, the step that left nothing)
    ('def read_lines(path):\n    """Doc."""\n    ', "\n", "multi", "\ndef", postprocess_module.WHY_LEFT_BLOCK),
    ("def total(self):\n    return ", "self.price * self.quantity\n", "single", "self.price * self.quantity\n\n", postprocess_module.WHY_OVERLAP),
    ("def f(x):\n    return ", "\n", "single", "<|endoftext|>", postprocess_module.WHY_NOTHING),
    ("def f(x):\n    return ", "\n", "single", "", postprocess_module.WHY_NOTHING),
    ("def f(x):\n    ", "\n    return x\n", "multi", "return x\n", postprocess_module.WHY_REPEATS_NEXT),
    ("x = [1, 2", "]\n", "single", "]]\n", postprocess_module.WHY_CLOSERS),
    ("def f(x):\n    ", "\n", "multi", "```python\nx = 1\n", postprocess_module.WHY_PROSE),
    ("def f(x):\n    ", "\n", "multi", "else:\n        pass\n", postprocess_module.WHY_SYNTAX),
    ("foo(", "bar)\n", "single", "\nbaz\n", postprocess_module.WHY_SPLITS_LINE),
]


@pytest.mark.parametrize(("before", "after", "mode", "generated", "why"), EXPLAINED)
def test_an_empty_answer_names_the_step_that_emptied_it(before: str, after: str, mode: str, generated: str, why: str) -> None:
    """Fed in one chunk or character by character (a stop at the very start cuts the text to
    nothing, and the reason is then read from what was cut), the answer is empty and says why."""
    for pieces in ([generated], list(generated)):
        cutter = SyntaxCutter(before, after, "python", mode)  # type: ignore[arg-type]
        for piece in pieces:
            if cutter.feed(piece):
                break
        assert cutter.finish(False) == ""
        assert cutter.why_empty(False) == why
