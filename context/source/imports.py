"""From a source file's imports to the workspace files they name, and for each imported name the
file(s) that define it: Python (absolute, relative, packages, ``src/`` layout, names that are
submodules or re-exported by a package's ``__init__``), JavaScript/TypeScript (relative specifiers
with or without extensions, ``index`` files, ``tsconfig``/``jsconfig`` ``paths`` and ``baseUrl``,
``export ... from`` re-exports) and Go (the ``go.mod`` module path and the package directory; the
names are the package's exported identifiers the file uses).

Imports that name nothing in the workspace (the standard library, dependencies) are left out.
Everything is read through a :class:`SourceTree` (the workspace index), so nothing outside the
roots is opened.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from context.source.definitions import js_imports, python_imports
from context.source.languages import language_info, normalize_language_id
from context.source.workspace import FileSummary

_MAX_DEPTH = 4  # re-exports followed through at most this many files


class SourceTree(Protocol):
    """What resolution reads (:class:`context.source.workspace.WorkspaceIndex` is one)."""

    def roots(self) -> tuple[str, ...]: ...

    def is_file(self, path: str) -> bool: ...

    def text(self, path: str) -> str | None: ...

    def summary(self, path: str) -> FileSummary | None: ...

    def files_in(self, directory: str) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class ResolvedImport:
    """One import of the current file: the module as written, the workspace files it is (a Go
    package: all its files), and for each name taken from it the files defining that name."""

    module: str
    files: tuple[str, ...]
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def resolve_imports(tree: SourceTree, path: str, text: str, language_id: str = "") -> tuple[ResolvedImport, ...]:
    """The workspace files that ``text`` (the file at ``path``) imports, in the order written."""
    family = language_info(normalize_language_id(language_id, path)).family
    path = os.path.abspath(path)
    if family == "python":
        return _PythonResolver(tree).resolve(path, text)
    if family == "javascript":
        return _JsResolver(tree).resolve(path, text)
    if family == "go":
        return _resolve_go(tree, path, text)
    return ()


def _within_roots(tree: SourceTree, path: str) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in tree.roots())


def _defining(tree: SourceTree, files: Sequence[str], name: str) -> tuple[str, ...]:
    found = []
    for file in files:
        summary = tree.summary(file)
        if summary is not None and summary.defines(name):
            found.append(file)
    return tuple(found)


# ------------------------------------------------------------------------------------------------
# Python


def _is_from_name(module: str, imports: Mapping[str, tuple[str, ...]]) -> bool:
    """Whether ``module`` is the ``pkg.name`` entry python_imports adds for ``from pkg import name``."""
    parent, dot, name = module.rpartition(".")
    if not dot:
        return False
    return parent in imports and name in imports[parent]


class _PythonResolver:
    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._imports: dict[str, dict[str, tuple[str, ...]]] = {}
        self._bases: dict[str, list[str]] = {}
        self._modules: dict[tuple[str, str], str | None] = {}

    def resolve(self, path: str, text: str) -> tuple[ResolvedImport, ...]:
        imports = python_imports(text)
        merged: dict[tuple[str, tuple[str, ...]], dict[str, tuple[str, ...]]] = {}
        for module, names in imports.items():
            if _is_from_name(module, imports) and self.module_file(path, module.rpartition(".")[0]):
                continue  # handled as a name of its parent
            file = self.module_file(path, module)
            if file is not None:
                found = {n: self.name_files(file, n, 0, set()) for n in names}
                merged.setdefault((module, (file,)), {}).update({n: f for n, f in found.items() if f})
                continue
            parent, _, name = module.rpartition(".")
            parent = parent if parent.strip(".") or not module.startswith(".") else parent + "."
            parent_file = self.module_file(path, parent) if parent else None
            if parent_file is not None:  # `from . import name`, `from pkg import name` as one entry
                files = self.name_files(parent_file, name, 0, set())
                entry = merged.setdefault((parent, (parent_file,)), {})
                if files:
                    entry[name] = files
        return tuple(ResolvedImport(module, files, names) for (module, files), names in merged.items())

    def module_file(self, importer: str, module: str) -> str | None:
        """The file a module names, from the file ``importer``."""
        key = (os.path.dirname(importer), module)
        if key not in self._modules:
            self._modules[key] = self._find_module(importer, module)
        return self._modules[key]

    def _find_module(self, importer: str, module: str) -> str | None:
        bare = module.lstrip(".")
        level = len(module) - len(bare)
        parts = bare.split(".") if bare else []
        if level:
            base = os.path.dirname(importer)
            for _ in range(level - 1):
                base = os.path.dirname(base)
            bases = [base] if _within_roots(self.tree, base) else []
        else:
            bases = self.bases(importer)
        for base in bases:
            found = self._file_in(os.path.join(base, *parts), bool(parts))
            if found is not None:
                return found
        return None

    def _file_in(self, target: str, may_be_module: bool) -> str | None:
        candidates = [target + ".py", target + ".pyi"] if may_be_module else []
        candidates += [os.path.join(target, "__init__.py"), os.path.join(target, "__init__.pyi")]
        return next((c for c in candidates if self.tree.is_file(c)), None)

    def bases(self, importer: str) -> list[str]:
        """Where absolute imports start: above the importer's top package, each root, its src/."""
        if importer not in self._bases:
            self._bases[importer] = self._find_bases(importer)
        return self._bases[importer]

    def _find_bases(self, importer: str) -> list[str]:
        top = os.path.dirname(importer)
        while self.tree.is_file(os.path.join(top, "__init__.py")) and _within_roots(self.tree, os.path.dirname(top)):
            top = os.path.dirname(top)
        found = [top] if _within_roots(self.tree, top) else []
        for root in self.tree.roots():
            found += [root, os.path.join(root, "src"), os.path.join(root, "lib")]
        return list(dict.fromkeys(found))

    def name_files(self, module_file: str, name: str, depth: int, seen: set[str]) -> tuple[str, ...]:
        """The files defining ``name`` as seen from ``module_file``: a submodule of its package, its
        own definition, or a re-export (``from .x import name``, ``from .x import *``), followed."""
        if module_file in seen or depth > _MAX_DEPTH:
            return ()
        seen.add(module_file)
        if os.path.basename(module_file).startswith("__init__."):
            sub = self._file_in(os.path.join(os.path.dirname(module_file), name), True)
            if sub is not None:
                return (sub,)
        if _defining(self.tree, [module_file], name):
            return (module_file,)
        imports = self._imports_of(module_file)
        for module, names in imports.items():
            if names and name not in names:
                continue
            if not names and module.rpartition(".")[2] == name:  # `from . import name`: a module
                target = self.module_file(module_file, module)
                if target is not None:
                    return (target,)
            target = self.module_file(module_file, module)
            if target is not None and target != module_file:
                found = self.name_files(target, name, depth + 1, seen)
                if found:
                    return found
        return ()

    def _imports_of(self, path: str) -> dict[str, tuple[str, ...]]:
        if path not in self._imports:
            text = self.tree.text(path)
            self._imports[path] = python_imports(text) if text else {}
        return self._imports[path]


# ------------------------------------------------------------------------------------------------
# JavaScript / TypeScript

_JS_EXTENSIONS = (".ts", ".tsx", ".d.ts", ".js", ".jsx", ".mjs", ".cjs", ".mts", ".cts")
_JS_EXT = re.compile(r"(?:\.d)?\.(?:[cm]?[jt]sx?)$")
_JS_FROM_ANY = re.compile(r"""\b(?:import|export)\s+(?:type\s+)?([^;'"]*?)\s*from\s*['"]([^'"./][^'"]*)['"]""")
_JS_CALL_ANY = re.compile(
    r"""(?:(?:const|let|var)\s+([^=;]+?)\s*=\s*)?\b(?:require|import)\s*\(\s*['"]([^'"./][^'"]*)['"]\s*\)"""
)
_JS_EXPORT_STAR = re.compile(r"""\bexport\s*\*\s*(?:as\s+\w+\s*)?from\s*['"]([^'"]+)['"]""")
_JSON_NOISE = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/', re.S)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")


def _clause_names(clause: str) -> tuple[str, ...]:
    """The names in an import clause's braces (``()``: the whole module)."""
    brace = re.search(r"\{([^}]*)\}", clause)
    if brace is None or clause.replace(brace.group(0), "").strip(" ,"):
        return ()
    names = []
    for part in brace.group(1).split(","):
        name = part.strip().split(" as ")[0].split(":")[0].strip().removeprefix("type ").strip()
        if name.isidentifier():
            names.append(name)
    return tuple(sorted(set(names)))


def _bare_imports(text: str) -> dict[str, tuple[str, ...]]:
    """Non-relative specifiers (``@/util``, ``lib/x``; tsconfig paths may map them) -> names."""
    found: dict[str, tuple[str, ...]] = {}
    for regex in (_JS_FROM_ANY, _JS_CALL_ANY):
        for m in regex.finditer(text):
            names = _clause_names(m.group(1) or "")
            spec = m.group(2)
            whole = not names or (spec in found and not found[spec])
            found[spec] = () if whole else tuple(sorted({*found.get(spec, ()), *names}))
    return found


def _parse_jsonc(text: str) -> object:
    """tsconfig.json: JSON with comments and trailing commas."""
    stripped = _JSON_NOISE.sub(lambda m: m.group(0) if m.group(0).startswith('"') else "", text)
    return json.loads(_TRAILING_COMMA.sub(r"\1", stripped))


@dataclass(frozen=True)
class _TsPaths:
    base_url: str | None
    paths_base: str
    paths: tuple[tuple[str, tuple[str, ...]], ...]

    def candidates(self, spec: str) -> Iterator[str]:
        for pattern, targets in sorted(self.paths, key=lambda p: -len(p[0].split("*")[0])):
            prefix, star, suffix = pattern.partition("*")
            if star and spec.startswith(prefix) and spec.endswith(suffix) and len(spec) >= len(prefix) + len(suffix):
                matched = spec[len(prefix) : len(spec) - len(suffix)]
                yield from (os.path.join(self.paths_base, t.replace("*", matched)) for t in targets)
            elif not star and spec == pattern:
                yield from (os.path.join(self.paths_base, t) for t in targets)
        if self.base_url is not None:
            yield os.path.join(self.base_url, spec)


class _JsResolver:
    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._configs: dict[str, _TsPaths | None] = {}

    def resolve(self, path: str, text: str) -> tuple[ResolvedImport, ...]:
        result = []
        for spec, names in [*js_imports(text).items(), *_bare_imports(text).items()]:
            file = self.spec_file(path, spec)
            if file is None:
                continue
            found = {n: self.name_files(file, n, 0, set()) for n in names}
            result.append(ResolvedImport(spec, (file,), {n: f for n, f in found.items() if f}))
        return tuple(result)

    def spec_file(self, importer: str, spec: str) -> str | None:
        if spec.startswith("."):
            return self._file_at(os.path.normpath(os.path.join(os.path.dirname(importer), spec)))
        config = self.config_for(os.path.dirname(importer))
        if config is None:
            return None
        return next((f for f in map(self._file_at, config.candidates(spec)) if f is not None), None)

    def _file_at(self, base: str) -> str | None:
        """A module file for a path written with or without extension, or its directory's index."""
        base = os.path.normpath(base)
        if _JS_EXT.search(base) and self.tree.is_file(base):
            return base
        stems = [base, _JS_EXT.sub("", base)] if _JS_EXT.search(base) else [base]
        for stem in stems:
            for ext in _JS_EXTENSIONS:
                if self.tree.is_file(stem + ext):
                    return stem + ext
        for ext in _JS_EXTENSIONS:
            if self.tree.is_file(os.path.join(base, "index" + ext)):
                return os.path.join(base, "index" + ext)
        return None

    def config_for(self, directory: str) -> _TsPaths | None:
        """The nearest tsconfig.json (or jsconfig.json) at or above ``directory``, within a root."""
        if directory in self._configs:
            return self._configs[directory]
        found: _TsPaths | None = None
        if _within_roots(self.tree, directory):
            for name in ("tsconfig.json", "jsconfig.json"):
                found = self._read_config(os.path.join(directory, name), 0)
                if found is not None:
                    break
            parent = os.path.dirname(directory)
            if found is None and parent != directory:
                found = self.config_for(parent)
        self._configs[directory] = found
        return found

    def _read_config(self, path: str, depth: int) -> _TsPaths | None:
        text = self.tree.text(path)
        if text is None or depth > _MAX_DEPTH:
            return None
        try:
            data = _parse_jsonc(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        inherited = None
        extends = data.get("extends")
        if isinstance(extends, str) and extends.startswith("."):
            target = os.path.normpath(os.path.join(os.path.dirname(path), extends))
            inherited = self._read_config(target if target.endswith(".json") else target + ".json", depth + 1)
        return _ts_paths(data.get("compilerOptions"), os.path.dirname(path), inherited)

    def name_files(self, file: str, name: str, depth: int, seen: set[str]) -> tuple[str, ...]:
        """The files defining ``name`` as exported by ``file``, through ``export ... from`` chains."""
        if file in seen or depth > _MAX_DEPTH:
            return ()
        seen.add(file)
        if _defining(self.tree, [file], name):
            return (file,)
        text = self.tree.text(file) or ""
        followed = [spec for spec, names in js_imports(text).items() if name in names]
        followed += _JS_EXPORT_STAR.findall(text)
        for spec in followed:
            target = self.spec_file(file, spec)
            found = self.name_files(target, name, depth + 1, seen) if target else ()
            if found:
                return found
        return ()


def _ts_paths(options: object, config_dir: str, inherited: _TsPaths | None) -> _TsPaths | None:
    """A config's ``baseUrl`` and ``paths`` (relative to the config declaring them), over the
    ones it extends."""
    options = options if isinstance(options, dict) else {}
    base_url = inherited.base_url if inherited else None
    if isinstance(options.get("baseUrl"), str):
        base_url = os.path.normpath(os.path.join(config_dir, options["baseUrl"]))
    paths = inherited.paths if inherited else ()
    paths_base = inherited.paths_base if inherited else config_dir
    raw = options.get("paths")
    if isinstance(raw, dict):
        paths = tuple(
            (k, tuple(t for t in v if isinstance(t, str))) for k, v in raw.items() if isinstance(k, str) and isinstance(v, list)
        )
        paths_base = base_url or config_dir
    elif isinstance(options.get("baseUrl"), str) and inherited is not None:
        paths_base = base_url or paths_base
    if base_url is None and not paths:
        return None
    return _TsPaths(base_url, paths_base, paths)


# ------------------------------------------------------------------------------------------------
# Go

_GO_BLOCK = re.compile(r"^\s*import\s*\((.*?)\)", re.M | re.S)
_GO_SPEC = re.compile(r'^\s*(?:import\s+)?([\w.]+\s+)?"([^"]+)"', re.M)
_GO_SINGLE = re.compile(r'^\s*import\s+([\w.]+\s+)?"([^"]+)"', re.M)
_GO_MODULE = re.compile(r"^\s*module\s+(\S+)", re.M)
_GO_PACKAGE = re.compile(r"^\s*package\s+(\w+)", re.M)


def go_imports(text: str) -> dict[str, str]:
    """Import path -> the name the file uses for it (its alias, else ``""``)."""
    found: dict[str, str] = {}
    for block in _GO_BLOCK.finditer(text):
        for m in _GO_SPEC.finditer(block.group(1)):
            found[m.group(2)] = (m.group(1) or "").strip()
    for m in _GO_SINGLE.finditer(text):
        found[m.group(2)] = (m.group(1) or "").strip()
    return found


def _go_module(tree: SourceTree, directory: str) -> tuple[str, str] | None:
    """The nearest go.mod at or above ``directory``: (module path, its directory)."""
    while _within_roots(tree, directory):
        text = tree.text(os.path.join(directory, "go.mod"))
        match = _GO_MODULE.search(text) if text else None
        if match:
            return match.group(1), directory
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    return None


def _resolve_go(tree: SourceTree, path: str, text: str) -> tuple[ResolvedImport, ...]:
    module = _go_module(tree, os.path.dirname(path))
    if module is None:
        return ()
    module_path, module_dir = module
    result = []
    for import_path, alias in go_imports(text).items():
        if import_path != module_path and not import_path.startswith(module_path + "/"):
            continue
        directory = os.path.join(module_dir, *import_path[len(module_path) :].strip("/").split("/"))
        files = tuple(f for f in tree.files_in(directory) if f.endswith(".go") and not f.endswith("_test.go"))
        if not files:
            continue
        if not alias:
            package = _GO_PACKAGE.search(tree.text(files[0]) or "")
            alias = package.group(1) if package else import_path.rsplit("/", 1)[-1]
        used = sorted(set(re.findall(rf"\b{re.escape(alias)}\.([A-Z]\w*)", text))) if alias not in ("_", ".") else []
        names = {n: found for n in used if (found := _defining(tree, files, n))}
        result.append(ResolvedImport(import_path, files, names))
    return tuple(result)
