"""The prefix window of a prompt: where it starts (the anchor), how many tokens it holds, where
the suffix is cut, and the lines that precede it (the file header, the scope lines).

Every number that decides a cut comes from text that typing at the cursor does not change, and
the decisions that a half-typed statement could sway read the text above the cursor rather than
the tree (see :mod:`context.prompt.builder`). Token counts and headers are remembered in the document's
:class:`context.source.memo.TextMemo` when the caller has one; without it they are computed afresh.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import Protocol

from context.source.languages import CUT_CONTINUATION, HEADER_STATEMENT, bracket_depth, indent_columns
from context.source.memo import TextMemo

try:  # typing only; tree-sitter is always installed with ember
    from tree_sitter import Node, Tree
except ImportError:  # pragma: no cover
    Node = Tree = object  # type: ignore[misc,assignment]


class TokenCounter(Protocol):
    """Anything with ``count(text) -> int``: the engine's tokenizer is passed in (context never
    imports engine)."""

    def count(self, text: str) -> int: ...


class ApproxCounter(TokenCounter):
    """A tokenizer stand-in for budgets when the real one is unknown: ~3.5 characters a token."""

    def count(self, text: str) -> int:
        return (len(text) * 2 + 6) // 7


# Estimates use a sample of this many characters taken where typing does not change it.
_SAMPLE_CHARS = 4096

_DEFINITION_SUFFIXES = ("definition", "declaration", "item", "specifier", "method", "function", "class")

_HEADER_SCAN_LINES = 400  # imports live at the top; a later one is not worth scanning for
_TRIPLE_QUOTE = re.compile(r'"""|\'\'\'')


# ------------------------------------------------------------------------------------------------
# small text helpers


def line_starts(text: str, end: int) -> list[int]:
    """Offsets at which lines start, for lines that start at or before ``end`` ("\\n" breaks, as
    tree-sitter counts rows)."""
    starts = [0]
    # split + accumulate run in C: about twice as fast as a find() loop on a 2000-line file.
    starts.extend(accumulate(map((1).__add__, map(len, text[:end].split("\n")[:-1]))))
    return starts


def _indent(line: str) -> int:
    # Characters, not columns: callers slice lines by it.
    return indent_columns(line, tab_width=1)


def _usable(memo: TextMemo | None, text: str) -> TextMemo | None:
    return memo if memo is not None and memo.describes(text) else None


def count_window(
    text: str, starts: Sequence[int], first_line: int, offset: int, counter: TokenCounter, memo: TextMemo | None = None
) -> int:
    """Tokens of the window from ``first_line`` to ``offset``, counted as the whole lines above the
    cursor's line plus the cursor's line. With the text's ``memo``, the lines above are
    remembered and extended a line at a time when the user presses Enter: a keystroke costs a
    count of one or two lines, not of the window.

    The sum is an upper bound for the usual BPE tokenizers: a split at a line start only keeps a
    newline from merging with the indentation after it.
    """
    memo = _usable(memo, text)
    cursor_line = len(starts) - 1
    start, line_start = starts[first_line], starts[cursor_line]
    counted = memo.count(counter, "window", start, line_start) if memo is not None else None
    if counted is None:
        before = None
        if memo is not None and cursor_line - 1 > first_line:
            before = memo.count(counter, "window", start, starts[cursor_line - 1])
        if before is not None:
            counted = before + counter.count(text[starts[cursor_line - 1] : line_start])
        else:
            counted = counter.count(text[start:line_start]) if cursor_line > first_line else 0
        if memo is not None:
            # Pinned, as counts were before the memo: a sum of line counts can exceed a fresh
            # count by a token, so reusing it after an edit above would change the window.
            memo.remember_count(counter, "window", start, line_start, counted, pinned=True)
    return counted + (counter.count(text[line_start:offset]) if offset > line_start else 0)


def chars_per_token(text: str, offset: int, counter: TokenCounter, memo: TextMemo | None = None) -> float:
    """Characters per token of the code around the cursor, rounded down to a quarter.

    The sample is text that typing at ``offset`` leaves alone: the last whole 4 KiB block before
    the cursor, or, near the top of the file, the text after the cursor. So the estimate, and
    every cut derived from it, stays put while the user types.
    """
    memo = _usable(memo, text)
    if offset >= _SAMPLE_CHARS:
        end = offset - offset % _SAMPLE_CHARS
        begin = end - _SAMPLE_CHARS
    else:
        begin, end = offset, min(len(text), offset + _SAMPLE_CHARS)
    if end - begin < 256:
        return 3.5
    tokens = memo.count(counter, "sample", begin, end) if memo is not None else None
    if tokens is None:
        tokens = counter.count(text[begin:end])
        if memo is not None:
            memo.remember_count(counter, "sample", begin, end, tokens)
    raw = (end - begin) / max(1, tokens)
    return max(1.0, math.floor(raw * 4) / 4)


def cut_suffix(suffix: str, max_chars: int) -> str:
    """The text after the cursor up to about ``max_chars``, ending at a line end (never half a line).

    The rest of the cursor's own line is always kept. Among the line ends in the second half of the
    budget, the cut goes where the next line is least indented (the end of a definition or block)
    and, among equals, the latest. Only the suffix text decides, so the cut does not move while the
    user types before it.
    """
    if len(suffix) <= max_chars:
        return suffix
    first_nl = suffix.find("\n")
    if first_nl == -1 or first_nl >= max_chars:
        # Only a line longer than twice the budget (minified code) is cut inside.
        return suffix[: min(len(suffix) if first_nl == -1 else first_nl + 1, 2 * max_chars)]
    half = max_chars // 2
    best_end, best_score = -1, math.inf
    last_end = first_nl + 1  # the latest line end within the budget
    pending = first_nl + 1  # the end of the last non-blank line: a cut candidate, scored by the next line
    pos = first_nl + 1
    while pos < len(suffix) and pos <= max_chars + 4096:
        nl = suffix.find("\n", pos)
        end = len(suffix) if nl == -1 else nl + 1
        stripped = suffix[pos:end].strip()
        if stripped:
            if pending >= half:
                score = _indent(suffix[pos:end]) + (1000 if CUT_CONTINUATION.match(stripped) else 0)
                if score <= best_score:
                    best_end, best_score = pending, score
            if end > max_chars:
                break
            pending = end
        if end <= max_chars:
            last_end = end
        pos = end
    return suffix[: best_end if best_end >= 0 else last_end]



# ------------------------------------------------------------------------------------------------
# syntax: the cursor's enclosing nodes, boundaries, the file header


def _children(node: Node) -> Iterator[Node]:
    """A node's children with ERROR nodes opened up: while the user types, error recovery may wrap
    earlier statements in an ERROR node, and their boundaries must stay boundaries."""
    for child in node.children:
        if child.type == "ERROR":
            yield from _children(child)
        else:
            yield child


def cursor_path(tree: Tree, text: str, offset: int, cursor_byte: int, cursor_line_start: int) -> list[Node]:
    """The nodes that enclose the cursor, root first.

    Looked up at the last code character before the cursor: in indentation languages an empty line
    inside a block lies outside the block's node. A node counts as enclosing when the cursor is
    strictly inside it, or when it starts left of the cursor line's indentation (the cursor is in
    its indented body).
    """
    tail = text[max(0, offset - 256) : offset]
    code = tail.rstrip()
    gap = tail[len(code) :]
    probe = max(0, cursor_byte - len(gap.encode("utf-8", "surrogatepass")) - 1)
    indent = _indent(text[cursor_line_start:offset])
    chain: list[Node] = []
    node: Node | None = tree.root_node.descendant_for_byte_range(probe, probe)
    while node is not None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    path = [chain[0]]
    for node in chain[1:]:
        inside = node.start_byte < cursor_byte < node.end_byte
        if not inside and not (node.start_byte < cursor_byte and node.start_point[1] < indent):
            break
        path.append(node)
    return path


def scope_names(path: Sequence[Node]) -> tuple[str, ...]:
    """Names of the definitions on ``path``, outermost first (e.g. ('Parser', 'parse'))."""
    names: list[str] = []
    for node in path:
        if node.type.endswith(_DEFINITION_SUFFIXES) or node.type == "impl_item":
            name = node.child_by_field_name("name") or node.child_by_field_name("type")
            if name is not None and name.text is not None:
                names.append(name.text.decode("utf-8", "replace"))
    return tuple(names)


def snap_to_syntax(tree: Tree | None, text: str, starts: Sequence[int], lowest_line: int, slack: int) -> int:
    """The first line at or after ``lowest_line`` where a syntax node starts, preferring shallow
    nodes: a top-level boundary within ``slack`` characters wins; else the search descends into
    the node that spans ``lowest_line``. Without any, ``lowest_line`` itself (a whole line)."""
    cursor_line = len(starts) - 1
    limit = starts[lowest_line] + slack
    if tree is None:
        # Indentation stands in for depth: the least indented line in reach, the first of equals.
        best, best_indent = lowest_line, 1 << 30
        for line in range(lowest_line, cursor_line):
            if starts[line] > limit:
                break
            content = text[starts[line] : starts[line + 1]]
            stripped = content.strip()
            if stripped and not CUT_CONTINUATION.match(stripped) and _indent(content) < best_indent:
                best, best_indent = line, _indent(content)
        return best
    node = tree.root_node
    while True:
        spanning: Node | None = None
        for child in _children(node):
            row = child.start_point[0]
            if row >= lowest_line:
                if row <= cursor_line and starts[row] <= limit:
                    return row
                break
            if child.end_point[0] >= lowest_line:
                spanning = child
        if spanning is None:
            return lowest_line
        node = spanning


def choose_anchor(
    offset: int,
    starts: Sequence[int],
    enclosing: Sequence[int],
    window_chars: int,
    step: float,
    snap: Callable[[int, int], int],
) -> int:
    """The line where the prefix window starts.

    ``enclosing`` are the start lines of the definitions around the cursor, outermost first: the
    outermost that fits whole up to the cursor is taken when it starts before the quantized
    lowest start (more context, and it stays put while the user types inside it). Otherwise the
    lowest start advances in steps of ``step * window_chars`` and snaps to a syntax boundary.
    """
    cursor_line = len(starts) - 1
    if offset <= window_chars:
        return 0
    quantum = max(1, int(window_chars * step))
    lowest = -(-(offset - window_chars) // quantum) * quantum  # ceil to a multiple of quantum
    for line in enclosing:
        if offset - starts[line] <= window_chars:
            if starts[line] < lowest:
                return line
            break
    lowest_line = bisect_left(starts, lowest)
    if lowest_line >= cursor_line:
        return cursor_line
    # Up to half the window may go unused for a cleaner start: a whole definition beats the tail
    # of one as context, and the boundary is the same for every request in this quantum.
    return snap(lowest_line, window_chars // 2)


def indent_chain(text: str, starts: Sequence[int], line: int, indent: int, top: int = 0) -> list[int]:
    """The lines above ``line`` (down to line ``top``) that open the blocks it sits in, outermost
    first: going up, each non-blank line indented less than the last one found (comments and
    closing lines skipped).

    Text, not the tree: the lines above the cursor do not change while the user types, while
    tree-sitter's error recovery reshapes the tree around a half-typed statement.
    """
    chain: list[int] = []
    row = line - 1
    stop = max(top, line - 5000) - 1
    while row > stop and indent > 0:
        start = starts[row]
        # Cheap test first: only a line with code within the first ``indent`` columns can qualify.
        if text[start : start + indent].strip():
            content = text[start : starts[row + 1]]
            stripped = content.strip()
            if not stripped.startswith(("#", "//", "/*", "*", "--")) and not CUT_CONTINUATION.match(stripped):
                chain.append(row)
                indent = _indent(content)
        row -= 1
    chain.reverse()
    return chain


def cursor_indent(text: str, starts: Sequence[int], cursor_line: int, offset: int) -> int:
    """The indentation the cursor's code has: its line's, or while that line is still blank, one
    more than the line above (an editor's new line inside the block above; typing the indentation
    key by key must not change the answer)."""
    before = text[starts[cursor_line] : offset]
    if before.strip():
        return _indent(before)
    row = cursor_line - 1
    while row >= 0:
        content = text[starts[row] : starts[row + 1]]
        if content.strip():
            return _indent(content) + 1
        row -= 1
    return 0


def scope_lines(text: str, starts: Sequence[int], anchor_line: int) -> str:
    """The first lines of the blocks the anchor sits in (e.g. ``class Response:`` when the window
    starts inside it), so the model sees where the window is."""
    if anchor_line <= 0:
        return ""
    end = starts[anchor_line + 1] if anchor_line + 1 < len(starts) else len(text)
    chain = indent_chain(text, starts, anchor_line, _indent(text[starts[anchor_line] : end]))
    return "".join(text[starts[row] : min(starts[row + 1], starts[row] + 240)].rstrip("\n") + "\n" for row in chain)


def header_text(
    text: str, starts: Sequence[int], anchor_line: int, max_chars: int, memo: TextMemo | None = None
) -> str:
    """Imports, package and use declarations above the anchor, as whole statements in file order,
    as many as fit in ``max_chars`` (one that does not fit is left out whole).

    Read from the text (the top of the file does not change while the user types further down;
    a tree might be mid-recovery), and remembered in the text's ``memo`` when given.
    """
    scan = min(anchor_line, _HEADER_SCAN_LINES)
    if scan <= 0 or max_chars <= 0:
        return ""
    memo = _usable(memo, text)
    cached = memo.derived("header", 0, starts[scan], max_chars) if memo is not None else None
    if isinstance(cached, str):
        return cached
    header = _read_header(text, starts, scan, max_chars)
    if memo is not None:
        memo.remember("header", 0, starts[scan], max_chars, header)
    return header


def _string_after(line: str, quote: str) -> str:
    """The triple quote still open after ``line`` when ``quote`` was open before it."""
    for found in _TRIPLE_QUOTE.finditer(line):
        if not quote:
            quote = found.group()
        elif found.group() == quote:
            quote = ""
    return quote


def _read_header(text: str, starts: Sequence[int], scan: int, max_chars: int) -> str:
    parts: list[str] = []
    used = 0
    prev_end = -1  # the line after the last statement taken
    row = 0
    quote = ""  # the triple quote of the string the scan is inside: a docstring's "import time ..." is prose
    while row < scan:
        line = text[starts[row] : starts[row + 1]]
        if quote or not HEADER_STATEMENT.match(line):
            quote = _string_after(line, quote)
            row += 1
            continue
        first = row
        depth = bracket_depth(line)
        while (depth > 0 or line.rstrip().endswith("\\")) and row + 1 < scan and row - first < 60:
            row += 1
            line = text[starts[row] : starts[row + 1]]
            depth += bracket_depth(line)
        row += 1
        # One blank line between neighbouring statements stays, as in the file.
        joined = prev_end >= 0 and first - prev_end == 1 and not text[starts[prev_end] : starts[first]].strip()
        begin = prev_end if joined else first
        chunk = text[starts[begin] : starts[row]]
        if used + len(chunk) > max_chars:
            continue
        parts.append(chunk)
        used += len(chunk)
        prev_end = row
    header = "".join(parts)
    if header and not header.endswith("\n"):
        header += "\n"
    return header
