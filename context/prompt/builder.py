"""From (document text, cursor) to a prompt whose beginning stays the same while the user types.

Layout: ``[snippets from other files][file header][scope lines][window: anchor ... cursor]`` and,
for FIM models, the suffix (before everything in SPM order, after the window in PSM order). The
header is the file's imports, the scope lines are the first lines of the blocks the window starts
in (``class Response:``); all of it sits before the cursor's line, so typing only appends.

In PSM order the suffix would follow the cursor, so each keystroke would change the prompt before
it and the engine would prefill the whole suffix again. The "append" layout (the default) splits
the window at a *middle anchor* instead: the window up to it is the FIM prefix, and the text from
it to the cursor follows the middle token, as if the model had written it
(``<pre>head window<suf>suffix<mid>typed``), so typing only appends here too. The middle anchor
is the start of the body being typed (the outermost block around the cursor whose body begins at
most :data:`MIDDLE_MAX_LINES` lines above it), else a line start that moves in steps of
:data:`MIDDLE_STEP_LINES` lines from the window's anchor: pressing Enter leaves it where it is.
"classic" keeps everything before the cursor in the FIM prefix; the append layout falls back to
it where the window begins inside the cursor's line (nothing would be left for the FIM prefix).

The anchor is where the window starts. A window that slides by a line per keystroke invalidates
every cached KV block after its start, so the anchor is:

* the start of the outermost block around the cursor that fits whole up to the cursor;
* otherwise the first syntax boundary after a *quantized* lowest start (it moves only when the
  cursor has advanced a quarter of the window), the shallowest node within half a window first.

Every number that decides a cut (characters per token, window size, suffix length) comes from text
that typing at the cursor does not change, and the decisions that a half-typed statement could
sway (enclosing blocks, scope lines, header) read the text above the cursor rather than the tree,
whose error recovery reshapes it mid-statement. So consecutive requests cut at the same places.
Given the document's :class:`context.source.memo.TextMemo` (``PromptRequest.memo``), the tokenizer
counts the window once when the anchor moves and then one line per keystroke; without one
(plain strings) every build counts the window afresh. The prompt's text is the same either way;
``extra["window_tokens"]`` may differ by a token (a sum of line counts against one count).

Also here: :func:`build_naive_prompt` (the last-N-lines baseline that benchmarks compare against).
The window's parts are in :mod:`context.prompt.window`, the context from other open files
(:func:`select_snippets`) in :mod:`context.snippets`; both are importable from here too.
"""

from __future__ import annotations

import functools
import hashlib
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from context.prompt.fim import PREFIX_ONLY, FimTemplate, neutralize_control_tokens
from context.prompt.snippets import NO_CROSS_FILE, CrossFile, Snippet, render_repository, render_snippets, select_snippets
from context.prompt.window import (
    ApproxCounter,
    TokenCounter,
    chars_per_token,
    choose_anchor,
    count_window,
    cursor_indent,
    cursor_path,
    cut_suffix,
    header_text,
    indent_chain,
    line_starts,
    scope_lines,
    scope_names,
    snap_to_syntax,
)
from context.source.definitions import Definition, definitions, js_imports, module_keys, python_imports
from context.source.languages import language_info
from context.source.memo import TextMemo

try:  # typing only; tree-sitter is always installed with ember
    from tree_sitter import Node, Tree
except ImportError:  # pragma: no cover
    Node = Tree = object  # type: ignore[misc,assignment]

# Other modules import the window's and the snippets' names from here too.
__all__ = [
    "NO_CROSS_FILE",
    "ApproxCounter",
    "CrossFile",
    "Definition",
    "PrefixKey",
    "Prompt",
    "PromptBudget",
    "PromptRequest",
    "Snippet",
    "TokenCounter",
    "anchored_prompt",
    "build_naive_prompt",
    "build_prompt",
    "chars_per_token",
    "choose_anchor",
    "count_window",
    "cursor_indent",
    "cursor_path",
    "cut_suffix",
    "definitions",
    "header_text",
    "heal_cursor_line",
    "heal_middle",
    "indent_chain",
    "js_imports",
    "line_starts",
    "module_keys",
    "naive_prompt",
    "python_imports",
    "render_snippets",
    "scope_lines",
    "scope_names",
    "select_snippets",
    "snap_to_syntax",
]


# Shares of the model's context window (max_model_len) that the parts of a prompt get by default:
# at 2048 tokens these are 1024 / 256 / 128 / 256, the budgets ember had before they followed the
# model. The rest (3/16) is for the FIM and path tokens and the generated tokens.
PREFIX_SHARE = 1 / 2
SUFFIX_SHARE = 1 / 8
HEADER_SHARE = 1 / 16
SNIPPET_SHARE = 1 / 8
# Characters of cross-file text selected per snippet token: a little under code's usual ~3.5, so
# that what is selected fits when rendered.
SNIPPET_CHARS_PER_TOKEN = 880 / 256
# Tokens the template adds around the parts (FIM markers, the path comment); budgets are estimates.
TEMPLATE_RESERVE_TOKENS = 32
MIN_PREFIX_TOKENS = 16


# The cross-file budget with crossFile "workspace", as a share of the context (512 tokens at
# 2048): retrieval ranks what it packs, so more room holds more of what the cursor needs (on the
# cross-file dev set 512 tokens did better than 256). It takes only room the other parts leave
# free, so the current file's window is the same with or without it; "open" keeps its old share.
WORKSPACE_SNIPPET_SHARE = 1 / 4


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
    @functools.lru_cache(maxsize=64)  # pure; a request asks twice (the session's snippets, the prompt)
    def for_model(
        cls,
        max_model_len: int,
        max_tokens: int,
        *,
        prefix_tokens: int | None = None,
        suffix_tokens: int | None = None,
        snippet_tokens: int | None = None,
        workspace: bool = False,
    ) -> PromptBudget:
        """Budgets as shares of ``max_model_len``, except those given (the user's settings win),
        shrunk so that the prompt plus ``max_tokens`` generated tokens fits the model's context:
        the derived parts give way first, explicit ones only when they alone do not fit (the
        engine would reject every request otherwise). ``workspace``: the cross-file context
        comes from the workspace (crossFile "workspace"), whose derived budget is larger
        (:data:`WORKSPACE_SNIPPET_SHARE`). 1024/256 at 2048, and 512 from the workspace, 256
        from open tabs."""
        derived = {
            "prefix_tokens": int(max_model_len * PREFIX_SHARE),
            "suffix_tokens": int(max_model_len * SUFFIX_SHARE),
            "header_tokens": int(max_model_len * HEADER_SHARE),
            "snippet_tokens": int(max_model_len * SNIPPET_SHARE),
        }
        asked = (("prefix_tokens", prefix_tokens), ("suffix_tokens", suffix_tokens), ("snippet_tokens", snippet_tokens))
        given = {name: value for name, value in asked if value is not None}
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
        if workspace and snippet_tokens is None:
            # Only room the other parts leave free: the current file's window stays the same.
            free_room = max_model_len - max_tokens - TEMPLATE_RESERVE_TOKENS - sum(parts.values())
            wanted = int(max_model_len * WORKSPACE_SNIPPET_SHARE)
            parts["snippet_tokens"] = max(parts["snippet_tokens"], min(wanted, parts["snippet_tokens"] + free_room))
        return cls(**parts)

    @property
    def snippet_chars(self) -> int:
        """How much cross-file text to select for the snippet block (880 characters for 256
        tokens); the prompt then renders what fits ``snippet_tokens`` at the text's measured rate."""
        return int(self.snippet_tokens * SNIPPET_CHARS_PER_TOKEN)


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
    # "append" (the text from the middle anchor after the FIM middle token), "classic", or "" for
    # layouts where the two are the same (SPM, prefix-only: the cursor's text is last anyway).
    layout: str = ""


# The middle anchor (see the module docstring) is the start of the body being typed while that is
# at most MIDDLE_MAX_LINES above the cursor, else it moves in steps of MIDDLE_STEP_LINES lines: the
# suffix is prefilled again once per body or step, not once per keystroke.
MIDDLE_MAX_LINES = 12
MIDDLE_STEP_LINES = 4


# Windows are sized below the budget so the exact count rarely disagrees (a disagreement costs
# extra tokenizer calls and a shift of the anchor).
_MARGIN = 0.92
_SHRINK = 0.8


# ------------------------------------------------------------------------------------------------
# the prompt


@dataclass(frozen=True)
class _Parts:
    head: str
    window_prefix: str
    window_suffix: str
    anchor_line: int
    cursor_line_start: int  # where the cursor's line starts inside window_prefix
    middle_start: int  # where the middle anchor is inside window_prefix (<= cursor_line_start)
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


def heal_middle(typed: str) -> tuple[str, str]:
    """(the typed text as the "append" layout ends the prompt with it, the part left out).

    After the middle token the prompt ends where the model goes on writing, so it must end where
    the tokenizer would end a token anyway. Trailing spaces after code are left out as by
    :func:`heal_cursor_line`. An indented empty line keeps all its indentation but the last
    space or tab: BPE tokenizers split ``"        x"`` as seven spaces and `` x`` (Qwen's,
    GPT-2's, Llama 3's pre-tokenizers alike), so a prompt ending in all eight spaces ends in a
    token that real code never has before a word, and the model answers with a ninth space
    (seen on every such cursor of a probe with Qwen2.5-Coder-0.5B). The indentation still says
    which block the model writes in. A lone punctuation mark at the end (``if(``, ``self.``) is
    left out too: the same pre-tokenizers join it with the word after it (``(a``, ``.name``), so
    a prompt that ends in it alone makes the model start with a space (`` a[j]`` after ``if(``,
    seen on SAFIM's control cases); the model writes it again and post-processing drops its copy.
    """
    line_start = typed.rfind("\n") + 1
    line = typed[line_start:]
    kept, healed = heal_cursor_line(line)
    if healed:
        return typed[:line_start] + kept, healed
    if line and not line.strip(" \t"):
        return typed[:-1], typed[-1]
    if _lone_mark(line):
        return typed[:-1], typed[-1]
    return typed, ""


def _lone_mark(line: str) -> bool:
    """Whether ``line`` ends in one punctuation mark after a word, a digit or a space (a run of
    marks, ``((`` or ``->``, is a token of its own)."""
    if not line or line[-1].isalnum() or line[-1] in " \t_":
        return False
    return len(line) == 1 or line[-2].isalnum() or line[-2] in " \t_"


def _assemble(parts: _Parts, request: PromptRequest, snippets_head: str, repository: str = "") -> Prompt:
    """``repository``: the cross-file block in the model's repository format (before the
    template), else ``snippets_head`` (comments, inside the FIM prefix)."""
    uri, template, heal = request.uri, request.template, request.heal

    def clean(part: str) -> str:
        return neutralize_control_tokens(part, template)

    head = clean(snippets_head + parts.head)
    before, after = template.split(head, clean(parts.window_suffix))
    before = repository + before
    layout = request.layout if template.order == "psm" else ""
    if layout == "append":
        # Cleaned apart: a control token never spans a line break, and the split gives the stable part.
        above = clean(parts.window_prefix[: parts.middle_start])
        typed, healed = parts.window_prefix[parts.middle_start :], ""
        if heal:
            typed, healed = heal_middle(typed)
        stable = before + above + after
        text = stable + clean(typed)
    else:
        above = clean(parts.window_prefix[: parts.cursor_line_start])
        cursor_line, healed = parts.window_prefix[parts.cursor_line_start :], ""
        if heal:
            cursor_line, healed = heal_cursor_line(cursor_line)
        stable = before + above
        text = before + above + clean(cursor_line) + after
    key = PrefixKey(
        uri=uri,
        anchor_line=parts.anchor_line,
        scope=parts.scope,
        stable_hash=hashlib.blake2b(stable.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest(),
    )
    return Prompt(
        text=text,
        key=key,
        template=template.name,
        stop=template.stop,
        window_prefix=parts.window_prefix,
        window_suffix=parts.window_suffix,
        stable_chars=len(stable),
        extra={"window_tokens": parts.window_tokens, "head_chars": len(head), "anchor_line": parts.anchor_line},
        healed=healed,
        layout=layout,
    )


def _long_line_start(
    text: str, line_start: int, offset: int, counter: TokenCounter, budget_tokens: int, cpt: float
) -> tuple[int, int]:
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


@dataclass(frozen=True)
class PromptRequest:
    """What a prompt is built from: the text and cursor, the document's tree and memo, the model's
    template and tokenizer, the budgets. ``memo`` (the document's :attr:`Document.memo
    <context.source.document.Document.memo>`) is only read when it was made for ``text``."""

    text: str
    offset: int
    uri: str = ""
    language_id: str = ""
    tree: Tree | None = None
    cursor_byte: int | None = None
    template: FimTemplate = PREFIX_ONLY
    counter: TokenCounter | None = None
    budget: PromptBudget = PromptBudget()
    cross_file: CrossFile = NO_CROSS_FILE
    heal: bool = False
    memo: TextMemo | None = None
    # Where a PSM template puts the text before the cursor: "append" or "classic" (module docstring).
    layout: str = "append"


# Stateless: one instance serves every request that brings no tokenizer (and keeps memo counts).
_APPROX = ApproxCounter()


@dataclass(frozen=True)
class _Window:
    """Where a prompt's prefix window starts and what it holds."""

    anchor_line: int
    start: int
    tokens: int
    enclosing: tuple[int, ...]  # the lines that open the blocks around the cursor, outermost first


def _anchored_window(request: PromptRequest, counter: TokenCounter, cpt: float, starts: Sequence[int]) -> _Window:
    """The anchor (see the module docstring) and the window from it to the cursor."""
    text, offset, budget, tree, memo = request.text, request.offset, request.budget, request.tree, request.memo
    window_chars = int(budget.prefix_tokens * cpt * _MARGIN)
    cursor_line = len(starts) - 1
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
        window_tokens = count_window(text, starts, anchor_line, offset, counter, memo)
        if window_tokens <= budget.prefix_tokens:
            break
        chars = int(chars * _SHRINK)
    else:
        while anchor_line < cursor_line and window_tokens > budget.prefix_tokens:
            anchor_line += max(1, (cursor_line - anchor_line) // 8)
            anchor_line = min(anchor_line, cursor_line)
            window_tokens = count_window(text, starts, anchor_line, offset, counter, memo)
    window_start = starts[anchor_line]
    if window_tokens > budget.prefix_tokens:
        window_start, window_tokens = _long_line_start(text, window_start, offset, counter, budget.prefix_tokens, cpt)
    return _Window(anchor_line, window_start, window_tokens, tuple(enclosing))


def _middle_line(cursor_line: int, window: _Window) -> int:
    """Where the append layout's middle starts: the body of the outermost block around the cursor
    that begins at most :data:`MIDDLE_MAX_LINES` lines above it (so that a function body typed
    line by line, nested blocks included, keeps it), else a line that moves in steps of
    :data:`MIDDLE_STEP_LINES` from the window's anchor."""
    for opener in window.enclosing:
        body = opener + 1
        if window.anchor_line <= body <= cursor_line and cursor_line - body <= MIDDLE_MAX_LINES:
            return body
    steps = (cursor_line - window.anchor_line) // MIDDLE_STEP_LINES
    return window.anchor_line + steps * MIDDLE_STEP_LINES


def _scope_path(request: PromptRequest, starts: Sequence[int]) -> list[Node]:
    """The tree's nodes around the cursor, root first (none without a tree)."""
    if request.tree is None:
        return []
    cursor_byte = request.cursor_byte
    if cursor_byte is None:
        cursor_byte = len(request.text[: request.offset].encode("utf-8", "surrogatepass"))
    return cursor_path(request.tree, request.text, request.offset, cursor_byte, starts[-1])


def _finish(request: PromptRequest, parts: _Parts, cpt: float) -> Prompt:
    """The parts, the other files' snippets and the template made into the prompt."""
    cross_file, template = request.cross_file, request.template
    max_chars = int(request.budget.snippet_tokens * cpt)
    if cross_file.repo_name and template.file_token and template.has_fim:
        def clean(part: str) -> str:
            return neutralize_control_tokens(part, template)

        repository = render_repository(cross_file, template.repo_token, template.file_token, max_chars, clean)
        return _assemble(parts, request, "", repository)
    comment = language_info(request.language_id).line_comment
    return _assemble(parts, request, render_snippets(cross_file.snippets, comment, max_chars))


def anchored_prompt(request: PromptRequest) -> Prompt:
    """The prompt for a completion at ``request.offset``: :func:`build_prompt` with its
    arguments in one value (and the document's memo, which :func:`build_prompt` has no way to
    take)."""
    counter = request.counter or _APPROX
    text, offset, budget = request.text, request.offset, request.budget
    cpt = chars_per_token(text, offset, counter, request.memo)
    starts = line_starts(text, offset)
    path = _scope_path(request, starts)
    window = _anchored_window(request, counter, cpt, starts)
    header = header_text(text, starts, window.anchor_line, int(budget.header_tokens * cpt * _MARGIN), request.memo)
    scope = scope_lines(text, starts, window.anchor_line)
    if header and not header.endswith("\n\n"):
        header += "\n"  # a blank line between the imports and the code, as in a file
    suffix = ""
    if request.template.has_fim:
        suffix = cut_suffix(text[offset:], int(budget.suffix_tokens * cpt * _MARGIN))
    middle_line = _middle_line(len(starts) - 1, window)
    if window.start > starts[middle_line]:
        # The window begins inside the line (minified code): nothing before the cursor's text
        # would be left for the FIM prefix.
        request = replace(request, layout="classic")
    parts = _Parts(
        head=header + scope,
        window_prefix=text[window.start : offset],
        window_suffix=suffix,
        anchor_line=window.anchor_line,
        cursor_line_start=max(0, starts[-1] - window.start),
        middle_start=max(0, starts[middle_line] - window.start),
        scope=scope_names(path),
        window_tokens=window.tokens,
    )
    return _finish(request, parts, cpt)


def _naive_suffix(suffix_text: str, n_lines: int, max_chars: int) -> str:
    """The baseline's suffix: the next ``n_lines`` lines, cut back to a line end within
    ``max_chars`` (the rest of the cursor's line always stays)."""
    end = 0
    for _ in range(n_lines):
        nl = suffix_text.find("\n", end)
        if nl == -1:
            end = len(suffix_text)
            break
        end = nl + 1
    suffix = suffix_text[:end]
    if len(suffix) > max_chars:
        first_nl = suffix.find("\n")
        cut = max(suffix.rfind("\n", 0, max_chars), first_nl)
        suffix = suffix[: cut + 1] if cut != -1 else suffix
    return suffix


def naive_prompt(request: PromptRequest) -> Prompt:
    """:func:`build_naive_prompt` with its arguments in one value (always in the classic layout:
    the baseline has none of ember's ideas)."""
    request = replace(request, layout="classic")
    counter = request.counter or _APPROX
    text, offset, budget, memo = request.text, request.offset, request.budget, request.memo
    cpt = chars_per_token(text, offset, counter, memo)
    window_chars = int(budget.prefix_tokens * cpt * _MARGIN)
    starts = line_starts(text, offset)
    cursor_line = len(starts) - 1
    first = min(bisect_left(starts, offset - window_chars), cursor_line)
    window_tokens = count_window(text, starts, first, offset, counter, memo)
    while first < cursor_line and window_tokens > budget.prefix_tokens:
        first = min(cursor_line, first + max(1, (cursor_line - first) // 8))
        window_tokens = count_window(text, starts, first, offset, counter, memo)
    window_start = starts[first]
    if window_tokens > budget.prefix_tokens:
        window_start, window_tokens = _long_line_start(text, window_start, offset, counter, budget.prefix_tokens, cpt)
    suffix = ""
    if request.template.has_fim:
        suffix = _naive_suffix(text[offset:], cursor_line - first + 1, int(budget.suffix_tokens * cpt * _MARGIN))
    parts = _Parts(
        head="",
        window_prefix=text[window_start:offset],
        window_suffix=suffix,
        anchor_line=first,
        cursor_line_start=max(0, starts[cursor_line] - window_start),
        middle_start=max(0, starts[cursor_line] - window_start),
        scope=(),
        window_tokens=window_tokens,
    )
    return _finish(request, parts, cpt)


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
    layout: str = "append",
) -> Prompt:
    """The prompt for a completion at ``offset`` (an index into ``text``).

    ``tree`` is the document's tree-sitter tree (``None``: indentation stands in for syntax) and
    ``cursor_byte`` the UTF-8 offset of ``offset`` (computed when missing). ``heal``: end the
    prompt before the spaces/tabs that end the cursor's line (see :func:`heal_cursor_line`);
    ``Prompt.healed`` says what was left out, for post-processing. ``layout``: where a PSM
    template puts the text before the cursor (the module docstring). Counts without a memo: see
    :func:`anchored_prompt` for the request that brings the document's.
    """
    return anchored_prompt(
        PromptRequest(
            text,
            offset,
            uri=uri,
            language_id=language_id,
            tree=tree,
            cursor_byte=cursor_byte,
            template=template,
            counter=counter,
            budget=budget,
            cross_file=CrossFile(tuple(snippets)),
            heal=heal,
            layout=layout,
        )
    )


def build_naive_prompt(text: str, offset: int, **options: Any) -> Prompt:
    """The baseline that benchmarks compare against: the last N lines before the cursor (as many as
    fit ``prefix_tokens``) and, for FIM, the next N lines (cut to ``suffix_tokens``); no header,
    no syntax. The window slides by a line whenever the cursor's distance to its top outgrows
    the budget. Takes :func:`build_prompt`'s keyword arguments; same template handling and healing."""
    snippets = options.pop("snippets", ())
    return naive_prompt(PromptRequest(text, offset, cross_file=CrossFile(tuple(snippets)), **options))
