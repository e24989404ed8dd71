"""What ember knows about each language: its grammar, and the lexical facts that prompt building
and post-processing read (comments, strings, continuation lines, block openers, indentation).

Grammars come from the per-language PyPI wheels (``tree-sitter-python`` ...), never from a
run-time download, so that ember works offline. A language without a grammar gets ``None`` and
the caller falls back to line-based context; one without an entry in the table below gets the
C-like defaults (:func:`language_info`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from dataclasses import dataclass
from functools import cache, lru_cache

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


@cache
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


# ------------------------------------------------------------------------------------------------
# lexical facts

# Columns a tab advances to (the next multiple of): post-processing compares indentation in these.
TAB_WIDTH = 4

# Statements that make up a file's header, at column 0, in any of the supported languages.
HEADER_STATEMENT = re.compile(
    r"(?:import\b(?!\()|from\s+[\w.]+\s+import\b|#\s*include\b|package\s+[\w.]+\s*;?\s*$|"
    r"(?:pub(?:\([^)]*\))?\s+)?use\s+[\w:{*]|extern\s+crate\b|(?:pub\s+)?mod\s+\w+\s*;|using\s+[\w.]+|"
    r"(?:const|let|var)\s+[^=]+=\s*require\(|export\s+(?:\*|\{[^}]*\})\s+from\b)"
)

# A cut just before one of these lines splits the construct above it (prompt building's reading,
# kept apart from STATEMENT_CONTINUATION: it also knows Ruby/Lua's ``end``).
CUT_CONTINUATION = re.compile(r"[)\]}]|(?:else|elif|except|finally|catch|end)\b")
# A line that continues a statement whose block has just been closed (post-processing's reading:
# it also knows do-while's ``} while (x);``, not ``end``).
STATEMENT_CONTINUATION = re.compile(r"^(?:[)\]}]|else\b|elif\b|except\b|finally\b|catch\b|while\b.*[;)]\s*$)")
# A branch that continues a compound statement (``else:``, ``} else {``, ``except E:``, ``} catch (e) {``).
BRANCH = re.compile(r"^(?:\}\s*)?(else|elif|except|finally|catch)\b")
# For each branch keyword, the headers whose statement it may continue (after an optional `} `).
BRANCH_HEADERS: dict[str, re.Pattern[str]] = {
    "else": re.compile(r"^(?:\}\s*)?(?:if|elif|else\s+if|for|while|try|except)\b"),
    "elif": re.compile(r"^(?:if|elif)\b"),
    "except": re.compile(r"^(?:try|except)\b"),
    "finally": re.compile(r"^(?:\}\s*)?(?:try|except|catch)\b"),
    "catch": re.compile(r"^(?:\}\s*)?(?:try|catch)\b"),
}
# Multi-line string and comment delimiters, and what to skip while looking for them (one-line
# strings are matched whole so that their quotes do not count).
_HASH_TOKENS = re.compile(r'"""|\'\'\'|#|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
_SLASH_TOKENS = re.compile(r'/\*|\*/|//|`|"(?:\\.|[^"\\\n])*"')


@dataclass(frozen=True, eq=False)
class LanguageInfo:
    """The lexical facts of one language family, as ember's line-based heuristics read them.

    Rough on purpose: they serve a lexer that runs per keystroke over a few lines, not a parser
    (the tree-sitter grammar is the parser). Where two readers need a fact differently, both
    are here under their own names (``cut_continuation`` / ``statement_continuation``).
    """

    # Languages that share it: an import in one can name a file of another (TypeScript imports
    # JavaScript), and other files' snippets come from the same family.
    family: str
    # Starts a comment to the end of the line; also the marker of snippet path headers.
    line_comment: str = "//"
    # The line comment that post-processing's rough bracket scan skips (context.cut.brackets). Not
    # ``line_comment``: it reproduces the scan's values exactly, ``#`` for Python and ``//`` for
    # every other language, Ruby and shell scripts included (whose multi-line lexer is the C-like
    # one too); moving them to ``#`` would change which of their brackets count.
    scan_line_comment: str = "//"
    block_comment: tuple[str, str] | None = ("/*", "*/")
    # Characters the rough bracket scan takes for one-line string quotes: a backtick everywhere
    # (a stray one is rare, a template string common); in Rust ``'a`` is a lifetime as often as a
    # char, so ``'`` is left out there.
    quotes: str = "\"'`"
    # Delimiters of the strings and comments that may span lines, and the lexer that finds them.
    multiline_openers: tuple[str, ...] = ("/*",)
    multiline_tokens: re.Pattern[str] = _SLASH_TOKENS
    # Line endings that open a block (its body follows on the next lines).
    block_openers: tuple[str, ...] = (":", "{", "(", "[")
    cut_continuation: re.Pattern[str] = CUT_CONTINUATION
    statement_continuation: re.Pattern[str] = STATEMENT_CONTINUATION
    branch: re.Pattern[str] = BRANCH
    branch_headers: dict[str, re.Pattern[str]] = dataclasses.field(default_factory=lambda: BRANCH_HEADERS)
    indentation_significant: bool = False
    # What stands for a body in a definition's signature.
    elided_body: str = " { ... }"
    # The text is prose (markdown, plain text): fences and sentences are its content, not chat.
    prose: bool = False

    def multiline_closer(self, opener: str) -> str:
        """The delimiter that ends what ``opener`` (one of ``multiline_openers``) started."""
        if self.block_comment is not None and opener == self.block_comment[0]:
            return self.block_comment[1]
        return opener


_PYTHON = LanguageInfo(
    "python",
    line_comment="#",
    scan_line_comment="#",
    block_comment=None,
    quotes="\"'`",
    multiline_openers=('"""', "'''"),
    multiline_tokens=_HASH_TOKENS,
    indentation_significant=True,
    elided_body=" ...",
)
_JAVASCRIPT = LanguageInfo("javascript", multiline_openers=("/*", "`"))
# Ruby and shell scripts have no grammar here: only their comment marker differs from the defaults.
_LANGUAGES: dict[str, LanguageInfo] = {
    "python": _PYTHON,
    "javascript": _JAVASCRIPT,
    "javascriptreact": _JAVASCRIPT,
    "typescript": _JAVASCRIPT,
    "typescriptreact": _JAVASCRIPT,
    "go": LanguageInfo("go", multiline_openers=("/*", "`")),
    "rust": LanguageInfo("rust", quotes="\"`"),
    "java": LanguageInfo("java"),
    "c": LanguageInfo("c"),
    "cpp": LanguageInfo("cpp"),
    "csharp": LanguageInfo("csharp"),
    "ruby": LanguageInfo("ruby", line_comment="#"),
    "shellscript": LanguageInfo("shellscript", line_comment="#"),
    **{
        name: LanguageInfo(name, prose=True)
        for name in (
            "markdown", "plaintext", "text", "latex", "tex", "restructuredtext", "asciidoc", "org", "html", "xml", "yaml"
        )
    },
}


@lru_cache(maxsize=128)
def language_info(language_id: str) -> LanguageInfo:
    """The facts for a normalized languageId (:func:`normalize_language_id`); a language ember
    does not know gets the C-like defaults, as a family of its own."""
    info = _LANGUAGES.get(language_id)
    return info if info is not None else LanguageInfo(language_id)


def indent_columns(line: str, tab_width: int = TAB_WIDTH) -> int:
    """The width of the spaces and tabs that start ``line``, a tab advancing to the next multiple
    of ``tab_width``. ``tab_width=1`` counts characters (for slicing by the indentation)."""
    lead = len(line) - len(line.lstrip(" \t"))
    if tab_width == 1 or "\t" not in line[:lead]:
        return lead
    width = 0
    for ch in line[:lead]:
        width = width + tab_width - width % tab_width if ch == "\t" else width + 1
    return width


def bracket_depth(line: str) -> int:
    """Brackets ``line`` opens minus those it closes (strings and comments not excluded)."""
    return line.count("(") + line.count("{") + line.count("[") - line.count(")") - line.count("}") - line.count("]")
