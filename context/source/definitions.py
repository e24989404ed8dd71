"""Top-level definitions of a source file (name, signature, full text) and the modules it
imports, read with the tree-sitter grammars: what the workspace index keeps per file and what the
cross-file context shows of another file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from context.source.languages import HEADER_STATEMENT, language_info, parser_for
from context.source.memo import TextMemo

try:  # typing only; tree-sitter is always installed with ember
    from tree_sitter import Node, Parser
except ImportError:  # pragma: no cover
    Node = Parser = object  # type: ignore[misc,assignment]


@dataclass(frozen=True)
class Definition:
    """A top-level definition of another file: its name, its text without bodies, its full text."""

    name: str
    signature: str
    full: str


_CLASSLIKE = frozenset(
    {"class_definition", "class_declaration", "abstract_class_declaration", "class", "impl_item", "trait_item"}
)
_MEMBER_TYPES = frozenset(
    {
        "function_definition",
        "decorated_definition",
        "method_definition",
        "function_item",
        "function_signature_item",
        "method_signature",
        "abstract_method_signature",
    }
)
_DATA_LIMIT = 400  # a body-less definition (struct, interface, constant) is shown whole up to this
FULL_LIMIT = 1200  # an imported definition is shown whole up to this

_PY_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*(?:\\\n[^\n#;]*)*)", re.M)
_PY_IMPORT = re.compile(r"^[ \t]*import[ \t]+([^\n#;]+)", re.M)
_JS_FROM = re.compile(r"""\b(?:import|export)\s+(?:type\s+)?([^;'"]*?)\s*from\s*['"](\.\.?/[^'"]+)['"]""")
_JS_REQUIRE = re.compile(r"""(?:(?:const|let|var)\s+([^=;]+?)\s*=\s*)?\b(?:require|import)\s*\(\s*['"](\.\.?/[^'"]+)['"]\s*\)""")
_JS_EXT = re.compile(r"\.(?:[cm]?[jt]sx?)$")

def clean_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def python_imports(text: str) -> dict[str, tuple[str, ...]]:
    """Imported module -> imported names (``()``: the module itself) for a Python source.

    ``from pkg import mod`` may import a module: it is listed as ``pkg.mod`` too."""
    found: dict[str, set[str] | None] = {}

    def add(module: str, names: Sequence[str]) -> None:
        if not module.strip("."):
            return
        current = found.get(module, set())
        found[module] = None if current is None or not names else current | set(names)

    for m in _PY_FROM.finditer(text):
        module = m.group(1)
        raw = m.group(2).replace("\\\n", " ").strip().strip("()")
        names = [part.split(" as ")[0].strip() for part in raw.replace("\n", " ").split(",")]
        names = [n for n in names if n.isidentifier()]
        add(module, names)
        for name in names:
            add(f"{module}.{name}" if module.strip(".") else f"{module}{name}", ())
    for m in _PY_IMPORT.finditer(text):
        for part in m.group(1).split(","):
            module = part.split(" as ")[0].strip()
            if module and all(p.isidentifier() for p in module.split(".")):
                add(module, ())
    return {module: tuple(sorted(names)) if names else () for module, names in found.items()}


def js_imports(text: str) -> dict[str, tuple[str, ...]]:
    """Relative import path (without extension) -> imported names (``()``: all) for JS/TS."""
    found: dict[str, set[str] | None] = {}
    for regex in (_JS_FROM, _JS_REQUIRE):
        for m in regex.finditer(text):
            clause, spec = (m.group(1) or ""), _JS_EXT.sub("", m.group(2))
            names: set[str] = set()
            brace = re.search(r"\{([^}]*)\}", clause)
            if brace:
                for part in brace.group(1).split(","):
                    name = part.strip().split(" as ")[0].split(":")[0].strip()
                    if name.startswith("type "):
                        name = name[5:].strip()
                    if name.isidentifier():
                        names.add(name)
            current = found.get(spec, set())
            # A default or namespace import next to the braces means the whole module.
            whole = not brace or bool(clause.replace(brace.group(0), "").strip(" ,"))
            found[spec] = None if current is None or whole else current | names
    return {spec: tuple(sorted(names)) if names else () for spec, names in found.items()}


@lru_cache(maxsize=4096)
def module_keys(path: str, family: str) -> frozenset[str]:
    """The names an import can use for the file at ``path``: every trailing run of its path parts
    (``a.b.mod``, ``b.mod``, ``mod`` in Python, ``pkg/__init__.py`` as ``pkg``; ``src/util/x``,
    ``util/x``, ``x`` in JS/TS, ``dir/index.ts`` as ``dir`` too)."""
    clean = clean_path(path).replace("\\", "/")
    if family == "python":
        parts = clean.split("/")
        stem = parts[-1].rsplit(".", 1)[0]
        parts = parts[:-1] if stem == "__init__" else parts[:-1] + [stem]
        return frozenset(".".join(parts[i:]) for i in range(len(parts)) if parts[i:])
    stems = [_JS_EXT.sub("", clean)]
    if stems[0].endswith("/index"):
        stems.append(stems[0][: -len("/index")])
    keys: set[str] = set()
    for stem in stems:
        parts = stem.split("/")
        keys.update("/".join(parts[i:]) for i in range(len(parts)) if parts[i:])
    return frozenset(keys)


def import_key(module: str, family: str) -> str:
    """An imported module or relative path in the form :func:`module_keys` lists."""
    if family == "python":
        return module.lstrip(".")
    return "/".join(p for p in module.split("/") if p not in (".", ".."))


def _node_text(data: bytes, start: int, end: int) -> str:
    return data[start:end].decode("utf-8", "replace")


def _line_start_byte(data: bytes, byte: int) -> int:
    return data.rfind(b"\n", 0, byte) + 1


def _unwrap(node: Node) -> Node:
    """The definition inside export/decorator wrappers (the wrapper's text is kept by callers)."""
    if node.type in ("export_statement", "decorated_definition"):
        inner = node.child_by_field_name("declaration") or node.child_by_field_name("definition")
        if inner is not None:
            return inner
    return node


def _name_of(node: Node) -> str:
    name = node.child_by_field_name("name") or node.child_by_field_name("type")
    if name is None and node.type in ("lexical_declaration", "variable_declaration", "type_declaration", "const_declaration"):
        for child in node.named_children:
            name = child.child_by_field_name("name")
            if name is not None:
                break
    if name is None and node.type == "expression_statement" and node.named_children:
        target = node.named_children[0].child_by_field_name("left")
        if target is not None and target.type == "member_expression":  # exports.f = / X.prototype.f =
            target = target.child_by_field_name("property")
        name = target if target is not None and target.type in ("identifier", "property_identifier") else None
    return name.text.decode("utf-8", "replace") if name is not None and name.text is not None else ""


def _body_of(node: Node) -> Node | None:
    body = node.child_by_field_name("body")
    if body is None and node.type in ("lexical_declaration", "variable_declaration", "expression_statement"):
        for child in node.named_children:
            value = child.child_by_field_name("value") or child.child_by_field_name("right")
            if value is not None and value.type in ("arrow_function", "function_expression", "function"):
                body = value.child_by_field_name("body")
    return body


def _header_end(body: Node) -> int:
    """Where a definition's header ends: after the token before its body (the ``:`` in Python,
    the parameters or return type elsewhere), so a comment that opens the body stays out."""
    before = body.prev_sibling
    while before is not None and before.type == "comment":
        before = before.prev_sibling
    return before.end_byte if before is not None else body.start_byte


def _elide(language_id: str) -> str:
    return language_info(language_id).elided_body


def _signature(wrapper: Node, data: bytes, language_id: str, depth: int = 0) -> str:
    node = _unwrap(wrapper)
    start, pad = wrapper.start_byte, ""
    if depth:
        line_start = _line_start_byte(data, wrapper.start_byte)
        if data[line_start : wrapper.start_byte].strip():  # shares its line with other code
            pad = "    " * depth
        else:
            start = line_start
    body = _body_of(node)
    if node.type in _CLASSLIKE and body is not None:
        head = _node_text(data, start, _header_end(body)).rstrip()
        members = []
        for member in body.named_children:
            inner = _unwrap(member)
            if inner.type not in _MEMBER_TYPES:
                continue
            name = _name_of(inner)
            if language_id == "python" and name.startswith("_") and name != "__init__":
                continue
            if name.startswith("#"):
                continue
            members.append(_signature(member, data, language_id, depth + 1))
        if language_id == "python":
            return "\n".join([pad + head + (" ..." if not members else ""), *members])
        indent = pad or _node_text(data, start, wrapper.start_byte)
        return "\n".join([pad + head + " {", *members, indent + "}"])
    if body is None or node.type in ("struct_item", "enum_item", "interface_declaration", "type_alias_declaration"):
        text = _node_text(data, start, wrapper.end_byte)
        if len(text) <= _DATA_LIMIT:
            return pad + text
        first = text.split("\n", 1)[0]
        return pad + (first if body is None else _node_text(data, start, _header_end(body)).rstrip() + _elide(language_id))
    return pad + _node_text(data, start, _header_end(body)).rstrip() + _elide(language_id)


def definitions(
    text: str, language_id: str, path: str = "", memo: TextMemo | None = None, *, private: bool = False
) -> tuple[Definition, ...]:
    """Top-level definitions of a source file in file order (remembered in ``memo``, the memo of
    the document whose text ``text`` is, when given). ``private``: Python's ``_names`` too (an
    import can name them; an open tab's outline leaves them out)."""
    memo = memo if memo is not None and memo.describes(text) else None
    what = (path, language_id, private)
    cached = memo.derived("definitions", 0, len(text), what) if memo is not None else None
    if isinstance(cached, tuple):
        return cached
    parser = parser_for(language_id)
    result = _line_definitions(text) if parser is None else _tree_definitions(text, language_id, parser, private)
    if memo is not None:
        memo.remember("definitions", 0, len(text), what, result)
    return result


def _line_definitions(text: str) -> tuple[Definition, ...]:
    """Without a grammar: every line at column 0 that is not a comment or a closer."""
    result: list[Definition] = []
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith(("#", "//", "/*", "*", "}", ")", "]")):
            words = line.split("(")[0].split()  # empty for a line that starts with "(": a subshell
            result.append(Definition(words[-1] if words else "", line, line))
    return tuple(result)


def _tree_definitions(text: str, language_id: str, parser: Parser, private: bool = False) -> tuple[Definition, ...]:
    result: list[Definition] = []
    data = text.encode("utf-8", "surrogatepass")
    for child in parser.parse(data).root_node.named_children:
        head = data[child.start_byte : child.start_byte + 200].decode("utf-8", "ignore")
        if child.type in ("comment", "ERROR") or HEADER_STATEMENT.match(head):
            continue
        node = _unwrap(child)
        name = _name_of(node)
        if not name or (language_id == "python" and name.startswith("_") and not (private and name != "_")):
            continue
        if node.type == "expression_statement" and child.end_byte - child.start_byte > _DATA_LIMIT:
            continue  # long module-level statements are code, not declarations
        signature = _signature(child, data, language_id)
        result.append(Definition(name, signature, _node_text(data, child.start_byte, child.end_byte)))
    return tuple(result)
