"""The completion item that ``textDocument/completion`` answers with (Helix and older clients)."""

from __future__ import annotations

import re

from lsprotocol import types

from lsp.session import EmberServer

_WORD_TAIL = re.compile(r"[A-Za-z0-9_$]+$")


def word_before(ls: EmberServer, uri: str, position: types.Position) -> str:
    """The identifier the user is typing at the cursor (ASCII, so its length is the same in every
    position encoding)."""
    state = ls.open.get(uri)
    doc = state.document if state is not None else None
    if doc is None or not 0 <= position.line < doc.line_count:
        return ""
    line, character = ls.to_utf16(doc, position.line, position.character)
    start = doc.offset_at(line, 0)
    match = _WORD_TAIL.search(doc.text[start : doc.offset_at(line, character, clamp=True)])
    return match.group(0) if match else ""


def completion_item(
    text: str, position: types.Position, word: str = "", confidence: float | None = None
) -> types.CompletionItem:
    """Replaces the word being typed with itself plus the generated text: clients filter items by
    the word at the cursor, and would drop an item that does not start with it. ``data`` carries
    the suggestion's confidence (context.cut.confidence) for editors that rank or style by it."""
    first_line = text.split("\n", 1)[0].strip() or text.strip()
    start = types.Position(line=position.line, character=position.character - len(word))
    return types.CompletionItem(
        label=(word + first_line)[:80],
        kind=types.CompletionItemKind.Text,
        detail="ember",
        insert_text=word + text,
        insert_text_format=types.InsertTextFormat.PlainText,
        text_edit=types.TextEdit(range=types.Range(start=start, end=position), new_text=word + text),
        sort_text="0",
        filter_text=word + (first_line or text),
        data={"confidence": confidence},
    )
