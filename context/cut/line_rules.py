"""Which lines of the model's text make the completion (steps 2-4 of context.cut.postprocess.postprocess).

:func:`prepare_lines` aligns the model's lines to the cursor, fixes their indentation and cuts
where chat text begins; :func:`keep_lines` decides how many of them the completion keeps: the end
of the statement (single mode), the end of the block, the repeated next line, a generation loop.
Both judge a line only once it is complete, so that a streamed decision never depends on how the
text was chunked.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from context.cut.brackets import CLOSERS, scan_brackets
from context.cut.chat import chat_start
from context.cut.suffix_rules import TERMINAL, header_end, repeats_suffix, statement_start, suffix_continues
from context.cut.surroundings import (
    Mode,
    Surroundings,
    completeness,
    is_closer_line,
    is_comment,
    leading_space,
    no_cr,
    opens_block,
    same_line,
)
from context.source.languages import TAB_WIDTH, indent_columns

# Single mode follows brackets opened on its line through at most this many more lines.
_SINGLE_SPAN = 16


# Generation loops: a group of this many lines or fewer, repeated this many times in a row.
_LOOP_GROUP = 3


_LOOP_REPEATS = 3


# A header that starts a definition: completions that start one stop after it (one definition at
# a time, like the peers), instead of writing the rest of the file.
_DEFINITION = re.compile(
    r"^\s*(?:(?:pub(?:\([^)]*\))?|export|default|async|static|public|private|protected|internal|"
    r"abstract|final|override|virtual|unsafe|extern|inline|const|sealed|open|suspend)\s+)*"
    r"(?:def|class|function|fn|func|impl|struct|enum|trait|interface|mod|type|union|namespace|"
    r"module|object)\b"
)


# A statement whose branches are not optional (``try`` needs ``except`` / ``catch`` / ``finally``).
_TRY = re.compile(r"^(?:\}\s*)?try\b")


# Blocks whose bodies list definitions.
_CONTAINER = re.compile(
    r"^\s*(?:[\w()]+\s+)*(?:class|impl|interface|trait|namespace|mod|struct|enum|object|extern|module)\b"
)


# Java/C#/C++ methods: a return type, a name, parameters, a brace.
_METHOD = re.compile(r"^\s*(?:[\w<>\[\],.?*&:]+\s+)+[\w~]+\s*\([^;]*\)\s*[\w\s,.]*\{$")


def _convert_indent(line: str, site: Surroundings) -> str:
    """The line's leading whitespace in the document's style (tabs vs spaces)."""
    lead = leading_space(line)
    if not lead or site.indent_char is None:
        return line
    if site.indent_char == "\t" and "\t" not in lead:
        width = len(lead)
        return "\t" * (width // TAB_WIDTH) + " " * (width % TAB_WIDTH) + line[len(lead) :]
    if site.indent_char == " " and "\t" in lead:
        width = indent_columns(lead)
        return " " * width + line[len(lead) :]
    return line


def _shift(line: str, indent: str) -> str:
    return indent + line if line.strip() else line


@dataclass(frozen=True)
class _Text:
    """The model's text as lines, ready for :func:`keep_lines`."""

    raw: list[str]  # the model's lines (special tokens removed), "\r" included
    skip: int  # raw lines before lines[0]: a leading line break that the cursor's line replaces
    lines: list[str]  # raw[skip:], aligned to the cursor and with indentation fixed
    final: bool  # nothing can follow lines: the text ended (or chat text after code begins)


def prepare_lines(body: str, site: Surroundings, mode: Mode, healed: str, final: bool) -> _Text | None:
    """The shared first half of :func:`find_stop` and :func:`postprocess`: lines aligned to the
    cursor (see :func:`_align`), indentation fixed, and cut where chat text begins. ``None``:
    the model left the cursor's block at once (the completion is empty)."""
    raw = body.split("\n")
    aligned = _align([no_cr(r) for r in raw], site, mode, healed)
    if aligned is None:
        return None
    skip, lines, absolute = aligned
    lines = _fix_indentation(lines, site, mode, absolute)
    chat = chat_start(lines, site, mode, final)
    if chat is not None:
        lines, final = lines[:chat], True
    return _Text(raw, skip, lines, final)


def _align(lines: list[str], site: Surroundings, mode: Mode, healed: str) -> tuple[int, list[str], bool] | None:
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
    if indent_columns(lines[k]) < col:
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
        width = width + 1 if line[i] == " " else width + TAB_WIDTH - width % TAB_WIDTH
        i += 1
    return " " * max(0, width - col) + line[i:]


def _fix_indentation(lines: list[str], site: Surroundings, mode: Mode, absolute: bool = False) -> list[str]:
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
    if col > 0 and leading_space(out[0]):
        header_level = opens_block(site.prev_line, site.info) and col <= indent_columns(site.prev_line)
        if not header_level:
            out[0] = out[0].lstrip(" \t")

    # Lines after the first written as if the first one were at column 0 (models without FIM
    # training, chat models): a block header followed by a line indented at most to the cursor,
    # or a plain line followed, without a blank line, by a line at column 0 that neither closes
    # nor continues a block: in brace languages a real dedent would come after a `}`; where
    # indentation is significant (Python), code inside a def/class does not jump to column 0
    # without a blank line (a script's loop body may, so there it counts only inside a
    # definition). A line that repeats the next line of the suffix is taken as written: the
    # model is echoing it.
    if col > 0 and not absolute and not leading_space(out[0]) and rest:
        second = out[rest[0]]
        width2 = indent_columns(second)
        echoes = bool(site.next_lines) and same_line(second, site.next_lines[0])
        plain = (
            (not site.info.indentation_significant or any(_DEFINITION.match(a) for a in site.ancestors))
            and width2 == 0
            and rest[0] == 1
            and not site.info.statement_continuation.match(second.strip())
            and not is_closer_line(second.strip())
            and not is_comment(second.strip())  # commented-out code often sits at column 0
        )
        relative = not echoes and (
            (opens_block(out[0], site.info) and 0 < width2 <= col) or plain or _closes_at_zero(out, site)
        )
        if relative:
            indent = leading_space(site.before)
            out = [out[0]] + [_shift(line, indent) for line in out[1:]]

    if site.info.indentation_significant and opens_block(site.prev_line, site.info):
        out = _indent_under_header(out, site)
    return _rescale_levels(out, site)


def _indent_under_header(out: list[str], site: Surroundings) -> list[str]:
    """Where indentation is significant (Python), what follows a block header is its body,
    deeper than the header (an editor without smart indent leaves the cursor at the header's
    column, a model may follow it): a first line not deeper is shifted, with the lines after it,
    to the body's column: that of the suffix's next line when the suffix holds the body already
    (the cursor before it), else one level in (an empty body; also before an ``else:`` that
    follows). Brace languages do not care, and real code there often keeps a body at its
    header's column."""
    header = indent_columns(site.prev_line)
    first_width = site.column + indent_columns(out[0])
    if first_width > header:
        return out
    nxt = indent_columns(site.next_lines[0]) if site.next_lines else 0
    if nxt > header and (first_width < header or TERMINAL.match(out[0].strip())):
        return out  # the suffix holds the body: a line left of the header, or a `return`, goes after the block
    body = nxt if nxt > header else header + (TAB_WIDTH if site.indent_char == "\t" else site.indent_unit)
    missing = body - first_width
    pad = "\t" * -(-missing // TAB_WIDTH) if site.indent_char == "\t" else " " * missing
    return [pad + out[0]] + [_shift(line, pad) for line in out[1:]]


def _closes_at_zero(out: list[str], site: Surroundings) -> bool:
    """Does a bracket that the first line opens close on a line at column 0? Written at the
    cursor's column, that closer would sit at the column of its opening line; at column 0, the
    model wrote the lines as if the first one were at column 0 (even when the body's depth,
    4 columns in a 2-space file, exceeds the cursor's column and looks absolute)."""
    depth = len(scan_brackets(out[0], site.info)[1])
    if depth == 0:
        return False
    for line in out[1:]:
        stripped = line.strip()
        if not stripped or is_comment(stripped):
            continue
        if indent_columns(line) == 0:
            return stripped[0] in CLOSERS
        closed, opened, _ = scan_brackets(line, site.info)
        depth += len(opened) - sum(1 for p in closed if line[p] in CLOSERS)
        if depth <= 0:
            return False  # closed at its own column: absolute after all
    return False


def _rescale_levels(out: list[str], site: Surroundings) -> list[str]:
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
    if header is None or site.column - indent_columns(header) != unit:
        return out
    base = site.column + indent_columns(out[0])  # multi mode on a blank line: see the caller
    deltas = [indent_columns(line) - base for line in out[1:] if line.strip()]
    deeper = [d for d in deltas if d > 0]
    if not deeper:
        return out
    step = min(deeper)
    if step == unit or step not in (2, 4) or any(d % step for d in deeper):
        return out

    def rescale(line: str) -> str:
        width = indent_columns(line)
        if not line.strip() or width <= base:
            return line
        new = base + (width - base) // step * unit
        lead = "\t" * (new // TAB_WIDTH) + " " * (new % TAB_WIDTH) if site.indent_char == "\t" else " " * new
        return lead + line.lstrip(" \t")

    return [out[0]] + [rescale(line) for line in out[1:]]


def keep_lines(lines: list[str], site: Surroundings, mode: Mode, final: bool, stopped: bool = False) -> int | None:
    """How many of ``lines`` make the completion, or ``None`` while undecided (not ``final``).
    ``stopped``: the lines end where these rules stopped the stream (see
    :func:`context.cut.postprocess.postprocess`)."""
    if not lines:
        return 0
    keep = _single_keep(lines, site, final) if mode == "single" else _multi_keep(lines, site, final, stopped)
    # A loop is judged within what the rules keep (or all there is, while they wait for more).
    loop = _loop_end(lines, site, len(lines) if keep is None else keep, final)
    return loop if loop is not None and (keep is None or loop < keep) else keep



def _single_keep(lines: list[str], site: Surroundings, final: bool) -> int | None:
    n = len(lines)
    complete = completeness(n, final)
    if lines[0].strip():
        if not complete(0):
            return None
        if site.blank_before and site.next_lines and same_line(site.before + lines[0], site.next_lines[0]):
            return 0
        return _single_end(lines, 0, site, complete)
    if n == 1:
        return 0 if final else None
    if site.after.strip():
        # A line break would split the code after the cursor, unless that code only closes an
        # empty pair of braces (`{|}`): then the model writes the block between them.
        return _pair_end(lines, site, complete) if empty_pair(site) else 0
    for i in range(1, n):
        if lines[i].strip():
            if not complete(i):
                return None
            if site.next_lines and same_line(lines[i], site.next_lines[0]):
                return 0
            return _single_end(lines, i, site, complete)
    return 0 if final else None


def _multi_keep(lines: list[str], site: Surroundings, final: bool, stopped: bool = False) -> int | None:
    n = len(lines)
    complete = completeness(n, final)
    first = next((i for i in range(n) if lines[i].strip()), None)
    if first is None:
        return 0 if final else None
    if not complete(first):
        return None
    outer = _outer_definition(lines, site, complete)
    if outer is not False:
        return None if outer is None else 0
    at_cursor = first > 0 or site.blank_before  # the first line stands at the cursor's column
    head = site.before + lines[0] if first == 0 and site.blank_before else lines[first]
    nxt = site.next_lines[0] if site.next_lines else None
    if nxt is not None and at_cursor and same_line(head, nxt):
        return first
    base = indent_columns(head) if at_cursor else indent_columns(site.before)
    stop, repeated = _block_end(lines, first, base, head, site, complete)
    if stop is None:
        if not final:
            return None
        stop, repeated = _before_comments(lines, n, first, base), stopped
    return stop if repeated else header_end(lines, first, stop, site)


def _block_end(
    lines: list[str], first: int, base: int, head: str, site: Surroundings, complete: Callable[[int], bool]
) -> tuple[int | None, bool]:
    """Where the block that starts at line ``first`` (at column ``base``) ends, ``None`` while
    the lines so far do not say; and whether it ends because the model repeats the suffix's next
    line (then it is in step with the suffix: the lines before are what it lacks)."""
    nxt = site.next_lines[0] if site.next_lines else None
    definition = opens_block(lines[first], site.info) and _definition_level(head, base, site)
    deeper = closed = False
    returned = bool(TERMINAL.match(lines[first].strip()))  # code after it at its level is dead
    for i in range(first + 1, len(lines)):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            continue
        if not complete(i):
            return None, False
        if nxt is not None and same_line(line, nxt):
            return _before_comments(lines, i, first, base), True
        width = indent_columns(line)
        if is_comment(stripped):
            continue  # comments (often at column 0) end no block; the next code line decides
        if repeats_suffix(line, base, site):
            return _before_comments(lines, statement_start(lines, i, first, base), first, base), False
        if width == base and (returned or suffix_continues(stripped, base, site)):
            return _before_comments(lines, i, first, base), False
        returned = returned or (width == base and bool(TERMINAL.match(stripped)))
        closer = is_closer_line(stripped)
        if closed and not closer:
            return _before_comments(lines, i, first, base), False
        if width < base:
            if closer:
                closed = True
                continue
            if _continues_statement(stripped, width, base, site):
                # `else:` of the `if` whose body is being filled: its body comes next, and the
                # next line back at the `if`'s column (not deeper) ends the completion.
                base = width + 1
                continue
            return _before_comments(lines, i, first, base), False
        if width > base:
            deeper = True
        elif definition and deeper and not closer and not site.info.statement_continuation.match(stripped):
            return _before_comments(lines, i, first, base), False
    return None, False


def _outer_definition(lines: list[str], site: Surroundings, complete: Callable[[int], bool]) -> bool | None:
    """Where indentation is significant (Python): does the completion start a definition of its own at column 0 (a ``def`` or
    ``class`` with a body) while the code after the cursor goes on indented? The cursor is then
    inside that indented block (an empty line at column 0 in a function body), and the model
    left it: the new definition would swallow the rest of the block. ``None``: undecided yet.

    A definition whose body is the suffix (the model wrote only the header) is not affected,
    and neither is a nested helper (not at column 0)."""
    if not site.info.indentation_significant or not site.blank_before or not site.next_lines or site.column > 0:
        return False
    if indent_columns(site.next_lines[0]) == 0:
        return False
    code = (i for i, line in enumerate(lines) if line.strip() and not is_comment(line.strip()))
    head = next(code, None)
    if head is None or not complete(head):
        return False if head is None else None
    if indent_columns(lines[head]) > 0 or not _DEFINITION.match(lines[head]):
        return False
    body = next(code, None)
    if body is None or not complete(body):
        return None if body is not None or not complete(len(lines) - 1) else False
    return indent_columns(lines[body]) > 0


def _continues_statement(stripped: str, width: int, base: int, site: Surroundings) -> bool:
    """Is a line dedented to ``width`` below the block (at ``base``) a branch of the statement
    whose block the cursor is in (``else:``/``elif``/``except``/``finally``, ``} else {``,
    ``} catch (e) {``)? Only when the block's header above the cursor sits at that column and
    is one the branch can follow, and the suffix does not go on with that block or with a
    branch of its own (a second ``else`` would be a syntax error)."""
    branch = site.info.branch
    m = branch.match(stripped)
    if m is None:
        return False
    header = site.enclosing(base)
    if header is None or indent_columns(header) != width or not site.info.branch_headers[m.group(1)].match(header.strip()):
        return False
    nxt = site.next_lines
    if nxt and indent_columns(nxt[0]) > width:
        return False  # more of the block follows the cursor: a branch would split it
    # Past the block's closer (`}` the editor added), the suffix's own branch would follow.
    ahead = nxt[:2] if nxt and is_closer_line(nxt[0].strip()) else nxt[:1]
    if any(branch.match(line.strip()) for line in ahead):
        return False
    # The author's next statement right after the header's block (no closer between: Python):
    # its body was what was missing, and an optional branch of the model's own (`else`) would
    # come between them (the dev sets' authors wrote none); `try` needs its `except`.
    goes_on = bool(nxt) and indent_columns(nxt[0]) == width and not is_closer_line(nxt[0].strip())
    return not goes_on or _TRY.match(header.strip()) is not None


def empty_pair(site: Surroundings) -> bool:
    """Is the cursor between ``{`` and ``}`` on one line (``{|}``, ``({|});``), with nothing
    after the ``}`` but closers, ``;`` and ``,``? A block goes there. (In ``f(|)`` a line
    break would start a multi-line argument list, which single mode does not write.)"""
    after = site.after.strip()
    return site.before.rstrip().endswith("{") and after.startswith("}") and all(
        c in CLOSERS or c in ";," or c.isspace() for c in after
    )


def _pair_end(lines: list[str], site: Surroundings, complete: Callable[[int], bool]) -> int | None:
    """Lines to keep when the model answers ``{|}`` with a line break and a block: the lines
    indented deeper than the cursor's line; the first line back at its column (the model's
    copy of the closer, or code after the pair) ends the block. Nothing deeper: nothing."""
    header = indent_columns(site.before)
    body = False
    for i in range(1, len(lines)):
        stripped = lines[i].strip()
        if not stripped:
            continue
        if not complete(i):
            return None
        if indent_columns(lines[i]) <= header:
            return i if body else 0
        body = True
    if not complete(len(lines) - 1):
        return None
    return len(lines) if body else 0


def _definition_level(line: str, base: int, site: Surroundings) -> bool:
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
        if above.strip() and not (is_comment(above.strip()) and indent_columns(above) < base):
            break
        stop -= 1
    return stop


def _single_end(lines: list[str], j: int, site: Surroundings, complete: Callable[[int], bool]) -> int | None:
    """Lines to keep in single mode when line ``j`` is the first one with code: that line, or,
    when it leaves brackets open (``np.array([``, ``th([]() {``), through the line that closes
    them, so that one line does not leave the code broken. Brackets still open after
    ``_SINGLE_SPAN`` lines fall back to the first line alone."""
    quote = scan_brackets(site.before, site.info)[2] if j == 0 else None
    closed, opened, _ = scan_brackets(lines[j], site.info, quote)
    depth = len(opened) - sum(1 for p in closed if lines[j][p] in CLOSERS)
    if depth <= 0:
        return j + 1
    for i in range(j + 1, min(len(lines), j + 1 + _SINGLE_SPAN)):
        if not complete(i):
            return None
        closed, opened, _ = scan_brackets(lines[i], site.info)
        depth += len(opened) - sum(1 for p in closed if lines[i][p] in CLOSERS)
        if depth <= 0:
            return i + 1
    if len(lines) > j + _SINGLE_SPAN or complete(len(lines) - 1):
        return j + 1
    return None


def _loop_end(lines: list[str], site: Surroundings, limit: int, final: bool) -> int | None:
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
    content = "".join(line for line in group if not is_closer_line(line.strip()))
    if any(c.isalpha() for c in content):
        return True
    return False if any(c.isdigit() for c in content) else None
