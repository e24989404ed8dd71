"""One open document: its text, a line index and its tree-sitter tree, kept in sync with edits.

Positions crossing the LSP edge are (line, character) in UTF-16 code units; everything inside
ember works on Python ``str`` indices ("offsets"), and tree-sitter works on UTF-8 bytes. This
module is the one place that converts between the three.

Decisions (so that other modules can rely on them):

* Change ranges follow vscode-languageserver-textdocument's ``TextDocument.update``: a reversed
  range is swapped, a line past the end means the end of the document, a negative line means its
  start, a character past a line's end means that line's end (before its terminator). Editors
  compute their own text the same way, so our text stays equal to theirs even when a client
  sends a sloppy range. Direct calls to :meth:`Document.offset_at` are strict unless asked to
  clamp, because there a bad position is a bug worth reporting.
* Python strings hold code points, so a position between the two halves of a surrogate pair
  cannot be represented; it snaps forward to after the pair (the editor never shows half an
  emoji either).
* Lone surrogates (JSON text may carry ``"\\ud800"``) are replaced by U+FFFD, and surrogate
  pairs held as two code points are joined, when text enters the document. Both keep the UTF-16
  length, so positions the editor sends afterwards stay valid, and the text is then valid
  Unicode everywhere downstream (UTF-8 for tree-sitter, the tokenizer, JSON replies).
* Line breaks are ``\\n``, ``\\r\\n`` and a lone ``\\r`` (LSP). The line index is always the one
  a fresh scan of the text would give, also when an edit joins or splits a ``\\r\\n``.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right

from tree_sitter import Parser, Tree

from context.source.languages import normalize_language_id, parser_for
from context.source.memo import TextMemo

Range = tuple[tuple[int, int], tuple[int, int]]

# A line starts right after each match. The lookahead keeps "\r\n" one break, and since it looks
# at one character only, a rescan of a few characters around an edit finds every changed break.
_LINE_BREAK = re.compile(r"\n|\r(?!\n)")
_ASTRAL = "\U00010000"


class PositionError(ValueError):
    """A position or offset outside the document; the message says which part and the limits."""


class Document:
    def __init__(
        self,
        uri: str,
        language_id: str,
        text: str,
        version: int = 0,
        *,
        max_parse_bytes: int = 4_000_000,
    ) -> None:
        self.uri = uri
        self.language_id = normalize_language_id(language_id, uri)
        self.version = version
        self.max_parse_bytes = max_parse_bytes
        self._parser: Parser | None = parser_for(self.language_id)
        self._text = ""
        self._tree: Tree | None = None
        # Only kept while there is a tree: the source the tree was parsed from.
        self._bytes: bytes | None = None
        self._starts: list[int] = [0]
        self._byte_starts: list[int] = [0]
        # Line breaks that are a lone "\r": tree-sitter counts rows by "\n" only, so while this is
        # zero an LSP line number is also a tree-sitter row.
        self._lone_cr = 0
        self._replace_all(text)

    @property
    def text(self) -> str:
        """The current full text (read-only: change it with apply_change)."""
        return self._text

    @property
    def tree(self) -> Tree | None:
        """The syntax tree of text; None without a grammar or above max_parse_bytes."""
        return self._tree

    @property
    def memo(self) -> TextMemo:
        """What prompt building derived from text (token counts, header, definitions); each edit
        gives the new text a memo that keeps what the edit did not touch."""
        return self._memo

    # ----- edits -------------------------------------------------------------------------------

    def apply_change(
        self, text: str, range: Range | None = None, version: int | None = None
    ) -> None:
        """One LSP TextDocumentContentChangeEvent. range = ((start_line, start_char), (end_line,
        end_char)) in UTF-16 code units; None = full replacement."""
        if range is None:
            self._replace_all(text)
        else:
            start, end = range
            if tuple(start) > tuple(end):
                start, end = end, start
            s = self._change_offset(*start)
            e = max(s, self._change_offset(*end))
            self._splice(s, e, text)
        if version is not None:
            self.version = version

    def _change_offset(self, line: int, character: int) -> int:
        # vscode-languageserver-textdocument's offsetAt: clamp everything, never raise.
        if line < 0:
            return 0
        return self.offset_at(line, max(character, 0), clamp=True)

    def _replace_all(self, text: str) -> None:
        self._text, data = _clean(text)
        self._memo = TextMemo(self._text)
        self._starts, self._byte_starts, self._lone_cr = _index(self._text)
        self._reparse(data, None)

    def _splice(self, s: int, e: int, new: str) -> None:
        old = self._text
        new, new_data = _clean(new)
        sb, eb = self.byte_offset(s), self.byte_offset(e)
        old_size = self._byte_starts[-1] + _utf8_len(old[self._starts[-1]:])
        new_size = old_size - (eb - sb) + len(new_data)
        incremental = self._tree is not None and new_size <= self.max_parse_bytes
        # Points must be taken on the old text, before the index moves.
        start_point = self._ts_point(s, sb) if incremental else (0, 0)
        old_end_point = self._ts_point(e, eb) if incremental else (0, 0)

        self._text = old[:s] + new + old[e:]
        self._memo = self._memo.after_edit(self._text, s, e, len(new))
        self._update_index(old, s, e, new, sb, eb, len(new_data))

        if not incremental or self._tree is None or self._bytes is None:
            fits = self._parser is not None and new_size <= self.max_parse_bytes
            self._reparse(self._text.encode("utf-8") if fits else None, None)
            return
        new_end, new_end_byte = s + len(new), sb + len(new_data)
        self._tree.edit(
            start_byte=sb,
            old_end_byte=eb,
            new_end_byte=new_end_byte,
            start_point=start_point,
            old_end_point=old_end_point,
            new_end_point=self._ts_point(new_end, new_end_byte),
        )
        self._reparse(self._bytes[:sb] + new_data + self._bytes[eb:], self._tree)

    def _reparse(self, data: bytes | None, old_tree: Tree | None) -> None:
        if data is None or self._parser is None or len(data) > self.max_parse_bytes:
            self._tree, self._bytes = None, None
            return
        self._bytes = data
        # py-tree-sitter rejects old_tree=None, so the two calls differ.
        if old_tree is None:
            self._tree = self._parser.parse(data)
        else:
            self._tree = self._parser.parse(data, old_tree)

    def _update_index(
        self, old: str, s: int, e: int, new: str, sb: int, eb: int, new_bytes: int
    ) -> None:
        # A line start p depends only on the characters at p-1 and p, so starts below s and
        # (old) starts above e are unchanged, only shifted; rescan [s, s+len(new)] in the new text.
        starts, byte_starts = self._starts, self._byte_starts
        i = bisect_left(starts, max(s, 1))
        j = bisect_left(starts, e + 1)
        self._lone_cr -= sum(1 for p in starts[i:j] if old[p - 1] == "\r")

        scanned: list[int] = []
        scanned_bytes: list[int] = []
        prev, prev_byte = s, sb
        window_end = min(s + len(new) + 1, len(self._text))
        for m in _LINE_BREAK.finditer(self._text, max(s - 1, 0), window_end):
            p = m.end()
            if p > s + len(new):
                break
            prev_byte += _utf8_len(self._text[prev:p])
            prev = p
            scanned.append(p)
            scanned_bytes.append(prev_byte)
            if m.group() == "\r":
                self._lone_cr += 1

        delta, byte_delta = len(new) - (e - s), new_bytes - (eb - sb)
        starts[i:] = scanned + [p + delta for p in starts[j:]]
        byte_starts[i:] = scanned_bytes + [b + byte_delta for b in byte_starts[j:]]

    # ----- positions ---------------------------------------------------------------------------

    @property
    def line_count(self) -> int:
        return len(self._starts)

    def line_text(self, line: int) -> str:
        """The text of a line without its terminator."""
        self._check_line(line)
        return self._text[self._starts[line]:self._line_end(line)]

    def offset_at(self, line: int, character: int, *, clamp: bool = False) -> int:
        """The str index of an LSP position. With clamp, a line past the end means the end of
        the document and a character past the line's end means the line's end; negatives always
        raise."""
        if character < 0:
            raise PositionError(f"character {character} is negative")
        if clamp and line >= self.line_count:
            return len(self._text)
        self._check_line(line)
        start, end = self._starts[line], self._line_end(line)
        offset, fits = _advance_utf16(self._text, start, end, character)
        if not fits and not clamp:
            length = _utf16_len(self._text[start:end])
            raise PositionError(
                f"character {character} is past the end of line {line} ({length} UTF-16 code units)"
            )
        return offset

    def position_at(self, offset: int) -> tuple[int, int]:
        """The LSP (line, UTF-16 character) of a str index. An index between "\\r" and "\\n" is
        reported as the end of its line, as vscode-languageserver-textdocument does."""
        self._check_offset(offset)
        line = bisect_right(self._starts, offset) - 1
        offset = min(offset, self._line_end(line))
        return line, _utf16_len(self._text[self._starts[line]:offset])

    def byte_offset(self, offset: int) -> int:
        """The UTF-8 byte offset of a str index (tree-sitter nodes and edits count bytes)."""
        self._check_offset(offset)
        line = bisect_right(self._starts, offset) - 1
        return self._byte_starts[line] + _utf8_len(self._text[self._starts[line]:offset])

    def offset_from_byte(self, byte_offset: int) -> int:
        """The str index of a UTF-8 byte offset (e.g. a node's start_byte); a byte inside a
        character maps to that character's start."""
        line = bisect_right(self._byte_starts, byte_offset) - 1
        if byte_offset < 0 or line < 0:
            raise PositionError(f"byte offset {byte_offset} is negative")
        start = self._starts[line]
        end = self._starts[line + 1] if line + 1 < self.line_count else len(self._text)
        data = self._text[start:end].encode("utf-8")
        rest = byte_offset - self._byte_starts[line]
        if rest > len(data):
            raise PositionError(f"byte offset {byte_offset} is past the end of the document")
        return start + len(data[:rest].decode("utf-8", errors="ignore"))

    def _ts_point(self, offset: int, byte: int) -> tuple[int, int]:
        """tree-sitter's (row, byte column) of an offset: rows advance on "\\n" only."""
        if self._lone_cr == 0:
            line = bisect_right(self._starts, offset) - 1
            return line, byte - self._byte_starts[line]
        # Old Mac line endings are rare: a linear scan is fine.
        row_start = self._text.rfind("\n", 0, offset) + 1
        return self._text.count("\n", 0, offset), byte - self.byte_offset(row_start)

    def _line_end(self, line: int) -> int:
        if line + 1 >= self.line_count:
            return len(self._text)
        nxt = self._starts[line + 1]
        return nxt - 2 if nxt >= 2 and self._text.startswith("\r\n", nxt - 2) else nxt - 1

    def _check_line(self, line: int) -> None:
        if line < 0:
            raise PositionError(f"line {line} is negative")
        if line >= self.line_count:
            raise PositionError(
                f"line {line} is past the end of the document ({self.line_count} lines)"
            )

    def _check_offset(self, offset: int) -> None:
        if not 0 <= offset <= len(self._text):
            raise PositionError(f"offset {offset} is outside the document (0..{len(self._text)})")

    def __repr__(self) -> str:
        return (
            f"Document({self.uri!r}, {self.language_id!r}, version={self.version}, "
            f"lines={self.line_count}, parsed={self.tree is not None})"
        )


def utf16_position(doc: Document, line: int, character: int, encoding: str | None) -> tuple[int, int]:
    """An LSP position counted in ``encoding`` ("utf-8", "utf-16", "utf-32", as negotiated in
    ``initialize``; None is UTF-16) as the UTF-16 position documents count in. Lines outside the
    document are left for the caller's own range rules."""
    if encoding in (None, "utf-16") or line < 0 or line >= doc.line_count:
        return line, character
    text = doc.line_text(line)
    if encoding == "utf-8":
        prefix = text.encode("utf-8", "surrogatepass")[: max(character, 0)].decode("utf-8", "ignore")
        extra = 0
    else:  # utf-32: code points
        prefix = text[: max(character, 0)]
        extra = max(0, character - len(prefix))
    return line, len(prefix.encode("utf-16-le", "surrogatepass")) // 2 + extra


def _clean(text: str) -> tuple[str, bytes]:
    """The text made valid Unicode without changing its UTF-16 length, and its UTF-8 encoding."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError:
        # Joins pairs held as two code points and turns each lone surrogate into one U+FFFD.
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        return text, text.encode("utf-8")


def _index(text: str) -> tuple[list[int], list[int], int]:
    """Line starts (str and byte offsets) and the number of lone-"\\r" breaks of a whole text."""
    starts, lone_cr = [0], 0
    for m in _LINE_BREAK.finditer(text):
        starts.append(m.end())
        lone_cr += m.group() == "\r"
    if text.isascii():
        return starts, list(starts), lone_cr
    byte_starts, byte, prev = [0], 0, 0
    for p in starts[1:]:
        byte += _utf8_len(text[prev:p])
        byte_starts.append(byte)
        prev = p
    return starts, byte_starts, lone_cr


def _utf8_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8"))


def _utf16_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-16-le")) // 2


def _advance_utf16(text: str, start: int, end: int, units: int) -> tuple[int, bool]:
    """The str index `units` UTF-16 code units after start, at most end, and whether the line
    was long enough. A count ending inside a surrogate pair moves to after the pair."""
    segment = text[start:end]
    if _utf16_len(segment) == len(segment):
        return (start + units, True) if units <= len(segment) else (end, False)
    count = 0
    for k, ch in enumerate(segment):
        if count >= units:
            return start + k, True
        count += 2 if ch >= _ASTRAL else 1
    return end, count >= units
