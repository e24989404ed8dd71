"""Fill-in-the-middle templates per model family, chosen from the model's special tokens.

Order matters for the KV cache: with suffix-prefix-middle (SPM) the text before the cursor sits
last, so typing only appends to the prompt. Families trained on SPM use it; the others use
prefix-suffix-middle with a short suffix, which keeps all of the prefix cached anyway.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FimTemplate:
    name: str
    prefix: str = ""
    suffix: str = ""
    middle: str = ""
    order: str = "psm"  # "psm", "spm" or "none" (prefix only)
    stop: tuple[str, ...] = ()

    @property
    def has_fim(self) -> bool:
        return self.order != "none"

    def render(self, head: str, prefix: str, suffix: str) -> str:
        """``head`` is the stable context (other files, imports) that precedes the prefix."""
        if self.order == "none":
            return head + prefix
        if self.order == "spm":
            return f"{self.suffix}{suffix}{self.prefix}{head}{prefix}{self.middle}"
        return f"{self.prefix}{head}{prefix}{self.suffix}{suffix}{self.middle}"


PREFIX_ONLY = FimTemplate("prefix-only", order="none")

TEMPLATES: dict[str, FimTemplate] = {
    t.name: t
    for t in (
        FimTemplate(
            "qwen2.5-coder",
            "<|fim_prefix|>",
            "<|fim_suffix|>",
            "<|fim_middle|>",
            "psm",
            ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>"),
        ),
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
        FimTemplate("codestral", "[PREFIX]", "[SUFFIX]", "", "spm", ("</s>",)),
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

_LEAKING_TOKEN = re.compile(r"<\|[a-z_]+\|>|<fim_[a-z]+>|<｜[^｜]+｜>|<(?:PRE|SUF|MID|EOT)>|\[(?:PREFIX|SUFFIX)\]")


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


def strip_control_tokens(text: str) -> str:
    """Remove FIM/chat control tokens that a model may emit as text."""
    return _LEAKING_TOKEN.sub("", text)
