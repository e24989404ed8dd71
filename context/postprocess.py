"""From a raw model completion to the text that is safe to insert at the cursor.

The model sees the text before the cursor (prefix) and after it (suffix) and writes raw text for
the cursor. Users judge us by whether accepting it leaves their code right, so this module decides
(DESIGN.md, "Let syntax decide"):

* :func:`completion_mode`: one line or a block?
* :func:`find_stop`: while streaming, where the completion is complete (so generation can stop);
* :func:`postprocess`: the text to insert (cut, cleaned, re-indented, balanced against the suffix);
* :func:`syntax_ok`: the quality metric (inserting adds no tree-sitter ERROR/MISSING node).

All functions are pure (strings in, strings out). tree-sitter is used where a grammar exists (the
mode at the cursor, bracket balancing, the metric); everything else is line and indentation
heuristics, so a language without a grammar gets the same behaviour minus those checks, never an
error. ``find_stop`` and ``postprocess`` never raise: garbage in gives ``None`` / ``""`` out.

Shared conventions:

* Indentation widths count a tab as 4 columns, consistently on both sides of every comparison.
* Line breaks may be ``\\r\\n``; analysis ignores the ``\\r`` and :func:`postprocess` writes the
  document's own line break.
* A "closer line" holds only closing brackets (``}``, ``)``, ``]``) plus ``;`` / ``,``, or ``end``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Literal

from tree_sitter import Node

from context.languages import normalize_language_id, parser_for

log = logging.getLogger(__name__)

Mode = Literal["single", "multi"]

__all__ = ["Mode", "completion_mode", "find_stop", "postprocess", "syntax_ok", "strip_special_tokens"]

_TAB = 4
# Single mode follows brackets opened on its line through at most this many more lines.
_SINGLE_SPAN = 16
# Only the ends of the document matter for the decisions here, and find_stop runs per streamed
# chunk: never scan more than this much of the prefix/suffix.
_SCAN_CHARS = 8000
# Bracket decisions parse at most this much on each side of the cursor.
_PARSE_CHARS = 64_000
# completion_mode's string/comment check parses at most this much on each side.
_MODE_PARSE_CHARS = 8_000

# Special tokens of FIM models leak into text when the server does not treat them as stop
# strings. Anything of the `<|...|>` shape without spaces (Qwen, StarCoder2, CodeGemma, Llama 3),
# DeepSeek's full-width `<｜...｜>`, StarCoder's bare `<fim_prefix>` family, CodeLlama's
# `<PRE>`/`<SUF>`/`<MID>`/`<EOT>`. Spaces are excluded so that code using the F#/Elm operators
# `<|` and `|>` (`f <| x |> g`) survives.
_SPECIAL = re.compile(
    r"<\|[^\s|<>]{1,64}\|>"
    r"|<｜[^\s｜<>]{1,64}｜>"
    r"|<(?:fim_(?:prefix|suffix|middle|pad)|file_sep|filename|repo_name|gh_stars|empty_output)>"
    r"|<(?:PRE|SUF|MID|EOT)>"
)
# A model may echo the "middle" marker that ends its prompt before writing the completion; any
# other token at the start (end of text, file separator) means the completion is empty.
_LEADING_SPECIAL = re.compile(r"(?:<\|fim_middle\|>|<fim_middle>|<｜fim▁end｜>|<MID>)+")
# The start of a special token cut off by the end of the stream (only stripped from final text).
_PARTIAL_SPECIAL = re.compile(r"(?:<\|[^\s|<>]{0,64}\|?|<｜[^\s｜<>]{0,64}｜?|<(?:fim|file|repo)_\w*)$")

_CLOSERS = ")]}"
_OPENERS = "([{"
_PAIR = {")": "(", "]": "[", "}": "{"}
_CLOSER_LINE = re.compile(r"^(?:[)\]}][)\]};,]*|end\b[;,]?)$")
# Lines that continue a statement whose block has just been closed: not a new statement.
_CONTINUATION = re.compile(r"^(?:[)\]}]|else\b|elif\b|except\b|finally\b|catch\b|while\b.*[;)]\s*$)")
# A trailing comment without quotes in it, so that `x = {  # note` still ends with `{`.
_TRAILING_COMMENT = re.compile(r"\s*(?:#|//)[^\"'`]*$")
# A header that starts a definition: completions that start one stop after it (one definition at
# a time, like the peers), instead of writing the rest of the file.
_DEFINITION = re.compile(
    r"^\s*(?:(?:pub(?:\([^)]*\))?|export|default|async|static|public|private|protected|internal|"
    r"abstract|final|override|virtual|unsafe|extern|inline|const|sealed|open|suspend)\s+)*"
    r"(?:def|class|function|fn|func|impl|struct|enum|trait|interface|mod|type|union|namespace|"
    r"module|object)\b"
)
# Blocks whose bodies list definitions.
_CONTAINER = re.compile(
    r"^\s*(?:[\w()]+\s+)*(?:class|impl|interface|trait|namespace|mod|struct|enum|object|extern|module)\b"
)
# Java/C#/C++ methods: a return type, a name, parameters, a brace.
_METHOD = re.compile(r"^\s*(?:[\w<>\[\],.?*&:]+\s+)+[\w~]+\s*\([^;]*\)\s*[\w\s,.]*\{$")
_COMMENT_TYPES = ("comment",)
_STRING_TYPES = ("string", "template_string", "heredoc", "char_literal", "text_block")


# --------------------------------------------------------------------------------------------
# Public API


def completion_mode(prefix: str, suffix: str, language_id: str) -> Mode:
    """``"multi"`` when the cursor is on a line with nothing but whitespace before it, else ``"single"``.

    * Text before the cursor on its line (middle or end of a line): ``single``. The user is
      finishing a statement; a block after ``def f():|`` still comes as its first line, because
      single mode accepts a completion that starts with a line break when the line ends at the
      cursor (see :func:`find_stop`).
    * Only whitespace before the cursor: ``multi``. This covers the empty block body (after
      ``:`` + newline in Python, between ``{`` and a ``}`` on a later line), an empty line inside
      a just-opened block, and an empty line where a new statement or definition is expected
      (between statements, after the last one, at top level). How much of a block comes back
      is limited by :func:`find_stop` (indentation scope, the repeated next line, one
      definition at a time), not by the mode. The cursor at the start of a line that has code
      after it (whole lines being inserted above that code) is ``multi`` too; the completion
      then ends with a line break so the code keeps its own line.
      Unless that code starts with punctuation (``|;``, ``|)``, ``|.method()``, ``|= 1``): then
      the cursor is inside a statement that continues on the line, and the completion is an
      expression: ``single``.
    * Exception, from the syntax tree: an empty line inside a string or comment (docstring,
      block comment) is ``single``; prose has no block structure to stop on.
    """
    try:
        before = _line_before(prefix)
        if before.strip():
            return "single"
        after = suffix[: suffix.find("\n")] if "\n" in suffix else suffix
        if after.strip() and not _starts_statement(after.strip()):
            return "single"
        lang = normalize_language_id(language_id)
        if _inside_string_or_comment(prefix, suffix, lang):
            return "single"
        return "multi"
    except Exception:  # a mode decision must never break a request
        log.warning("completion_mode failed; using single", exc_info=True)
        return "single"


def find_stop(generated: str, prefix: str, suffix: str, language_id: str, mode: Mode) -> int | None:
    """The index in ``generated`` where the completion is complete, or ``None`` to keep going.

    Cheap enough to call per streamed chunk: string scans of ``generated`` plus a small cached
    summary of the cursor's surroundings; no parsing. A line is judged only once it is complete
    (its line break has arrived), so a decision never depends on how the stream was chunked.

    * A leaked special token (``<|endoftext|>``, ``<|file_sep|>`` ...) ends the completion where
      it starts; tokens at the very start are skipped.
    * ``single``: the end of the first line. A first line that is empty means the model wants to
      continue on the next line: when nothing follows the cursor on its line, the completion is
      that next non-blank line (``def f():|`` gets ``\\n    return x``); when text follows the
      cursor, a line break would split that text, so the completion ends at once (index 0).
      A line that leaves brackets open (``np.array([``, ``th([]() {``) runs on to the end of
      the line that closes them (at most 16 more lines, else the first line alone), so that
      "one line" never means "broken code". A line that repeats the next line of the suffix
      gives an empty completion.
    * ``multi``: the block ends before the first complete line that

      - equals the first non-blank line after the cursor, indentation included (the model
        repeats the next line),
      - is indented below the block's indentation (that of the first generated line), unless it
        is a closer line that the suffix does not already have (``}`` when the editor did not
        auto-close); closers are kept, and any other line after them ends the block,
      - when the completion started a definition where definitions are listed (``def``,
        ``fn``, ``class``, a method header at top level or in a class/impl body; any block
        opened at column 0), starts the next statement at the block's indentation.

      Comment lines never end a block by their indentation (commented-out code sits at column
      0); blank lines and comments indented below the block just before the stop are left out
      (they belong to what follows).

      Indentation is judged after the same fixes :func:`postprocess` applies (tabs vs spaces,
      lines written relative to column 0), so a model that indents wrongly is not cut short.
    """
    try:
        lang = normalize_language_id(language_id)
        site = _site(prefix, suffix, lang)
        start, end = _special_span(generated)
        ended = end < len(generated)  # a special token ended the text: all before it is final
        raw = generated[start:end].split("\n")
        lines = _fix_indentation([_no_cr(r) for r in raw], site, mode)
        keep = _keep_lines(lines, site, mode, final=ended)
        if keep is None:
            return end if ended else None
        if keep == 0:
            return start
        offset = start + sum(len(r) + 1 for r in raw[: keep - 1])
        return offset + len(_no_cr(raw[keep - 1]))
    except Exception:
        log.warning("find_stop failed; letting generation continue", exc_info=True)
        return None


def postprocess(generated: str, prefix: str, suffix: str, language_id: str, mode: Mode) -> str:
    """The text to insert at the cursor, or ``""`` when nothing useful remains.

    Steps, in order:

    1. Special tokens: leading ones are dropped, the text is cut at the first other one, and a
       token cut short by the end of the stream is dropped.
    2. Indentation (multi, and the lines after the first in single): leading tabs/spaces follow
       the document's style; a first line that repeats the whitespace already before the cursor
       loses it; lines written relative to column 0 instead of the cursor's column are shifted;
       an empty block body whose completion is not indented deeper than its header is shifted
       one level in.
    3. Cut where :func:`find_stop` would stop (the final text counts as complete).
    4. A line repeated 4+ times at the end (a generation loop) is kept once. (Lines repeating
       the suffix are already cut in step 3.)
    5. Same-line overlap: a completion that ends with the rest of the cursor's line (the model
       rewrote it) loses that copy, and so does a partial copy of at least 4 characters.
    6. Brackets: closers (and a closing quote) in the completion that close something opened
       before the cursor, when the suffix already starts with that closer: the completion is cut
       before one of them (``foo(|)`` + ``a, b)`` -> ``a, b``; ``a, b).then(f)`` -> ``a, b``).
       With a grammar, each candidate cut is parsed in place and kept only if it has fewer
       ERROR/MISSING nodes than the uncut text (so a needed inner ``)`` stays); without one, the
       brackets of the cursor's line are counted instead.
    7. Trailing whitespace is stripped, except what the suffix needs: when the cursor sits before
       code at the start of a line (multi), the completion ends with a line break and the line's
       indentation, and trailing spaces before code on the same line are kept (``return |x``).
    8. Line breaks become the document's (``\\r\\n`` when it uses them).
    """
    try:
        return _postprocess(generated, prefix, suffix, normalize_language_id(language_id), mode)
    except Exception:
        log.warning("postprocess failed; falling back to the first line", exc_info=True)
    try:  # a plain, safe answer rather than none
        start, end = _special_span(generated)
        return generated[start:end].split("\n")[0].rstrip()
    except Exception:
        return ""


def syntax_ok(prefix: str, completion: str, suffix: str, language_id: str) -> bool:
    """True when ``prefix + completion + suffix`` has no more tree-sitter ERROR/MISSING nodes than
    ``prefix + suffix`` (DESIGN.md metric). True for languages without a grammar."""
    lang = normalize_language_id(language_id)
    before = _error_count(prefix + suffix, lang)
    if before is None:
        return True
    after = _error_count(prefix + completion + suffix, lang)
    return after is not None and after <= before


def strip_special_tokens(text: str) -> str:
    """``text`` without leading special tokens and cut at the first other one."""
    start, end = _special_span(text)
    return text[start:end]


# --------------------------------------------------------------------------------------------
# What the text around the cursor says


@dataclass(frozen=True)
class _Site:
    """The cursor's surroundings, summarised once per (prefix, suffix, language)."""

    lang: str
    before: str  # the cursor's line up to the cursor
    after: str  # the cursor's line from the cursor to its end, without the line break
    prev_line: str  # the last non-blank line above the cursor's line, "" when none
    next_lines: tuple[str, ...]  # the first non-blank whole lines after the cursor
    indent_char: str | None  # "\t" or " " when the document is consistent, else None
    indent_unit: int  # columns per level
    eol: str  # "\n" or "\r\n"
    ancestors: tuple[str, ...] = ()  # the lines above whose indentation drops, nearest first

    def enclosing(self, width: int) -> str | None:
        """The nearest line above the cursor indented less than ``width`` (a block's header)."""
        return next((a for a in self.ancestors if _indent_width(a) < width), None)

    @property
    def blank_before(self) -> bool:
        return not self.before.strip()

    @property
    def column(self) -> int:
        return _indent_width(self.before) if self.blank_before else len(self.before)

    @property
    def empty_body(self) -> bool:
        """The cursor is on an empty line right after a block opener whose body is still empty."""
        if not self.blank_before or self.after.strip() or not _opens_block(self.prev_line):
            return False
        return not self.next_lines or _indent_width(self.next_lines[0]) <= _indent_width(self.prev_line)


@lru_cache(maxsize=64)
def _site(prefix: str, suffix: str, lang: str) -> _Site:
    head = prefix[-_SCAN_CHARS:]
    tail = suffix[:_SCAN_CHARS]
    above = head.split("\n")
    before = _no_cr(above[-1])
    below = tail.split("\n")
    after = _no_cr(below[0])

    prev_line = ""
    for line in reversed(above[:-1]):
        if line.strip():
            prev_line = _no_cr(line).rstrip()
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
            next_lines.append(_no_cr(line).rstrip())

    ancestors: list[str] = []
    lowest = 1 << 30
    for line in reversed(above[:-1]):
        stripped = line.strip()
        if not stripped or _is_comment(stripped):
            continue
        width = _indent_width(line)
        if width < lowest:
            ancestors.append(_no_cr(line).rstrip())
            lowest = width
            if width == 0:
                break

    # The cursor's own indentation counts: it is often the only indented line of a new file.
    own = [before + "x"] if before and not before.strip() else []
    indent_char, unit = _indent_style(above[-200:-1] + own + below[:100])
    eol = "\r\n" if "\r\n" in head[-2000:] or "\r\n" in tail[:2000] else "\n"
    return _Site(lang, before, after, prev_line, tuple(next_lines), indent_char, unit, eol, tuple(ancestors))


def _indent_style(lines: list[str]) -> tuple[str | None, int]:
    """(indent character, columns per level). The character is ``None`` unless (nearly) every
    indented line uses it: in a document that mixes tabs and spaces the model's choice is as good
    as ours, and converting would only move lines around."""
    tab_lines = space_lines = 0
    steps: dict[int, int] = {}
    last = 0
    for line in lines:
        if not line.strip():
            continue
        lead = _leading(line)
        if "\t" in lead:
            tab_lines += 1
        # " * " continues a block comment in a tab-indented C file; not an indentation choice.
        elif lead and not line.lstrip().startswith("*"):
            space_lines += 1
        width = _indent_width(line)
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
        return char, _TAB
    common = [s for s in sorted(steps, key=lambda s: -steps[s]) if s in (2, 3, 4, 8)]
    return char, common[0] if common else 4


def _inside_string_or_comment(prefix: str, suffix: str, lang: str) -> bool:
    parser = parser_for(lang)
    if parser is None:
        return False
    # Once per request, on the request path: a window keeps a huge file from costing ~60 ms.
    prefix, suffix = _window(prefix, suffix, _MODE_PARSE_CHARS)
    pos = len(prefix.encode("utf-8"))
    tree = parser.parse((prefix + suffix).encode("utf-8"))
    node: Node | None = tree.root_node.descendant_for_byte_range(pos, pos)
    while node is not None:
        kind = node.type
        if any(t in kind for t in _COMMENT_TYPES + _STRING_TYPES) and node.start_byte < pos < node.end_byte:
            return True
        node = node.parent
    return False


# --------------------------------------------------------------------------------------------
# Lines: indentation and where the completion ends


def _no_cr(line: str) -> str:
    return line[:-1] if line.endswith("\r") else line


def _indent_width(line: str) -> int:
    width = 0
    for ch in line:
        if ch == " ":
            width += 1
        elif ch == "\t":
            width += _TAB - width % _TAB
        else:
            break
    return width


def _leading(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _opens_block(line: str) -> bool:
    code = _TRAILING_COMMENT.sub("", line.rstrip())
    return code.endswith((":", "{", "(", "["))


def _is_closer_line(stripped: str) -> bool:
    return bool(_CLOSER_LINE.match(stripped))


def _is_comment(stripped: str) -> bool:
    # `#` also covers C preprocessor lines: like comments, they end no block.
    return stripped.startswith(("#", "//", "/*", "*"))


def _same_line(line: str, other: str) -> bool:
    """Does ``line`` repeat ``other``? Indentation must match too: the same text at another depth
    is usually a legitimate statement of another block (``return False`` after an inner ``if``),
    and by the time lines are compared their indentation has been fixed."""
    a, b = line.strip(), other.strip()
    return bool(a) and a == b and _indent_width(line) == _indent_width(other)


def _convert_indent(line: str, site: _Site) -> str:
    """The line's leading whitespace in the document's style (tabs vs spaces)."""
    lead = _leading(line)
    if not lead or site.indent_char is None:
        return line
    if site.indent_char == "\t" and "\t" not in lead:
        width = len(lead)
        return "\t" * (width // _TAB) + " " * (width % _TAB) + line[len(lead) :]
    if site.indent_char == " " and "\t" in lead:
        width = _indent_width(lead)
        return " " * width + line[len(lead) :]
    return line


def _shift(line: str, indent: str) -> str:
    return indent + line if line.strip() else line


def _fix_indentation(lines: list[str], site: _Site, mode: Mode) -> list[str]:
    """The model's lines with their indentation made to fit the block at the cursor.

    Only leading whitespace changes, so line ``i`` still is line ``i`` of the model's text.
    """
    if not lines:
        return lines
    # The first line's leading whitespace is inline spacing when code precedes the cursor.
    first = _convert_indent(lines[0], site) if site.blank_before else lines[0]
    out = [first] + [_convert_indent(line, site) for line in lines[1:]]
    if mode != "multi" or not site.blank_before or not out[0].strip():
        return out

    col = site.column
    rest = [i for i in range(1, len(out)) if out[i].strip()]
    # The model repeated the whitespace already before the cursor. A deeper first line is only
    # right when the editor left the cursor at the level of a block header above it.
    if col > 0 and _leading(out[0]):
        header_level = _opens_block(site.prev_line) and col <= _indent_width(site.prev_line)
        if not header_level:
            out[0] = out[0].lstrip(" \t")

    # Lines after the first written as if the first one were at column 0 (models without FIM
    # training, chat models): a block header followed by a line indented at most to the cursor,
    # or a plain line followed, without a blank line, by a line at column 0 that neither closes
    # nor continues a block: in brace languages a real dedent would come after a `}`, in Python
    # code inside a def/class does not jump to column 0 without a blank line (a script's loop
    # body may, so there it counts only inside a definition). A line that repeats the next line
    # of the suffix is taken as written: the model is echoing it.
    if col > 0 and not _leading(out[0]) and rest:
        second = out[rest[0]]
        width2 = _indent_width(second)
        echoes = bool(site.next_lines) and _same_line(second, site.next_lines[0])
        plain = (
            (site.lang != "python" or any(_DEFINITION.match(a) for a in site.ancestors))
            and width2 == 0
            and rest[0] == 1
            and not _CONTINUATION.match(second.strip())
            and not _is_closer_line(second.strip())
            and not _is_comment(second.strip())  # commented-out code often sits at column 0
        )
        relative = not echoes and ((_opens_block(out[0]) and 0 < width2 <= col) or plain)
        if relative:
            indent = _leading(site.before)
            out = [out[0]] + [_shift(line, indent) for line in out[1:]]

    # In Python an empty block body must be indented deeper than its header (an editor without
    # smart indent leaves the cursor at the header's column, a model may follow it). Brace
    # languages do not care, and real code there often keeps a body at its header's column.
    if site.lang == "python" and site.empty_body:
        header = _indent_width(site.prev_line)
        first_width = col + _indent_width(out[0])
        if first_width <= header:
            missing = header + (_TAB if site.indent_char == "\t" else site.indent_unit) - first_width
            pad = "\t" * -(-missing // _TAB) if site.indent_char == "\t" else " " * missing
            out = [pad + out[0]] + [_shift(line, pad) for line in out[1:]]
    return out


def _keep_lines(lines: list[str], site: _Site, mode: Mode, final: bool) -> int | None:
    """How many of ``lines`` make the completion, or ``None`` while undecided (not ``final``)."""
    n = len(lines)

    def complete(i: int) -> bool:
        return i < n - 1 or final

    if mode == "single":
        if lines[0].strip():
            if not complete(0):
                return None
            if site.blank_before and site.next_lines and _same_line(site.before + lines[0], site.next_lines[0]):
                return 0
            return _single_end(lines, 0, site, complete)
        if n == 1:
            return 0 if final else None
        if site.after.strip():
            return 0  # a line break would split the code after the cursor
        for i in range(1, n):
            if lines[i].strip():
                if not complete(i):
                    return None
                if site.next_lines and _same_line(lines[i], site.next_lines[0]):
                    return 0
                return _single_end(lines, i, site, complete)
        return 0 if final else None

    # multi
    def full(i: int) -> str:
        return site.before + lines[0] if i == 0 and site.blank_before else lines[i]

    first = next((i for i in range(n) if lines[i].strip()), None)
    if first is None:
        return 0 if final else None
    if not complete(first):
        return None
    nxt = site.next_lines[0] if site.next_lines else None
    if nxt is not None and (first > 0 or site.blank_before) and _same_line(full(first), nxt):
        return first
    base = _indent_width(full(first)) if (first > 0 or site.blank_before) else _indent_width(site.before)
    definition = _opens_block(lines[first]) and _definition_level(full(first), base, site)
    deeper = closed = False
    for i in range(first + 1, n):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            continue
        if not complete(i):
            return None
        if nxt is not None and _same_line(line, nxt):
            return _before_comments(lines, i, first, base)
        width = _indent_width(line)
        if _is_comment(stripped):
            continue  # comments (often at column 0) end no block; the next code line decides
        closer = _is_closer_line(stripped)
        if closed and not closer:
            return _before_comments(lines, i, first, base)
        if width < base:
            if closer:
                closed = True
                continue
            return _before_comments(lines, i, first, base)
        if width > base:
            deeper = True
        elif definition and deeper and not closer and not _CONTINUATION.match(stripped):
            return _before_comments(lines, i, first, base)
    return n if final else None


def _definition_level(line: str, base: int, site: _Site) -> bool:
    """Does ``line`` start a definition where definitions are listed (module top level, a class,
    impl or namespace body)? Then the completion is one definition. Top-level code also comes
    one statement at a time. A helper defined inside a function body is followed by more of
    that body, so it is not limited."""
    if base == 0:
        return True
    if not (_DEFINITION.match(line) or _METHOD.match(line.rstrip())):
        return False
    header = site.enclosing(base)
    return header is None or bool(_CONTAINER.match(header))


def _before_comments(lines: list[str], stop: int, first: int, base: int) -> int:
    """Where to stop when line ``stop`` is the first one out of the block: blank lines and
    comments indented below the block just above it belong to what follows (a comment above the
    next definition); comments at the block's depth stay with it."""
    while stop - 1 > first:
        above = lines[stop - 1]
        if above.strip() and not (_is_comment(above.strip()) and _indent_width(above) < base):
            break
        stop -= 1
    return stop


def _single_end(lines: list[str], j: int, site: _Site, complete: Callable[[int], bool]) -> int | None:
    """Lines to keep in single mode when line ``j`` is the first one with code: that line, or,
    when it leaves brackets open (``np.array([``, ``th([]() {``), through the line that closes
    them, so that one line does not leave the code broken. Brackets still open after
    ``_SINGLE_SPAN`` lines fall back to the first line alone."""
    quote = _scan(site.before, site.lang)[2] if j == 0 else None
    closed, opened, _ = _scan(lines[j], site.lang, quote)
    depth = len(opened) - sum(1 for p in closed if lines[j][p] in _CLOSERS)
    if depth <= 0:
        return j + 1
    for i in range(j + 1, min(len(lines), j + 1 + _SINGLE_SPAN)):
        if not complete(i):
            return None
        closed, opened, _ = _scan(lines[i], site.lang)
        depth += len(opened) - sum(1 for p in closed if lines[i][p] in _CLOSERS)
        if depth <= 0:
            return i + 1
    if len(lines) > j + _SINGLE_SPAN or complete(len(lines) - 1):
        return j + 1
    return None


def _drop_loop(lines: list[str]) -> list[str]:
    """A line repeated 4+ times at the end is a generation loop: keep one copy."""
    if len(lines) < 4:
        return lines
    last = lines[-1]
    if not last.strip() or not any(c.isalnum() for c in last):
        return lines
    count = 0
    for line in reversed(lines):
        if line != last:
            break
        count += 1
    return lines[: len(lines) - count + 1] if count >= 4 else lines


# --------------------------------------------------------------------------------------------
# Special tokens


def _special_span(text: str) -> tuple[int, int]:
    """(start, end) of the text between leading special tokens and the next one."""
    m = _LEADING_SPECIAL.match(text)
    start = m.end() if m else 0
    m2 = _SPECIAL.search(text, start)
    return start, m2.start() if m2 else len(text)


# --------------------------------------------------------------------------------------------
# Brackets against the suffix


def _string_openers(lang: str) -> str:
    # In Rust `'a` is a lifetime as often as a char; in Python/others `'` opens strings.
    return "\"`" if lang == "rust" else "\"'`"


def _comment_start(lang: str) -> tuple[str, ...]:
    return ("#",) if lang == "python" else ("//",)


def _scan(text: str, lang: str, in_string: str | None = None) -> tuple[list[int], list[str], str | None]:
    """A rough lexer: (offsets of closers/quotes in ``text`` that close something opened before
    it, openers still unclosed at the end, the quote still open at the end). Strings end at a
    line break except template strings; comments run to the end of the line."""
    unmatched: list[int] = []
    stack: list[str] = []
    quotes = _string_openers(lang)
    comments = _comment_start(lang)
    quote = in_string
    quote_from_before = in_string is not None
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if quote is not None:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                if quote_from_before:
                    unmatched.append(i)
                quote = None
                quote_from_before = False
            elif ch == "\n" and quote != "`":
                quote = None
                quote_from_before = False
            i += 1
            continue
        if ch in quotes:
            quote = ch
        elif any(text.startswith(c, i) for c in comments):
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            continue
        elif ch in _OPENERS:
            stack.append(ch)
        elif ch in _CLOSERS:
            if stack and stack[-1] == _PAIR[ch]:
                stack.pop()
            elif not stack:
                unmatched.append(i)
            else:  # mismatched: the model's own mess, not ours to judge
                stack.pop()
        i += 1
    return unmatched, stack, quote


def _suffix_head(suffix: str, same_line: bool) -> str:
    """The closers and quotes that the suffix starts with (whitespace between them skipped)."""
    out = []
    for ch in suffix[:200]:
        if ch in " \t":
            continue
        if ch in "\r\n":
            if same_line:
                break
            continue
        if ch in _CLOSERS or ch in "\"'`":
            out.append(ch)
            continue
        break
    return "".join(out)


def _balance(text: str, prefix: str, suffix: str, site: _Site, joiner: str = "") -> str:
    """``text`` cut before a closer that the suffix already has, when that helps (see
    :func:`postprocess`, step 6). ``joiner`` is what will follow the text before the suffix."""
    _, _, quote_at_cursor = _scan(site.before, site.lang)
    unmatched, _, _ = _scan(text, site.lang, quote_at_cursor)
    if not unmatched:
        return text
    has_grammar = parser_for(site.lang) is not None
    head = _suffix_head(suffix, same_line=not has_grammar)
    if not head:
        return text
    cuts = [p for p in unmatched if text[p] == head[0]]
    if not cuts:
        return text

    if not has_grammar:
        # Count on the cursor's line: openers left open before the cursor must be closed exactly
        # once, by the completion's closers or the suffix's.
        _, open_before, _ = _scan(site.before, site.lang)
        closing_in_head = sum(1 for c in head if c in _CLOSERS)
        if quote_at_cursor is not None and head[0] == quote_at_cursor:
            return text[: cuts[0]].rstrip(" \t")
        want = len(open_before) - closing_in_head  # closers the completion should keep
        closers = [p for p in unmatched if text[p] in _CLOSERS]
        if 0 <= want < len(closers) and text[closers[want]] == head[0]:
            return text[: closers[want]].rstrip(" \t")
        return text

    base = _error_count(prefix + text + joiner + suffix, site.lang)
    if base is None or base == 0:
        return text
    best, best_errors = text, base
    for p in cuts[:4]:
        candidate = text[:p].rstrip()
        errors = _error_count(prefix + candidate + joiner + suffix, site.lang)
        # Cuts come in text order; on a tie the earlier (shorter) one loses, keeping more text.
        if errors is not None and errors <= best_errors and (errors < best_errors or best is not text):
            best, best_errors = candidate, errors
    return best


def _window(prefix: str, suffix: str, limit: int = _PARSE_CHARS) -> tuple[str, str]:
    """The part of a huge document that a decision parses (whole lines near the cursor): the
    candidates differ only at the cursor, and parsing megabytes per candidate is slow."""
    if len(prefix) > limit:
        cut = prefix.find("\n", len(prefix) - limit)
        prefix = prefix[cut + 1 :] if cut >= 0 else prefix[-limit:]
    if len(suffix) > limit:
        cut = suffix.rfind("\n", 0, limit)
        suffix = suffix[:cut] if cut >= 0 else suffix[:limit]
    return prefix, suffix


def _error_count(source: str, lang: str) -> int | None:
    """ERROR and MISSING nodes in the parse of ``source``; ``None`` without a grammar."""
    parser = parser_for(lang)
    if parser is None:
        return None
    root = parser.parse(source.encode("utf-8", "surrogatepass")).root_node
    if not root.has_error:
        return 0
    count = 0
    stack = [root]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            count += 1
        # has_error covers the node and its descendants: healthy subtrees are skipped.
        stack.extend(child for child in node.children if child.has_error)
    return count


# --------------------------------------------------------------------------------------------
# The pipeline


def _overlap_rest(text: str, site: _Site) -> str | None:
    """``text`` without the copy of the rest of the cursor's line that it ends with, or ``None``
    when it has none."""
    rest = site.after.strip()
    if not rest:
        return None
    body = text.rstrip()
    if body.endswith(rest):
        cut = body[: len(body) - len(rest)]
        return cut.rstrip(" \t") if site.after[:1].isspace() else cut
    # A partial copy: the completion ends with the start of the rest, up to a word boundary.
    for k in range(min(len(rest), len(body)) - 1, 3, -1):
        piece = rest[:k]
        if body.endswith(piece) and any(c.isalnum() for c in piece) and not rest[k].isalnum():
            return body[: len(body) - k]
    return None


def _trim_overlap(text: str, prefix: str, suffix: str, site: _Site) -> str:
    """Same-line overlap: the model rewrote the rest of the line. A rest with a word in it is
    trusted; one made of punctuation (`;`, `):`, `))`) may be the completion's own, so a parse
    must not get worse, and closers alone are left to the bracket balancer."""
    cut = _overlap_rest(text, site)
    if cut is None:
        return text
    rest = site.after.strip()
    if any(c.isalnum() for c in rest):
        return cut
    if all(c in _CLOSERS or c.isspace() for c in rest):
        return text
    before = _error_count(prefix + text + suffix, site.lang)
    if before is None:
        return cut
    after = _error_count(prefix + cut + suffix, site.lang)
    return cut if after is not None and after <= before else text


def _postprocess(generated: str, prefix: str, suffix: str, lang: str, mode: Mode) -> str:
    site = _site(prefix, suffix, lang)
    start, end = _special_span(generated)
    body = generated[start:end]
    if end == len(generated):
        body = _PARTIAL_SPECIAL.sub("", body)
    lines = [_no_cr(line) for line in body.split("\n")]
    lines = _fix_indentation(lines, site, mode)
    keep = _keep_lines(lines, site, mode, final=True)
    lines = lines[: keep if keep is not None else len(lines)]
    while lines and not lines[-1].strip():
        lines.pop()
    lines = _drop_loop(lines)
    lines = [line.rstrip() for line in lines[:-1]] + lines[-1:]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return ""
    text = "\n".join(lines)

    code_follows = bool(site.after.strip())
    # Whole lines inserted above code (the cursor at the start of a line, multi): the completion
    # ends with a break and the indentation that code had, so the code keeps its own line.
    joiner = ""
    if code_follows and mode == "multi" and site.blank_before:
        joiner = "\n" + site.before
        if site.after.strip()[0] in _CLOSERS and _opens_block(site.prev_line):
            joiner = "\n" + _leading(site.prev_line)  # `{|}`: the brace goes back under its header
    if not code_follows or joiner or site.after[:1].isspace():
        text = text.rstrip()
    prefix, suffix = _window(prefix, suffix)
    if not joiner:
        text = _trim_overlap(text, prefix, suffix, site)
    text = _balance(text, prefix, suffix, site, joiner)
    if not text.strip():
        return ""
    text = text.rstrip() + joiner if (joiner or not code_follows) else text
    return text.replace("\n", site.eol) if site.eol != "\n" else text


def _starts_statement(code: str) -> bool:
    """Can ``code`` (the rest of a line after the cursor) be a line of its own? A word, a string,
    a decorator, a comment or a closing ``}`` can; other punctuation (``;``, ``)``, ``.x``,
    ``/ y``, ``= 1``) continues an expression."""
    return code[0].isalnum() or code[0] in "_$@#\"'`}" or code.startswith(("//", "/*"))


def _line_before(prefix: str) -> str:
    return prefix[prefix.rfind("\n") + 1 :]
