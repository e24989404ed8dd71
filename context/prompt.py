"""From (document text, cursor) to a prompt whose beginning stays the same while the user types.

Layout: ``[snippets from other files][file header][prefix from an anchor ... cursor]`` and, for FIM
models, the suffix (before everything in SPM order, after the prefix in PSM order).

The anchor is where the prefix window starts. A window that slides by a line per keystroke
invalidates every cached KV block after its start, so the anchor is snapped to a top-level syntax
boundary and quantized: it only moves when the cursor has advanced a quarter of the window.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from context.fim import PREFIX_ONLY, FimTemplate

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


@dataclass(frozen=True)
class PromptBudget:
    prefix_tokens: int = 1024
    suffix_tokens: int = 256
    header_tokens: int = 128
    snippet_tokens: int = 256
    # The anchor moves in steps of this fraction of the prefix window.
    anchor_step: float = 0.25


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
    # What the model saw around the cursor; post-processing compares output against these.
    window_prefix: str
    window_suffix: str
    stable_chars: int = 0  # length of the prompt part that does not depend on the cursor line
    extra: dict[str, int] = field(default_factory=dict)


_HEADER_LINE = re.compile(
    r"^\s*(?:import\b|from\s+\S+\s+import\b|#\s*include\b|#!|package\b|use\b|using\b|extern\s+crate\b|"
    r"(?:const|let|var)\s+\S+\s*=\s*require\(|//|#|/\*|\*|\"\"\"|'''|$)"
)

_DEFINITION_SUFFIXES = ("definition", "declaration", "item", "specifier", "method", "function", "class")


def line_starts(text: str, end: int) -> list[int]:
    """Offsets at which lines start, for lines that start before ``end``."""
    starts = [0]
    find = text.find
    pos = find("\n", 0, end)
    while pos != -1:
        starts.append(pos + 1)
        pos = find("\n", pos + 1, end)
    return starts


def boundary_lines(tree: Tree | None, text: str, upto_line: int, starts: Sequence[int]) -> list[int]:
    """Lines where a top-level construct starts: from the tree, else lines without indentation."""
    if tree is not None:
        lines = sorted({child.start_point[0] for child in tree.root_node.children})
        return [line for line in lines if line <= upto_line]
    result = []
    for line in range(min(upto_line, len(starts) - 1) + 1):
        start = starts[line]
        ch = text[start : start + 1]
        if ch and not ch.isspace() and ch not in ")]}":
            result.append(line)
    return result


def choose_anchor(
    offset: int, starts: Sequence[int], boundaries: Sequence[int], window_chars: int, step: float
) -> int:
    """The line where the prefix window starts.

    Quantized: ``lowest`` advances in steps of ``step * window_chars`` as the cursor moves, and the
    anchor is the first boundary at or after it, so consecutive requests share the anchor.
    """
    cursor_line = len(starts) - 1
    if offset <= window_chars:
        return 0
    quantum = max(1, int(window_chars * step))
    lowest = -(-(offset - window_chars) // quantum) * quantum  # ceil to a multiple of quantum
    for line in boundaries:
        if starts[line] >= lowest and line <= cursor_line:
            return line
    for line, start in enumerate(starts):  # no boundary in the window: a plain line start
        if start >= lowest:
            return line
    return cursor_line


def header_text(text: str, starts: Sequence[int], anchor_line: int, max_chars: int) -> str:
    """The file's leading imports/comments (before the anchor), cut at a line end."""
    end = 0
    for line in range(anchor_line):
        start = starts[line]
        stop = starts[line + 1] if line + 1 < len(starts) else len(text)
        if not _HEADER_LINE.match(text[start:stop]):
            break
        if stop > max_chars:
            break
        end = stop
    return text[:end]


def scope_path(tree: Tree | None, cursor_byte: int | None) -> tuple[str, ...]:
    """Names of the definitions enclosing the cursor, outermost first (e.g. ('Parser', 'parse'))."""
    if tree is None or cursor_byte is None:
        return ()
    node: Node | None = tree.root_node.descendant_for_byte_range(cursor_byte, cursor_byte)
    names: list[str] = []
    while node is not None:
        if node.type.endswith(_DEFINITION_SUFFIXES):
            name = node.child_by_field_name("name")
            if name is not None and name.text is not None:
                names.append(name.text.decode("utf-8", "replace"))
        node = node.parent
    return tuple(reversed(names))


def cut_suffix(suffix: str, max_chars: int) -> str:
    """The text after the cursor up to about ``max_chars``, ending at a line end (never half a line);
    the rest of the cursor's own line is always kept."""
    if len(suffix) <= max_chars:
        return suffix
    first_nl = suffix.find("\n")
    if first_nl == -1 or first_nl >= max_chars:
        return suffix[: first_nl + 1] if first_nl != -1 else suffix
    cut = suffix.rfind("\n", 0, max_chars)
    return suffix[: cut + 1]


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


_COMMENT = {"python": "#", "shellscript": "#", "ruby": "#"}


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
) -> Prompt:
    """The prompt for a completion at ``offset`` (an index into ``text``)."""
    counter = counter or ApproxCounter()
    prefix_full = text[:offset]
    chars_per_token = _chars_per_token(prefix_full[-4000:], counter)
    window_chars = int(budget.prefix_tokens * chars_per_token)

    starts = line_starts(text, offset)
    cursor_line = len(starts) - 1
    boundaries = boundary_lines(tree, text, cursor_line, starts)
    anchor_line = choose_anchor(offset, starts, boundaries, window_chars, budget.anchor_step)
    # The estimate can be off for unusual text: walk the anchor forward until the window fits.
    while anchor_line < cursor_line and counter.count(text[starts[anchor_line] : offset]) > budget.prefix_tokens:
        later = [b for b in boundaries if b > anchor_line]
        anchor_line = later[0] if later else anchor_line + 1
    window_prefix = text[starts[anchor_line] : offset]

    header = ""
    if anchor_line > 0:
        header = header_text(text, starts, anchor_line, int(budget.header_tokens * chars_per_token))
        if header and not header.endswith("\n"):
            header += "\n"

    comment = _COMMENT.get(language_id, "//")
    head = render_snippets(snippets, comment, int(budget.snippet_tokens * chars_per_token)) + header
    window_suffix = cut_suffix(text[offset:], int(budget.suffix_tokens * chars_per_token)) if template.has_fim else ""

    prompt_text = template.render(head, window_prefix, window_suffix)
    cursor_line_start = starts[cursor_line] - starts[anchor_line]
    stable = prompt_text[: prompt_text.rfind(window_prefix) + cursor_line_start] if window_prefix else prompt_text
    key = PrefixKey(
        uri=uri,
        anchor_line=anchor_line,
        scope=scope_path(tree, cursor_byte),
        stable_hash=hashlib.blake2b(stable.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest(),
    )
    return Prompt(
        text=prompt_text,
        key=key,
        template=template.name,
        stop=template.stop,
        window_prefix=window_prefix,
        window_suffix=window_suffix,
        stable_chars=len(stable),
    )


def _chars_per_token(sample: str, counter: TokenCounter) -> float:
    if len(sample) < 200:
        return 3.5
    return max(1.0, len(sample) / max(1, counter.count(sample)))
