"""Import resolution to workspace files: golden results per language on small trees."""

from __future__ import annotations

from pathlib import Path

from context.source.imports import ResolvedImport, go_imports, resolve_imports
from context.source.workspace import WorkspaceIndex


def tree(root: Path, files: dict[str, str], scan: bool = True) -> WorkspaceIndex:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    index = WorkspaceIndex([str(root)])
    while scan and not index.scan().done:
        pass
    return index


def golden(root: Path, found: tuple[ResolvedImport, ...]) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    def rel(path: str) -> str:
        return str(Path(path).relative_to(root))

    return {r.module: ([rel(f) for f in r.files], {n: [rel(f) for f in fs] for n, fs in r.names.items()}) for r in found}


PYTHON = {
    "pyproject.toml": "[project]\nname = 'app'\n",
    "src/app/__init__.py": "from .core import Engine\nfrom .util import *\n",
    "src/app/core.py": "class Engine:\n    def run(self): ...\n",
    "src/app/util.py": "def helper(x):\n    return x\n",
    "src/app/models/__init__.py": "",
    "src/app/models/user.py": "class User: ...\n",
    "src/app/cli.py": (
        "import os\nfrom app import Engine, helper, models\nfrom .core import Engine as E\nfrom . import util\n"
        "from .models.user import User\nimport app.models.user\nfrom .. import nothing\nfrom .models import missing\n"
    ),
}


def test_python_absolute_relative_packages_src_layout_and_reexports(tmp_path: Path) -> None:
    index = tree(tmp_path, PYTHON)
    cli = tmp_path / "src/app/cli.py"
    found = golden(tmp_path, resolve_imports(index, str(cli), cli.read_text(), "python"))
    assert found == {
        "app": (
            ["src/app/__init__.py"],
            {"Engine": ["src/app/core.py"], "helper": ["src/app/util.py"], "models": ["src/app/models/__init__.py"]},
        ),
        ".core": (["src/app/core.py"], {"Engine": ["src/app/core.py"]}),
        ".util": (["src/app/util.py"], {}),
        ".models.user": (["src/app/models/user.py"], {"User": ["src/app/models/user.py"]}),
        "app.models.user": (["src/app/models/user.py"], {}),
        ".models": (["src/app/models/__init__.py"], {}),  # `missing` is defined nowhere
    }


def test_python_flat_layout_and_from_dot_import_a_name(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "VERSION = '1'\n\ndef setup(): ...\n",
        "pkg/b.py": "def f(): ...\n",
        "pkg/sub/a.py": "from pkg.b import f\nfrom .. import setup, VERSION\nimport pkg\n",
        "pkg/sub/__init__.py": "",
    }
    index = tree(tmp_path, files)
    a = tmp_path / "pkg/sub/a.py"
    assert golden(tmp_path, resolve_imports(index, str(a), a.read_text())) == {
        "pkg.b": (["pkg/b.py"], {"f": ["pkg/b.py"]}),
        "..": (["pkg/__init__.py"], {"setup": ["pkg/__init__.py"], "VERSION": ["pkg/__init__.py"]}),
        "pkg": (["pkg/__init__.py"], {}),
    }


def test_resolution_works_before_the_scan_lists_the_files(tmp_path: Path) -> None:
    index = tree(tmp_path, PYTHON, scan=False)
    cli = tmp_path / "src/app/cli.py"
    assert golden(tmp_path, resolve_imports(index, str(cli), "from .core import Engine\n")) == {
        ".core": (["src/app/core.py"], {"Engine": ["src/app/core.py"]})
    }


JS = {
    "tsconfig.json": (
        '{\n  // comments and trailing commas are allowed\n  "compilerOptions": {\n    "baseUrl": "./src",\n'
        '    "paths": {"@/*": ["*"], "#config": ["config/index.ts"]},\n  },\n}\n'
    ),
    "src/util/index.ts": "export * from './dates';\nexport { clamp } from './math.js';\n",
    "src/util/dates.ts": "export function formatDate(d: Date): string {\n  return '';\n}\n",
    "src/util/math.ts": "export const clamp = (x: number) => x;\n",
    "src/widget.tsx": "export default function Widget() {\n  return null;\n}\n",
    "src/lib/legacy.cjs": "module.exports.load = function load() {};\n",
    "src/config/index.ts": "export const settings = {};\n",
    "src/app.ts": (
        "import { formatDate, clamp } from './util';\nimport Widget from './widget';\n"
        "import { load } from './lib/legacy.cjs';\nimport { formatDate as f2 } from '@/util/dates';\n"
        "import { clamp as c } from 'util/math';\nimport { settings } from '#config';\nimport React from 'react';\n"
        "const { missing } = require('./nowhere');\n"
    ),
}


def test_javascript_and_typescript_relative_index_extensions_and_tsconfig_paths(tmp_path: Path) -> None:
    index = tree(tmp_path, JS)
    app = tmp_path / "src/app.ts"
    assert golden(tmp_path, resolve_imports(index, str(app), app.read_text(), "typescript")) == {
        "./util": (["src/util/index.ts"], {"formatDate": ["src/util/dates.ts"], "clamp": ["src/util/math.ts"]}),
        "./widget": (["src/widget.tsx"], {}),
        "./lib/legacy": (["src/lib/legacy.cjs"], {"load": ["src/lib/legacy.cjs"]}),
        "@/util/dates": (["src/util/dates.ts"], {"formatDate": ["src/util/dates.ts"]}),
        "util/math": (["src/util/math.ts"], {"clamp": ["src/util/math.ts"]}),
        "#config": (["src/config/index.ts"], {"settings": ["src/config/index.ts"]}),
    }


def test_tsconfig_extends_and_no_config_means_relative_only(tmp_path: Path) -> None:
    files = {
        "web/tsconfig.base.json": '{"compilerOptions": {"paths": {"~/*": ["lib/*"]}}}',
        "web/tsconfig.json": '{"extends": "./tsconfig.base.json"}',
        "web/lib/x.js": "export function x() {}\n",
        "web/main.jsx": "import { x } from '~/x';\n",
        "plain/a.mjs": "export const a = 1;\n",
        "plain/b.js": "import { a } from './a.mjs';\nimport { y } from 'lib/x';\n",
    }
    index = tree(tmp_path, files)
    main, b = tmp_path / "web/main.jsx", tmp_path / "plain/b.js"
    web = golden(tmp_path, resolve_imports(index, str(main), main.read_text()))
    assert web == {"~/x": (["web/lib/x.js"], {"x": ["web/lib/x.js"]})}
    plain = golden(tmp_path, resolve_imports(index, str(b), b.read_text()))
    assert plain == {"./a": (["plain/a.mjs"], {"a": ["plain/a.mjs"]})}


GO = {
    "go.mod": "module example.com/shop\n\ngo 1.21\n",
    "internal/cart/cart.go": "package cart\n\ntype Cart struct{ Items []string }\n\nfunc New() *Cart { return &Cart{} }\n",
    "internal/cart/total.go": "package cart\n\nfunc (c *Cart) Total() int { return 0 }\n\nfunc Sum(xs []int) int { return 0 }\n",
    "internal/cart/cart_test.go": "package cart\n\nfunc TestNew() {}\n",
    "pkg/money/money.go": "package money\n\nfunc Format(x int) string { return \"\" }\n",
    "cmd/shop/main.go": (
        'package main\n\nimport (\n\t"fmt"\n\tc "example.com/shop/internal/cart"\n\t"example.com/shop/pkg/money"\n)\n\n'
        "func main() {\n\tx := c.New()\n\tfmt.Println(c.Sum(nil), money.Format(1), x)\n}\n"
    ),
}


def test_go_module_path_and_package_directory(tmp_path: Path) -> None:
    index = tree(tmp_path, GO)
    main = tmp_path / "cmd/shop/main.go"
    assert golden(tmp_path, resolve_imports(index, str(main), main.read_text(), "go")) == {
        "example.com/shop/internal/cart": (
            ["internal/cart/cart.go", "internal/cart/total.go"],
            {"New": ["internal/cart/cart.go"], "Sum": ["internal/cart/total.go"]},
        ),
        "example.com/shop/pkg/money": (["pkg/money/money.go"], {"Format": ["pkg/money/money.go"]}),
    }
    assert go_imports('import "a/b"\nimport x "c/d"\n') == {"a/b": "", "c/d": "x"}


def test_imports_never_leave_the_roots(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "secret").mkdir(parents=True)
    (outside / "secret/__init__.py").write_text("def key(): ...\n")
    index = tree(tmp_path / "root", {"pkg/__init__.py": "", "pkg/m.py": "from ... import secret\nfrom ..outside import x\n"})
    m = tmp_path / "root/pkg/m.py"
    assert resolve_imports(index, str(m), m.read_text()) == ()
    assert resolve_imports(index, str(tmp_path / "root/x.rb"), "require 'x'\n") == ()
