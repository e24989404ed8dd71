"""Context from other open files: their top-level definitions, the files the current one imports
first, packed into a budget in a stable order (so the front of the prompt stays in the engine's
prefix cache while the user types); and the cross-file block's rendering.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from context.source.definitions import (
    FULL_LIMIT,
    Definition,
    clean_path,
    definitions,
    import_key,
    js_imports,
    module_keys,
    python_imports,
)
from context.source.languages import language_info, normalize_language_id
from context.source.memo import TextMemo


@dataclass(frozen=True)
class Snippet:
    """Context from another file, placed first in the prompt in a stable order; ``reasons`` says
    what is in it and why it was chosen (``ember/stats``), one line per piece."""

    path: str
    text: str
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class CrossFile:
    """The cross-file block of a prompt: the snippets in prompt order and, for context from a
    workspace folder, the folder's name and the current file's path in it (then a model with a
    repository-level format gets it: Qwen2.5-Coder's ``<|repo_name|>`` / ``<|file_sep|>``)."""

    snippets: tuple[Snippet, ...] = ()
    repo_name: str = ""
    path: str = ""


NO_CROSS_FILE = CrossFile()


def _family(language_id: str) -> str:
    return language_info(language_id).family


def render_repository(
    cross_file: CrossFile, repo_token: str, file_token: str, max_chars: int, clean: Callable[[str], str]
) -> str:
    """The snippets in a repository-level format: the folder's name, each file after a file token
    and the current file's path last, where the prompt's prefix follows; files are left out from
    the end when ``max_chars`` is spent. ``clean`` makes document text safe for the prompt."""
    tail = f"{file_token}{clean(cross_file.path)}\n"
    parts = [f"{repo_token}{clean(cross_file.repo_name)}\n"]
    used = len(parts[0]) + len(tail)
    for snippet in cross_file.snippets:
        block = f"{file_token}{clean(snippet.path)}\n{clean(snippet.text.rstrip())}\n"
        if used + len(block) > max_chars:
            break
        parts.append(block)
        used += len(block)
    return "".join(parts) + tail if len(parts) > 1 else ""


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


def select_snippets(
    current_text: str,
    language_id: str,
    others: Sequence[tuple[str, str]],
    budget_chars: int,
    memos: Mapping[str, TextMemo] | None = None,
) -> tuple[Snippet, ...]:
    """Context from other open files (``(path, text)`` pairs), for the front of the prompt.

    Files the current one imports come first (Python ``import``/``from``, JS/TS relative imports),
    showing the imported definitions whole when small; then the other files of the same language
    as signatures of their top-level definitions. Each group is sorted by path, and the selection
    depends only on the imports and the other files, so it stays the same while the user types
    (and stays in the engine's cache). Snippets are packed until ``budget_chars`` (path lines
    included) is spent; a definition that does not fit is left out whole. ``memos``: path ->
    the memo of that document (used for a text that is the document's own, not a slice of it).
    """
    language_id = normalize_language_id(language_id)
    family = _family(language_id)
    same = sorted(
        (path, text)
        for path, text in others
        if _family(normalize_language_id("", clean_path(path))) == family and text.strip()
    )
    if not same:
        return ()
    imported, rest = _split_imported(same, _wanted_by_key(current_text, family), family)
    memos = memos or {}

    def defs(path: str, text: str) -> tuple[Definition, ...]:
        return definitions(text, normalize_language_id("", clean_path(path)), path, memos.get(path))

    result: list[Snippet] = []
    left = budget_chars
    for path, text, names in imported:
        found = defs(path, text)
        chosen = [d.full if len(d.full) <= FULL_LIMIT else d.signature for d in found if names and d.name in names]
        if not chosen:  # `import x`, or names that x does not define (submodules, re-exports)
            chosen = [d.signature for d in found]
        left = _pack(result, path, chosen, left)
    for path, text in rest:
        left = _pack(result, path, [d.signature for d in defs(path, text)], left)
    return tuple(result)


def _wanted_by_key(current_text: str, family: str) -> dict[str, set[str] | None]:
    """What the current file imports, by :func:`module_keys` key: the names it takes (``None``:
    the whole module)."""
    if family == "python":
        imports = python_imports(current_text)
    elif family == "javascript":
        imports = js_imports(current_text)
    else:
        imports = {}
    wanted_by_key: dict[str, set[str] | None] = {}
    for module, names in imports.items():
        key = import_key(module, family)
        if key:
            current = wanted_by_key.get(key, set())
            wanted_by_key[key] = None if current is None or not names else current | set(names)
    return wanted_by_key


def _split_imported(
    same: Sequence[tuple[str, str]], wanted_by_key: dict[str, set[str] | None], family: str
) -> tuple[list[tuple[str, str, set[str] | None]], list[tuple[str, str]]]:
    """The files the current one imports, with the names it takes from each, and the rest."""
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
    return imported, rest


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
    result.append(Snippet(clean_path(path), "\n".join(kept)))
    return left
