"""Which files of a tree are source files to index: not in version control, dependency, cache or
build directories, nor in a virtualenv, nor ignored by a .gitignore (read as git reads them:
patterns relative to the directory holding the file, the last matching pattern deciding, a deeper
file's patterns after a shallower's), with a known source extension, and text (no NUL, UTF-8)."""

from __future__ import annotations

import codecs
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pathspec

from context.source.languages import language_info, normalize_language_id

# Directories never listed: version control, dependencies, caches and build output.
SKIPPED_DIRS = frozenset(
    {
        ".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", "build", "dist", "target",
        ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".eggs",
    }
)
VENV_MARKER = "pyvenv.cfg"  # a directory holding one is a virtualenv, whatever its name

# Why a file was left out (the keys of IndexStats.skipped).
SKIP_REASONS = (
    "ignored", "skipped_dir", "virtualenv", "unknown_extension", "too_large", "binary", "not_utf8",
    "unreadable", "vanished", "outside_root",
)


def source_language(path: str) -> str | None:
    """The language id of a source file by its extension; None for prose and unknown files."""
    language_id = normalize_language_id("", path)
    if language_id == "plaintext" or language_info(language_id).prose:
        return None
    return language_id


def classify_head(head: bytes, probe: int) -> str | None:
    """Why a file's first bytes disqualify it (binary, not UTF-8), or None."""
    if b"\0" in head[:probe]:
        return "binary"
    try:  # an incremental decoder tolerates a character cut at the end of the probe
        codecs.getincrementaldecoder("utf-8")().decode(head[:probe], final=False)
    except UnicodeDecodeError:
        return "not_utf8"
    return None


@dataclass(frozen=True)
class IgnoreFile:
    """One .gitignore and the directory its patterns are relative to."""

    base: str
    spec: pathspec.GitIgnoreSpec


IgnoreChain = tuple[IgnoreFile, ...]


class GitignoreRules:
    """The .gitignore of each directory, read once through ``read`` (path -> text, or None when
    absent or not to be read) and kept until :meth:`forget` or :meth:`clear`."""

    def __init__(self, read: Callable[[str], str | None]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._specs: dict[str, pathspec.GitIgnoreSpec | None] = {}

    def extend(self, directory: str, chain: IgnoreChain) -> IgnoreChain:
        """``chain`` (the rules of the directories above) with ``directory``'s own .gitignore."""
        spec = self._spec(directory)
        return chain + (IgnoreFile(directory, spec),) if spec is not None else chain

    def _spec(self, directory: str) -> pathspec.GitIgnoreSpec | None:
        with self._lock:
            if directory in self._specs:
                return self._specs[directory]
        text = self._read(os.path.join(directory, ".gitignore"))
        spec = pathspec.GitIgnoreSpec.from_lines(text.splitlines()) if text is not None else None
        with self._lock:
            self._specs[directory] = spec
        return spec

    def forget(self, directory: str) -> None:
        with self._lock:
            self._specs.pop(directory, None)

    def clear(self) -> None:
        with self._lock:
            self._specs.clear()

    @staticmethod
    def ignored(path: str, is_dir: bool, chain: IgnoreChain) -> bool:
        verdict: bool | None = None
        for ignore in chain:
            relative = os.path.relpath(path, ignore.base).replace(os.sep, "/") + ("/" if is_dir else "")
            include = ignore.spec.check_file(relative).include
            if include is not None:
                verdict = include
        return bool(verdict)
