"""Cross-file context from the workspace (context/prompt/retrieval.py), its repository-level layout in the
prompt, and the sessions' shared indexes (lsp/workspaces.py)."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from context.prompt.builder import PromptBudget, PromptRequest, anchored_prompt
from context.prompt.fim import TEMPLATES
from context.prompt.retrieval import Cursor, OpenFile, WorkspaceView, retrieval_key, retrieve, workspace_context
from context.prompt.snippets import CrossFile, Snippet
from context.source.document import Document
from context.source.workspace import WorkspaceIndex
from lsp.workspaces import IndexRegistry, SessionFolders, uri_path

UTIL = '''"""Helpers."""


def parse_header(value: str, *, strict: bool = False) -> dict[str, str]:
    """Split a header into its parameters."""
    return dict(part.split("=", 1) for part in value.split(";"))


def _private_join(parts: list[str]) -> str:
    return ";".join(parts)


class Registry:
    """Named things."""

    def __init__(self) -> None:
        self.items: dict[str, object] = {}

    def register(self, name: str, item: object) -> None:
        self.items[name] = item

    def _hidden(self) -> None:
        pass
'''

UNRELATED = '''def colour_of_the_sky(weather: str) -> str:
    return "blue" if weather == "clear" else "grey"
'''

MAIN = '''from pkg.util import parse_header, Registry
from pkg.util import _private_join


def handle(request):
    registry = Registry()
    fields = '''


def make_tree(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "util.py").write_text(UTIL)
    (root / "pkg" / "weather.py").write_text(UNRELATED)
    (root / "pkg" / "main.py").write_text(MAIN)
    return root


def context_for(root: Path, text: str, offset: int | None = None, open_files: dict[str, OpenFile] | None = None,
                budget: int = 2000) -> CrossFile:
    index = WorkspaceIndex([str(root)])
    index.scan()
    path = str(root / "pkg" / "main.py")
    files = {path: OpenFile(text, "python"), **(open_files or {})}
    cursor = Cursor(path, text, len(text) if offset is None else offset, "python")
    return workspace_context(WorkspaceView(index, files), cursor, budget)


def test_imported_definitions_come_whole_with_paths_relative_to_the_root(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    found = context_for(root, MAIN)
    assert found.repo_name == "proj" and found.path == "pkg/main.py"
    assert [s.path for s in found.snippets] == ["pkg/util.py"]
    text = found.snippets[0].text
    assert "def parse_header(value: str, *, strict: bool = False) -> dict[str, str]:" in text
    assert 'return dict(part.split("=", 1)' in text  # small: shown whole
    assert "class Registry:" in text and "def register(self, name: str, item: object) -> None:" in text
    assert "def _private_join(parts: list[str]) -> str:" in text  # imported by name, so shown though private
    assert "colour_of_the_sky" not in "".join(s.text for s in found.snippets)
    # ember/stats says what went in and why, per file in file order (names on import lines are
    # not uses, though they are near the cursor).
    assert found.snippets[0].reasons == (
        "parse_header: imported, not used yet", "_private_join: imported, not used yet", "Registry: used near the cursor"
    )


def test_an_unrelated_open_tab_does_not_get_in_a_related_one_does(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    weather = str(root / "pkg" / "weather.py")
    found = context_for(root, MAIN, open_files={weather: OpenFile(UNRELATED, "python")})
    assert "pkg/weather.py" not in [s.path for s in found.snippets]
    # The same tab once the code near the cursor reads like it: the similar-code windows find it.
    similar = MAIN + "colour = colour_of_the_sky(weather)\n    if weather == 'clear':\n        "
    found = context_for(root, similar, open_files={weather: OpenFile(UNRELATED, "python")})
    assert "pkg/weather.py" in [s.path for s in found.snippets]
    (window,) = [s for s in found.snippets if s.path == "pkg/weather.py"]
    assert len(window.reasons) == 1 and re.fullmatch(r"lines \d+-\d+: similar code \(0\.\d\d\)", window.reasons[0])


def test_an_open_documents_text_wins_over_the_disk(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    util = str(root / "pkg" / "util.py")
    edited = UTIL.replace("strict: bool = False", "strict: bool = True, limit: int = 8")
    found = context_for(root, MAIN, open_files={util: OpenFile(edited, "python")})
    assert "limit: int = 8" in found.snippets[0].text
    # Changed on disk while open: still the editor's text.
    (root / "pkg" / "util.py").write_text(UTIL.replace("parse_header", "parse_other"))
    found = context_for(root, MAIN, open_files={util: OpenFile(edited, "python")})
    assert "def parse_header(" in found.snippets[0].text and "limit: int = 8" in found.snippets[0].text


def test_the_context_stays_the_same_while_the_user_types_a_line(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    typed = MAIN + "parse_header(request.headers['x'], strict=True)"
    keys = {retrieval_key(typed[: len(MAIN) + n], len(MAIN) + n) for n in range(len(typed) - len(MAIN) + 1)}
    assert len(keys) == 1  # the cursor's line is not part of the key
    contexts = {context_for(root, typed[: len(MAIN) + n]) for n in range(0, len(typed) - len(MAIN) + 1, 7)}
    assert len(contexts) == 1


def test_the_budget_is_kept_and_the_best_pieces_go_first(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    found = context_for(root, MAIN, budget=260)
    text = "".join(s.text for s in found.snippets)
    assert sum(len(s.text) + len(s.path) + 16 for s in found.snippets) <= 260
    # Registry is used near the cursor: it goes first; parse_header (not used yet) when it fits.
    assert "class Registry:" in text


def test_nothing_outside_the_root_is_read(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "keys.py").write_text("def api_key():\n    return 'hunter2'\n")
    os.symlink(outside / "keys.py", root / "pkg" / "keys.py")
    text = "from pkg.keys import api_key\n\n\ndef f():\n    return api_key()\n    hunter = "
    found = context_for(root, text)
    assert "hunter2" not in "".join(s.text for s in found.snippets)
    assert all("keys" not in s.path for s in found.snippets)


def test_go_and_typescript_imports_bring_their_definitions(tmp_path: Path) -> None:
    root = tmp_path / "web"
    (root / "src" / "lib").mkdir(parents=True)
    (root / "src" / "lib" / "format.ts").write_text(
        "export function formatPrice(cents: number, currency: string): string {\n  return `${cents / 100} ${currency}`;\n}\n"
    )
    main = "import { formatPrice } from './lib/format';\n\nexport function show(c: number) {\n  return "
    index = WorkspaceIndex([str(root)])
    index.scan()
    path = str(root / "src" / "main.ts")
    snippets = retrieve(WorkspaceView(index, {path: OpenFile(main, "typescript")}), Cursor(path, main, len(main), "typescript"), 1000)
    assert [s.path for s in snippets] == ["src/lib/format.ts"]
    assert "export function formatPrice(cents: number, currency: string): string" in snippets[0].text


def test_qwen_repo_template_gets_the_repository_format_and_the_key_covers_it() -> None:
    qwen = TEMPLATES["qwen2.5-coder-repo"]
    text = "import util\n\n\ndef f(x):\n    return "
    cross = CrossFile((Snippet("pkg/util.py", "def g(y):\n    return '<|fim_middle|>'"),), "proj", "pkg/main.py")
    prompt = anchored_prompt(PromptRequest(text, len(text), uri="file:///proj/pkg/main.py", language_id="python",
                                           template=qwen, budget=PromptBudget(), cross_file=cross))
    assert prompt.text.startswith("<|repo_name|>proj\n<|file_sep|>pkg/util.py\ndef g(y):\n")
    assert "<|file_sep|>pkg/main.py\n<|fim_prefix|>import util" in prompt.text
    assert prompt.text.count("<|fim_middle|>") == 1  # the snippet's own marker is broken up, the template's stays
    assert prompt.stable_chars > prompt.text.index("<|fim_prefix|>")
    other = anchored_prompt(PromptRequest(text, len(text), uri="file:///proj/pkg/main.py", language_id="python",
                                          template=qwen, budget=PromptBudget(),
                                          cross_file=CrossFile((Snippet("pkg/util.py", "def h(): ..."),), "proj", "pkg/main.py")))
    assert other.key != prompt.key  # routing and caches tell the two apart
    # A model without a repository format gets path comments inside its prefix, as before; so does
    # Qwen's default template (the dev set preferred them: bench/results/crossfile-batch-b.json).
    for name in ("starcoder2", "qwen2.5-coder"):
        plain = anchored_prompt(PromptRequest(text, len(text), language_id="python", template=TEMPLATES[name],
                                              budget=PromptBudget(), cross_file=cross))
        assert "# pkg/util.py\ndef g(y):" in plain.text and "<|repo_name|>" not in plain.text
    assert "<|fim_prefix|># pkg/util.py\ndef g(y):" in plain.text


def test_sessions_sharing_a_root_share_one_index_and_it_goes_with_the_last(tmp_path: Path) -> None:
    root, other = make_tree(tmp_path), tmp_path / "other"
    other.mkdir()

    async def run() -> None:
        registry = IndexRegistry()
        first, second = SessionFolders(registry), SessionFolders(registry)
        first.add([str(root)])
        second.add([str(root), str(other), str(tmp_path / "missing")])
        assert first.indexes()[0] is second.indexes()[0]
        assert len(second.indexes()) == 2  # the missing folder is logged and left out
        for _ in range(50):
            if first.stats()["scan_done"]:
                break
            await asyncio.sleep(0.05)
        assert first.stats()["files"] == 4 and first.stats()["roots"] == [str(root)]
        assert first.index_for(str(root / "pkg" / "util.py")) is first.indexes()[0]
        assert first.index_for(str(other / "x.py")) is None  # not this session's folder
        first.close()
        assert str(root) in registry.roots()
        second.close()
        assert registry.roots() == ()

    asyncio.run(run())


def test_uris_become_paths() -> None:
    assert uri_path("file:///tmp/a%20b/c.py") == "/tmp/a b/c.py"
    assert uri_path("untitled:Untitled-1") is None
    assert uri_path(Document("file:///x/y.py", "python", "").uri) == "/x/y.py"


def test_cross_file_settings() -> None:
    import pytest
    from lsp.config import ConfigError, Settings, merge_settings

    assert Settings().cross_file == "workspace"
    assert merge_settings(Settings(), {"crossFile": True}).cross_file == "workspace"  # what true meant grew
    assert merge_settings(Settings(), {"crossFile": False}).cross_file == "off"
    assert merge_settings(Settings(), {"crossFile": "open"}).cross_file == "open"
    with pytest.raises(ConfigError, match='"off" or "open" or "workspace"'):
        merge_settings(Settings(), {"crossFile": "tabs"})
    assert Settings().budget_for(2048).snippet_tokens == 512  # from the workspace
    assert Settings().budget_for(2048).prefix_tokens == 1024  # with room for it at the default maxTokens
    assert merge_settings(Settings(), {"crossFile": "open"}).budget_for(2048).snippet_tokens == 256  # as before
    assert merge_settings(Settings(), {"crossFileTokens": 600}).budget_for(2048).snippet_tokens == 600
    assert merge_settings(Settings(), {"crossFileTokens": 600}).budget_for(2048).prefix_tokens < 1024  # room is shared
