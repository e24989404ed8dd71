"""Where a completion is asked for: the cursor and what surrounds it, gathered once per request.

A :class:`CompletionSite` is built by :func:`site_at` before the first token and read by every
later step: the prompt builder (the whole text, the tree, the snippets), the completion cache
(the suffix) and the cutter (the windows, the mode). Nothing after it goes back to the document.
"""

from __future__ import annotations

from dataclasses import dataclass

from tree_sitter import Tree

from context.cut.postprocess import completion_mode
from context.cut.surroundings import Mode
from context.prompt.snippets import NO_CROSS_FILE, CrossFile
from context.source.document import Document
from context.source.memo import TextMemo

# Post-processing decides from the lines near the cursor, never from the whole file: this many
# characters on each side are all it reads (the prompt builder picks its own, token-sized window).
AROUND_CHARS = 8000


@dataclass(frozen=True)
class CompletionSite:
    """One cursor in one document version."""

    uri: str
    language_id: str  # normalized (context.source.languages.normalize_language_id)
    text: str  # the whole document at the request's version
    offset: int  # the cursor, in characters of ``text``
    tree: Tree | None  # the document's tree-sitter tree at that version, None without a grammar
    cursor_byte: int | None  # the cursor's UTF-8 offset in ``text`` (set with ``tree``)
    prefix: str  # up to AROUND_CHARS before the cursor: what post-processing reads
    suffix: str  # up to AROUND_CHARS after the cursor
    mode: Mode  # one line or a block (context.cut.postprocess.completion_mode)
    cross_file: CrossFile = NO_CROSS_FILE  # context from other files, in prompt order
    memo: TextMemo | None = None  # what is derived from ``text`` and kept across keystrokes (Document.memo)


def site_at(doc: Document, offset: int, cross_file: CrossFile = NO_CROSS_FILE) -> CompletionSite:
    """The site of a completion at ``offset`` in ``doc`` as it is now."""
    text = doc.text
    tree = doc.tree
    cursor_byte = doc.byte_offset(offset) if tree is not None else None
    prefix = text[max(0, offset - AROUND_CHARS) : offset]
    suffix = text[offset : offset + AROUND_CHARS]
    mode = completion_mode(prefix, suffix, doc.language_id, tree=tree, cursor_byte=cursor_byte)
    return CompletionSite(doc.uri, doc.language_id, text, offset, tree, cursor_byte, prefix, suffix, mode, cross_file, doc.memo)
