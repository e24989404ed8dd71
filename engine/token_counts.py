"""What counts a prompt's tokens for its budgets: the model's own tokenizer (transformers', or the
``tokenizers`` library's read from a GGUF file), or an estimate when neither is at hand."""

from __future__ import annotations

import math
from typing import Any


class ApproxTokenizer:
    """Estimates tokens as characters / 3.5 when the model's tokenizer is not available locally."""

    chars_per_token = 3.5

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)


class HFTokenizer:
    """Counts tokens with the model's own tokenizer (for prompt budgets)."""

    def __init__(self, tokenizer: Any) -> None:  # transformers tokenizer: untyped on purpose
        self._tok = tokenizer

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))


class TokenizersTokenizer:
    """Counts tokens with the model's own tokenizer (the ``tokenizers`` library, no transformers)."""

    def __init__(self, tokenizer: Any) -> None:  # tokenizers.Tokenizer
        self._tok = tokenizer

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def vocabulary(self) -> dict[str, int]:
        return dict(self._tok.get_vocab())
