"""Brackets, strings and the parse check: post-processing's steps that read the suffix.

:func:`balance` drops closers the suffix already has, :func:`trim_overlap` drops a copy of the
rest of the cursor's line, :func:`parsing_lines` cuts a block back to lines that parse in place;
:func:`scan_brackets` is the small lexer they share (brackets still open, outside strings and
comments), and :func:`error_count` the tree-sitter ERROR/MISSING count behind the quality metric.
"""

from __future__ import annotations

from tree_sitter import Node, Parser

from context.cut.surroundings import Surroundings, is_closer_line, leading_space, parse_window, string_or_comment_at
from context.source.languages import LanguageInfo, parser_for

CLOSERS = ")]}"


_OPENERS = "([{"


_PAIR = {")": "(", "]": "[", "}": "{"}


def scan_brackets(text: str, info: LanguageInfo, in_string: str | None = None) -> tuple[list[int], list[str], str | None]:
    """A rough lexer: (offsets of closers/quotes in ``text`` that close something opened before
    it, openers still unclosed at the end, the quote still open at the end). Strings (opened by
    ``info.quotes``) end at a line break except template strings; comments (``info.scan_line_comment``)
    run to the end of the line."""
    unmatched: list[int] = []
    stack: list[str] = []
    quotes = info.quotes
    comment = info.scan_line_comment
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
        elif text.startswith(comment, i):
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            continue
        elif ch in _OPENERS:
            stack.append(ch)
        elif ch in CLOSERS:
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
        if ch in CLOSERS or ch in "\"'`":
            out.append(ch)
            continue
        break
    return "".join(out)


def balance(text: str, prefix: str, suffix: str, site: Surroundings, joiner: str = "") -> str:
    """``text`` cut before a closer that the suffix already has, when that helps (see
    :func:`postprocess`, step 6). ``joiner`` is what will follow the text before the suffix."""
    _, _, quote_at_cursor = scan_brackets(site.before, site.info)
    unmatched, _, _ = scan_brackets(text, site.info, quote_at_cursor)
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
        _, open_before, _ = scan_brackets(site.before, site.info)
        closing_in_head = sum(1 for c in head if c in CLOSERS)
        if quote_at_cursor is not None and head[0] == quote_at_cursor:
            return text[: cuts[0]].rstrip(" \t")
        want = len(open_before) - closing_in_head  # closers the completion should keep
        closers = [p for p in unmatched if text[p] in CLOSERS]
        if 0 <= want < len(closers) and text[closers[want]] == head[0]:
            return text[: closers[want]].rstrip(" \t")
        return text

    base = error_count(prefix + text + joiner + suffix, site.lang)
    if base is None or base == 0:
        return text
    best, best_errors = text, base
    for p in cuts:
        candidate = text[:p].rstrip()
        errors = error_count(prefix + candidate + joiner + suffix, site.lang)
        # Cuts come in text order; on a tie the earlier (shorter) one loses, keeping more text.
        if errors is not None and errors <= best_errors and (errors < best_errors or best is not text):
            best, best_errors = candidate, errors
    return best


_CHECK_CHARS = 2500


class InsertionCheck:
    """Does inserting a candidate at the cursor keep the parse as good as without it (no more
    tree-sitter ERROR/MISSING nodes, the ``syntax_ok`` metric)? A few KB around the cursor are
    parsed once; each candidate is an edit of that tree, which tree-sitter reparses
    incrementally. The same window is parsed with and without the completion, so its cut edges
    count the same. ``None`` from :meth:`of` for a language without a grammar."""

    def __init__(self, parser: Parser, prefix: str, suffix: str, joiner: str) -> None:
        prefix, suffix = parse_window(prefix, suffix, _CHECK_CHARS)
        self._parser = parser
        self._joiner = joiner
        self._head = prefix.encode("utf-8", "surrogatepass")
        self._tail = suffix.encode("utf-8", "surrogatepass")
        self._base = parser.parse(self._head + self._tail)
        self._before = _errors(self._base.root_node)
        self._at = (prefix.count("\n"), len(self._head) - (self._head.rfind(b"\n") + 1))  # (row, byte column)

    @classmethod
    def of(cls, prefix: str, suffix: str, site: Surroundings, joiner: str) -> InsertionCheck | None:
        parser = parser_for(site.lang)
        return None if parser is None else cls(parser, prefix, suffix, joiner)

    def judges_ends(self) -> bool:
        """Can the parse show where a node at the cursor ends? Not inside a string or comment
        (prose), nor when the text around the cursor has errors of its own beyond a few: a body
        half typed, or a docstring being typed that turns the rest of the file into a string,
        where every cut would "parse better" and each reparse costs milliseconds."""
        return self._before <= _MAX_OWN_ERRORS and not string_or_comment_at(self._base.root_node, len(self._head))

    def parses(self, candidate: str) -> bool:
        return self.errors(candidate) <= self._before

    def errors(self, candidate: str) -> int:
        """ERROR/MISSING nodes with ``candidate`` inserted."""
        inserted = (candidate + self._joiner).encode("utf-8", "surrogatepass")
        rows = inserted.count(b"\n")
        at = self._at
        end = (at[0] + rows, (at[1] if rows == 0 else 0) + len(inserted) - (inserted.rfind(b"\n") + 1))
        start = len(self._head)
        tree = self._base.copy()
        tree.edit(start, start, start + len(inserted), at, at, end)
        return _errors(self._parser.parse(self._head + inserted + self._tail, tree).root_node)


def parsing_lines(text: str, prefix: str, suffix: str, site: Surroundings, joiner: str, truncated: bool) -> str:
    """The longest run of ``text``'s first lines that the document parses with (see
    :class:`InsertionCheck`). Catches what the line rules cannot see, e.g. a line at the wrong
    depth for Python (``return x`` dedented out of the loop that the suffix continues, a
    header's body not indented). Only when the whole text fails; when no first lines parse,
    ``""``, or the first line when the token limit cut the text (it is the start of a
    statement, as in step 1)."""
    check = InsertionCheck.of(prefix, suffix, site, joiner)
    if check is None or check.parses(text):
        return text
    lines = text.split("\n")
    for k in range(len(lines) - 1, 0, -1):
        candidate = "\n".join(lines[:k]).rstrip()
        if candidate.strip() and check.parses(candidate):
            return candidate
    return lines[0] if truncated else ""


# A single-line answer is cut back at most this many token boundaries from its end.
_MAX_TOKEN_CUTS = 32
# ... and only where the window without it has at most this many errors of its own (dev sets:
# 584 of 645 single-line answers; the others gave 3 cuts, and cost up to 5 ms where the replay's
# half-typed docstrings, with 14 errors, cost 40-200 ms).
_MAX_OWN_ERRORS = 2


def parsing_tokens(text: str, prefix: str, suffix: str, site: Surroundings, joiner: str) -> str:
    """A single-line answer whose insertion leaves more tree-sitter errors than a start of it
    (cut at a token boundary) does: the longest start with the fewest errors. That is where the
    node at the cursor ended and the suffix takes over (``x > 0: self.a()`` before the suffix's
    `` self.b()`` ends at ``x > 0:``; ``i++package a;`` before ``)`` ends at ``i++``). The
    document without the answer may have errors of its own (an empty ``if ()``), so starts are
    compared with each other, not with it. Unchanged when no start is better, or where the parse
    cannot judge (:meth:`InsertionCheck.judges_ends`)."""
    check = InsertionCheck.of(prefix, suffix, site, joiner)
    if check is None or not check.judges_ends():
        return text
    best, fewest = text, check.errors(text)
    if fewest == 0:
        return text
    for end in _token_ends(text)[:_MAX_TOKEN_CUTS]:
        candidate = text[:end].rstrip()
        if not candidate.strip():
            break
        if _dangling(candidate):
            continue  # a node does not end on an operator (`self.` parses before ` self.b()`)
        errors = check.errors(candidate)
        if errors < fewest:
            best, fewest = candidate, errors
            if errors == 0:
                break
    return best


def _token_ends(text: str) -> list[int]:
    """The offsets in ``text`` where a token ends, the last first (text's own end excluded): not
    inside a word or a run of operator characters (``!=``, ``>>``), not after a space."""
    ends = []
    for p in range(len(text) - 1, 0, -1):
        a, b = text[p - 1], text[p]
        inside_word = _word(a) and _word(b) and not (a.isdigit() and b.isalpha() and _number_ends(text, p))
        if a.isspace() or inside_word or (_operator(a) and _operator(b)):
            continue
        ends.append(p)
    return ends


def _number_ends(text: str, p: int) -> bool:
    """Does a run of digits that is a number of its own (not the end of a name) end at ``p``
    (``0package``: the model ran on after ``0``)?"""
    k = p
    while k > 0 and text[k - 1].isdigit():
        k -= 1
    return k == 0 or not _word(text[k - 1])


def _dangling(text: str) -> bool:
    """Does ``text`` end with an opener, a ``.`` / ``,`` or an operator (postfix ``++`` / ``--``
    and Rust's ``?`` aside)?"""
    last = text[-1]
    if last in _OPENERS or last in ".,":
        return True
    return _operator(last) and not text.endswith(("++", "--", "?"))


def _operator(ch: str) -> bool:
    return not (ch.isspace() or _word(ch) or ch in _OPENERS or ch in CLOSERS or ch in ",;:\"'`")


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _closer_tail(text: str) -> int | None:
    """Where the closer line that ``text`` ends with starts (its first closer), if it has one
    and more lines before it."""
    body = text.rstrip()
    start = body.rfind("\n") + 1
    if start == 0 or not is_closer_line(body[start:].strip()):
        return None
    return start + len(leading_space(body[start:]))


def error_count(source: str, lang: str) -> int | None:
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


def _overlap_rest(text: str, site: Surroundings) -> str | None:
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
            cut = body[: len(body) - k]
            return cut.rstrip(" \t") if site.after[:1].isspace() else cut
    return None


def trim_overlap(text: str, prefix: str, suffix: str, site: Surroundings) -> str:
    """Same-line overlap: the model rewrote the rest of the line. A rest with a word in it is
    trusted; one made of punctuation (`;`, `):`, `))`) may be the completion's own, so a parse
    must not get worse, and closers alone are left to the bracket balancer."""
    cut = _overlap_rest(text, site)
    if cut is None:
        return text
    rest = site.after.strip()
    if any(c.isalnum() for c in rest):
        return cut
    if all(c in CLOSERS or c.isspace() for c in rest):
        return text
    before = error_count(prefix + text + suffix, site.lang)
    if before is None:
        return cut
    after = error_count(prefix + cut + suffix, site.lang)
    return cut if after is not None and after <= before else text
