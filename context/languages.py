"""Which tree-sitter grammar parses a document.

Grammars come from the per-language PyPI wheels (``tree-sitter-python`` ...), never from a
run-time download, so that ember works offline. A language without a grammar gets ``None`` and
the caller falls back to line-based context.
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache

from tree_sitter import Language, Parser

# languageId (LSP) -> (module, function in that module returning the grammar pointer)
_GRAMMARS: dict[str, tuple[str, str]] = {
    "python": ("tree_sitter_python", "language"),
    "javascript": ("tree_sitter_javascript", "language"),
    "javascriptreact": ("tree_sitter_javascript", "language"),
    "typescript": ("tree_sitter_typescript", "language_typescript"),
    "typescriptreact": ("tree_sitter_typescript", "language_tsx"),
    "rust": ("tree_sitter_rust", "language"),
    "go": ("tree_sitter_go", "language"),
    "java": ("tree_sitter_java", "language"),
    "c": ("tree_sitter_c", "language"),
    "cpp": ("tree_sitter_cpp", "language"),
}

_EXTENSIONS: dict[str, str] = {
    ".py": "python",
    ".pyi": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".cjs": "javascript",
    ".jsx": "javascriptreact",
    ".ts": "typescript",
    ".mts": "typescript",
    ".cts": "typescript",
    ".tsx": "typescriptreact",
    ".rs": "rust",
    ".go": "go",
    ".java": "java",
    ".c": "c",
    ".h": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".cxx": "cpp",
    ".hpp": "cpp",
    ".hh": "cpp",
    ".cs": "csharp",
    ".rb": "ruby",
    ".lua": "lua",
    ".sh": "shellscript",
}

# Editors disagree on a few ids; map theirs to the LSP ones.
_ALIASES: dict[str, str] = {
    "py": "python",
    "js": "javascript",
    "ts": "typescript",
    "tsx": "typescriptreact",
    "jsx": "javascriptreact",
    "c++": "cpp",
    "golang": "go",
}


def normalize_language_id(language_id: str | None, uri: str = "") -> str:
    """The LSP languageId for a document, guessed from the URI's extension when the id is empty."""
    lang = (language_id or "").strip().lower()
    lang = _ALIASES.get(lang, lang)
    if lang and lang != "plaintext":
        return lang
    ext = os.path.splitext(uri)[1].lower()
    return _EXTENSIONS.get(ext, lang or "plaintext")


@lru_cache(maxsize=None)
def grammar_for(language_id: str) -> Language | None:
    """The tree-sitter grammar for a normalized languageId, or None when no wheel provides one."""
    entry = _GRAMMARS.get(language_id)
    if entry is None:
        return None
    module_name, function = entry
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return Language(getattr(module, function)())


def parser_for(language_id: str) -> Parser | None:
    """A fresh parser for the language (parsers hold state, so each document gets its own)."""
    grammar = grammar_for(language_id)
    return Parser(grammar) if grammar is not None else None


def supported_languages() -> list[str]:
    return sorted(_GRAMMARS)
