"""The workspace folders of editor sessions: one :class:`context.source.workspace.WorkspaceIndex` per root
folder, shared by the sessions that have that folder open (:class:`IndexRegistry`, on the
process' core), listed in the background in a worker thread; and a session's own folders
(:class:`SessionFolders`), from ``initialize`` and ``workspace/didChangeWorkspaceFolders``.

The protocol edge owns this because the folders and file events arrive as LSP URIs and
notifications; what an index holds and how context is chosen is in :mod:`context`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lsprotocol import types
from pygls.uris import to_fs_path

from context.source.workspace import IndexLimits, WorkspaceIndex

log = logging.getLogger(__name__)

SCAN_STEP_S = 0.2  # one listing step in the worker thread; the loop runs between steps


def uri_path(uri: str) -> str | None:
    """The absolute file-system path of a ``file:`` URI (percent-decoded), else None."""
    if not uri.startswith("file:"):
        return None
    path = to_fs_path(uri)
    return os.path.abspath(path) if path else None


@dataclass
class _Shared:
    index: WorkspaceIndex
    sessions: int = 0
    scan: asyncio.Task[None] | None = None
    scan_s: float | None = None  # how long the first full listing took


class IndexRegistry:
    """The process' workspace indexes, one per root folder, shared by the sessions that use it and
    dropped when the last of them lets go."""

    def __init__(self, limits: IndexLimits | None = None) -> None:
        self.limits = limits or IndexLimits()
        self._shared: dict[str, _Shared] = {}

    def acquire(self, root: str) -> WorkspaceIndex | None:
        """The index of ``root`` (a directory), listed in the background from the first call; None
        when it is not a directory."""
        root = os.path.realpath(root)
        shared = self._shared.get(root)
        if shared is None:
            if not os.path.isdir(root):
                return None
            shared = self._shared[root] = _Shared(WorkspaceIndex([root], self.limits))
            shared.scan = asyncio.ensure_future(self._list(shared, root))
        shared.sessions += 1
        return shared.index

    def release(self, root: str) -> None:
        root = os.path.realpath(root)
        shared = self._shared.get(root)
        if shared is None:
            return
        shared.sessions -= 1
        if shared.sessions <= 0:
            del self._shared[root]
            if shared.scan is not None:
                shared.scan.cancel()

    def rescan(self, index: WorkspaceIndex) -> None:
        """List ``index`` again (a changed ``.gitignore``), in the background."""
        for root, shared in self._shared.items():
            if shared.index is index:
                index.rescan()
                if shared.scan is None or shared.scan.done():
                    shared.scan = asyncio.ensure_future(self._list(shared, root))

    async def _list(self, shared: _Shared, root: str) -> None:
        started = time.monotonic()
        try:
            while True:
                progress = await asyncio.to_thread(shared.index.scan, None, SCAN_STEP_S)
                if progress.done:
                    break
        except Exception:  # a listing that fails leaves what it listed; requests go on with it
            log.exception("workspace index: listing %s failed", root)
            return
        elapsed = time.monotonic() - started
        if shared.scan_s is None:
            shared.scan_s = elapsed
        stats = shared.index.stats()
        log.info("workspace index: %d files under %s listed in %.2f s%s", stats.files_listed, root, elapsed,
                 " (the cap: not all files)" if stats.cap_hit else "")

    def scan_seconds(self, index: WorkspaceIndex) -> float | None:
        return next((s.scan_s for s in self._shared.values() if s.index is index), None)

    def roots(self) -> tuple[str, ...]:
        return tuple(self._shared)


def folder_paths(params: types.InitializeParams) -> list[str]:
    """The workspace folders an editor sends in ``initialize`` (``workspaceFolders``, else the
    deprecated ``rootUri`` / ``rootPath``)."""
    if params.workspace_folders:
        found = [uri_path(folder.uri) for folder in params.workspace_folders]
    elif params.root_uri:
        found = [uri_path(params.root_uri)]
    else:
        found = [os.path.abspath(params.root_path)] if params.root_path else []
    return [path for path in found if path]


class SessionFolders:
    """One session's workspace folders and their (shared) indexes."""

    def __init__(self, registry: IndexRegistry) -> None:
        self.registry = registry
        self._indexes: dict[str, WorkspaceIndex] = {}

    def add(self, paths: Iterable[str]) -> None:
        for path in paths:
            root = os.path.realpath(path)
            if root in self._indexes:
                continue
            index = self.registry.acquire(root)
            if index is None:
                log.warning("workspace folder %s is not a directory; no workspace context from it", path)
                continue
            self._indexes[root] = index

    def remove(self, paths: Iterable[str]) -> None:
        for path in paths:
            root = os.path.realpath(path)
            if self._indexes.pop(root, None) is not None:
                self.registry.release(root)

    def close(self) -> None:
        self.remove(list(self._indexes))

    def indexes(self) -> Sequence[WorkspaceIndex]:
        return tuple(self._indexes.values())

    def index_for(self, path: str) -> WorkspaceIndex | None:
        """The index whose root holds ``path`` (the innermost root), if any."""
        holding = [index for index in self._indexes.values() if index.contains(path)]
        return max(holding, key=lambda index: len(index.roots()[0]), default=None) if holding else None

    async def file_changed(self, path: str, deleted: bool) -> None:
        """A file created, changed or deleted on disk (watched-file events, didSave)."""
        for index in self._indexes.values():
            if not index.contains(path):
                continue
            if deleted:
                await asyncio.to_thread(index.forget, path)
            else:
                await asyncio.to_thread(index.refresh, path)
            if os.path.basename(path) == ".gitignore":
                self.registry.rescan(index)

    def stats(self) -> dict[str, Any]:
        """The part of ``ember/stats`` about this session's folders."""
        found = [index.stats() for index in self._indexes.values()]
        skipped: dict[str, int] = {}
        for stats in found:
            for reason, count in stats.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + count
        scans = [self.registry.scan_seconds(index) for index in self._indexes.values()]
        return {
            "roots": [root for stats in found for root in stats.roots],
            "files": sum(s.files_listed for s in found),
            "scan_done": all(s.scan_done for s in found),
            "cap_hit": any(s.cap_hit for s in found),
            "max_files": found[0].max_files if found else self.registry.limits.max_files,
            "summaries": sum(s.summaries_cached for s in found),
            "summary_bytes": sum(s.summary_bytes for s in found),
            "summary_budget_bytes": self.registry.limits.summary_budget_bytes,
            "skipped": skipped,
            "scan_s": max((s for s in scans if s is not None), default=None) if all(s is not None for s in scans) else None,
        }
