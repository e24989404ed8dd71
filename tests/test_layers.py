"""The folders are the architecture: no import circles between ember's modules, and no import
against the layers (ARCHITECTURE.md). Every import counts, also those inside functions and under
``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lsp", "context", "engine")

# Who may import whom, by layer (a module's layer: its room inside context/, else its package).
# Each layer may import itself and the layers listed; nothing else of ember's.
ALLOWED: dict[str, frozenset[str]] = {
    "lsp": frozenset({"context.source", "context.cut", "context.prompt", "engine"}),
    "engine": frozenset(),
    "context.source": frozenset(),
    "context.cut": frozenset({"context.source"}),
    "context.prompt": frozenset({"context.source", "context.cut"}),
}


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` under ``root``."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, name: str, modules: Mapping[str, Path]) -> set[str]:
    """The modules of ``modules`` that the module ``name`` (at ``path``) imports, anywhere in it."""
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` names a.b.c; a name in a module names the module
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
    return edges


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "context" and len(parts) > 1 else parts[0]


def against_layers(graph: Mapping[str, set[str]]) -> list[str]:
    """``a -> b`` for each import that the layers do not allow (the bare ``context`` package holds
    no code and is in no layer's list)."""
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer(target) != layer(module) and layer(target) not in ALLOWED.get(layer(module), frozenset())
    ]


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


def test_imports_follow_the_layers() -> None:
    graph = import_graph()
    assert {layer(m) for m in graph} >= {"lsp", "engine", "context.source", "context.cut", "context.prompt"}
    assert against_layers(graph) == []


def test_context_has_no_loose_modules() -> None:
    loose = [p.name for p in (ROOT / "context").glob("*.py") if p.name != "__init__.py"]
    assert loose == []


def test_the_check_finds_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The checks above can fail: a circle through a function-level import, and an import of lsp
    (and of a higher room) from below, in a small tree laid out like ember's."""
    (tmp_path / "lsp").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "context" / "source").mkdir(parents=True)
    (tmp_path / "context" / "prompt").mkdir()
    for package in ("lsp", "engine", "context", "context/source", "context/prompt"):
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "lsp" / "a.py").write_text("from lsp.b import thing\n")
    (tmp_path / "lsp" / "b.py").write_text("def thing():\n    from lsp import a\n")
    (tmp_path / "engine" / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lsp.a\n")
    (tmp_path / "context" / "source" / "s.py").write_text("from ..prompt import p\n")
    (tmp_path / "context" / "prompt" / "p.py").write_text("from context.source.s import x\n")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["context.prompt.p", "context.source.s"], ["lsp.a", "lsp.b"]]
    assert against_layers(graph) == ["context.source.s -> context.prompt.p", "engine.e -> lsp.a"]
