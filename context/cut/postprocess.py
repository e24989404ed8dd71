"""From a raw model completion to the text that is safe to insert at the cursor.

The model sees the text before the cursor (prefix) and after it (suffix) and writes raw text for
the cursor. Users judge us by whether accepting it leaves their code right, so this module decides
(DESIGN.md, "Let syntax decide"):

* :func:`completion_mode`: one line or a block?
* :func:`find_stop`: while streaming, where the completion is complete (so generation can stop);
* :func:`postprocess`: the text to insert (cut, cleaned, re-indented, balanced against the suffix);
* :func:`syntax_ok`: the quality metric (inserting adds no tree-sitter ERROR/MISSING node).

:class:`SyntaxCutter` applies them to one streamed completion (the completer's cutter); the rules
live in context.cut.line_rules (which lines to keep), context.cut.brackets (brackets, overlap, the parse
check) and context.cut.surroundings (the summary of the cursor's surroundings they all read).

All functions are pure (strings in, strings out). tree-sitter is used where a grammar exists (the
mode at the cursor, bracket balancing, the metric); everything else is line and indentation
heuristics, so a language without a grammar gets the same behaviour minus those checks, never an
error. ``find_stop`` and ``postprocess`` never raise: garbage in gives ``None`` / ``""`` out.

Shared conventions:

* Indentation widths count a tab as 4 columns (``context.source.languages.indent_columns``), consistently
  on both sides of every comparison.
* Line breaks may be ``\\r\\n``; analysis ignores the ``\\r`` and :func:`postprocess` writes the
  document's own line break.
* A "closer line" holds only closing brackets (``}``, ``)``, ``]``) plus ``;`` / ``,``, or ``end``.
"""

from __future__ import annotations

import logging
import re

from tree_sitter import Tree

from context.cut.brackets import CLOSERS, balance, error_count, parsing_lines, parsing_tokens, scan_brackets, trim_overlap
from context.cut.control_tokens import strip_control_tokens
from context.cut.line_rules import empty_pair, keep_lines, prepare_lines
from context.cut.surroundings import (
    Mode,
    Surroundings,
    inside_string_or_comment,
    leading_space,
    no_cr,
    opens_block,
    parse_window,
    same_line,
    surroundings_of,
)
from context.source.languages import LanguageInfo, normalize_language_id

log = logging.getLogger(__name__)


__all__ = [
    "Mode",
    "StreamCutter",
    "SyntaxCutter",
    "completion_mode",
    "find_stop",
    "plain_postprocess",
    "plain_stop",
    "postprocess",
    "strip_special_tokens",
    "syntax_ok",
]


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
      definition at a time), not by the mode. Between statements of a block that goes on below
      the cursor, that is one statement unless the model's next lines are new code: it ends
      before a line the suffix has, before a ``return`` or branch that clashes with the
      suffix, and (Python) after a header whose body the suffix holds; an empty block body
      (after ``def f():``, ``{``, ``=>``) takes the whole block. The same rules serve every
      language family: indentation-significant ones (Python) and brace ones (C, C++, Java, C#,
      JavaScript/TypeScript, Go, Rust), read from ``LanguageInfo``.
      The cursor at the start of a line that has code
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
        if inside_string_or_comment(prefix, suffix, lang, tree, cursor_byte):
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

      - where the block goes on below the cursor (the suffix's next line is at the block's
        column), is a ``return`` / ``raise`` / ``throw`` / ``break`` / ``continue`` at the
        block's column (the suffix's code would be unreachable), or a branch (``elif``,
        ``else if``) when the suffix's next line is a branch already,
      - is at the block's column after such a statement of the model's own (dead code),
      - repeats a later line of the suffix (indentation included, not a closer or a bare
        keyword): the block ends before the statement at the block's column that holds it
        (the model is writing the code that follows),

      and where indentation is significant, a first line that is a header one level above the
      suffix's next line (``for c in s:`` before the loop's body) is the whole completion
      unless the model comes back to that line (it was writing what was missing before it).

      Comment lines never end a block by their indentation (commented-out code sits at column
      0); blank lines and comments indented below the block just before the stop are left out
      (they belong to what follows), and so are those at the end of the text.

      Indentation is judged after the same fixes :func:`postprocess` applies (tabs vs spaces,
      lines written relative to column 0), so a model that indents wrongly is not cut short.
      A dedented line that continues the statement whose block is being filled (``else:``,
      ``} else {``, ``except E:``, ``} catch (e) {`` at that statement's column, when the suffix
      does not continue it already) is kept; the next line back at that column ends the block.
      Not when the author's next statement follows the header's block directly (Python: the
      body was what was missing), except a ``try``'s ``except`` / ``finally``.

    * Both modes: a markdown fence line (three backticks) or chat prose after a blank line
      (instruct models close their answer and explain it) ends the completion as if the text
      ended there (not in markdown or plain text), and a group of 1-3 lines repeated 3 times in
      a row (a generation loop) ends it after its first copy.
    * A leading line break on an indented empty line (``multi``) does not count: the first line
      with code goes on the cursor's line (see :func:`postprocess`, step 2). Such a line
      indented below the cursor ends the completion at once (index 0).

    ``healed``: what :func:`context.prompt.builder.build_prompt` stripped from the end of the prompt
    (``Prompt.healed``); the model's text then starts before the cursor (see :func:`postprocess`).
    """
    try:
        return _stop_at(generated, surroundings_of(prefix, suffix, normalize_language_id(language_id)), mode, healed)
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
    stopped: bool = False,
) -> str:
    """The text to insert at the cursor, or ``""`` when nothing useful remains.

    ``stopped``: ``generated`` ends where :func:`find_stop` stopped it (the streaming cutter's
    final text), so the rules that judge a block by its last line have been applied already, to
    the line that made the stop (the line after the end is gone: one that repeated the suffix
    showed the model in step with it, and the block is then kept whole).

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
       (also when the block the first line opens closes at column 0); after a block header
       (Python) a first line not indented deeper than the header is shifted to the body's
       column (the suffix's next line's when it holds the body, unless the line is a ``return``
       or left of the header; else one level in); in ``multi``,
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
       header left without its body. In ``single`` mode (final text, a grammar), an answer
       whose insertion leaves more ERROR/MISSING nodes than a start of it cut at a token
       boundary is cut to the longest such start with the fewest: the node at the cursor
       ended there (``x > 0: self.a()`` before the suffix's `` self.b()`` -> ``x > 0:``).
    7. Trailing whitespace is stripped, except what the suffix needs: when the cursor sits before
       code at the start of a line (multi), the completion ends with a line break and the line's
       indentation, and trailing spaces before code on the same line are kept (``return |x``).
       A block written between an empty pair of brackets on one line (``{|}``, single mode,
       starting with a line break) ends with a line break and the line's indentation, so the
       closer goes under its header.
    8. Line breaks become the document's (``\\r\\n`` when it uses them).
    """
    try:
        site = surroundings_of(prefix, suffix, normalize_language_id(language_id))
        return _postprocess(
            generated, site, prefix, suffix, mode, truncated=truncated, healed=healed, partial=partial, stopped=stopped
        )[0]
    except Exception:
        log.warning("postprocess failed; falling back to the first line", exc_info=True)
        return _first_line(generated)


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
    before = error_count(prefix + suffix, lang)
    if before is None:
        return True
    after = error_count(prefix + completion + suffix, lang)
    return after is not None and after <= before


def strip_special_tokens(text: str) -> str:
    """``text`` without leading special tokens and cut at the first other one."""
    start, end = _special_span(text)
    return text[start:end]


def _stop_at(generated: str, site: Surroundings, mode: Mode, healed: str) -> int | None:
    """:func:`find_stop` for a summarised site (may raise)."""
    start, end = _special_span(generated)
    ended = end < len(generated)  # a special token ended the text: all before it is final
    text = prepare_lines(generated[start:end], site, mode, healed, final=ended)
    if text is None:
        return start
    keep = keep_lines(text.lines, site, mode, final=text.final)
    if keep is None:
        return end if ended else None
    if keep == 0:
        return start
    raw = text.raw[: text.skip + keep]
    offset = start + sum(len(r) + 1 for r in raw[:-1])
    return offset + len(no_cr(raw[-1]))


def _first_line(generated: str) -> str:
    """A plain, safe answer when post-processing fails, rather than none."""
    try:
        start, end = _special_span(generated)
        return generated[start:end].split("\n")[0].rstrip()
    except Exception:  # noqa: BLE001 - the fallback must never raise: an empty answer instead
        return ""


class StreamCutter:
    """A streamed completion cut where :meth:`_stop` says it is complete; subclasses say where
    and what text to show."""

    raw: str  # the model's text so far (control tokens included), cut once feed() said so
    seen: str = ""  # all the text the model sent, uncut
    _previewed: str  # the raw text the preview shows: as of the last chunk that did not stop

    def feed(self, chunk: str) -> bool:
        """Adds streamed text; True when the completion is complete (stop generating)."""
        self.raw += chunk
        self.seen += chunk
        cut = self._stop()
        if cut is not None:
            self.raw = self.raw[:cut]
            return True
        self._previewed = self.raw
        return False

    def _stop(self) -> int | None:
        raise NotImplementedError


class SyntaxCutter(StreamCutter):
    """ember's post-processing of one streamed completion: :func:`find_stop` on every chunk,
    :func:`postprocess` for the preview and the final text, with the cursor's surroundings
    summarised once."""

    def __init__(self, prefix: str, suffix: str, language_id: str, mode: Mode, healed: str = "") -> None:
        self.prefix = prefix
        self.suffix = suffix
        self.mode = mode
        self.healed = healed
        self.raw = ""
        self._previewed = ""
        self._preview = ("", "")  # (raw, text) of the last preview made
        self._language_id = language_id
        self._stopped = False  # feed() stopped the text (finish() then knows find_stop cut it)
        # Summarised at the first chunk, not here: that work then overlaps the engine's prefill
        # instead of delaying the request (as find_stop did before the cutter existed).
        self._summary: tuple[Surroundings | None] | None = None

    def _site(self) -> Surroundings | None:
        """The cursor's surroundings, summarised once; None when that failed."""
        if self._summary is None:
            try:
                self._summary = (surroundings_of(self.prefix, self.suffix, normalize_language_id(self._language_id)),)
            except Exception:
                log.warning("summarising the cursor's surroundings failed; cutting at the first line", exc_info=True)
                self._summary = (None,)
        return self._summary[0]

    def preview(self) -> str:
        """The text to show while the stream goes on (the final text's rules minus the parse check)."""
        if self._preview[0] != self._previewed:
            self._preview = (self._previewed, self._text(self._previewed, truncated=False, partial=True))
        return self._preview[1]

    def finish(self, truncated: bool) -> str:
        """The text to insert once the stream ended; ``truncated``: by the token limit or the deadline."""
        return self._text(self.raw, truncated=truncated, partial=False, stopped=self._stopped)

    def why_empty(self, truncated: bool) -> str:
        """Which step left nothing of the model's text, when :meth:`finish` gave ``""``."""
        site = self._site()
        if site is None:
            return "the cursor's surroundings could not be read"
        # A stop at the very start cut the text to nothing: its reason lies in what was cut.
        raw, stopped = (self.raw, self._stopped) if self.raw.strip() else (self.seen, False)
        try:
            return _postprocess(
                strip_control_tokens(raw), site, self.prefix, self.suffix, self.mode,
                truncated=truncated, healed=self.healed, stopped=stopped,
            )[1] or WHY_BLOCK_RULES
        except Exception:
            log.warning("explaining an empty answer failed", exc_info=True)
            return "post-processing failed"

    def _stop(self) -> int | None:
        site = self._site()
        if site is None:
            return None  # as find_stop does when it fails: the token limit ends the text
        try:
            stop = _stop_at(self.raw, site, self.mode, self.healed)
            self._stopped = stop is not None
            return stop
        except Exception:
            log.warning("find_stop failed; letting generation continue", exc_info=True)
            return None

    def _text(self, raw: str, *, truncated: bool, partial: bool, stopped: bool = False) -> str:
        generated = strip_control_tokens(raw)
        site = self._site()
        if site is None:
            return _first_line(generated)
        try:
            return _postprocess(
                generated, site, self.prefix, self.suffix, self.mode,
                truncated=truncated, healed=self.healed, partial=partial, stopped=stopped,
            )[0]
        except Exception:
            log.warning("postprocess failed; falling back to the first line", exc_info=True)
            return _first_line(generated)


def _special_span(text: str) -> tuple[int, int]:
    """(start, end) of the text between leading special tokens and the next one."""
    m = _LEADING_SPECIAL.match(text)
    start = m.end() if m else 0
    m2 = _SPECIAL.search(text, start)
    return start, m2.start() if m2 else len(text)


def _postprocess(
    generated: str,
    site: Surroundings,
    prefix: str,
    suffix: str,
    mode: Mode,
    *,
    truncated: bool,
    healed: str,
    partial: bool = False,
    stopped: bool = False,
) -> tuple[str, str]:
    """:func:`postprocess`'s steps: (the text, "") or ("", why nothing is left)."""
    lines, why = _final_lines(generated, site, mode, truncated, healed, stopped)
    if not lines:
        return "", why
    text = "\n".join(lines)

    code_follows = bool(site.after.strip())
    joiner = _joiner(text, site, mode)
    if not code_follows or joiner or site.after[:1].isspace():
        text = text.rstrip()
    prefix, suffix = parse_window(prefix, suffix)
    if not joiner:
        text = trim_overlap(text, prefix, suffix, site)
        if not text.strip():
            return "", WHY_OVERLAP
    text = balance(text, prefix, suffix, site, joiner)
    if not text.strip():
        return "", WHY_CLOSERS
    if not partial and mode == "multi":
        text = parsing_lines(text, prefix, suffix, site, joiner, truncated)
    elif not partial:
        cut = parsing_tokens(text, prefix, suffix, site, joiner)
        # What the cut left may end with the suffix's start again (the part after it was a comment).
        text = trim_overlap(cut, prefix, suffix, site) if cut != text and not joiner else cut
    if not text.strip():
        return "", WHY_SYNTAX
    text = text.rstrip() + joiner if (joiner or not code_follows) else text
    return (text.replace("\n", site.eol) if site.eol != "\n" else text), ""


def _final_lines(
    generated: str, site: Surroundings, mode: Mode, truncated: bool, healed: str, stopped: bool
) -> tuple[list[str], str]:
    """Steps 1-4 of :func:`postprocess`: the lines to insert, before the suffix is consulted;
    with none, why."""
    start, end = _special_span(generated)
    body = generated[start:end]
    if not body.strip():
        # In single mode a line break before code on the cursor's line stops the stream at once.
        splits = mode == "single" and "\n" in body and bool(site.after.strip())
        return [], WHY_SPLITS_LINE if splits else WHY_NOTHING
    if end == len(generated):
        body = _PARTIAL_SPECIAL.sub("", body)
        cut = body.rfind("\n") + 1
        if truncated and mode == "multi" and body[:cut].strip():
            # The token limit cut the last line short; it goes when whole lines come before it
            # (a first line alone stays, as in single mode: the start of a statement beats nothing).
            body = body[:cut]
    text = prepare_lines(body, site, mode, healed, final=True)
    if text is None:
        return [], WHY_LEFT_BLOCK
    if not any(line.strip() for line in text.lines):
        return [], WHY_PROSE
    keep = keep_lines(text.lines, site, mode, final=True, stopped=stopped)
    lines = text.lines[: keep if keep is not None else len(text.lines)]
    lines = [line.rstrip() for line in lines[:-1]] + lines[-1:]
    while lines and not lines[-1].strip():
        lines.pop()
    if truncated and mode == "multi":
        lines = _whole_statements(lines, site)
    return lines, "" if lines else _why_no_lines(text.lines, site, mode)


# Why post-processing left nothing of the model's text (ember/stats' why_empty).
WHY_NOTHING = "the model wrote no code: it ended at once, or wrote only whitespace"
WHY_LEFT_BLOCK = "the model's first line is indented left of the cursor: it left the cursor's block"
WHY_PROSE = "the model wrote prose or a markdown fence, not code"
WHY_REPEATS_NEXT = "the model's first line repeats the line after the cursor"
WHY_SPLITS_LINE = "the model started a new line, which would split the code after the cursor"
WHY_BLOCK_RULES = "the block rules kept none of its lines: it starts the code that follows (a definition or statement)"
WHY_OVERLAP = "it is the code after the cursor again"
WHY_CLOSERS = "it only closes brackets that the code after the cursor closes already"
WHY_SYNTAX = "inserting any of it would break the syntax"


def _why_no_lines(lines: list[str], site: Surroundings, mode: Mode) -> str:
    """Which line rule left none of ``lines`` (see :func:`context.cut.line_rules.keep_lines`)."""
    first = next((line for line in lines if line.strip()), "")
    head = site.before + first if mode == "multi" and site.blank_before and lines[0].strip() else first
    if site.next_lines and same_line(head, site.next_lines[0]):
        return WHY_REPEATS_NEXT
    if mode == "single" and not lines[0].strip() and site.after.strip():
        return WHY_SPLITS_LINE
    return WHY_BLOCK_RULES


def _whole_statements(lines: list[str], site: Surroundings) -> list[str]:
    """A block cut by the token limit, back to its last line that ends a statement: no bracket
    or string it opened left open, not a block header waiting for its body (``if x:``,
    ``return self.send(``). Without such a line, the first line alone (as when the limit cuts
    the first line itself: the start of a statement beats nothing)."""
    _, _, quote_at_cursor = scan_brackets(site.before, site.info)
    for k in range(len(lines), 0, -1):
        last = lines[k - 1].rstrip()
        if not last.strip() or (site.info.indentation_significant and last.endswith(":")):
            continue
        kept = "\n".join(lines[:k])
        _, still_open, quote = scan_brackets(kept, site.info, quote_at_cursor)
        if not still_open and quote is None and not _open_block_string(kept, site.info):
            return lines[:k]
    return lines[:1]


def _open_block_string(text: str, info: LanguageInfo) -> bool:
    """Does ``text`` (starting outside any string, as multi mode does) end inside a docstring or
    a ``/* */`` comment, which :func:`scan_brackets` does not follow across lines?"""
    if info.block_comment is None:  # Python: what spans lines are its triple-quoted strings
        return any(text.count(opener) % 2 == 1 for opener in info.multiline_openers)
    opener, closer = info.block_comment
    return text.rfind(opener) > text.rfind(closer)


def _joiner(text: str, site: Surroundings, mode: Mode) -> str:
    """What goes between the completion and code after the cursor on its line, so that code
    keeps a line of its own: a line break and that code's indentation (the cursor at the start
    of a line, multi), or its header's (``{|}``: the brace goes back under its header)."""
    if not site.after.strip():
        return ""
    if mode == "multi" and site.blank_before:
        if site.after.strip()[0] in CLOSERS and opens_block(site.prev_line, site.info):
            return "\n" + leading_space(site.prev_line)
        return "\n" + site.before
    if mode == "single" and text.startswith("\n") and empty_pair(site):
        return "\n" + leading_space(site.before)
    return ""


def _starts_statement(code: str) -> bool:
    """Can ``code`` (the rest of a line after the cursor) be a line of its own? A word, a string,
    a decorator, a comment or a closing ``}`` can; other punctuation (``;``, ``)``, ``.x``,
    ``/ y``, ``= 1``) continues an expression."""
    return code[0].isalnum() or code[0] in "_$@#\"'`}" or code.startswith(("//", "/*"))


def _line_before(prefix: str) -> str:
    return prefix[prefix.rfind("\n") + 1 :]
