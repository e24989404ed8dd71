"""The workspace index on small trees under tmp_path: what is listed, what is refused, freshness."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import context.source.workspace as workspace
from context.source.workspace import IndexLimits, WorkspaceIndex


def write(root: Path, relative: str, text: str | bytes = "def f():\n    return 1\n") -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def scanned(root: Path, limits: IndexLimits | None = None) -> WorkspaceIndex:
    index = WorkspaceIndex([str(root)], limits)
    while not index.scan().done:
        pass
    return index


def listed(index: WorkspaceIndex, root: Path) -> list[str]:
    return sorted(os.path.relpath(p, root) for p in index.files())


def test_gitignore_root_and_nested(tmp_path: Path) -> None:
    write(tmp_path, ".gitignore", "*.log\nsecret/\ngen_*.py\n!gen_keep.py\n")
    write(tmp_path, "sub/.gitignore", "local.py\n")
    for name in ("a.py", "gen_x.py", "gen_keep.py", "secret/s.py", "sub/local.py", "sub/ok.py", "other/local.py", "x.log"):
        write(tmp_path, name)
    index = scanned(tmp_path)
    assert listed(index, tmp_path) == ["a.py", "gen_keep.py", "other/local.py", "sub/ok.py"]
    assert index.stats().skipped["ignored"] == 3  # gen_x.py, secret/, sub/local.py (x.log: unknown extension)
    # refresh() applies the same rules to a single path.
    assert not index.refresh(str(tmp_path / "sub/local.py"))
    assert index.refresh(str(tmp_path / "sub/ok.py"))


def test_skipped_directories_binaries_and_unknown_files(tmp_path: Path) -> None:
    for name in (".git/x.py", "node_modules/m/index.js", "__pycache__/c.py", ".venv/y.py", "venv/z.py", "build/b.py",
                 "dist/d.py", "target/t.rs", ".tox/x.py", ".mypy_cache/m.py", "env/lib/site.py", "src/ok.py"):
        write(tmp_path, name)
    write(tmp_path, "env/pyvenv.cfg", "home = /usr\n")
    write(tmp_path, "src/data.bin", b"\0\1\2")
    write(tmp_path, "src/blob.py", b"x = 1\n\0\0\0")
    write(tmp_path, "src/latin.py", "s = 'caf\xe9'\n".encode("latin-1"))
    write(tmp_path, "README.md", "# prose\n")
    index = scanned(tmp_path)
    assert listed(index, tmp_path) == ["src/ok.py"]
    skipped = index.stats().skipped
    assert skipped["skipped_dir"] == 10 and skipped["virtualenv"] == 1
    assert skipped["binary"] == 1 and skipped["not_utf8"] == 1 and skipped["unknown_extension"] == 2


def test_symlinks_outside_the_root_are_refused_inside_are_listed(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    secret = write(outside, "secret.py", "def secret(): ...\n")
    write(root, "pkg/real.py", "def real(): ...\n")
    (root / "link.py").symlink_to(secret)
    (root / "linkdir").symlink_to(outside, target_is_directory=True)
    (root / "inside.py").symlink_to(root / "pkg/real.py")
    (root / "alias").symlink_to(root / "pkg", target_is_directory=True)
    index = scanned(root)
    assert listed(index, root) == ["inside.py", "pkg/real.py"]  # alias/ is listed by its target's path
    assert index.stats().skipped["outside_root"] == 2
    assert [d.name for d in index.summary(str(root / "inside.py")).definitions] == ["real"]  # type: ignore[union-attr]
    for escape in (str(root / "link.py"), str(root / "linkdir/secret.py"), f"{root}/../outside/secret.py", str(secret)):
        assert index.summary(escape) is None and index.text(escape) is None and not index.is_file(escape)
        assert not index.set_override(escape, "x = 1\n") and not index.refresh(escape)
    assert index.text(f"{root}/pkg/../pkg/real.py") == "def real(): ...\n"


def test_unreadable_files_are_skipped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked, later = write(tmp_path, "locked.py"), write(tmp_path, "later.py")
    write(tmp_path, "ok.py")
    real_read = workspace._read_head

    def read(path: str, limit: int) -> bytes:
        if path in blocked:
            raise PermissionError(13, "Permission denied", path)
        return real_read(path, limit)

    blocked = {str(locked)}
    monkeypatch.setattr(workspace, "_read_head", read)
    index = scanned(tmp_path)
    assert listed(index, tmp_path) == ["later.py", "ok.py"]
    blocked.add(str(later))  # unreadable after listing: dropped when summarized
    assert index.summary(str(later)) is None and index.text(str(later)) is None
    assert listed(index, tmp_path) == ["ok.py"] and index.stats().skipped["unreadable"] == 2


def test_a_50_mb_file_is_skipped_without_being_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "big.py"
    with big.open("wb") as stream:
        stream.truncate(50_000_000)
    write(tmp_path, "small.py")
    reads: list[tuple[str, int]] = []
    real_read = workspace._read_head

    def read(path: str, limit: int) -> bytes:
        reads.append((path, limit))
        return real_read(path, limit)

    monkeypatch.setattr(workspace, "_read_head", read)
    index = scanned(tmp_path)
    assert listed(index, tmp_path) == ["small.py"] and index.stats().skipped["too_large"] == 1
    assert index.summary(str(big)) is None and not index.refresh(str(big))
    assert index.text(str(big)) is None
    assert all(limit <= index.limits.max_file_bytes + 1 for path, limit in reads if path == str(big))
    assert [path for path, _ in reads if path == str(big)] == [str(big)]  # only text(), 1 MB of it


def test_a_file_deleted_while_indexing(tmp_path: Path) -> None:
    first, second, third = (write(tmp_path, f"{n}.py") for n in ("a", "b", "c"))
    index = WorkspaceIndex([str(tmp_path)])
    assert index.scan(max_files=1).listed == 1  # a.py listed, b.py and c.py seen but not probed yet
    second.unlink()
    assert index.scan().done
    assert listed(index, tmp_path) == ["a.py", "c.py"] and index.stats().skipped["vanished"] == 1
    first.unlink()  # deleted between listing and summarizing
    assert index.summary(str(first)) is None
    assert listed(index, tmp_path) == ["c.py"] and index.stats().skipped["vanished"] == 2
    third.unlink()
    assert not index.refresh(str(third)) and index.files() == ()


def test_a_changed_mtime_gives_a_fresh_summary(tmp_path: Path) -> None:
    path = write(tmp_path, "m.py", "def old(): ...\n")
    index = scanned(tmp_path)
    before = index.summary(str(path))
    assert before is not None and [d.name for d in before.definitions] == ["old"]
    assert index.summary(str(path)) is before  # cached
    path.write_text("def new(): ...\n")
    os.utime(path, ns=(before.mtime_ns + 10**9, before.mtime_ns + 10**9))
    after = index.summary(str(path))
    assert after is not None and [d.name for d in after.definitions] == ["new"]


def test_an_open_document_wins_over_the_disk(tmp_path: Path) -> None:
    path = write(tmp_path, "m.py", "def on_disk(): ...\n")
    index = scanned(tmp_path)
    assert index.summary(str(path)).defines("on_disk")  # type: ignore[union-attr]
    assert index.set_override(f"file://{path}", "def live(): ...\n")
    live = index.summary(str(path))
    assert live is not None and live.defines("live") and not live.defines("on_disk") and live.mtime_ns == -1
    assert index.text(str(path)) == "def live(): ...\n"
    index.set_override(str(path), "def typed(): ...\n")
    path.write_text("def changed_on_disk(): ...\n")  # changed on disk while open: the editor's text wins
    assert index.summary(str(path)).defines("typed")  # type: ignore[union-attr]
    index.clear_override(str(path))
    assert index.summary(str(path)).defines("changed_on_disk")  # type: ignore[union-attr]
    # An unsaved new file is known while open.
    new = tmp_path / "pkg" / "new.py"
    assert index.set_override(str(new), "def fresh(): ...\n") and str(new) in index.files() and index.is_file(str(new))
    index.clear_override(str(new))
    assert str(new) not in index.files()


def test_two_indexes_see_only_their_own_roots(tmp_path: Path) -> None:
    a, b = write(tmp_path, "a/x.py"), write(tmp_path, "b/y.py")
    first, second = scanned(tmp_path / "a"), scanned(tmp_path / "b")
    assert first.files() == (str(a),) and second.files() == (str(b),)
    assert first.summary(str(b)) is None and not first.is_file(str(b)) and first.text(str(b)) is None
    assert second.summary(str(b)) is not None and not second.set_override(str(a), "x = 1\n")


def test_the_file_cap_is_reported(tmp_path: Path) -> None:
    for n in range(5):
        write(tmp_path, f"f{n}.py")
    index = WorkspaceIndex([str(tmp_path)], IndexLimits(max_files=3))
    progress = index.scan()
    assert progress.done and progress.cap_hit and progress.total == 3
    stats = index.stats()
    assert stats.cap_hit and stats.files_listed == 3 and stats.max_files == 3
    write(tmp_path, "late.py")
    assert not index.refresh(str(tmp_path / "late.py")) and len(index.files()) == 3
    # Over the cap, imports still find files on disk (nothing more is listed or crawled).
    assert index.is_file(str(tmp_path / "late.py")) and len(index.files_in(str(tmp_path))) == 6


def test_a_resumed_scan_lists_what_one_scan_lists(tmp_path: Path) -> None:
    for name in ("a.py", "d/b.ts", "d/e/c.go", "d/e/f.rs", "z.js"):
        write(tmp_path, name, "x = 1\n")
    whole = scanned(tmp_path)
    stepped = WorkspaceIndex([str(tmp_path)])
    steps = []
    while not (progress := stepped.scan(max_files=2)).done:
        steps.append(progress.listed)
    assert steps[0] == 2 and stepped.files() == whole.files() and len(whole.files()) == 5
    assert WorkspaceIndex([str(tmp_path)]).scan(deadline_s=0).listed == 0


def test_refresh_lists_new_files_and_forget_drops_them(tmp_path: Path) -> None:
    index = scanned(tmp_path)
    path = write(tmp_path, "pkg/new.py", "def made(): ...\n")
    assert index.refresh(str(path)) and index.files() == (str(path),) and index.files_in(str(path.parent)) == (str(path),)
    assert index.summary(str(path)).defines("made")  # type: ignore[union-attr]
    index.forget(str(path))
    assert index.files() == () and index.stats().summaries_cached == 0


def test_summaries_stay_within_their_byte_budget(tmp_path: Path) -> None:
    for n in range(20):
        write(tmp_path, f"m{n}.py", "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(20)))
    index = scanned(tmp_path, IndexLimits(summary_budget_bytes=20_000))
    for path in index.files():
        assert index.summary(path) is not None
    stats = index.stats()
    assert 0 < stats.summaries_cached < 20 and stats.summary_bytes <= 20_000
    assert index.summary(index.files()[-1]) is not None  # the most recent stays cached


def test_summaries_are_served_while_another_thread_scans(tmp_path: Path) -> None:
    for n in range(200):
        write(tmp_path, f"d{n % 7}/m{n}.py", f"def f{n}(): ...\n")
    index = WorkspaceIndex([str(tmp_path)])

    def scan_in_small_steps() -> None:
        while not index.scan(max_files=5).done:
            pass

    scanner = threading.Thread(target=scan_in_small_steps)
    scanner.start()
    seen = 0
    while scanner.is_alive() or seen < len(index.files()):
        files = index.files()
        if seen < len(files):
            assert index.summary(files[seen]) is not None
            seen += 1
    scanner.join()
    assert seen == 200 and index.stats().summaries_cached == 200


def test_a_file_the_parser_trips_on_gets_an_empty_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "run.sh", '(cd "$here" && make)\n')
    index = scanned(tmp_path)

    def trip(*args: object, **kwargs: object) -> None:
        raise IndexError("a parser bug")

    monkeypatch.setattr("context.source.workspace.definitions", trip)
    summary = index.summary(str(path))
    assert summary is not None and summary.definitions == ()


def test_directories_created_and_deleted(tmp_path: Path) -> None:
    write(tmp_path, ".gitignore", "gen/\n")
    index = scanned(tmp_path)
    write(tmp_path, "pkg/a.py")
    write(tmp_path, "pkg/sub/b.py")
    write(tmp_path, "gen/c.py")
    assert not index.refresh(str(tmp_path / "pkg")) and not index.refresh(str(tmp_path / "gen"))
    while not index.scan().done:
        pass
    assert listed(index, tmp_path) == ["pkg/a.py", "pkg/sub/b.py"]
    index.forget(str(tmp_path / "pkg/sub"))
    assert listed(index, tmp_path) == ["pkg/a.py"]
