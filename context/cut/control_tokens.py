"""Control tokens in the model's output: FIM and chat markers that a model may write as text, and
the broken-up copies of them that the prompt builder puts in place of control-token strings in the
user's own code (:func:`context.prompt.fim.neutralize_control_tokens`).
"""

from __future__ import annotations

import re

LEAKING_TOKEN = re.compile(
    r"<\|[a-z_]+\|>|<fim_[a-z]+>|<(?:file_sep|repo_name|gh_stars)>|<｜[^｜]+｜>|<(?:PRE|SUF|MID|EOT)>|\[(?:PREFIX|SUFFIX)\]"
)
# Zero-width space: breaks a control token's string so the tokenizer reads it as plain text; a
# human reading the prompt sees the same code.
TOKEN_BREAK = "\u200b"


def strip_control_tokens(text: str) -> str:
    """Remove FIM/chat control tokens that a model may emit as text, and undo
    :func:`context.prompt.fim.neutralize_control_tokens` where the model copied a broken-up one from the prompt (it
    is the user's own text then, and a zero-width space must not land in their file)."""
    text = LEAKING_TOKEN.sub("", text)
    if TOKEN_BREAK in text:
        text = text.replace("<" + TOKEN_BREAK, "<").replace("[" + TOKEN_BREAK, "[")
    return text
