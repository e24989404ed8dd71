"""Fill-in-the-middle templates per model family, chosen from the model's special tokens.

Order matters for the KV cache: with suffix-prefix-middle (SPM) the text before the cursor sits
last, so typing only appends to the prompt. Families trained on SPM use it; the others use
prefix-suffix-middle (PSM), where the suffix would follow the cursor and be prefilled again after
every keystroke. So ember's PSM prompts put the cursor's own lines after the middle token, as the
start of the middle the model is writing (``<pre>window<suf>suffix<mid>typed``: the "append"
layout of :mod:`context.prompt.builder`), and typing only appends there too.

Two SPM layouts exist in the wild: BigCode's (StarCoder: ``<pre><suf>suffix<mid>prefix``, the
"variant 2" of the FIM paper that their training code emits) and Mistral's (``[SUFFIX]suffix
[PREFIX]prefix``). Both keep the prefix last; ``spm_lead``/``spm_join`` say which tokens go where.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache

from context.cut.control_tokens import LEAKING_TOKEN, TOKEN_BREAK


@dataclass(frozen=True)
class FimTemplate:
    name: str
    prefix: str = ""
    suffix: str = ""
    middle: str = ""
    order: str = "psm"  # "psm", "spm" or "none" (prefix only)
    stop: tuple[str, ...] = ()
    # SPM only: the tokens before the suffix and between suffix and prefix; None = BigCode's
    # layout (prefix+suffix tokens, then the middle token).
    spm_lead: str | None = None
    spm_join: str | None = None
    # The repository-level format's tokens, where the family was trained on one (before the FIM
    # prefix: the repository's name, then each file after ``file_token`` and its path).
    repo_token: str = ""
    file_token: str = ""

    @property
    def has_fim(self) -> bool:
        return self.order != "none"

    def split(self, head: str, suffix: str) -> tuple[str, str]:
        """``(before, after)`` such that the prompt is ``before + prefix + after``.

        ``head`` is the stable context (other files, imports) that precedes the prefix. Kept apart
        from :meth:`render` so that callers know where the prefix starts without searching.
        """
        if self.order == "none":
            return head, ""
        if self.order == "spm":
            lead = self.prefix + self.suffix if self.spm_lead is None else self.spm_lead
            join = self.middle if self.spm_join is None else self.spm_join
            # The middle token (if the layout has one left) would break "typing only appends" if it
            # sat before the prefix; BigCode's layout already spent it in ``join``.
            tail = "" if self.spm_join is None else self.middle
            return f"{lead}{suffix}{join}{head}", tail
        return f"{self.prefix}{head}", f"{self.suffix}{suffix}{self.middle}"

    def render(self, head: str, prefix: str, suffix: str) -> str:
        before, after = self.split(head, suffix)
        return before + prefix + after

    @property
    def control_tokens(self) -> tuple[str, ...]:
        """The strings that the model's tokenizer turns into control tokens for this template."""
        marks = (self.prefix, self.suffix, self.middle, self.spm_lead or "", self.spm_join or "", *self.stop)
        return tuple(sorted({m.strip() for m in marks if m.strip()}))


PREFIX_ONLY = FimTemplate("prefix-only", order="none")

# Other files as path comments inside the prefix: with Qwen2.5-Coder-0.5B-Instruct (ember's default
# code model) the same workspace block laid out so got 27 of 118 stratified cross-file dev cases
# exactly right, in the repository format 21 (off: 25; +7 -1 against it;
# bench/results/crossfile-batch-b.json). "qwen2.5-coder-repo" keeps the repository format, for the
# base checkpoints it was trained with.
_QWEN = FimTemplate(
    "qwen2.5-coder",
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "psm",
    ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>"),
)

TEMPLATES: dict[str, FimTemplate] = {
    t.name: t
    for t in (
        _QWEN,
        replace(_QWEN, name="qwen2.5-coder-repo", repo_token="<|repo_name|>", file_token="<|file_sep|>"),
        FimTemplate(
            "starcoder2",
            "<fim_prefix>",
            "<fim_suffix>",
            "<fim_middle>",
            "spm",
            ("<|endoftext|>", "<file_sep>", "<fim_pad>"),
        ),
        FimTemplate(
            "deepseek-coder",
            "<｜fim▁begin｜>",
            "<｜fim▁hole｜>",
            "<｜fim▁end｜>",
            "psm",
            ("<｜end▁of▁sentence｜>", "<|EOT|>"),
        ),
        FimTemplate("codellama", "<PRE> ", " <SUF>", " <MID>", "psm", ("<EOT>", "</s>")),
        FimTemplate("codestral", "[PREFIX]", "[SUFFIX]", "", "spm", ("</s>",), spm_lead="[SUFFIX]", spm_join="[PREFIX]"),
        PREFIX_ONLY,
    )
}

# The token that identifies each family in a tokenizer's vocabulary.
_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|fim_prefix|>", "qwen2.5-coder"),
    ("<fim_prefix>", "starcoder2"),
    ("<｜fim▁begin｜>", "deepseek-coder"),
    ("▁<PRE>", "codellama"),
    ("<PRE>", "codellama"),
    ("[SUFFIX]", "codestral"),
)

# For remote engines whose vocabulary we cannot see: guess from the model name.
_NAME_HINTS: tuple[tuple[str, str], ...] = (
    (r"qwen.*coder", "qwen2.5-coder"),
    (r"starcoder", "starcoder2"),
    (r"deepseek.*coder", "deepseek-coder"),
    (r"codellama|code-llama", "codellama"),
    (r"codestral", "codestral"),
)

def choose_template(special_tokens: Iterable[str], model_name: str = "", override: str | None = None) -> FimTemplate:
    """The FIM template for a model; ``override`` (a template name) wins when given."""
    if override:
        if override not in TEMPLATES:
            raise ValueError(f"unknown FIM template {override!r}; known: {', '.join(sorted(TEMPLATES))}")
        return TEMPLATES[override]
    tokens = set(special_tokens)
    for marker, name in _MARKERS:
        if marker in tokens:
            return TEMPLATES[name]
    lowered = model_name.lower()
    for pattern, name in _NAME_HINTS:
        if re.search(pattern, lowered):
            return TEMPLATES[name]
    return PREFIX_ONLY


@lru_cache(maxsize=32)
def _control_pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    extra = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
    return re.compile(f"{LEAKING_TOKEN.pattern}|{extra}" if extra else LEAKING_TOKEN.pattern)


def neutralize_control_tokens(text: str, template: FimTemplate = PREFIX_ONLY) -> str:
    """Document text as it may enter a prompt: control-token strings that happen to be in the code
    (a file about FIM, an HTML ``</s>``) are broken up so the tokenizer cannot read them as the
    template's own markers."""
    pattern = _control_pattern(template.control_tokens)
    if pattern.search(text) is None:  # the common case: one scan, no copy
        return text
    return pattern.sub(lambda m: m.group(0)[0] + TOKEN_BREAK + m.group(0)[1:], text)
