"""Where a model stops writing code and starts chatting: a markdown fence or prose after its code.

Instruct models close their answer with a fence and explain it; :func:`chat_start` finds the first
such line so that the completion ends before it (markdown and plain text excepted, where fences
and sentences are the content).
"""

from __future__ import annotations

import re

from context.cut.surroundings import Mode, Surroundings, completeness
from context.source.languages import LanguageInfo

# A markdown fence: instruct models close their answer with one and write prose after it.
_FENCE = re.compile(r"^\s*```")


# Chat prose after code: a capitalised word and at least three more plain words, at column 0.
_PROSE = re.compile(r"^[A-Z][a-z]+(?:'[a-z]+)?,?(?:[ \t]+[\w'`\"(),.:!?/-]+){3,}[ \t]*$")


# The openers that chat models use for remarks, whatever follows them.
_PROSE_START = re.compile(
    r"^(?:Here(?:'s| is| are)\b|(?:This|The) (?:code|function|program|implementation|solution|example|output)\b"
    r"|(?:Explanation|Example usage|Usage|Output|Note|Notes)\s*:)"
)


# Starting a line, these continue code, never prose (`None if x else y`, `Some(x)`).
_CODE_WORDS = frozenset({"None", "True", "False", "Some", "Ok", "Err", "Self", "Nil"})


_WORD = re.compile(r"[A-Za-z']+[,.:!?]?")


def chat_start(lines: list[str], site: Surroundings, mode: Mode, final: bool) -> int | None:
    """The first complete line that is chat rather than code: a markdown fence (three
    backticks, with or without a language), or prose at column 0 after a blank line (``This
    function returns ...``); ``None`` when there is none. Lines inside a multi-line string or
    comment (a docstring with an example) are code.

    Line 0 is only judged when it is a whole line of code (``multi``; in ``single`` on a blank
    line the cursor sits in a string or comment, where a fence is text)."""
    if site.info.prose:
        return None  # fences and sentences are the content of markdown and plain text
    complete = completeness(len(lines), final)
    state = _open_block(site.before, site.info, None)
    for i, line in enumerate(lines):
        if not complete(i):
            return None
        judged = i > 0 or (mode == "multi" and site.blank_before)
        if judged and state is None:
            if _FENCE.match(line):
                return i
            if i > 0 and not lines[i - 1].strip() and _looks_like_prose(line):
                return i
        state = _open_block(line, site.info, state)
    return None


def _open_block(line: str, info: LanguageInfo, state: str | None) -> str | None:
    """The multi-line string or comment still open after ``line`` (one of ``info.multiline_openers``:
    a triple quote, a template string's backtick, ``/*``), given the one open before it. A rough
    lexer: one-line strings and line comments are skipped so that their quotes do not count."""
    pos = 0
    while pos < len(line):
        if state is not None:
            close = info.multiline_closer(state)
            end = line.find(close, pos)
            if end < 0:
                return state
            state, pos = None, end + len(close)
            continue
        m = info.multiline_tokens.search(line, pos)
        if m is None:
            return None
        token = m.group(0)
        # Either lexer's line comment (each finds only its own). Not info.line_comment: Ruby and
        # shell scripts are read with the C-like lexer, whose `//` has always ended the scan there.
        if token in ("#", "//"):
            return None
        if token in info.multiline_openers:
            state = token
        pos = m.end()
    return state


def _looks_like_prose(line: str) -> bool:
    """An English sentence at column 0 (chat text), not a line of code: a capitalised word, then
    plain words; no operators, no braces, no trailing ``;`` or ``{``."""
    if line[:1].isspace() or not line.strip():
        return False
    if _PROSE_START.match(line):
        return True
    if not _PROSE.match(line) or line.split()[0].rstrip(",") in _CODE_WORDS:
        return False
    return sum(1 for word in line.split() if _WORD.fullmatch(word)) >= 4
