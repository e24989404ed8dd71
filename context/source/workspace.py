"""The workspace's own source files: listed from root folders in resumable steps, summarized lazily
(top-level definitions with signatures, through :func:`context.source.definitions.definitions`), cached by
(path, mtime, size) in an LRU with a byte budget.

Built to be driven from a worker thread: every method is safe to call from several threads (a
lock guards the tables; reading and parsing happen outside it), none waits on the scan, and a
caller that needs an answer now gets whatever is listed so far. Nothing outside the roots is ever
opened: paths are normalized (``..`` collapsed) and symlinks resolved before any read, and a path
whose target lies outside every root is refused.

Longer than this project's ~600 lines: the listing, the summaries and their freshness share one
lock and one table of files; split apart, each half would reach into the other's state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from context.source.definitions import Definition, definitions
from context.source.file_rules import (
    SKIP_REASONS,
    SKIPPED_DIRS,
    VENV_MARKER,
    GitignoreRules,
    IgnoreChain,
    classify_head,
    source_language,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IndexLimits:
    """The index's caps. ``summary_budget_bytes`` bounds the summaries' estimated size (their
    strings' lengths plus per-object overhead, see :func:`summary_cost`), not the process."""

    max_files: int = 20_000
    max_file_bytes: int = 1_000_000
    summary_budget_bytes: int = 32 * 1024 * 1024
    binary_probe_bytes: int = 8192


@dataclass(frozen=True)
class FileSummary:
    """One file's top-level definitions, as of the text it was made from."""

    path: str
    language_id: str
    mtime_ns: int  # -1 when made from an override (an open document's text)
    size: int
    definitions: tuple[Definition, ...]

    def defines(self, name: str) -> bool:
        return any(d.name == name for d in self.definitions)


@dataclass(frozen=True)
class ScanProgress:
    """What one :meth:`WorkspaceIndex.scan` step did."""

    listed: int  # files listed by this step
    total: int  # files listed so far
    done: bool  # nothing left to visit (or the cap was hit)
    cap_hit: bool


@dataclass(frozen=True)
class IndexStats:
    roots: tuple[str, ...]
    files_listed: int
    scan_done: bool
    cap_hit: bool
    max_files: int
    skipped: Mapping[str, int]
    summaries_cached: int
    summary_bytes: int
    summary_budget_bytes: int
    overrides: int


@dataclass(frozen=True)
class _Candidate:
    """A file seen in a directory listing, to be probed (size, binary, encoding) before listing."""

    path: str
    language_id: str
    size: int


@dataclass
class _Cached:
    stamp: tuple[int, int]  # (mtime_ns, size) on disk, or (-1, override version)
    summary: FileSummary
    cost: int


@dataclass
class _ScanState:
    pending_dirs: list[tuple[str, IgnoreChain]] = field(default_factory=list)
    candidates: list[_Candidate] = field(default_factory=list)
    cap_hit: bool = False


def _read_head(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes from the start of a file (the one place the index reads files)."""
    with open(path, "rb") as stream:
        return stream.read(limit)


def summary_cost(summary: FileSummary) -> int:
    """A summary's estimated size in bytes: string lengths plus ~64 bytes per object."""
    cost = 200 + len(summary.path)
    for d in summary.definitions:
        cost += len(d.name) + len(d.signature) + len(d.full) + 4 * 64
    return cost


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class WorkspaceIndex:
    """The source files under some root folders, and their summaries."""

    def __init__(self, roots: Iterable[str], limits: IndexLimits | None = None) -> None:
        self.limits = limits or IndexLimits()
        resolved = sorted({os.path.realpath(os.path.abspath(r)) for r in roots if os.path.isdir(r)})
        # A root inside another root is listed through the outer one.
        self._roots = tuple(r for r in resolved if not any(o != r and _under(r, o) for o in resolved))
        self._lock = threading.RLock()
        self._files: dict[str, str] = {}  # path -> language id, in listing order
        self._by_dir: dict[str, set[str]] = {}
        self._skipped: Counter[str] = Counter()
        self._summaries: OrderedDict[str, _Cached] = OrderedDict()
        self._summary_bytes = 0
        self._overrides: dict[str, tuple[int, str]] = {}  # path -> (version, text)
        self._override_version = 0
        self._generation = 0  # counts changes to the listing and to files on disk that were reported
        self._gitignores = GitignoreRules(self._gitignore_text)
        self._scan = self._fresh_scan()

    # -------------------------------------------------------------------------------------------
    # paths

    def roots(self) -> tuple[str, ...]:
        return self._roots

    def contains(self, path: str) -> bool:
        """Whether ``path`` (after resolving ``..`` and symlinks) lies under a root."""
        return self._key(path) is not None

    def _key(self, path: str) -> str | None:
        """The index's name for ``path``, or None when it (or its symlink target) leaves the roots."""
        lexical = os.path.abspath(path.removeprefix("file://"))
        real = os.path.realpath(lexical)
        if not any(_under(real, r) for r in self._roots):
            return None
        return lexical if any(_under(lexical, r) for r in self._roots) else real

    def _root_of(self, path: str) -> str:
        return next(r for r in self._roots if _under(path, r))

    # -------------------------------------------------------------------------------------------
    # listing

    def _fresh_scan(self) -> _ScanState:
        state = _ScanState()
        state.pending_dirs = [(r, ()) for r in reversed(self._roots)]
        return state

    def rescan(self) -> None:
        """Forget the listing and start over (summaries stay cached: they are checked by mtime)."""
        with self._lock:
            self._files.clear()
            self._by_dir.clear()
            self._skipped.clear()
            self._gitignores.clear()
            self._scan = self._fresh_scan()
            self._generation += 1

    def scan(self, max_files: int | None = None, deadline_s: float | None = None) -> ScanProgress:
        """List more files: until ``max_files`` more are listed, ``deadline_s`` seconds pass, or
        everything is listed. Call again to resume where it stopped."""
        started = time.monotonic()
        listed = 0
        while True:
            if max_files is not None and listed >= max_files:
                break
            if deadline_s is not None and time.monotonic() - started >= deadline_s:
                break
            with self._lock:
                state = self._scan
                if state.cap_hit:
                    break
                candidate = state.candidates.pop() if state.candidates else None
                directory = state.pending_dirs.pop() if candidate is None and state.pending_dirs else None
            if candidate is not None:
                listed += self._list_candidate(state, candidate)
            elif directory is not None:
                self._visit(state, *directory)
            else:
                break
        return self._progress(listed)

    def _progress(self, listed: int) -> ScanProgress:
        with self._lock:
            state = self._scan
            done = state.cap_hit or not (state.candidates or state.pending_dirs)
            return ScanProgress(listed, len(self._files), done, state.cap_hit)

    def _listing_complete(self) -> bool:
        """Whether every file under the roots has been seen (not so while scanning or over the cap)."""
        with self._lock:
            state = self._scan
            return not (state.cap_hit or state.candidates or state.pending_dirs)

    def _list_candidate(self, state: _ScanState, candidate: _Candidate) -> int:
        reason = self._probe(candidate.path, candidate.size)
        with self._lock:
            if state is not self._scan:  # a rescan started meanwhile
                return 0
            if reason is not None:
                self._skipped[reason] += 1
                return 0
            if candidate.path in self._files:
                return 0
            if len(self._files) >= self.limits.max_files:
                state.cap_hit = True
                log.warning("workspace index: %d files listed, the cap; not listing more under %s",
                            self.limits.max_files, ", ".join(self._roots))
                return 0
            self._add(candidate.path, candidate.language_id)
            return 1

    @property
    def generation(self) -> int:
        """A number that changes whenever the listing does or a file is refreshed or forgotten (what
        was derived from the index may be stale then)."""
        return self._generation

    def _add(self, path: str, language_id: str) -> None:
        self._generation += 1
        self._files[path] = language_id
        self._by_dir.setdefault(os.path.dirname(path), set()).add(path)

    def _remove(self, path: str) -> bool:
        if self._files.pop(path, None) is None:
            return False
        self._generation += 1
        siblings = self._by_dir.get(os.path.dirname(path))
        if siblings is not None:
            siblings.discard(path)
        return True

    def _probe(self, path: str, size: int) -> str | None:
        """Why a listed-to-be file is left out (too large, binary, unreadable ...), or None."""
        if size > self.limits.max_file_bytes:
            return "too_large"
        try:
            head = _read_head(path, self.limits.binary_probe_bytes)
        except FileNotFoundError:
            return "vanished"
        except OSError:
            return "unreadable"
        return classify_head(head, self.limits.binary_probe_bytes)

    def _visit(self, state: _ScanState, directory: str, ignores: IgnoreChain) -> None:
        """Read one directory: its files become candidates, its subdirectories pending."""
        ignores = self._gitignores.extend(directory, ignores)
        skipped: Counter[str] = Counter()
        candidates: list[_Candidate] = []
        subdirs: list[tuple[str, IgnoreChain]] = []
        try:
            with os.scandir(directory) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except FileNotFoundError:
            entries, skipped["vanished"] = [], 1
        except OSError:
            entries, skipped["unreadable"] = [], 1
        for entry in entries:
            try:
                kind = self._entry_kind(entry, ignores)
                if kind == "dir":
                    subdirs.append((entry.path, ignores))
                elif kind == "file":
                    language_id = source_language(entry.name)
                    assert language_id is not None
                    candidates.append(_Candidate(entry.path, language_id, entry.stat().st_size))
                elif kind:
                    skipped[kind] += 1
            except FileNotFoundError:
                skipped["vanished"] += 1
            except OSError:
                skipped["unreadable"] += 1
        with self._lock:
            if state is not self._scan:
                return
            self._skipped.update(skipped)
            state.pending_dirs.extend(reversed(subdirs))
            state.candidates.extend(reversed(candidates))

    def _entry_kind(self, entry: os.DirEntry[str], ignores: IgnoreChain) -> str:
        """"dir" to descend, "file" to probe, a skip reason, or "" for an entry not counted."""
        if entry.is_symlink() and self._key(entry.path) is None:
            return "outside_root"
        if entry.is_dir():
            if entry.is_symlink():  # its target is under a root: listed there, by its own path
                return ""
            if entry.name in SKIPPED_DIRS:
                return "skipped_dir"
            if self._gitignores.ignored(entry.path, True, ignores):
                return "ignored"
            if os.path.isfile(os.path.join(entry.path, VENV_MARKER)):
                return "virtualenv"
            return "dir"
        if not entry.is_file():
            return ""
        if source_language(entry.name) is None:
            return "unknown_extension"
        return "ignored" if self._gitignores.ignored(entry.path, False, ignores) else "file"

    def _gitignore_text(self, path: str) -> str | None:
        if not os.path.isfile(path) or self._key(path) is None:
            return None
        try:
            return _read_head(path, self.limits.max_file_bytes).decode("utf-8", "replace")
        except OSError:
            return None

    def _directory_rules(self, directory: str) -> tuple[str | None, IgnoreChain]:
        """Why the listing leaves out everything in ``directory`` (None: it does not), and the
        .gitignore rules of the directories above it."""
        root = self._root_of(directory)
        ignores: IgnoreChain = ()
        current = root
        for part in [p for p in os.path.relpath(directory, root).split(os.sep) if p not in ("", ".")]:
            ignores = self._gitignores.extend(current, ignores)
            current = os.path.join(current, part)
            if part in SKIPPED_DIRS:
                return "skipped_dir", ignores
            if self._gitignores.ignored(current, True, ignores):
                return "ignored", ignores
            if os.path.isfile(os.path.join(current, VENV_MARKER)):
                return "virtualenv", ignores
        return None, ignores

    def _path_reason(self, key: str) -> str | None:
        """Why the listing would leave out the file at ``key``, from its directories and name."""
        directory = os.path.dirname(key)
        reason, ignores = self._directory_rules(directory)
        if reason is not None:
            return reason
        if source_language(key) is None:
            return "unknown_extension"
        ignores = self._gitignores.extend(directory, ignores)
        return "ignored" if self._gitignores.ignored(key, False, ignores) else None

    # -------------------------------------------------------------------------------------------
    # queries

    def files(self) -> tuple[str, ...]:
        """Listed files in listing order, then open documents' paths not listed."""
        with self._lock:
            return tuple(self._files) + tuple(p for p in self._overrides if p not in self._files)

    def language_of(self, path: str) -> str | None:
        key = self._key(path)
        if key is None:
            return None
        with self._lock:
            listed = self._files.get(key)
        return listed or source_language(key)

    def is_file(self, path: str) -> bool:
        """Whether ``path`` is a workspace source file: listed or open; while the scan is not done
        (or stopped at the cap), a source file on disk under a root counts too."""
        # Resolution asks about many paths that do not exist: answer those without resolving symlinks.
        lexical = os.path.abspath(path.removeprefix("file://"))
        with self._lock:
            if lexical in self._files or lexical in self._overrides:
                return True
            unfinished = not self._listing_complete()
        aliased = not any(_under(lexical, r) for r in self._roots)  # a root reached through a symlink
        if not (unfinished or aliased) or source_language(lexical) is None or not os.path.isfile(lexical):
            return False
        key = self._key(lexical)
        if key is None:
            return False
        with self._lock:
            if key in self._files or key in self._overrides:
                return True
        return unfinished

    def files_in(self, directory: str) -> tuple[str, ...]:
        """The source files directly in ``directory``, sorted (from disk too while the listing is
        incomplete)."""
        key = self._key(directory)
        if key is None:
            return ()
        with self._lock:
            found = set(self._by_dir.get(key, ())) | {p for p in self._overrides if os.path.dirname(p) == key}
            unfinished = not self._listing_complete()
        if unfinished:
            try:
                with os.scandir(key) as listing:
                    found.update(e.path for e in listing if source_language(e.name) and self.is_file(e.path))
            except OSError:
                pass
        return tuple(sorted(found))

    def text(self, path: str) -> str | None:
        """An open document's text, else the file's on disk (any file under a root within the size
        cap: configuration files too); None when outside the roots, missing, too large or not text."""
        key = self._key(path)
        if key is None:
            return None
        with self._lock:
            override = self._overrides.get(key)
        if override is not None:
            return override[1]
        text, _reason = self._read_text(key)
        return text

    def _read_text(self, key: str) -> tuple[str | None, str | None]:
        """The text of a file on disk, or None and why not."""
        try:
            data = _read_head(key, self.limits.max_file_bytes + 1)
        except FileNotFoundError:
            return None, "vanished"
        except OSError:
            return None, "unreadable"
        if len(data) > self.limits.max_file_bytes:
            return None, "too_large"
        reason = classify_head(data, self.limits.binary_probe_bytes)
        if reason is not None:
            return None, reason
        try:
            return data.decode("utf-8"), None
        except UnicodeDecodeError:
            return None, "not_utf8"

    # -------------------------------------------------------------------------------------------
    # summaries

    def summary(self, path: str) -> FileSummary | None:
        """The file's summary (an open document's text wins over the disk), parsed when not cached
        for its current mtime and size; None when it cannot be read (a listed file that vanished or
        became unreadable is dropped from the listing and counted)."""
        key = self._key(path)
        language_id = self.language_of(path) if key is not None else None
        if key is None or language_id is None:
            return None
        with self._lock:
            override = self._overrides.get(key)
        if override is not None:
            stamp = (-1, override[0])
        else:
            try:
                st = os.stat(key)
            except OSError as error:
                self._drop(key, "vanished" if isinstance(error, FileNotFoundError) else "unreadable")
                return None
            stamp = (st.st_mtime_ns, st.st_size)
            if st.st_size > self.limits.max_file_bytes:
                self._drop(key, "too_large")
                return None
        with self._lock:
            cached = self._summaries.get(key)
            if cached is not None and cached.stamp == stamp:
                self._summaries.move_to_end(key)
                return cached.summary
        text, reason = (override[1], None) if override is not None else self._read_text(key)
        if text is None:
            self._drop(key, reason or "unreadable")
            return None
        try:
            found = definitions(text, language_id, key, private=True)
        except Exception:  # one file the parser trips on must not fail the request asking (logged)
            log.warning("workspace index: no definitions for %s", key, exc_info=True)
            found = ()
        made = FileSummary(key, language_id, stamp[0], len(text), found)
        self._store(key, stamp, made)
        return made

    def _drop(self, key: str, reason: str) -> None:
        with self._lock:
            cached = self._summaries.pop(key, None)
            if cached is not None:
                self._summary_bytes -= cached.cost
            if self._remove(key):
                self._skipped[reason] += 1

    def _store(self, key: str, stamp: tuple[int, int], summary: FileSummary) -> None:
        cost = summary_cost(summary)
        with self._lock:
            old = self._summaries.pop(key, None)
            if old is not None:
                self._summary_bytes -= old.cost
            if cost > self.limits.summary_budget_bytes:
                return
            self._summaries[key] = _Cached(stamp, summary, cost)
            self._summary_bytes += cost
            while self._summary_bytes > self.limits.summary_budget_bytes:
                _, evicted = self._summaries.popitem(last=False)
                self._summary_bytes -= evicted.cost

    def _uncache(self, key: str) -> None:
        with self._lock:
            cached = self._summaries.pop(key, None)
            if cached is not None:
                self._summary_bytes -= cached.cost

    # -------------------------------------------------------------------------------------------
    # freshness

    def refresh(self, path: str) -> bool:
        """Re-read what the index knows of ``path`` (a file created, changed or deleted on disk, or
        a directory created or deleted); return whether it is listed now (a created directory is
        listed by the next :meth:`scan` steps). A changed .gitignore applies from the next
        :meth:`rescan`."""
        key = self._key(path)
        if key is None:
            return False
        if os.path.basename(key) == ".gitignore":
            self._gitignores.forget(os.path.dirname(key))
            return False
        if os.path.isdir(key):  # a directory created (or checked out): listed by the next scan steps
            reason, ignores = self._directory_rules(key)
            with self._lock:
                if reason is None and not self._scan.cap_hit:
                    self._scan.pending_dirs.append((key, ignores))
            return False
        self._uncache(key)
        with self._lock:
            self._generation += 1
        try:
            size = os.stat(key).st_size
            reason = self._path_reason(key) or self._probe(key, size)
        except FileNotFoundError:
            self.forget(key)
            return False
        except OSError:
            reason = "unreadable"
        with self._lock:
            if reason is not None:
                self._remove(key)
                return False
            if key in self._files:
                return True
            if len(self._files) >= self.limits.max_files:
                self._scan.cap_hit = True
                return False
            language_id = source_language(key)
            assert language_id is not None
            self._add(key, language_id)
            return True

    def forget(self, path: str) -> None:
        """Drop ``path`` from the listing and the cache (a file deleted on disk; a deleted directory:
        every file under it)."""
        key = self._key(path)
        if key is None:
            return
        with self._lock:
            self._generation += 1
            gone = [key] if key in self._files else [p for p in self._files if p.startswith(key + os.sep)]
            for file in gone:
                self._remove(file)
        for file in gone or [key]:
            self._uncache(file)

    def set_override(self, path: str, text: str) -> bool:
        """Use ``text`` for ``path`` instead of the disk (an open document); False when the path
        is outside the roots or not a source file."""
        key = self._key(path)
        if key is None or source_language(key) is None:
            return False
        with self._lock:
            self._override_version += 1
            self._overrides[key] = (self._override_version, text)
        return True

    def clear_override(self, path: str) -> None:
        key = self._key(path)
        if key is None:
            return
        with self._lock:
            self._overrides.pop(key, None)
        self._uncache(key)

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                roots=self._roots,
                files_listed=len(self._files),
                scan_done=self._progress(0).done,
                cap_hit=self._scan.cap_hit,
                max_files=self.limits.max_files,
                skipped=dict(self._skipped),
                summaries_cached=len(self._summaries),
                summary_bytes=self._summary_bytes,
                summary_budget_bytes=self.limits.summary_budget_bytes,
                overrides=len(self._overrides),
            )


__all__ = ["SKIPPED_DIRS", "SKIP_REASONS", "VENV_MARKER", "FileSummary", "IndexLimits", "IndexStats", "ScanProgress",
           "WorkspaceIndex", "source_language", "summary_cost"]
