"""Cross-file context from the workspace for one cursor: the definitions of the imported names the
code uses, then the code windows of nearby files most like the lines above the cursor.

The order of the steps is the ranking (CrossCodeEval's and Tabby's recipe, with the imports first):

1. the names the current file imports from workspace files (:func:`context.source.imports.resolve_imports`)
   and, for each, its definition there: whole when small, else its signature (a class: its
   header and its public members' signatures). Names used near the cursor come first, then names
   imported but not used yet (the likeliest next ones), then the rest;
2. windows of lines from the imported files, the current file's folder and the open documents,
   ranked by the Jaccard similarity of their identifiers with the lines above the cursor.

Open documents are files like any other here (their live text wins over the disk), so a tab
that nothing relates to the cursor does not get in. Everything is read through a
:class:`WorkspaceView`, so nothing outside the workspace roots is opened. The result depends only
on the imports, the identifiers of a quantized region around the cursor (:func:`retrieval_key`)
and the files, so it stays the same while the user types a line and the prompt's front stays in
the engine's cache.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from context.prompt.snippets import CrossFile, Snippet
from context.source.definitions import Definition, definitions
from context.source.imports import ResolvedImport, resolve_imports
from context.source.languages import language_info, normalize_language_id
from context.source.workspace import FileSummary, WorkspaceIndex

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FULL_LIMIT = 1200  # a definition is shown whole up to this many characters, else its signature
NEAR_LINES = 40  # lines above and below the cursor whose names count as "used near the cursor"
REGION_STEP = 20  # the near region moves in steps of this many lines
QUERY_LINES = 12  # lines above the cursor that similar windows are matched against
QUERY_STEP = 4  # the query moves in steps of this many lines
WINDOW_LINES = 12
WINDOW_STRIDE = 6
MAX_WINDOW_FILES = 40
MAX_WINDOW_SOURCE_CHARS = 100_000
MIN_SIMILARITY = 0.15
# Words that say nothing about which code is related (keywords and the commonest names).
_COMMON = frozenset(
    {
        "self", "cls", "None", "True", "False", "return", "if", "else", "elif", "for", "while", "in", "not", "and",
        "or", "is", "def", "class", "import", "from", "as", "with", "try", "except", "finally", "raise", "pass",
        "break", "continue", "lambda", "yield", "async", "await", "assert", "del", "global", "nonlocal", "this",
        "const", "let", "var", "function", "new", "null", "undefined", "true", "false", "typeof", "instanceof",
        "void", "export", "default", "extends", "super", "static", "public", "private", "protected", "int", "str",
        "bool", "float", "list", "dict", "set", "tuple", "len", "range", "print",
    }
)


@dataclass(frozen=True)
class OpenFile:
    """An open document as retrieval sees it: its live text (a snapshot: retrieval runs in a worker
    thread, so the document's own memo is not used)."""

    text: str
    language_id: str


class WorkspaceView:
    """The workspace index with the session's open documents over it (their text wins over the
    disk); what :func:`resolve_imports` and :func:`retrieve` read."""

    def __init__(self, index: WorkspaceIndex, open_files: Mapping[str, OpenFile]) -> None:
        self.index = index
        self.open_files = {path: f for path, f in open_files.items() if index.contains(path)}

    def roots(self) -> tuple[str, ...]:
        return self.index.roots()

    def is_file(self, path: str) -> bool:
        return os.path.abspath(path) in self.open_files or self.index.is_file(path)

    def text(self, path: str) -> str | None:
        found = self.open_files.get(os.path.abspath(path))
        return found.text if found is not None else self.index.text(path)

    def summary(self, path: str) -> FileSummary | None:
        found = self.open_files.get(os.path.abspath(path))
        if found is None:
            return self.index.summary(path)
        language_id = normalize_language_id(found.language_id, path)
        found_definitions = definitions(found.text, language_id, path, private=True)
        return FileSummary(path, language_id, -1, len(found.text), found_definitions)

    def files_in(self, directory: str) -> tuple[str, ...]:
        directory = os.path.abspath(directory)
        extra = {p for p in self.open_files if os.path.dirname(p) == directory}
        return tuple(sorted(set(self.index.files_in(directory)) | extra))

    def root_of(self, path: str) -> str | None:
        return next((r for r in self.roots() if path == r or path.startswith(r.rstrip(os.sep) + os.sep)), None)


@dataclass(frozen=True)
class Cursor:
    """The file and cursor that context is retrieved for (``path`` absolute)."""

    path: str
    text: str
    offset: int
    language_id: str


def identifiers(text: str) -> set[str]:
    return {word for word in _IDENTIFIER.findall(text) if word not in _COMMON and len(word) > 1}


def _lines_between(text: str, offset: int, line: int, first: int, last: int) -> list[str]:
    """Lines ``first`` to ``last`` (exclusive, clamped) of ``text``, whose cursor at ``offset`` is
    on ``line``; read around the cursor only (a keystroke in a large file must not split all of it)."""
    start = text.rfind("\n", 0, offset) + 1
    for _ in range(max(0, line - max(0, first))):
        start = text.rfind("\n", 0, start - 1) + 1
    end = start
    for _ in range(max(0, last - max(0, first))):
        found = text.find("\n", end)
        if found < 0:
            end = len(text)
            break
        end = found + 1
    return text[start:end].split("\n")[: max(0, last - max(0, first))]


def near_region(text: str, offset: int) -> str:
    """The lines whose names count as used near the cursor: a region that moves in steps of
    :data:`REGION_STEP` lines, without the cursor's own line (being typed) and without import lines
    (near the top of a file they would make every imported name "used near the cursor")."""
    line = text.count("\n", 0, offset)
    base = line // REGION_STEP * REGION_STEP
    first = max(0, base - NEAR_LINES)
    lines = _lines_between(text, offset, line, first, base + REGION_STEP + NEAR_LINES)
    return _body_text("\n".join(lines[: line - first] + lines[line - first + 1 :]))


def query_lines(text: str, offset: int) -> str:
    """The lines above the cursor that similar windows are matched against (moving in steps of
    :data:`QUERY_STEP` lines, without the cursor's line)."""
    line = text.count("\n", 0, offset)
    end = line // QUERY_STEP * QUERY_STEP
    first = max(0, end - QUERY_LINES)
    lines = _lines_between(text, offset, line, first, line)
    return "\n".join(lines)


def retrieval_key(text: str, offset: int) -> tuple[frozenset[str], frozenset[str]]:
    """What, besides the imports and the files, the retrieved context depends on."""
    return frozenset(identifiers(near_region(text, offset))), frozenset(identifiers(query_lines(text, offset)))


# ------------------------------------------------------------------------------------------------
# ranking


@dataclass(frozen=True)
class _Piece:
    """One candidate for the context: text from ``path`` at ``order`` (its place in that file)."""

    path: str
    order: int
    text: str
    short: str  # what to show when ``text`` does not fit ("" : nothing)
    reason: str = ""  # what it is and why it ranks where it does, for ember/stats


def _definition_piece(path: str, order: int, found: Definition, reason: str) -> _Piece:
    if len(found.full) <= _FULL_LIMIT:
        return _Piece(path, order, found.full, found.signature if found.signature != found.full else "", reason)
    return _Piece(path, order, found.signature, "", reason)


_TIER_REASONS = ("used near the cursor", "imported, not used yet", "imported, used elsewhere in the file")


def _body_text(text: str) -> str:
    """The file without its import lines (names there are not uses)."""
    return "\n".join(line for line in text.split("\n") if not line.lstrip().startswith(("import ", "from ")))


def _imported_pieces(view: WorkspaceView, cursor: Cursor, imports: Sequence[ResolvedImport]) -> list[_Piece]:
    """The imported names' definitions, best first (used near the cursor, not used yet, the rest)."""
    near = identifiers(near_region(cursor.text, cursor.offset))
    # Not the cursor's line: what the user is typing must not reorder the context under them.
    line_start = cursor.text.rfind("\n", 0, cursor.offset) + 1
    line_end = cursor.text.find("\n", cursor.offset)
    rest = cursor.text[:line_start] + ("" if line_end < 0 else cursor.text[line_end:])
    used = identifiers(_body_text(rest))
    ranked: list[tuple[int, int, _Piece]] = []
    seen: set[tuple[str, str]] = set()
    for position, resolved in enumerate(imports):
        for name, files in resolved.names.items():
            for file in files[:1]:
                tier = 0 if name in near else 1 if name not in used else 2
                piece = _piece_for(view, file, name, near, f"{name}: {_TIER_REASONS[tier]}")
                if piece is None or (file, name) in seen:
                    continue
                seen.add((file, name))
                ranked.append((tier, position, piece))
        if not resolved.names:  # `import pkg.mod`: the definitions the file uses as mod.X
            for file in resolved.files[:1]:
                for name, piece in _module_pieces(view, file, near | used, resolved.module):
                    ranked.append((0 if name in near else 2, position, piece))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return [piece for _, _, piece in ranked]


def _piece_for(view: WorkspaceView, file: str, name: str, near: set[str], reason: str) -> _Piece | None:
    summary = view.summary(file)
    if summary is None:
        return None
    for order, found in enumerate(summary.definitions):
        if found.name == name:
            return _definition_piece(file, order, found, reason)
    # The name is a submodule (`from pkg import mod`): the definitions used near the cursor.
    if os.path.splitext(os.path.basename(file))[0] in (name, "__init__"):
        pieces = [piece for _, piece in _module_pieces(view, file, near, name)]
        return pieces[0] if len(pieces) == 1 else _merge(file, pieces) if pieces else None
    return None


def _merge(file: str, pieces: Sequence[_Piece]) -> _Piece:
    text = "\n".join(p.short or p.text for p in pieces)
    return _Piece(file, pieces[0].order, text, "", "; ".join(p.reason for p in pieces))


def _module_pieces(view: WorkspaceView, file: str, wanted: set[str], module: str) -> list[tuple[str, _Piece]]:
    """(name, piece) for the definitions of ``file`` whose names are in ``wanted``."""
    summary = view.summary(file)
    if summary is None:
        return []
    return [
        (d.name, _definition_piece(file, order, d, f"{module}.{d.name}: used from the imported module"))
        for order, d in enumerate(summary.definitions)
        if d.name in wanted
    ]


def _window_files(view: WorkspaceView, cursor: Cursor, imports: Sequence[ResolvedImport]) -> list[str]:
    """Where similar code is looked for: the imported files, the current folder, the open documents."""
    family = language_info(normalize_language_id(cursor.language_id, cursor.path)).family
    found: dict[str, None] = {}
    for resolved in imports:
        for file in resolved.files:
            found[file] = None
        for files in resolved.names.values():
            for file in files:
                found[file] = None
    for file in (*view.files_in(os.path.dirname(cursor.path)), *sorted(view.open_files)):
        found[file] = None
    found.pop(cursor.path, None)
    same = [f for f in found if language_info(normalize_language_id("", f)).family == family]
    return same[:MAX_WINDOW_FILES]


def _similar_windows(view: WorkspaceView, cursor: Cursor, files: Sequence[str]) -> list[_Piece]:
    """Line windows of ``files`` by identifier similarity to the lines above the cursor, best first,
    at most one window per place (overlapping windows: the better one)."""
    query = identifiers(query_lines(cursor.text, cursor.offset))
    if not query:
        return []
    scored: list[tuple[float, str, int, str]] = []
    for file in files:
        text = view.text(file)
        if not text:
            continue
        lines = text[:MAX_WINDOW_SOURCE_CHARS].split("\n")
        best: tuple[float, int] | None = None
        for start in range(0, max(1, len(lines) - WINDOW_LINES // 2), WINDOW_STRIDE):
            words = identifiers("\n".join(lines[start : start + WINDOW_LINES]))
            if not words:
                continue
            similarity = len(query & words) / len(query | words)
            if similarity >= MIN_SIMILARITY and (best is None or similarity > best[0]):
                best = (similarity, start)
        if best is not None:
            window = "\n".join(lines[best[1] : best[1] + WINDOW_LINES]).strip("\n")
            scored.append((best[0], file, best[1], window))
    scored.sort(key=lambda item: (-item[0], item[1]))
    return [
        _Piece(file, 10_000 + start, window, "", f"lines {start + 1}-{start + WINDOW_LINES}: similar code ({similarity:.2f})")
        for similarity, file, start, window in scored
    ]


# ------------------------------------------------------------------------------------------------
# packing


def retrieve(view: WorkspaceView, cursor: Cursor, budget_chars: int) -> tuple[Snippet, ...]:
    """The cross-file context for ``cursor``: whole pieces packed best first until ``budget_chars``
    (path lines included) is spent, rendered per file in path order (a file's pieces in file
    order), with paths relative to the file's root."""
    imports = resolve_imports(view, cursor.path, cursor.text, cursor.language_id)
    definitions_ranked = _imported_pieces(view, cursor, imports)
    windows = _similar_windows(view, cursor, _window_files(view, cursor, imports))
    chosen: list[_Piece] = []
    left = budget_chars
    shown = {(p.path, p.text) for p in definitions_ranked}
    for piece in (*definitions_ranked, *[w for w in windows if not _covered(w, shown)]):
        cost = len(piece.text) + 1 + (0 if any(c.path == piece.path for c in chosen) else len(_relative(view, piece.path)) + 16)
        if cost <= left:
            chosen.append(piece)
            left -= cost
        elif piece.short and cost - len(piece.text) + len(piece.short) <= left:
            chosen.append(_Piece(piece.path, piece.order, piece.short, "", piece.reason + " (signature only)"))
            left -= cost - len(piece.text) + len(piece.short)
    return _render(view, chosen)


def workspace_context(view: WorkspaceView, cursor: Cursor, budget_chars: int) -> CrossFile:
    """:func:`retrieve`'s snippets with the folder's name and the current file's path in it, for a
    model's repository-level format."""
    snippets = retrieve(view, cursor, budget_chars)
    root = view.root_of(cursor.path)
    if root is None:
        return CrossFile(snippets)
    return CrossFile(snippets, os.path.basename(root), os.path.relpath(cursor.path, root).replace(os.sep, "/"))


def _covered(window: _Piece, shown: set[tuple[str, str]]) -> bool:
    """Whether a window is mostly a definition already in the context."""
    return any(path == window.path and window.text.strip() and window.text.strip() in text for path, text in shown)


def _relative(view: WorkspaceView, path: str) -> str:
    root = view.root_of(path)
    return os.path.relpath(path, root) if root else os.path.basename(path)


def _render(view: WorkspaceView, chosen: Sequence[_Piece]) -> tuple[Snippet, ...]:
    """Per file, sorted by path (so the block changes only when the set chosen does)."""
    snippets = []
    for path in sorted({piece.path for piece in chosen}):
        pieces = sorted((p for p in chosen if p.path == path), key=lambda p: p.order)
        text = "\n\n".join(p.text.rstrip() for p in pieces)
        snippets.append(Snippet(_relative(view, path).replace(os.sep, "/"), text, tuple(p.reason for p in pieces)))
    return tuple(snippets)
