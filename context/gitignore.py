"""A tree's .gitignore files, read as git reads them: patterns relative to the directory holding
the file, the last matching pattern deciding, a deeper file's patterns after a shallower's."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pathspec


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
