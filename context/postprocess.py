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

from tree_sitter import Node, Tree

from context.languages import normalize_language_id, parser_for

log = logging.getLogger(__name__)

Mode = Literal["single", "multi"]

__all__ = [
    "Mode",
    "completion_mode",
    "find_stop",
    "plain_postprocess",
    "plain_stop",
    "postprocess",
    "strip_special_tokens",
    "syntax_ok",
]

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
# A branch that continues a compound statement (``else:``, ``} else {``, ``except E:``, ``} catch (e) {``).
_BRANCH = re.compile(r"^(?:\}\s*)?(else|elif|except|finally|catch)\b")
# For each branch keyword, the headers whose statement it may continue (after an optional `} `).
_BRANCH_OF = {
    "else": re.compile(r"^(?:\}\s*)?(?:if|elif|else\s+if|for|while|try|except)\b"),
    "elif": re.compile(r"^(?:if|elif)\b"),
    "except": re.compile(r"^(?:try|except)\b"),
    "finally": re.compile(r"^(?:\}\s*)?(?:try|except|catch)\b"),
    "catch": re.compile(r"^(?:\}\s*)?(?:try|catch)\b"),
}
# A markdown fence: instruct models close their answer with one and write prose after it.
_FENCE = re.compile(r"^\s*```")
# Chat prose after code: a capitalised word and at least three more plain words, at column 0.
_PROSE = re.compile(r"^[A-Z][a-z]+(?:'[a-z]+)?,?(?:[ \t]+[\w'`\"(),.:!?/-]+){3,}[ \t]*$")
# The openers that chat models use for remarks, whatever follows them.
_PROSE_START = re.compile(
    r"^(?:Here(?:'s| is| are)\b|(?:This|The) (?:code|function|program|implementation|solution|example|output)\b"
    r"|(?:Explanation|Example usage|Usage|Output|Note|Notes)\s*:)"
)
# Languages whose text is prose: chat-text detection would cut their real content.
_TEXT_LANGUAGES = frozenset(
    {"markdown", "plaintext", "text", "latex", "tex", "restructuredtext", "asciidoc", "org", "html", "xml", "yaml"}
)
# Starting a line, these continue code, never prose (`None if x else y`, `Some(x)`).
_CODE_WORDS = frozenset({"None", "True", "False", "Some", "Ok", "Err", "Self", "Nil"})
# Multi-line string and comment delimiters, and what to skip while looking for them.
_PY_TOKENS = re.compile(r'"""|\'\'\'|#|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
_C_TOKENS = re.compile(r'/\*|\*/|//|`|"(?:\\.|[^"\\\n])*"')
_BLOCK_OPENERS = ('"""', "'''", "/*")
_BACKTICK_STRINGS = frozenset({"javascript", "javascriptreact", "typescript", "typescriptreact", "go"})
_WORD = re.compile(r"[A-Za-z']+[,.:!?]?")
# Generation loops: a group of this many lines or fewer, repeated this many times in a row.
_LOOP_GROUP = 3
_LOOP_REPEATS = 3
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


def completion_mode(
    prefix: str, suffix: str, language_id: str, *, tree: Tree | None = None, cursor_byte: int | None = None
) -> Mode:
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

    ``tree`` (the document's up-to-date tree-sitter tree) with ``cursor_byte`` (the cursor's UTF-8
    offset in the whole document) answers the string/comment question without parsing; without
    them, up to 8 KB on each side of the cursor are parsed (~3 ms). The answer is the same.
    """
    try:
        before = _line_before(prefix)
        if before.strip():
            return "single"
        after = suffix[: suffix.find("\n")] if "\n" in suffix else suffix
        if after.strip() and not _starts_statement(after.strip()):
            return "single"
        lang = normalize_language_id(language_id)
        if _inside_string_or_comment(prefix, suffix, lang, tree, cursor_byte):
            return "single"
        return "multi"
    except Exception:  # a mode decision must never break a request
        log.warning("completion_mode failed; using single", exc_info=True)
        return "single"


def find_stop(
    generated: str, prefix: str, suffix: str, language_id: str, mode: Mode, *, healed: str = ""
) -> int | None:
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
      A dedented line that continues the statement whose block is being filled (``else:``,
      ``} else {``, ``except E:``, ``} catch (e) {`` at that statement's column, when the suffix
      does not continue it already) is kept; the next line back at that column ends the block.

    * Both modes: a markdown fence line (three backticks) or chat prose after a blank line
      (instruct models close their answer and explain it) ends the completion as if the text
      ended there (not in markdown or plain text), and a group of 1-3 lines repeated 3 times in
      a row (a generation loop) ends it after its first copy.
    * A leading line break on an indented empty line (``multi``) does not count: the first line
      with code goes on the cursor's line (see :func:`postprocess`, step 2). Such a line
      indented below the cursor ends the completion at once (index 0).

    ``healed``: what :func:`context.prompt.build_prompt` stripped from the end of the prompt
    (``Prompt.healed``); the model's text then starts before the cursor (see :func:`postprocess`).
    """
    try:
        lang = normalize_language_id(language_id)
        site = _site(prefix, suffix, lang)
        start, end = _special_span(generated)
        ended = end < len(generated)  # a special token ended the text: all before it is final
        text = _prepare(generated[start:end], site, mode, healed, final=ended)
        if text is None:
            return start
        keep = _keep_lines(text.lines, site, mode, final=text.final)
        if keep is None:
            return end if ended else None
        if keep == 0:
            return start
        raw = text.raw[: text.skip + keep]
        offset = start + sum(len(r) + 1 for r in raw[:-1])
        return offset + len(_no_cr(raw[-1]))
    except Exception:
        log.warning("find_stop failed; letting generation continue", exc_info=True)
        return None


def postprocess(
    generated: str,
    prefix: str,
    suffix: str,
    language_id: str,
    mode: Mode,
    *,
    truncated: bool = False,
    healed: str = "",
    partial: bool = False,
) -> str:
    """The text to insert at the cursor, or ``""`` when nothing useful remains.

    ``partial``: the text is still streaming (a preview); the parse check of step 6b is left
    for the final text.

    ``truncated``: generation stopped at its token limit (finish reason ``length``), so the last
    line may be half written; in ``multi`` mode it is dropped when whole lines come before it,
    and the block ends with its last complete statement.
    ``healed``: the whitespace (or trailing spaces after code) that the prompt left out at the
    cursor (``Prompt.healed``, token healing); the model's text then starts where that
    whitespace started and is re-aligned to the cursor.

    Steps, in order:

    1. Special tokens: leading ones are dropped, the text is cut at the first other one, and a
       token cut short by the end of the stream is dropped. When ``truncated`` (multi), the text
       after the last line break is dropped if code comes before that break, and so are the
       lines after the last one that ends a statement (no bracket it opened left open, not a
       bare block header).
    2. Alignment: with ``healed`` after code, the model's copy of it is dropped from the start;
       with ``healed`` indentation (the cursor on an indented empty line), and in ``multi`` when
       the model starts with a line break there, the model's lines count from column 0: leading
       blank lines are dropped, and the first line with code goes on the cursor's line without
       the columns the cursor already has. A first line indented below the cursor left the
       cursor's block (``multi``: the completion is empty).
    3. Indentation (multi, and the lines after the first in single): leading tabs/spaces follow
       the document's style; a first line that repeats the whitespace already before the cursor
       loses it; lines written relative to column 0 instead of the cursor's column are shifted
       (also when the block the first line opens closes at column 0); an empty block body whose
       completion is not indented deeper than its header is shifted one level in; in ``multi``,
       levels written with another width than the document's (4 vs 2 columns) are rescaled.
    4. Cut where :func:`find_stop` would stop (the final text counts as complete): chat text
       after code, a generation loop (one copy is kept), the block's end, the repeated next
       line.
    5. Same-line overlap: a completion that ends with the rest of the cursor's line (the model
       rewrote it) loses that copy, and so does a partial copy of at least 4 characters.
    6. Brackets: closers (and a closing quote) in the completion that close something opened
       before the cursor, when the suffix already starts with that closer: the completion is cut
       before one of them (``foo(|)`` + ``a, b)`` -> ``a, b``; ``a, b).then(f)`` -> ``a, b``),
       or before a closer line it ends with (``} else {`` ... ``}`` + the suffix's ``}``).
       With a grammar, each candidate cut is parsed in place and kept only if it has fewer
       ERROR/MISSING nodes than the uncut text (so a needed inner ``)`` stays); without one, the
       brackets of the cursor's line are counted instead.
    6b. Parse check (multi, final text, languages with a grammar): when inserting the block
       adds ERROR/MISSING nodes, it is cut back to its longest run of first lines that does
       not (``""`` when none, the first line when ``truncated``): a line at the wrong depth, a
       header left without its body.
    7. Trailing whitespace is stripped, except what the suffix needs: when the cursor sits before
       code at the start of a line (multi), the completion ends with a line break and the line's
       indentation, and trailing spaces before code on the same line are kept (``return |x``).
       A block written between an empty pair of brackets on one line (``{|}``, single mode,
       starting with a line break) ends with a line break and the line's indentation, so the
       closer goes under its header.
    8. Line breaks become the document's (``\\r\\n`` when it uses them).
    """
    try:
        lang = normalize_language_id(language_id)
        return _postprocess(generated, prefix, suffix, lang, mode, truncated=truncated, healed=healed, partial=partial)
    except Exception:
        log.warning("postprocess failed; falling back to the first line", exc_info=True)
    try:  # a plain, safe answer rather than none
        start, end = _special_span(generated)
        return generated[start:end].split("\n")[0].rstrip()
    except Exception:
        return ""


def plain_stop(generated: str, mode: Mode) -> int | None:
    """Where the baseline without syntax stops (benchmarks' ``postprocess: "plain"``, what a
    client that only cuts at line breaks does): a special token ends the text; ``single`` ends
    after the first non-blank line; ``multi`` runs to the model's end or the token limit."""
    start, end = _special_span(generated)
    if end < len(generated):
        return end
    body = generated[start:]
    if mode == "single" and body.strip():
        first = start + len(body) - len(body.lstrip("\r\n"))  # where the first non-blank line starts
        newline = generated.find("\n", first)
        if newline >= 0:
            return newline
    return None


def plain_postprocess(generated: str, mode: Mode) -> str:
    """The baseline's text to insert: :func:`plain_stop` applied, trailing whitespace removed.
    No indentation, bracket, repetition or block-end handling: what ember's syntax-aware
    :func:`postprocess` is measured against."""
    stop = plain_stop(generated, mode)
    text = strip_special_tokens(generated if stop is None else generated[:stop])
    if mode == "single" and not text.strip():
        return ""
    return text.rstrip()


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
    unit_known: bool = False  # indent_unit was seen in the document, not a default

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
    indent_char, unit, known = _indent_style(above[-200:-1] + own + below[:100])
    eol = "\r\n" if "\r\n" in head[-2000:] or "\r\n" in tail[:2000] else "\n"
    return _Site(
        lang, before, after, prev_line, tuple(next_lines), indent_char, unit, eol, tuple(ancestors), known
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
        return char, _TAB, True
    common = [s for s in sorted(steps, key=lambda s: -steps[s]) if s in (2, 3, 4, 8)]
    if not common:
        return char, 4, False
    unit = common[0]
    known = steps[unit] >= 2 and all(steps[s] < steps[unit] for s in common[1:])
    return char, unit, known


def _inside_string_or_comment(
    prefix: str, suffix: str, lang: str, tree: Tree | None = None, cursor_byte: int | None = None
) -> bool:
    if tree is not None and cursor_byte is not None:
        # The document's own tree is up to date: no parse on the request path.
        return _string_or_comment_at(tree.root_node, cursor_byte)
    parser = parser_for(lang)
    if parser is None:
        return False
    # Once per request, on the request path: a window keeps a huge file from costing ~60 ms.
    prefix, suffix = _window(prefix, suffix, _MODE_PARSE_CHARS)
    pos = len(prefix.encode("utf-8"))
    parsed = parser.parse((prefix + suffix).encode("utf-8"))
    return _string_or_comment_at(parsed.root_node, pos)


def _string_or_comment_at(root: Node, pos: int) -> bool:
    """Is byte ``pos`` strictly inside a string or comment node of the tree under ``root``?"""
    node: Node | None = root.descendant_for_byte_range(pos, pos)
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
    if _is_comment(line.strip()):
        return False  # `# Examples:` / `/* Usage:` open no block
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


@dataclass(frozen=True)
class _Text:
    """The model's text as lines, ready for :func:`_keep_lines`."""

    raw: list[str]  # the model's lines (special tokens removed), "\r" included
    skip: int  # raw lines before lines[0]: a leading line break that the cursor's line replaces
    lines: list[str]  # raw[skip:], aligned to the cursor and with indentation fixed
    final: bool  # nothing can follow lines: the text ended (or chat text after code begins)


def _prepare(body: str, site: _Site, mode: Mode, healed: str, final: bool) -> _Text | None:
    """The shared first half of :func:`find_stop` and :func:`postprocess`: lines aligned to the
    cursor (see :func:`_align`), indentation fixed, and cut where chat text begins. ``None``:
    the model left the cursor's block at once (the completion is empty)."""
    raw = body.split("\n")
    aligned = _align([_no_cr(r) for r in raw], site, mode, healed)
    if aligned is None:
        return None
    skip, lines, absolute = aligned
    lines = _fix_indentation(lines, site, mode, absolute)
    chat = _chat_start(lines, site, mode, final)
    if chat is not None:
        lines, final = lines[:chat], True
    return _Text(raw, skip, lines, final)


def _align(lines: list[str], site: _Site, mode: Mode, healed: str) -> tuple[int, list[str], bool] | None:
    """(raw lines skipped, the lines from there, whether they count from column 0), or ``None``
    when the first line with code is indented below the cursor (``multi``: it left the block).

    * ``healed`` after code (``return |`` sent as ``return``): the model's text starts with its
      own copy of that whitespace (`` x``), which the document already has.
    * ``healed`` indentation (an indented empty line sent as a line start): the model wrote the
      whole line, indentation included.
    * ``multi``, the cursor at the end of an indented empty line, the model starting with a line
      break: it wrote the line after this one. Taken as is, the completion would leave the
      cursor's line behind, holding nothing but whitespace; its first line goes there instead.

    In the last two cases the lines count from column 0: the first line with code loses the
    columns the cursor already has, later lines keep theirs.
    """
    healed = healed if healed and site.before.endswith(healed) else ""
    whole_line = bool(healed) and healed == site.before  # the prompt ended at the line start
    if healed and not whole_line:
        lines = [_drop_prefix(lines[0], healed)] + lines[1:]
    leading_break = (
        mode == "multi" and site.blank_before and site.column > 0 and len(lines) > 1 and not lines[0].strip()
    )
    if not (whole_line or leading_break):
        return 0, lines, False
    k = next((i for i, line in enumerate(lines) if line.strip()), None)
    if k is None:
        return 0, lines, False  # no code yet: nothing to align
    col = site.column
    if _indent_width(lines[k]) < col:
        if mode == "multi":
            return None
        return k, [lines[k].lstrip(" \t")] + lines[k + 1 :], True
    return k, [_drop_columns(lines[k], col)] + lines[k + 1 :], True


def _drop_prefix(line: str, healed: str) -> str:
    """``line`` without the part of ``healed`` (whitespace left out of the prompt) that it
    starts with."""
    n = 0
    while n < min(len(line), len(healed)) and line[n] == healed[n]:
        n += 1
    return line[n:]


def _drop_columns(line: str, col: int) -> str:
    """``line`` without ``col`` columns of leading whitespace (a tab that reaches past ``col``
    leaves the rest as spaces)."""
    width = i = 0
    while i < len(line) and line[i] in " \t" and width < col:
        width = width + 1 if line[i] == " " else width + _TAB - width % _TAB
        i += 1
    return " " * max(0, width - col) + line[i:]


def _chat_start(lines: list[str], site: _Site, mode: Mode, final: bool) -> int | None:
    """The first complete line that is chat rather than code: a markdown fence (three
    backticks, with or without a language), or prose at column 0 after a blank line (``This
    function returns ...``); ``None`` when there is none. Lines inside a multi-line string or
    comment (a docstring with an example) are code.

    Line 0 is only judged when it is a whole line of code (``multi``; in ``single`` on a blank
    line the cursor sits in a string or comment, where a fence is text)."""
    if site.lang in _TEXT_LANGUAGES:
        return None  # fences and sentences are the content of markdown and plain text
    complete = _completeness(len(lines), final)
    state = _open_block(site.before, site.lang, None)
    for i, line in enumerate(lines):
        if not complete(i):
            return None
        judged = i > 0 or (mode == "multi" and site.blank_before)
        if judged and state is None:
            if _FENCE.match(line):
                return i
            if i > 0 and not lines[i - 1].strip() and _looks_like_prose(line):
                return i
        state = _open_block(line, site.lang, state)
    return None


def _open_block(line: str, lang: str, state: str | None) -> str | None:
    """The multi-line string or comment still open after ``line`` (a triple quote, a template
    string's backtick, ``/*``), given the one open before it. A rough lexer: one-line strings
    and line comments are skipped so that their quotes do not count."""
    tokens = _PY_TOKENS if lang == "python" else _C_TOKENS
    pos = 0
    while pos < len(line):
        if state is not None:
            close = "*/" if state == "/*" else state
            end = line.find(close, pos)
            if end < 0:
                return state
            state, pos = None, end + len(close)
            continue
        m = tokens.search(line, pos)
        if m is None:
            return None
        token = m.group(0)
        if token in ("#", "//"):
            return None
        if token in _BLOCK_OPENERS or (token == "`" and lang in _BACKTICK_STRINGS):
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


def _fix_indentation(lines: list[str], site: _Site, mode: Mode, absolute: bool = False) -> list[str]:
    """The model's lines with their indentation made to fit the block at the cursor.

    Only leading whitespace changes, so line ``i`` still is line ``i`` of the model's text.
    ``absolute``: the lines after the first were written from column 0 of their own lines (see
    :func:`_align`), so they cannot be relative to the cursor's column.
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
    if col > 0 and not absolute and not _leading(out[0]) and rest:
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
        relative = not echoes and ((_opens_block(out[0]) and 0 < width2 <= col) or plain or _closes_at_zero(out, site))
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
    return _rescale_levels(out, site)


def _closes_at_zero(out: list[str], site: _Site) -> bool:
    """Does a bracket that the first line opens close on a line at column 0? Written at the
    cursor's column, that closer would sit at the column of its opening line; at column 0, the
    model wrote the lines as if the first one were at column 0 (even when the body's depth,
    4 columns in a 2-space file, exceeds the cursor's column and looks absolute)."""
    depth = len(_scan(out[0], site.lang)[1])
    if depth == 0:
        return False
    for line in out[1:]:
        stripped = line.strip()
        if not stripped or _is_comment(stripped):
            continue
        if _indent_width(line) == 0:
            return stripped[0] in _CLOSERS
        closed, opened, _ = _scan(line, site.lang)
        depth += len(opened) - sum(1 for p in closed if line[p] in _CLOSERS)
        if depth <= 0:
            return False  # closed at its own column: absolute after all
    return False


def _rescale_levels(out: list[str], site: _Site) -> list[str]:
    """Lines below the first, written with 2-column levels in a 4-column document or the other
    way round, get the document's width per level (the first line's column stays the base).

    Only when the document's width was seen (not assumed), the cursor sits exactly that width
    inside its block's header (files that mix widths, a 2-column body in a 4-column function,
    keep what the model wrote), and every line deeper than the base sits a whole number of the
    model's levels deeper: aligned arguments and other odd columns are not levels.
    """
    unit = site.indent_unit
    if len(out) < 2 or not site.unit_known or site.indent_char is None or unit not in (2, 4):
        return out
    header = site.enclosing(site.column)
    if header is None or site.column - _indent_width(header) != unit:
        return out
    base = site.column + _indent_width(out[0])  # multi mode on a blank line: see the caller
    deltas = [_indent_width(line) - base for line in out[1:] if line.strip()]
    deeper = [d for d in deltas if d > 0]
    if not deeper:
        return out
    step = min(deeper)
    if step == unit or step not in (2, 4) or any(d % step for d in deeper):
        return out

    def rescale(line: str) -> str:
        width = _indent_width(line)
        if not line.strip() or width <= base:
            return line
        new = base + (width - base) // step * unit
        lead = "\t" * (new // _TAB) + " " * (new % _TAB) if site.indent_char == "\t" else " " * new
        return lead + line.lstrip(" \t")

    return [out[0]] + [rescale(line) for line in out[1:]]


def _keep_lines(lines: list[str], site: _Site, mode: Mode, final: bool) -> int | None:
    """How many of ``lines`` make the completion, or ``None`` while undecided (not ``final``)."""
    if not lines:
        return 0
    keep = _single_keep(lines, site, final) if mode == "single" else _multi_keep(lines, site, final)
    # A loop is judged within what the rules keep (or all there is, while they wait for more).
    loop = _loop_end(lines, site, len(lines) if keep is None else keep, final)
    return loop if loop is not None and (keep is None or loop < keep) else keep


def _completeness(n: int, final: bool) -> Callable[[int], bool]:
    """Is line ``i`` of ``n`` complete? All but the last are; the last only in the final text."""
    return lambda i: i < n - 1 or final


def _single_keep(lines: list[str], site: _Site, final: bool) -> int | None:
    n = len(lines)
    complete = _completeness(n, final)
    if lines[0].strip():
        if not complete(0):
            return None
        if site.blank_before and site.next_lines and _same_line(site.before + lines[0], site.next_lines[0]):
            return 0
        return _single_end(lines, 0, site, complete)
    if n == 1:
        return 0 if final else None
    if site.after.strip():
        # A line break would split the code after the cursor, unless that code only closes an
        # empty pair of braces (`{|}`): then the model writes the block between them.
        return _pair_end(lines, site, complete) if _empty_pair(site) else 0
    for i in range(1, n):
        if lines[i].strip():
            if not complete(i):
                return None
            if site.next_lines and _same_line(lines[i], site.next_lines[0]):
                return 0
            return _single_end(lines, i, site, complete)
    return 0 if final else None


def _multi_keep(lines: list[str], site: _Site, final: bool) -> int | None:
    n = len(lines)
    complete = _completeness(n, final)

    def full(i: int) -> str:
        return site.before + lines[0] if i == 0 and site.blank_before else lines[i]

    first = next((i for i in range(n) if lines[i].strip()), None)
    if first is None:
        return 0 if final else None
    if not complete(first):
        return None
    outer = _outer_definition(lines, site, complete)
    if outer is not False:
        return None if outer is None else 0
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
            if _continues_statement(stripped, width, base, site):
                # `else:` of the `if` whose body is being filled: its body comes next, and the
                # next line back at the `if`'s column (not deeper) ends the completion.
                base = width + 1
                continue
            return _before_comments(lines, i, first, base)
        if width > base:
            deeper = True
        elif definition and deeper and not closer and not _CONTINUATION.match(stripped):
            return _before_comments(lines, i, first, base)
    return n if final else None


def _outer_definition(lines: list[str], site: _Site, complete: Callable[[int], bool]) -> bool | None:
    """Python: does the completion start a definition of its own at column 0 (a ``def`` or
    ``class`` with a body) while the code after the cursor goes on indented? The cursor is then
    inside that indented block (an empty line at column 0 in a function body), and the model
    left it: the new definition would swallow the rest of the block. ``None``: undecided yet.

    A definition whose body is the suffix (the model wrote only the header) is not affected,
    and neither is a nested helper (not at column 0)."""
    if site.lang != "python" or not site.blank_before or not site.next_lines or site.column > 0:
        return False
    if _indent_width(site.next_lines[0]) == 0:
        return False
    code = (i for i, line in enumerate(lines) if line.strip() and not _is_comment(line.strip()))
    head = next(code, None)
    if head is None or not complete(head):
        return False if head is None else None
    if _indent_width(lines[head]) > 0 or not _DEFINITION.match(lines[head]):
        return False
    body = next(code, None)
    if body is None or not complete(body):
        return None if body is not None or not complete(len(lines) - 1) else False
    return _indent_width(lines[body]) > 0


def _continues_statement(stripped: str, width: int, base: int, site: _Site) -> bool:
    """Is a line dedented to ``width`` below the block (at ``base``) a branch of the statement
    whose block the cursor is in (``else:``/``elif``/``except``/``finally``, ``} else {``,
    ``} catch (e) {``)? Only when the block's header above the cursor sits at that column and
    is one the branch can follow, and the suffix does not go on with that block or with a
    branch of its own (a second ``else`` would be a syntax error)."""
    m = _BRANCH.match(stripped)
    if m is None:
        return False
    header = site.enclosing(base)
    if header is None or _indent_width(header) != width or not _BRANCH_OF[m.group(1)].match(header.strip()):
        return False
    nxt = site.next_lines
    if nxt and _indent_width(nxt[0]) > width:
        return False  # more of the block follows the cursor: a branch would split it
    # Past the block's closer (`}` the editor added), the suffix's own branch would follow.
    ahead = nxt[:2] if nxt and _is_closer_line(nxt[0].strip()) else nxt[:1]
    return not any(_BRANCH.match(line.strip()) for line in ahead)


def _empty_pair(site: _Site) -> bool:
    """Is the cursor between ``{`` and ``}`` on one line (``{|}``, ``({|});``), with nothing
    after the ``}`` but closers, ``;`` and ``,``? A block goes there. (In ``f(|)`` a line
    break would start a multi-line argument list, which single mode does not write.)"""
    after = site.after.strip()
    return site.before.rstrip().endswith("{") and after.startswith("}") and all(
        c in _CLOSERS or c in ";," or c.isspace() for c in after
    )


def _pair_end(lines: list[str], site: _Site, complete: Callable[[int], bool]) -> int | None:
    """Lines to keep when the model answers ``{|}`` with a line break and a block: the lines
    indented deeper than the cursor's line; the first line back at its column (the model's
    copy of the closer, or code after the pair) ends the block. Nothing deeper: nothing."""
    header = _indent_width(site.before)
    body = False
    for i in range(1, len(lines)):
        stripped = lines[i].strip()
        if not stripped:
            continue
        if not complete(i):
            return None
        if _indent_width(lines[i]) <= header:
            return i if body else 0
        body = True
    if not complete(len(lines) - 1):
        return None
    return len(lines) if body else 0


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


def _loop_end(lines: list[str], site: _Site, limit: int, final: bool) -> int | None:
    """Where the first copy ends of the first group of 1-3 lines that the model repeats 3 times
    in a row (a generation loop: ``# todo:`` x9), among the first ``limit`` complete lines;
    ``None`` when there is none. Everything after that copy goes: once a model loops, what
    follows the loop is not worth keeping either, and generation can stop.

    A group needs a word or a number outside closer lines (``}`` / ``end`` lines close nested
    blocks and repeat legitimately); a group of numbers alone must come 4 times (the rows of a
    3x3 table of zeros are not a loop). The first line is compared with the whitespace before
    the cursor, as it will stand in the document.
    """
    seen = [site.before + lines[0] if site.blank_before else lines[0], *lines[1:limit]]
    # Only complete lines count: the last line is still growing unless the text is final.
    usable = len(seen) if final or len(seen) < len(lines) else len(seen) - 1
    for i in range(usable):
        for size in range(1, _LOOP_GROUP + 1):
            end = i + size * _LOOP_REPEATS
            if end > usable:
                break
            group = seen[i : i + size]
            # Cheap list comparisons first: this runs on every streamed chunk.
            if seen[i + size : i + 2 * size] != group or seen[i + 2 * size : end] != group:
                continue
            words = _loop_words(group)
            if words is None:
                continue
            if not words:  # numbers only: a 4th copy is needed
                end += size
                if end > usable or seen[end - size : end] != group:
                    continue
            return i + size
    return None


def _loop_words(group: list[str]) -> bool | None:
    """For a repeated group: ``True`` when it holds a word outside closer lines, ``False`` when
    only numbers, ``None`` when neither (closers, punctuation, blank lines)."""
    content = "".join(line for line in group if not _is_closer_line(line.strip()))
    if any(c.isalpha() for c in content):
        return True
    return False if any(c.isdigit() for c in content) else None


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
    cuts = [p for p in unmatched if text[p] == head[0]][:4]
    tail = _closer_tail(text) if has_grammar else None
    if tail is not None and text[tail] == head[0] and tail not in cuts:
        # The completion closed a block opened before the cursor and opened one of its own
        # (`} else {`), which its last line closes: the suffix's closer makes that line one too
        # many, a cut that no unmatched closer gives.
        cuts.append(tail)
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
    for p in cuts:
        candidate = text[:p].rstrip()
        errors = _error_count(prefix + candidate + joiner + suffix, site.lang)
        # Cuts come in text order; on a tie the earlier (shorter) one loses, keeping more text.
        if errors is not None and errors <= best_errors and (errors < best_errors or best is not text):
            best, best_errors = candidate, errors
    return best


_CHECK_CHARS = 2500


def _parsing_lines(text: str, prefix: str, suffix: str, site: _Site, joiner: str, truncated: bool) -> str:
    """The longest run of ``text``'s first lines that the document parses with: no more
    tree-sitter ERROR/MISSING nodes than without the completion (the ``syntax_ok`` metric).
    Catches what the line rules cannot see, e.g. a line at the wrong depth for Python
    (``return x`` dedented out of the loop that the suffix continues, a header's body not
    indented). Only when the whole text fails; when no first lines parse, ``""``, or the first
    line when the token limit cut the text (it is the start of a statement, as in step 1)."""
    parser = parser_for(site.lang)
    if parser is None:
        return text
    # A few KB around the cursor, parsed once; each candidate is an edit of that tree, which
    # tree-sitter reparses incrementally (this runs on every final multi-line answer). The same
    # window is parsed with and without the completion, so its cut edges count the same.
    prefix, suffix = _window(prefix, suffix, _CHECK_CHARS)
    head = prefix.encode("utf-8", "surrogatepass")
    tail = suffix.encode("utf-8", "surrogatepass")
    base = parser.parse(head + tail)
    before = _errors(base.root_node)
    at = (prefix.count("\n"), len(head) - (head.rfind(b"\n") + 1))  # (row, byte column)

    def parses(candidate: str) -> bool:
        inserted = (candidate + joiner).encode("utf-8", "surrogatepass")
        rows = inserted.count(b"\n")
        end = (at[0] + rows, (at[1] if rows == 0 else 0) + len(inserted) - (inserted.rfind(b"\n") + 1))
        tree = base.copy()
        tree.edit(len(head), len(head), len(head) + len(inserted), at, at, end)
        return _errors(parser.parse(head + inserted + tail, tree).root_node) <= before

    if parses(text):
        return text
    lines = text.split("\n")
    for k in range(len(lines) - 1, 0, -1):
        candidate = "\n".join(lines[:k]).rstrip()
        if candidate.strip() and parses(candidate):
            return candidate
    return lines[0] if truncated else ""


def _closer_tail(text: str) -> int | None:
    """Where the closer line that ``text`` ends with starts (its first closer), if it has one
    and more lines before it."""
    body = text.rstrip()
    start = body.rfind("\n") + 1
    if start == 0 or not _is_closer_line(body[start:].strip()):
        return None
    return start + len(_leading(body[start:]))


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
    return _errors(parser.parse(source.encode("utf-8", "surrogatepass")).root_node)


def _errors(root: Node) -> int:
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


def _postprocess(
    generated: str, prefix: str, suffix: str, lang: str, mode: Mode, *, truncated: bool, healed: str, partial: bool = False
) -> str:
    site = _site(prefix, suffix, lang)
    lines = _final_lines(generated, site, mode, truncated, healed)
    if not lines:
        return ""
    text = "\n".join(lines)

    code_follows = bool(site.after.strip())
    joiner = _joiner(text, site, mode)
    if not code_follows or joiner or site.after[:1].isspace():
        text = text.rstrip()
    prefix, suffix = _window(prefix, suffix)
    if not joiner:
        text = _trim_overlap(text, prefix, suffix, site)
    text = _balance(text, prefix, suffix, site, joiner)
    if mode == "multi" and not partial:
        text = _parsing_lines(text, prefix, suffix, site, joiner, truncated)
    if not text.strip():
        return ""
    text = text.rstrip() + joiner if (joiner or not code_follows) else text
    return text.replace("\n", site.eol) if site.eol != "\n" else text


def _final_lines(generated: str, site: _Site, mode: Mode, truncated: bool, healed: str) -> list[str]:
    """Steps 1-4 of :func:`postprocess`: the lines to insert, before the suffix is consulted."""
    start, end = _special_span(generated)
    body = generated[start:end]
    if end == len(generated):
        body = _PARTIAL_SPECIAL.sub("", body)
        cut = body.rfind("\n") + 1
        if truncated and mode == "multi" and body[:cut].strip():
            # The token limit cut the last line short; it goes when whole lines come before it
            # (a first line alone stays, as in single mode: the start of a statement beats nothing).
            body = body[:cut]
    text = _prepare(body, site, mode, healed, final=True)
    if text is None:
        return []
    keep = _keep_lines(text.lines, site, mode, final=True)
    lines = text.lines[: keep if keep is not None else len(text.lines)]
    lines = [line.rstrip() for line in lines[:-1]] + lines[-1:]
    while lines and not lines[-1].strip():
        lines.pop()
    if truncated and mode == "multi":
        lines = _whole_statements(lines, site)
    return lines


def _whole_statements(lines: list[str], site: _Site) -> list[str]:
    """A block cut by the token limit, back to its last line that ends a statement: no bracket
    or string it opened left open, not a block header waiting for its body (``if x:``,
    ``return self.send(``). Without such a line, the first line alone (as when the limit cuts
    the first line itself: the start of a statement beats nothing)."""
    _, _, quote_at_cursor = _scan(site.before, site.lang)
    for k in range(len(lines), 0, -1):
        last = lines[k - 1].rstrip()
        if not last.strip() or (site.lang == "python" and last.endswith(":")):
            continue
        kept = "\n".join(lines[:k])
        _, still_open, quote = _scan(kept, site.lang, quote_at_cursor)
        if not still_open and quote is None and not _open_block_string(kept, site.lang):
            return lines[:k]
    return lines[:1]


def _open_block_string(text: str, lang: str) -> bool:
    """Does ``text`` (starting outside any string, as multi mode does) end inside a docstring or
    a ``/* */`` comment, which :func:`_scan` does not follow across lines?"""
    if lang == "python":
        return text.count('"""') % 2 == 1 or text.count("'''") % 2 == 1
    return text.rfind("/*") > text.rfind("*/")


def _joiner(text: str, site: _Site, mode: Mode) -> str:
    """What goes between the completion and code after the cursor on its line, so that code
    keeps a line of its own: a line break and that code's indentation (the cursor at the start
    of a line, multi), or its header's (``{|}``: the brace goes back under its header)."""
    if not site.after.strip():
        return ""
    if mode == "multi" and site.blank_before:
        if site.after.strip()[0] in _CLOSERS and _opens_block(site.prev_line):
            return "\n" + _leading(site.prev_line)
        return "\n" + site.before
    if mode == "single" and text.startswith("\n") and _empty_pair(site):
        return "\n" + _leading(site.before)
    return ""


def _starts_statement(code: str) -> bool:
    """Can ``code`` (the rest of a line after the cursor) be a line of its own? A word, a string,
    a decorator, a comment or a closing ``}`` can; other punctuation (``;``, ``)``, ``.x``,
    ``/ y``, ``= 1``) continues an expression."""
    return code[0].isalnum() or code[0] in "_$@#\"'`}" or code.startswith(("//", "/*"))


def _line_before(prefix: str) -> str:
    return prefix[prefix.rfind("\n") + 1 :]
