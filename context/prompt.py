"""From (document text, cursor) to a prompt whose beginning stays the same while the user types.

Layout: ``[snippets from other files][file header][scope lines][window: anchor ... cursor]`` and,
for FIM models, the suffix (before everything in SPM order, after the window in PSM order). The
header is the file's imports, the scope lines are the first lines of the blocks the window starts
in (``class Response:``); all of it sits before the cursor's line, so typing only appends.

The anchor is where the window starts. A window that slides by a line per keystroke invalidates
every cached KV block after its start, so the anchor is:

* the start of the outermost block around the cursor that fits whole up to the cursor;
* otherwise the first syntax boundary after a *quantized* lowest start (it moves only when the
  cursor has advanced a quarter of the window), the shallowest node within half a window first.

Every number that decides a cut (characters per token, window size, suffix length) comes from text
that typing at the cursor does not change, and the decisions that a half-typed statement could
sway (enclosing blocks, scope lines, header) read the text above the cursor rather than the tree,
whose error recovery reshapes it mid-statement. So consecutive requests cut at the same places.
The tokenizer counts the window once when the anchor moves and then one line per keystroke.

Also here: :func:`build_naive_prompt` (the last-N-lines baseline that benchmarks compare against)
and :func:`select_snippets` (context from other open files, imported definitions first).
"""

from __future__ import annotations

import hashlib
import math
import re
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

from context.fim import PREFIX_ONLY, FimTemplate, neutralize_control_tokens
from context.languages import normalize_language_id, parser_for

try:  # typing only; tree-sitter is always installed with ember
    from tree_sitter import Node, Tree
except ImportError:  # pragma: no cover
    Node = Tree = object  # type: ignore[misc,assignment]


class TokenCounter:
    """Anything with ``count(text) -> int``: the engine's tokenizer is passed in (context never
    imports engine)."""

    def count(self, text: str) -> int:  # pragma: no cover - protocol
        raise NotImplementedError


class ApproxCounter(TokenCounter):
    """A tokenizer stand-in for budgets when the real one is unknown: ~3.5 characters a token."""

    def count(self, text: str) -> int:
        return (len(text) * 2 + 6) // 7


# Shares of the model's context window (max_model_len) that the parts of a prompt get by default:
# at 2048 tokens these are 1024 / 256 / 128 / 256, the budgets ember had before they followed the
# model. The rest (3/16) is for the FIM and path tokens and the generated tokens.
PREFIX_SHARE = 1 / 2
SUFFIX_SHARE = 1 / 8
HEADER_SHARE = 1 / 16
SNIPPET_SHARE = 1 / 8
# Tokens the template adds around the parts (FIM markers, the path comment); budgets are estimates.
TEMPLATE_RESERVE_TOKENS = 32
MIN_PREFIX_TOKENS = 16


@dataclass(frozen=True)
class PromptBudget:
    prefix_tokens: int = 1024
    suffix_tokens: int = 256
    header_tokens: int = 128
    # The cross-file budget: snippets from other files (a crossFileTokens setting would set it).
    snippet_tokens: int = 256
    # The anchor moves in steps of this fraction of the prefix window.
    anchor_step: float = 0.25

    @classmethod
    def for_model(
        cls,
        max_model_len: int,
        max_tokens: int,
        *,
        prefix_tokens: int | None = None,
        suffix_tokens: int | None = None,
        snippet_tokens: int | None = None,
    ) -> PromptBudget:
        """Budgets as shares of ``max_model_len``, except those given (the user's settings win),
        shrunk so that the prompt plus ``max_tokens`` generated tokens fits the model's context:
        the derived parts give way first, explicit ones only when they alone do not fit (the
        engine would reject every request otherwise)."""
        derived = {
            "prefix_tokens": int(max_model_len * PREFIX_SHARE),
            "suffix_tokens": int(max_model_len * SUFFIX_SHARE),
            "header_tokens": int(max_model_len * HEADER_SHARE),
            "snippet_tokens": int(max_model_len * SNIPPET_SHARE),
        }
        given = {
            name: value
            for name, value in (("prefix_tokens", prefix_tokens), ("suffix_tokens", suffix_tokens), ("snippet_tokens", snippet_tokens))
            if value is not None
        }
        room = max(MIN_PREFIX_TOKENS, max_model_len - max_tokens - TEMPLATE_RESERVE_TOKENS)
        free = {name: value for name, value in derived.items() if name not in given}
        left = room - sum(given.values())
        if sum(free.values()) > max(left, 0):
            scale = max(left, 0) / sum(free.values())
            free = {name: int(value * scale) for name, value in free.items()}
        parts = {**free, **given}
        if sum(parts.values()) > room:
            scale = room / sum(parts.values())
            parts = {name: int(value * scale) for name, value in parts.items()}
        parts["prefix_tokens"] = max(MIN_PREFIX_TOKENS, parts["prefix_tokens"])
        return cls(**parts)


@dataclass(frozen=True)
class Snippet:
    """Context from another file, placed first in the prompt in a stable order."""

    path: str
    text: str


@dataclass(frozen=True)
class PrefixKey:
    """Identifies the reusable front of a prompt: for caches and for routing to an engine replica."""

    uri: str
    anchor_line: int
    scope: tuple[str, ...]
    stable_hash: str

    @property
    def routing_key(self) -> str:
        # Routing must not change while the user types in one region: anchor only, not the hash.
        return f"{self.uri}#{self.anchor_line}"


@dataclass(frozen=True)
class Prompt:
    text: str
    key: PrefixKey
    template: str
    stop: tuple[str, ...]
    # The document's text around the cursor that the prompt holds (the prompt's prefix ends
    # before ``healed``); post-processing compares output against these.
    window_prefix: str
    window_suffix: str
    stable_chars: int = 0  # length of the prompt part that does not depend on the cursor line
    extra: dict[str, int] = field(default_factory=dict)
    # Token healing (``heal=True``): the spaces/tabs at the end of the cursor's line that the
    # prompt leaves out (the prompt's prefix is ``window_prefix`` without them). Pass it to
    # ``postprocess(..., healed=)`` and ``find_stop(..., healed=)``, which re-align the output.
    healed: str = ""


# Estimates use a sample of this many characters taken where typing does not change it.
_SAMPLE_CHARS = 4096
# Windows are sized below the budget so the exact count rarely disagrees (a disagreement costs
# extra tokenizer calls and a shift of the anchor).
_MARGIN = 0.92
_SHRINK = 0.8

_COMMENT = {"python": "#", "shellscript": "#", "ruby": "#"}
_DEFINITION_SUFFIXES = ("definition", "declaration", "item", "specifier", "method", "function", "class")

# Statements that make up a file's header, at column 0, in any of the supported languages.
_HEADER_LINE = re.compile(
    r"(?:import\b(?!\()|from\s+[\w.]+\s+import\b|#\s*include\b|package\s+[\w.]+\s*;?\s*$|"
    r"(?:pub(?:\([^)]*\))?\s+)?use\s+[\w:{*]|extern\s+crate\b|(?:pub\s+)?mod\s+\w+\s*;|using\s+[\w.]+|"
    r"(?:const|let|var)\s+[^=]+=\s*require\(|export\s+(?:\*|\{[^}]*\})\s+from\b)"
)
_HEADER_SCAN_LINES = 400  # imports live at the top; a later one is not worth scanning for
# Lines that continue the construct above them: a cut just before one splits that construct.
_CONTINUATION = re.compile(r"[)\]}]|(?:else|elif|except|finally|catch|end)\b")


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
    return len(line) - len(line.lstrip(" \t"))


_CPT_CACHE: dict[tuple[int, int, int], float] = {}
_COUNT_CACHE: dict[tuple[int, int, int, int], int] = {}


def count_window(text: str, starts: Sequence[int], first_line: int, offset: int, counter: TokenCounter) -> int:
    """Tokens of the window from ``first_line`` to ``offset``, counted as the whole lines above the
    cursor's line (remembered, and extended a line at a time when the user presses Enter) plus the
    cursor's line: a keystroke costs a count of one or two lines, not of the window.

    The sum is an upper bound for the usual BPE tokenizers: a split at a line start only keeps a
    newline from merging with the indentation after it.
    """
    cursor_line = len(starts) - 1
    start = starts[first_line]

    def key(line: int) -> tuple[int, int, int, int]:
        above = text[start : starts[line]]
        return (id(counter), start, len(above), hash(above))

    counted = _COUNT_CACHE.get(here := key(cursor_line))
    if counted is None:
        before = _COUNT_CACHE.get(key(cursor_line - 1)) if cursor_line - 1 > first_line else None
        if before is not None:
            counted = before + counter.count(text[starts[cursor_line - 1] : starts[cursor_line]])
        else:
            counted = counter.count(text[start : starts[cursor_line]]) if cursor_line > first_line else 0
        if len(_COUNT_CACHE) > 256:
            _COUNT_CACHE.clear()
        _COUNT_CACHE[here] = counted
    line_start = starts[cursor_line]
    return counted + (counter.count(text[line_start:offset]) if offset > line_start else 0)


def chars_per_token(text: str, offset: int, counter: TokenCounter) -> float:
    """Characters per token of the code around the cursor, rounded down to a quarter.

    The sample is text that typing at ``offset`` leaves alone: the last whole 4 KiB block before
    the cursor, or, near the top of the file, the text after the cursor. So the estimate, and
    every cut derived from it, stays put while the user types.
    """
    if offset >= _SAMPLE_CHARS:
        end = offset - offset % _SAMPLE_CHARS
        sample = text[end - _SAMPLE_CHARS : end]
    else:
        sample = text[offset : offset + _SAMPLE_CHARS]
    if len(sample) < 256:
        return 3.5
    key = (id(counter), len(sample), hash(sample))
    cached = _CPT_CACHE.get(key)
    if cached is None:
        raw = len(sample) / max(1, counter.count(sample))
        cached = max(1.0, math.floor(raw * 4) / 4)
        if len(_CPT_CACHE) > 256:
            _CPT_CACHE.clear()
        _CPT_CACHE[key] = cached
    return cached


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
                score = _indent(suffix[pos:end]) + (1000 if _CONTINUATION.match(stripped) else 0)
                if score <= best_score:
                    best_end, best_score = pending, score
            if end > max_chars:
                break
            pending = end
        if end <= max_chars:
            last_end = end
        pos = end
    return suffix[: best_end if best_end >= 0 else last_end]


def render_snippets(snippets: Sequence[Snippet], comment: str, max_chars: int) -> str:
    """Other files' context as commented path headers followed by code, in the order given."""
    parts: list[str] = []
    used = 0
    for snippet in snippets:
        block = f"{comment} {snippet.path}\n{snippet.text.rstrip()}\n\n"
        if used + len(block) > max_chars:
            break
        parts.append(block)
        used += len(block)
    return "".join(parts)


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
            if stripped and not _CONTINUATION.match(stripped) and _indent(content) < best_indent:
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
            if not stripped.startswith(("#", "//", "/*", "*", "--")) and not _CONTINUATION.match(stripped):
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


_HEADER_CACHE: dict[tuple[int, int, int], str] = {}


def header_text(text: str, starts: Sequence[int], anchor_line: int, max_chars: int) -> str:
    """Imports, package and use declarations above the anchor, as whole statements in file order,
    as many as fit in ``max_chars`` (one that does not fit is left out whole).

    Read from the text (the top of the file does not change while the user types further down;
    a tree might be mid-recovery) and remembered by the text it was read from.
    """
    scan = min(anchor_line, _HEADER_SCAN_LINES)
    if scan <= 0 or max_chars <= 0:
        return ""
    top = text[: starts[scan]]
    key = (max_chars, len(top), hash(top))
    cached = _HEADER_CACHE.get(key)
    if cached is not None:
        return cached
    parts: list[str] = []
    used = 0
    prev_end = -1  # the line after the last statement taken
    row = 0
    while row < scan:
        line = text[starts[row] : starts[row + 1]]
        if not _HEADER_LINE.match(line):
            row += 1
            continue
        first = row
        depth = _depth(line)
        while (depth > 0 or line.rstrip().endswith("\\")) and row + 1 < scan and row - first < 60:
            row += 1
            line = text[starts[row] : starts[row + 1]]
            depth += _depth(line)
        row += 1
        # One blank line between neighbouring statements stays, as in the file.
        begin = prev_end if prev_end >= 0 and first - prev_end == 1 and not text[starts[prev_end] : starts[first]].strip() else first
        chunk = text[starts[begin] : starts[row]]
        if used + len(chunk) > max_chars:
            continue
        parts.append(chunk)
        used += len(chunk)
        prev_end = row
    header = "".join(parts)
    if header and not header.endswith("\n"):
        header += "\n"
    if len(_HEADER_CACHE) > 64:
        _HEADER_CACHE.clear()
    _HEADER_CACHE[key] = header
    return header


def _depth(line: str) -> int:
    return line.count("(") + line.count("{") + line.count("[") - line.count(")") - line.count("}") - line.count("]")


# ------------------------------------------------------------------------------------------------
# the prompt


@dataclass(frozen=True)
class _Parts:
    head: str
    window_prefix: str
    window_suffix: str
    anchor_line: int
    cursor_line_start: int  # where the cursor's line starts inside window_prefix
    scope: tuple[str, ...]
    window_tokens: int


def heal_cursor_line(line: str) -> tuple[str, str]:
    """(the cursor's line as the prompt ends it, the trailing spaces/tabs left out).

    Token healing: BPE tokenizers put a space in front of the word it precedes (`` return``)
    and split indentation before code (``"   "`` + `` return``), so a prompt that ends in
    whitespace ends in a token that training text rarely has there, and small models answer
    badly (a line break, code at column 0). Ending the prompt at the last non-blank character
    (or at the line start, on an indented empty line) lets the model write the whitespace
    itself; post-processing drops what the document already has. Only the cursor's own line is
    touched: it is the changing tail of the prompt anyway, so consecutive prompts while typing
    still extend each other (``return`` -> ``return`` -> ``return x``).

    An indented empty line keeps its indentation: it tells the model which block it writes in,
    and without it SmolLM2 answered every function-body cut of the repository bench at column 0
    (all of them empty after post-processing).
    """
    kept = line.rstrip(" \t")
    if not kept.strip():
        return line, ""
    return kept, line[len(kept) :]


def _assemble(parts: _Parts, uri: str, template: FimTemplate, snippets_head: str, heal: bool = False) -> Prompt:
    def clean(part: str) -> str:
        return neutralize_control_tokens(part, template)

    head = clean(snippets_head + parts.head)
    # Cleaned apart: a control token never spans a line break, and the split gives the stable part.
    above = clean(parts.window_prefix[: parts.cursor_line_start])
    cursor_line, healed = parts.window_prefix[parts.cursor_line_start :], ""
    if heal:
        cursor_line, healed = heal_cursor_line(cursor_line)
    prefix = above + clean(cursor_line)
    before, after = template.split(head, clean(parts.window_suffix))
    stable = before + above
    key = PrefixKey(
        uri=uri,
        anchor_line=parts.anchor_line,
        scope=parts.scope,
        stable_hash=hashlib.blake2b(stable.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest(),
    )
    return Prompt(
        text=before + prefix + after,
        key=key,
        template=template.name,
        stop=template.stop,
        window_prefix=parts.window_prefix,
        window_suffix=parts.window_suffix,
        stable_chars=len(stable),
        extra={"window_tokens": parts.window_tokens, "head_chars": len(head), "anchor_line": parts.anchor_line},
        healed=healed,
    )


def _long_line_start(text: str, line_start: int, offset: int, counter: TokenCounter, budget_tokens: int, cpt: float) -> tuple[int, int]:
    """Where the window starts when the cursor's line alone exceeds the budget (minified code, a
    file without line breaks): inside the line, at a quantized offset so that it still stays put
    while the user types. The one place where a line is cut."""
    chars = int(budget_tokens * cpt * _MARGIN)
    for _ in range(6):
        quantum = max(1, chars // 4)
        start = min(offset, max(line_start, -(-(offset - chars) // quantum) * quantum))
        tokens = counter.count(text[start:offset])
        if tokens <= budget_tokens:
            return start, tokens
        chars = int(chars * _SHRINK)
    return offset, 0


def build_prompt(
    text: str,
    offset: int,
    *,
    uri: str = "",
    language_id: str = "",
    tree: Tree | None = None,
    cursor_byte: int | None = None,
    template: FimTemplate = PREFIX_ONLY,
    counter: TokenCounter | None = None,
    budget: PromptBudget = PromptBudget(),
    snippets: Sequence[Snippet] = (),
    heal: bool = False,
) -> Prompt:
    """The prompt for a completion at ``offset`` (an index into ``text``).

    ``tree`` is the document's tree-sitter tree (``None``: indentation stands in for syntax) and
    ``cursor_byte`` the UTF-8 offset of ``offset`` (computed when missing). ``heal``: end the
    prompt before the spaces/tabs that end the cursor's line (see :func:`heal_cursor_line`);
    ``Prompt.healed`` says what was left out, for post-processing.
    """
    counter = counter or ApproxCounter()
    cpt = chars_per_token(text, offset, counter)
    window_chars = int(budget.prefix_tokens * cpt * _MARGIN)

    starts = line_starts(text, offset)
    cursor_line = len(starts) - 1
    path: list[Node] = []
    if tree is not None:
        if cursor_byte is None:
            cursor_byte = len(text[:offset].encode("utf-8", "surrogatepass"))
        path = cursor_path(tree, text, offset, cursor_byte, starts[cursor_line])
    # Only blocks that could fit whole matter: the scan stops a window's length above the cursor.
    reach = bisect_left(starts, offset - window_chars)
    enclosing = indent_chain(text, starts, cursor_line, cursor_indent(text, starts, cursor_line, offset), reach)

    def snap(lowest_line: int, slack: int) -> int:
        return snap_to_syntax(tree, text, starts, lowest_line, slack)

    # One exact count in the common case; a window the estimate got wrong shrinks by fixed
    # factors (not by the count itself, which changes with every keystroke).
    chars = window_chars
    for _ in range(3):
        anchor_line = choose_anchor(offset, starts, enclosing, chars, budget.anchor_step, snap)
        window_tokens = count_window(text, starts, anchor_line, offset, counter)
        if window_tokens <= budget.prefix_tokens:
            break
        chars = int(chars * _SHRINK)
    else:
        while anchor_line < cursor_line and window_tokens > budget.prefix_tokens:
            anchor_line += max(1, (cursor_line - anchor_line) // 8)
            anchor_line = min(anchor_line, cursor_line)
            window_tokens = count_window(text, starts, anchor_line, offset, counter)
    window_start = starts[anchor_line]
    if window_tokens > budget.prefix_tokens:
        window_start, window_tokens = _long_line_start(text, window_start, offset, counter, budget.prefix_tokens, cpt)

    header = header_text(text, starts, anchor_line, int(budget.header_tokens * cpt * _MARGIN))
    scope = scope_lines(text, starts, anchor_line)
    if header and not header.endswith("\n\n"):
        header += "\n"  # a blank line between the imports and the code, as in a file
    suffix = ""
    if template.has_fim:
        suffix = cut_suffix(text[offset:], int(budget.suffix_tokens * cpt * _MARGIN))
    parts = _Parts(
        head=header + scope,
        window_prefix=text[window_start:offset],
        window_suffix=suffix,
        anchor_line=anchor_line,
        cursor_line_start=max(0, starts[cursor_line] - window_start),
        scope=scope_names(path),
        window_tokens=window_tokens,
    )
    comment = _COMMENT.get(language_id, "//")
    snippets_head = render_snippets(snippets, comment, int(budget.snippet_tokens * cpt))
    return _assemble(parts, uri, template, snippets_head, heal)


def build_naive_prompt(
    text: str,
    offset: int,
    *,
    uri: str = "",
    language_id: str = "",
    tree: Tree | None = None,
    cursor_byte: int | None = None,
    template: FimTemplate = PREFIX_ONLY,
    counter: TokenCounter | None = None,
    budget: PromptBudget = PromptBudget(),
    snippets: Sequence[Snippet] = (),
    heal: bool = False,
) -> Prompt:
    """The baseline that benchmarks compare against: the last N lines before the cursor (as many as
    fit ``prefix_tokens``) and, for FIM, the next N lines (cut to ``suffix_tokens``); no header,
    no syntax. The window slides by a line whenever the cursor's distance to its top outgrows
    the budget. Same signature, template handling and healing as :func:`build_prompt`."""
    counter = counter or ApproxCounter()
    cpt = chars_per_token(text, offset, counter)
    window_chars = int(budget.prefix_tokens * cpt * _MARGIN)
    starts = line_starts(text, offset)
    cursor_line = len(starts) - 1
    first = min(bisect_left(starts, offset - window_chars), cursor_line)
    window_tokens = count_window(text, starts, first, offset, counter)
    while first < cursor_line and window_tokens > budget.prefix_tokens:
        first = min(cursor_line, first + max(1, (cursor_line - first) // 8))
        window_tokens = count_window(text, starts, first, offset, counter)
    window_start = starts[first]
    if window_tokens > budget.prefix_tokens:
        window_start, window_tokens = _long_line_start(text, window_start, offset, counter, budget.prefix_tokens, cpt)
    suffix = ""
    if template.has_fim:
        n_lines = cursor_line - first + 1
        rest = text[offset:]
        end = 0
        for _ in range(n_lines):
            nl = rest.find("\n", end)
            if nl == -1:
                end = len(rest)
                break
            end = nl + 1
        suffix = rest[:end]
        limit = int(budget.suffix_tokens * cpt * _MARGIN)
        if len(suffix) > limit:
            first_nl = suffix.find("\n")
            cut = max(suffix.rfind("\n", 0, limit), first_nl)
            suffix = suffix[: cut + 1] if cut != -1 else suffix
    parts = _Parts(
        head="",
        window_prefix=text[window_start:offset],
        window_suffix=suffix,
        anchor_line=first,
        cursor_line_start=max(0, starts[cursor_line] - window_start),
        scope=(),
        window_tokens=window_tokens,
    )
    comment = _COMMENT.get(language_id, "//")
    snippets_head = render_snippets(snippets, comment, int(budget.snippet_tokens * cpt))
    return _assemble(parts, uri, template, snippets_head, heal)


# ------------------------------------------------------------------------------------------------
# cross-file snippets


@dataclass(frozen=True)
class Definition:
    """A top-level definition of another file: its name, its text without bodies, its full text."""

    name: str
    signature: str
    full: str


_FAMILY = {"javascriptreact": "javascript", "typescript": "javascript", "typescriptreact": "javascript"}
_CLASSLIKE = frozenset(
    {"class_definition", "class_declaration", "abstract_class_declaration", "class", "impl_item", "trait_item"}
)
_MEMBER_TYPES = frozenset(
    {
        "function_definition",
        "decorated_definition",
        "method_definition",
        "function_item",
        "function_signature_item",
        "method_signature",
        "abstract_method_signature",
    }
)
_DATA_LIMIT = 400  # a body-less definition (struct, interface, constant) is shown whole up to this
_FULL_LIMIT = 1200  # an imported definition is shown whole up to this

_PY_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*(?:\\\n[^\n#;]*)*)", re.M)
_PY_IMPORT = re.compile(r"^[ \t]*import[ \t]+([^\n#;]+)", re.M)
_JS_FROM = re.compile(r"""\b(?:import|export)\s+(?:type\s+)?([^;'"]*?)\s*from\s*['"](\.\.?/[^'"]+)['"]""")
_JS_REQUIRE = re.compile(r"""(?:(?:const|let|var)\s+([^=;]+?)\s*=\s*)?\b(?:require|import)\s*\(\s*['"](\.\.?/[^'"]+)['"]\s*\)""")
_JS_EXT = re.compile(r"\.(?:[cm]?[jt]sx?)$")

_DEF_CACHE: dict[tuple[str, str, int, int], tuple[Definition, ...]] = {}


def _family(language_id: str) -> str:
    return _FAMILY.get(language_id, language_id)


def _clean_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def python_imports(text: str) -> dict[str, tuple[str, ...]]:
    """Imported module -> imported names (``()``: the module itself) for a Python source.

    ``from pkg import mod`` may import a module: it is listed as ``pkg.mod`` too."""
    found: dict[str, set[str] | None] = {}

    def add(module: str, names: Sequence[str]) -> None:
        if not module.strip("."):
            return
        current = found.get(module, set())
        found[module] = None if current is None or not names else current | set(names)

    for m in _PY_FROM.finditer(text):
        module = m.group(1)
        raw = m.group(2).replace("\\\n", " ").strip().strip("()")
        names = [part.split(" as ")[0].strip() for part in raw.replace("\n", " ").split(",")]
        names = [n for n in names if n.isidentifier()]
        add(module, names)
        for name in names:
            add(f"{module}.{name}" if module.strip(".") else f"{module}{name}", ())
    for m in _PY_IMPORT.finditer(text):
        for part in m.group(1).split(","):
            module = part.split(" as ")[0].strip()
            if module and all(p.isidentifier() for p in module.split(".")):
                add(module, ())
    return {module: tuple(sorted(names)) if names else () for module, names in found.items()}


def js_imports(text: str) -> dict[str, tuple[str, ...]]:
    """Relative import path (without extension) -> imported names (``()``: all) for JS/TS."""
    found: dict[str, set[str] | None] = {}
    for regex in (_JS_FROM, _JS_REQUIRE):
        for m in regex.finditer(text):
            clause, spec = (m.group(1) or ""), _JS_EXT.sub("", m.group(2))
            names: set[str] = set()
            brace = re.search(r"\{([^}]*)\}", clause)
            if brace:
                for part in brace.group(1).split(","):
                    name = part.strip().split(" as ")[0].split(":")[0].strip()
                    if name.startswith("type "):
                        name = name[5:].strip()
                    if name.isidentifier():
                        names.add(name)
            current = found.get(spec, set())
            # A default or namespace import next to the braces means the whole module.
            whole = not brace or bool(clause.replace(brace.group(0), "").strip(" ,"))
            found[spec] = None if current is None or whole else current | names
    return {spec: tuple(sorted(names)) if names else () for spec, names in found.items()}


@lru_cache(maxsize=4096)
def module_keys(path: str, family: str) -> frozenset[str]:
    """The names an import can use for the file at ``path``: every trailing run of its path parts
    (``a.b.mod``, ``b.mod``, ``mod`` in Python, ``pkg/__init__.py`` as ``pkg``; ``src/util/x``,
    ``util/x``, ``x`` in JS/TS, ``dir/index.ts`` as ``dir`` too)."""
    clean = _clean_path(path).replace("\\", "/")
    if family == "python":
        parts = clean.split("/")
        stem = parts[-1].rsplit(".", 1)[0]
        parts = parts[:-1] if stem == "__init__" else parts[:-1] + [stem]
        return frozenset(".".join(parts[i:]) for i in range(len(parts)) if parts[i:])
    stems = [_JS_EXT.sub("", clean)]
    if stems[0].endswith("/index"):
        stems.append(stems[0][: -len("/index")])
    keys = set()
    for stem in stems:
        parts = stem.split("/")
        keys.update("/".join(parts[i:]) for i in range(len(parts)) if parts[i:])
    return frozenset(keys)


def _import_key(module: str, family: str) -> str:
    """An imported module or relative path in the form :func:`module_keys` lists."""
    if family == "python":
        return module.lstrip(".")
    return "/".join(p for p in module.split("/") if p not in (".", ".."))


def _node_text(data: bytes, start: int, end: int) -> str:
    return data[start:end].decode("utf-8", "replace")


def _line_start_byte(data: bytes, byte: int) -> int:
    return data.rfind(b"\n", 0, byte) + 1


def _unwrap(node: Node) -> Node:
    """The definition inside export/decorator wrappers (the wrapper's text is kept by callers)."""
    if node.type in ("export_statement", "decorated_definition"):
        inner = node.child_by_field_name("declaration") or node.child_by_field_name("definition")
        if inner is not None:
            return inner
    return node


def _name_of(node: Node) -> str:
    name = node.child_by_field_name("name") or node.child_by_field_name("type")
    if name is None and node.type in ("lexical_declaration", "variable_declaration", "type_declaration", "const_declaration"):
        for child in node.named_children:
            name = child.child_by_field_name("name")
            if name is not None:
                break
    if name is None and node.type == "expression_statement" and node.named_children:
        target = node.named_children[0].child_by_field_name("left")
        if target is not None and target.type == "member_expression":  # exports.f = / X.prototype.f =
            target = target.child_by_field_name("property")
        name = target if target is not None and target.type in ("identifier", "property_identifier") else None
    return name.text.decode("utf-8", "replace") if name is not None and name.text is not None else ""


def _body_of(node: Node) -> Node | None:
    body = node.child_by_field_name("body")
    if body is None and node.type in ("lexical_declaration", "variable_declaration", "expression_statement"):
        for child in node.named_children:
            value = child.child_by_field_name("value") or child.child_by_field_name("right")
            if value is not None and value.type in ("arrow_function", "function_expression", "function"):
                body = value.child_by_field_name("body")
    return body


def _header_end(body: Node) -> int:
    """Where a definition's header ends: after the token before its body (the ``:`` in Python,
    the parameters or return type elsewhere), so a comment that opens the body stays out."""
    before = body.prev_sibling
    while before is not None and before.type == "comment":
        before = before.prev_sibling
    return before.end_byte if before is not None else body.start_byte


def _elide(language_id: str) -> str:
    return " ..." if language_id == "python" else " { ... }"


def _signature(wrapper: Node, data: bytes, language_id: str, depth: int = 0) -> str:
    node = _unwrap(wrapper)
    start, pad = wrapper.start_byte, ""
    if depth:
        line_start = _line_start_byte(data, wrapper.start_byte)
        if data[line_start : wrapper.start_byte].strip():  # shares its line with other code
            pad = "    " * depth
        else:
            start = line_start
    body = _body_of(node)
    if node.type in _CLASSLIKE and body is not None:
        head = _node_text(data, start, _header_end(body)).rstrip()
        members = []
        for member in body.named_children:
            inner = _unwrap(member)
            if inner.type not in _MEMBER_TYPES:
                continue
            name = _name_of(inner)
            if language_id == "python" and name.startswith("_") and name != "__init__":
                continue
            if name.startswith("#"):
                continue
            members.append(_signature(member, data, language_id, depth + 1))
        if language_id == "python":
            return "\n".join([pad + head + (" ..." if not members else ""), *members])
        indent = pad or _node_text(data, start, wrapper.start_byte)
        return "\n".join([pad + head + " {", *members, indent + "}"])
    if body is None or node.type in ("struct_item", "enum_item", "interface_declaration", "type_alias_declaration"):
        text = _node_text(data, start, wrapper.end_byte)
        if len(text) <= _DATA_LIMIT:
            return pad + text
        first = text.split("\n", 1)[0]
        return pad + (first if body is None else _node_text(data, start, _header_end(body)).rstrip() + _elide(language_id))
    return pad + _node_text(data, start, _header_end(body)).rstrip() + _elide(language_id)


def definitions(text: str, language_id: str, path: str = "") -> tuple[Definition, ...]:
    """Top-level definitions of a source file in file order (cached by content)."""
    key = (path, language_id, len(text), hash(text))
    cached = _DEF_CACHE.get(key)
    if cached is not None:
        return cached
    parser = parser_for(language_id)
    result: list[Definition] = []
    if parser is None:
        for line in text.splitlines():
            if line and not line[0].isspace() and not line.startswith(("#", "//", "/*", "*", "}", ")", "]")):
                result.append(Definition(line.split("(")[0].split()[-1] if line.split() else "", line, line))
    else:
        data = text.encode("utf-8", "surrogatepass")
        for child in parser.parse(data).root_node.named_children:
            if child.type in ("comment", "ERROR") or _HEADER_LINE.match(data[child.start_byte : child.start_byte + 200].decode("utf-8", "ignore")):
                continue
            node = _unwrap(child)
            name = _name_of(node)
            if not name or (language_id == "python" and name.startswith("_")):
                continue
            if node.type == "expression_statement" and child.end_byte - child.start_byte > _DATA_LIMIT:
                continue  # long module-level statements are code, not declarations
            signature = _signature(child, data, language_id)
            result.append(Definition(name, signature, _node_text(data, child.start_byte, child.end_byte)))
    if len(_DEF_CACHE) > 128:
        _DEF_CACHE.clear()
    _DEF_CACHE[key] = tuple(result)
    return _DEF_CACHE[key]


def select_snippets(
    current_text: str, language_id: str, others: Sequence[tuple[str, str]], budget_chars: int
) -> tuple[Snippet, ...]:
    """Context from other open files (``(path, text)`` pairs), for the front of the prompt.

    Files the current one imports come first (Python ``import``/``from``, JS/TS relative imports),
    showing the imported definitions whole when small; then the other files of the same language
    as signatures of their top-level definitions. Each group is sorted by path, and the selection
    depends only on the imports and the other files, so it stays the same while the user types
    (and stays in the engine's cache). Snippets are packed until ``budget_chars`` (path lines
    included) is spent; a definition that does not fit is left out whole.
    """
    language_id = normalize_language_id(language_id)
    family = _family(language_id)
    same = sorted(
        (path, text)
        for path, text in others
        if _family(normalize_language_id("", _clean_path(path))) == family and text.strip()
    )
    if not same:
        return ()
    if family == "python":
        imports = python_imports(current_text)
    elif family == "javascript":
        imports = js_imports(current_text)
    else:
        imports = {}
    wanted_by_key: dict[str, set[str] | None] = {}
    for module, names in imports.items():
        key = _import_key(module, family)
        if key:
            current = wanted_by_key.get(key, set())
            wanted_by_key[key] = None if current is None or not names else current | set(names)
    imported: list[tuple[str, str, set[str] | None]] = []
    rest: list[tuple[str, str]] = []
    for path, text in same:
        hits = [wanted_by_key[key] for key in module_keys(path, family) & wanted_by_key.keys()] if wanted_by_key else []
        if hits:
            names: set[str] | None = set()
            for wanted in hits:
                names = None if names is None or not wanted else names | wanted
            imported.append((path, text, names))
        else:
            rest.append((path, text))

    result: list[Snippet] = []
    left = budget_chars
    for path, text, names in imported:
        lang = normalize_language_id("", _clean_path(path))
        defs = definitions(text, lang, path)
        chosen = [d.full if len(d.full) <= _FULL_LIMIT else d.signature for d in defs if names and d.name in names]
        if not chosen:  # `import x`, or names that x does not define (submodules, re-exports)
            chosen = [d.signature for d in defs]
        left = _pack(result, path, chosen, left)
    for path, text in rest:
        lang = normalize_language_id("", _clean_path(path))
        left = _pack(result, path, [d.signature for d in definitions(text, lang, path)], left)
    return tuple(result)


def _pack(result: list[Snippet], path: str, pieces: Sequence[str], left: int) -> int:
    """Append a snippet of as many whole ``pieces`` as fit; return the budget left."""
    left -= len(path) + 8  # the path line and separators render_snippets adds
    kept: list[str] = []
    for piece in pieces:
        if len(piece) + 1 <= left:
            kept.append(piece)
            left -= len(piece) + 1
    if not kept:
        return left + len(path) + 8
    result.append(Snippet(_clean_path(path), "\n".join(kept)))
    return left
