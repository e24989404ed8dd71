"""What prompt building derived from one document text, kept with that text.

Each entry is keyed by the range of the text it was read from (and what was read: a token count,
a file header, definitions), so an edit elsewhere leaves it valid. :class:`context.source.document.Document`
gives every new text a new memo holding the entries its edit did not touch (those after the edit
moved with it, unless pinned): a keystroke at the cursor keeps the counts of the lines above it, which is what
lets the tokenizer count a line per keystroke instead of the whole window.

A memo belongs to one ``str`` object (:meth:`TextMemo.describes`): a caller that passes other text
gets nothing from it, so a stale memo can cost work but never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

# Entries of one kind kept per text before that kind starts afresh (a keystroke adds at most a few).
MAX_ENTRIES = 256

Key = tuple[int, int, Hashable]


class TextMemo:
    """Values derived from ranges of one text, by kind (``"window"``, ``"header"`` ...). Token
    counts are remembered for one counter at a time (the engine's tokenizer); asking with another
    one forgets them."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._counter: object | None = None
        self._counts: dict[str, dict[Key, int]] = {}
        self._derived: dict[str, dict[Key, object]] = {}
        # Kinds whose entries stay only while their range does not move (see remember_count).
        self._pinned: set[str] = set()

    def describes(self, text: str) -> bool:
        """Is ``text`` the very text this memo was made for?"""
        return text is self.text

    def count(self, counter: object, kind: str, start: int, end: int) -> int | None:
        """The tokens ``counter`` counted in ``text[start:end]`` for ``kind``, if remembered."""
        if counter is not self._counter:
            return None
        return self._counts.get(kind, {}).get((start, end, None))

    def remember_count(self, counter: object, kind: str, start: int, end: int, tokens: int, *, pinned: bool = False) -> None:
        """``pinned``: an edit before ``start`` drops the entry instead of moving it (for counts
        that are sums a fresh count of the moved text could come out below)."""
        if counter is not self._counter:
            self._counter, self._counts = counter, {}
        if pinned:
            self._pinned.add(kind)
        _put(self._counts.setdefault(kind, {}), (start, end, None), tokens)

    def derived(self, kind: str, start: int, end: int, what: Hashable = None) -> object | None:
        """A value of ``kind`` read from ``text[start:end]`` (``what``: with which settings)."""
        return self._derived.get(kind, {}).get((start, end, what))

    def remember(self, kind: str, start: int, end: int, what: Hashable, value: object) -> None:
        _put(self._derived.setdefault(kind, {}), (start, end, what), value)

    def after_edit(self, text: str, start: int, end: int, inserted: int) -> TextMemo:
        """The memo for ``text``, made from this one's text by replacing ``[start, end)`` with
        ``inserted`` characters: entries read before the edit stay, those after it move with it
        (pinned ones go)."""
        memo = TextMemo(text)
        memo._counter, memo._pinned = self._counter, set(self._pinned)
        edit = (start, end, inserted - (end - start))
        memo._counts = {kind: _surviving(entries, edit, kind not in self._pinned) for kind, entries in self._counts.items()}
        memo._derived = {kind: _surviving(entries, edit, True) for kind, entries in self._derived.items()}
        return memo


V = TypeVar("V")


def _surviving(entries: dict[Key, V], edit: tuple[int, int, int], moves: bool) -> dict[Key, V]:
    start, end, delta = edit
    kept: dict[Key, V] = {}
    for (a, b, what), value in entries.items():
        if b <= start:
            kept[(a, b, what)] = value
        elif moves and a >= end:
            kept[(a + delta, b + delta, what)] = value
    return kept


def _put(entries: dict[Key, V], key: Key, value: V) -> None:
    if len(entries) > MAX_ENTRIES:
        entries.clear()
    entries[key] = value
