"""What the text around the cursor says, summarised once per completion for post-processing.

:class:`Surroundings` (the cursor's line, the lines above and below, the document's indentation
style and line break, the language's :class:`~context.source.languages.LanguageInfo`) is what every
rule in context.cut.line_rules and context.cut.brackets reads; :func:`surroundings_of` builds it from the
windows around the cursor. Also here: the line helpers those rules share (closer lines, comments,
block openers) and the string/comment test behind :func:`context.cut.postprocess.completion_mode`.
Indentation is counted in columns by :func:`context.source.languages.indent_columns`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tree_sitter import Node, Tree

from context.source.languages import TAB_WIDTH, LanguageInfo, indent_columns, language_info, parser_for

Mode = Literal["single", "multi"]


# Only the ends of the document matter for the decisions here, and find_stop runs per streamed
# chunk: never scan more than this much of the prefix/suffix.
_SCAN_CHARS = 8000


# Bracket decisions parse at most this much on each side of the cursor.
_PARSE_CHARS = 64_000


# completion_mode's string/comment check parses at most this much on each side.
_MODE_PARSE_CHARS = 8_000


_CLOSER_LINE = re.compile(r"^(?:[)\]}][)\]};,]*|end\b[;,]?)$")


# A trailing comment without quotes in it, so that `x = {  # note` still ends with `{`.
_TRAILING_COMMENT = re.compile(r"\s*(?:#|//)[^\"'`]*$")


_COMMENT_TYPES = ("comment",)


_STRING_TYPES = ("string", "template_string", "heredoc", "char_literal", "text_block")


@dataclass(frozen=True)
class Surroundings:
    """The cursor's surroundings, summarised once per (prefix, suffix, language)."""

    lang: str
    info: LanguageInfo  # the lexical facts of ``lang``, looked up once
    before: str  # the cursor's line up to the cursor
    after: str  # the cursor's line from the cursor to its end, without the line break
    prev_line: str  # the last non-blank line above the cursor's line, "" when none
    next_lines: tuple[str, ...]  # the first non-blank whole lines after the cursor
    indent_char: str | None  # "\t" or " " when the document is consistent, else None
    indent_unit: int  # columns per level
    eol: str  # "\n" or "\r\n"
    ancestors: tuple[str, ...] = ()  # the lines above whose indentation drops, nearest first
    unit_known: bool = False  # indent_unit was seen in the document, not a default

    def enclosing(self, width: int) -> str | None:
        """The nearest line above the cursor indented less than ``width`` (a block's header)."""
        return next((a for a in self.ancestors if indent_columns(a) < width), None)

    @property
    def blank_before(self) -> bool:
        return not self.before.strip()

    @property
    def column(self) -> int:
        return indent_columns(self.before) if self.blank_before else len(self.before)


def surroundings_of(prefix: str, suffix: str, lang: str) -> Surroundings:
    head = prefix[-_SCAN_CHARS:]
    tail = suffix[:_SCAN_CHARS]
    above = head.split("\n")
    before = no_cr(above[-1])
    below = tail.split("\n")
    after = no_cr(below[0])

    prev_line = ""
    for line in reversed(above[:-1]):
        if line.strip():
            prev_line = no_cr(line).rstrip()
            break

    next_lines: list[str] = []
    # Only whole lines: the rest of a line with code before the cursor is a fragment, handled by
    # the same-line overlap rule instead.
    if not before.strip() and after.strip():
        next_lines.append((before + after).rstrip())
    for line in below[1:]:
        if len(next_lines) >= 8:
            break
        if line.strip():
            next_lines.append(no_cr(line).rstrip())

    ancestors: list[str] = []
    lowest = 1 << 30
    for line in reversed(above[:-1]):
        stripped = line.strip()
        if not stripped or is_comment(stripped):
            continue
        width = indent_columns(line)
        if width < lowest:
            ancestors.append(no_cr(line).rstrip())
            lowest = width
            if width == 0:
                break

    # The cursor's own indentation counts: it is often the only indented line of a new file.
    own = [before + "x"] if before and not before.strip() else []
    indent_char, unit, known = _indent_style(above[-200:-1] + own + below[:100])
    eol = "\r\n" if "\r\n" in head[-2000:] or "\r\n" in tail[:2000] else "\n"
    return Surroundings(
        lang, language_info(lang), before, after, prev_line, tuple(next_lines), indent_char, unit, eol, tuple(ancestors), known
    )


def _indent_style(lines: list[str]) -> tuple[str | None, int, bool]:
    """(indent character, columns per level, whether that width was seen rather than assumed).
    The character is ``None`` unless (nearly) every indented line uses it: in a document that
    mixes tabs and spaces the model's choice is as good as ours, and converting would only move
    lines around. The width is "seen" when it is the most common step, at least twice: only then
    may a model's levels be rescaled to it."""
    tab_lines = space_lines = 0
    steps: dict[int, int] = {}
    last = 0
    for line in lines:
        if not line.strip():
            continue
        lead = leading_space(line)
        if "\t" in lead:
            tab_lines += 1
        # " * " continues a block comment in a tab-indented C file; not an indentation choice.
        elif lead and not line.lstrip().startswith("*"):
            space_lines += 1
        width = indent_columns(line)
        if width > last:
            steps[width - last] = steps.get(width - last, 0) + 1
        last = width
    total = tab_lines + space_lines
    char: str | None = None
    if total and tab_lines >= 0.97 * total:
        char = "\t"
    elif total and space_lines >= 0.97 * total:
        char = " "
    if char == "\t":
        return char, TAB_WIDTH, True
    common = [s for s in sorted(steps, key=lambda s: -steps[s]) if s in (2, 3, 4, 8)]
    if not common:
        return char, 4, False
    unit = common[0]
    known = steps[unit] >= 2 and all(steps[s] < steps[unit] for s in common[1:])
    return char, unit, known


def inside_string_or_comment(
    prefix: str, suffix: str, lang: str, tree: Tree | None = None, cursor_byte: int | None = None
) -> bool:
    if tree is not None and cursor_byte is not None:
        # The document's own tree is up to date: no parse on the request path.
        return string_or_comment_at(tree.root_node, cursor_byte)
    parser = parser_for(lang)
    if parser is None:
        return False
    # Once per request, on the request path: a window keeps a huge file from costing ~60 ms.
    prefix, suffix = parse_window(prefix, suffix, _MODE_PARSE_CHARS)
    pos = len(prefix.encode("utf-8"))
    parsed = parser.parse((prefix + suffix).encode("utf-8"))
    return string_or_comment_at(parsed.root_node, pos)


def string_or_comment_at(root: Node, pos: int) -> bool:
    """Is byte ``pos`` strictly inside a string or comment node of the tree under ``root``?"""
    node: Node | None = root.descendant_for_byte_range(pos, pos)
    while node is not None:
        kind = node.type
        if any(t in kind for t in _COMMENT_TYPES + _STRING_TYPES) and node.start_byte < pos < node.end_byte:
            return True
        node = node.parent
    return False


def no_cr(line: str) -> str:
    return line[:-1] if line.endswith("\r") else line


def leading_space(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def opens_block(line: str, info: LanguageInfo) -> bool:
    """Does ``line`` end with one of the language's block openers (its body on the next lines)?"""
    if is_comment(line.strip()):
        return False  # `# Examples:` / `/* Usage:` open no block
    code = _TRAILING_COMMENT.sub("", line.rstrip())
    return code.endswith(info.block_openers)


def is_closer_line(stripped: str) -> bool:
    return bool(_CLOSER_LINE.match(stripped))


def is_comment(stripped: str) -> bool:
    # `#` also covers C preprocessor lines: like comments, they end no block.
    return stripped.startswith(("#", "//", "/*", "*"))


def same_line(line: str, other: str) -> bool:
    """Does ``line`` repeat ``other``? Indentation must match too: the same text at another depth
    is usually a legitimate statement of another block (``return False`` after an inner ``if``),
    and by the time lines are compared their indentation has been fixed."""
    a, b = line.strip(), other.strip()
    return bool(a) and a == b and indent_columns(line) == indent_columns(other)


def parse_window(prefix: str, suffix: str, limit: int = _PARSE_CHARS) -> tuple[str, str]:
    """The part of a huge document that a decision parses (whole lines near the cursor): the
    candidates differ only at the cursor, and parsing megabytes per candidate is slow."""
    if len(prefix) > limit:
        cut = prefix.find("\n", len(prefix) - limit)
        prefix = prefix[cut + 1 :] if cut >= 0 else prefix[-limit:]
    if len(suffix) > limit:
        cut = suffix.rfind("\n", 0, limit)
        suffix = suffix[:cut] if cut >= 0 else suffix[:limit]
    return prefix, suffix


def completeness(n: int, final: bool) -> Callable[[int], bool]:
    """Is line ``i`` of ``n`` complete? All but the last are; the last only in the final text."""
    return lambda i: i < n - 1 or final

