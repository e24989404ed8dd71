"""Golden tests for context.cut.postprocess on real-looking code, plus checks on the eval sets.

Each case is a document with the cursor marked by ``█``, the raw text a model might generate
there, and the text that must be inserted.
"""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from context.cut.postprocess import completion_mode, find_stop, plain_postprocess, plain_stop, postprocess, syntax_ok
from context.cut.surroundings import Mode
from context.source.document import Document
from tests.conftest import EVAL

CURSOR = "█"


def split(doc: str) -> tuple[str, str]:
    prefix, suffix = doc.split(CURSOR)
    return prefix, suffix


def complete(doc: str, generated: str, lang: str, mode: str | None = None) -> str:
    prefix, suffix = split(doc)
    mode = mode or completion_mode(prefix, suffix, lang)
    return postprocess(generated, prefix, suffix, lang, mode)


# --------------------------------------------------------------------------------------------
# single vs multi

MODES = [
    ("python", "def area(r):\n    █\n", "multi"),  # empty block body
    ("python", "def f(x):\n    y = x + 1\n    █\n    return y\n", "multi"),  # new statement
    ("python", "def f(x):\n█    return x\n", "multi"),  # whole lines above code
    ("python", "    total = sum(█)\n", "single"),
    ("python", "    return x█\n", "single"),
    ("python", 'def f():\n    """Sum things.\n\n    █\n    """\n', "single"),  # docstring
    ("javascript", "function add(a, b) {\n  █\n}\n", "multi"),
    ("javascript", "const xs = items.map(█);\n", "single"),
    ("typescript", "class Point {\n  █\n}\n", "multi"),
    ("rust", "fn main() {\n    █\n}\n", "multi"),
    ("rust", "/*\n█\n*/\nfn main() {}\n", "single"),  # block comment
    ("go", "func f() int {\n\t█\n}\n", "multi"),
    ("java", "class A {\n    /**\n     █\n     */\n    void f() {}\n}\n", "single"),  # javadoc
    ("java", "        Cache<String, String> c = Caffeine.newBuilder()\n            █.build();\n", "single"),
    ("cpp", "int main() {\n    █;\n}\n", "single"),  # an expression before `;`
    ("lua", "function f()\n  █\nend\n", "multi"),  # no grammar: line rules only
]


@pytest.mark.parametrize("lang,doc,mode", MODES)
def test_completion_mode(lang: str, doc: str, mode: str) -> None:
    prefix, suffix = split(doc)
    assert completion_mode(prefix, suffix, lang) == mode


# --------------------------------------------------------------------------------------------
# where a generated block ends

BLOCK_END = [
    (  # Python: the body ends where the model starts the next definition
        "python",
        "def area(r):\n    █\n\n\ndef perimeter(r):\n    return 2 * 3.14 * r\n",
        "return 3.14 * r * r\n\n\ndef volume(r):\n    return 0\n",
        "return 3.14 * r * r",
    ),
    (  # Python: a line dedented below the block ends it
        "python",
        "def total(xs):\n    t = 0\n    for x in xs:\n        █\n    return t\n",
        "t += x\n        print(x)\n    print(t)\n",
        "t += x\n        print(x)",
    ),
    (  # JavaScript: the editor's `}` is already there
        "javascript",
        "function add(a, b) {\n  █\n}\n",
        "return a + b;\n}\n\nfunction sub(a, b) {\n  return a - b;\n}\n",
        "return a + b;",
    ),
    (  # Rust without auto-close: the model's `}` is needed and kept, what follows is not
        "rust",
        "fn main() {\n    █",
        'let x = 5;\n    println!("{}", x);\n}\n\nfn other() {\n}\n',
        'let x = 5;\n    println!("{}", x);\n}',
    ),
    (  # Go at top level: one definition at a time
        "go",
        "package main\n\n█",
        "func add(a, b int) int {\n\treturn a + b\n}\n\nfunc sub(a, b int) int {\n\treturn a - b\n}\n",
        "func add(a, b int) int {\n\treturn a + b\n}",
    ),
    (  # Java: one method in a class body
        "java",
        "public class Calc {\n    █\n}\n",
        "public int add(int a, int b) {\n        return a + b;\n    }\n\n"
        "    public int sub(int a, int b) {\n        return a - b;\n    }\n}\n",
        "public int add(int a, int b) {\n        return a + b;\n    }",
    ),
    (  # Python: a helper defined inside a function body does not end the body
        "python",
        "def outer(xs):\n    █\n",
        "def helper(x):\n        return x * 2\n    return [helper(x) for x in xs]\n\n\ndef other():\n    pass\n",
        "def helper(x):\n        return x * 2\n    return [helper(x) for x in xs]",
    ),
    (  # C: a comment above the next definition goes with it
        "c",
        "int twice(int x) {\n    █\n}\n",
        "return 2 * x;\n}\n\n/* thrice */\nint thrice(int x) {\n",
        "return 2 * x;",
    ),
]


@pytest.mark.parametrize("lang,doc,generated,expected", BLOCK_END)
def test_block_end(lang: str, doc: str, generated: str, expected: str) -> None:
    assert complete(doc, generated, lang) == expected


def test_find_stop_waits_for_complete_lines() -> None:
    prefix, suffix = split("function add(a, b) {\n  █\n}\n")
    args = (prefix, suffix, "javascript", "multi")
    assert find_stop("return a", *args) is None
    assert find_stop("return a + b;\n", *args) is None  # the next line may still be inside the body
    assert find_stop("return a + b;\n}", *args) is None  # `}` might become `} else {`
    assert find_stop("return a + b;\n}\n", *args) == len("return a + b;")


def test_find_stop_single_line() -> None:
    prefix, suffix = split("    result = compute(█)\n")
    args = (prefix, suffix, "python", "single")
    assert find_stop("a, b", *args) is None
    assert find_stop("a, b)\n    return", *args) == len("a, b)")
    # text follows the cursor: a leading line break would split it, so nothing is kept
    assert find_stop("\n    x", *args) == 0


def test_single_mode_after_a_header_takes_the_next_line() -> None:
    doc = "def area(r):█\n"
    assert complete(doc, "\n    return 3.14 * r * r\n    # done\n", "python") == "\n    return 3.14 * r * r"


def test_single_mode_follows_open_brackets() -> None:
    doc = "    position = █\n    out.requires_grad = False\n"
    generated = "np.array([\n        [p / 2 for p in range(dim)]\n        for pos in range(n)\n    ])\n    x = 1\n"
    assert complete(doc, generated, "python") == (
        "np.array([\n        [p / 2 for p in range(dim)]\n        for pos in range(n)\n    ])"
    )


# --------------------------------------------------------------------------------------------
# the model repeats what follows the cursor

SUFFIX_ECHO = [
    (
        "python",
        "def f(x):\n    y = x * 2\n    █\n    return y\n",
        "z = y + 1\n    return y\n",
        "z = y + 1",
    ),
    (
        "c",
        "int main() {\n    int a = 1;\n    █\n    return 0;\n}\n",
        "a += 2;\n    return 0;\n}\n",
        "a += 2;",
    ),
    (  # the rest of the line, rewritten
        "cpp",
        "bool test_bit(const mpz_class& v, size_t i) {\n  return █ == 1;\n}\n",
        "mpz_tstbit(v.get_mpz_t(), i) == 1;",
        "mpz_tstbit(v.get_mpz_t(), i)",
    ),
    ("java", "        String s = █;\n", "name.trim();", "name.trim()"),
    ("typescript", "const total = █items.length;\n", "count + items.length;", "count + "),
    (  # whole lines inserted above code keep their line break
        "python",
        "def f(xs):\n    total = 0\n█    return total\n",
        "    for x in xs:\n        total += x\n    return total\n",
        "    for x in xs:\n        total += x\n",
    ),
]


@pytest.mark.parametrize("lang,doc,generated,expected", SUFFIX_ECHO)
def test_suffix_echo(lang: str, doc: str, generated: str, expected: str) -> None:
    assert complete(doc, generated, lang) == expected


def test_generation_loop_is_cut() -> None:
    generated = "log(x);\n" + "  log(x);\n" * 6
    assert complete("function f(x) {\n  █\n}\n", generated, "javascript") == "log(x);"


def test_brace_after_the_cursor_goes_back_under_its_header() -> None:
    doc = "function f() {\n  █}\n"
    assert complete(doc, "return 1;\n}", "javascript") == "return 1;\n"


def test_only_the_next_line_returns_empty() -> None:
    assert complete("def f(x):\n    y = 1\n    █\n    return y\n", "return y\n", "python") == ""


# --------------------------------------------------------------------------------------------
# closing brackets against the suffix

BRACKETS = [
    ("javascript", "console.log(█);\n", "a, b);", "a, b"),
    ("javascript", "const s = fmt(█)\n", "name, 2)", "name, 2"),
    ("javascript", "const r = fetch(█)\n", "url).then(r => r.json())", "url"),
    ("python", "n = print(len(█))\n", "items))", "items"),
    ("python", "x = foo(bar(█)\n", "1))", "1)"),  # only the outer `)` was auto-closed
    ("python", "x = foo(█)\n", "bar(1)", "bar(1)"),  # the completion's own `)` stays
    ("python", 'name = "█"\n', 'hello"', "hello"),
    ("rust", "let v = vec![█];\n", "1, 2, 3];", "1, 2, 3"),
    ("javascript", "foo(function () {\n  █\n});\n", "return 1;\n})", "return 1;"),
    ("go", "func main() {\n\tdefer func() {\n\t\t█\n\t}()\n}\n", "recover()\n}()", "recover()"),
    (  # no auto-close: the inner `}` the model writes is needed
        "c",
        "void f(int a, int b) {\n    if (a) {\n        if (b) {\n            █\n    }\n}\n",
        "a++;\n        }",
        "a++;\n        }",
    ),
    ("csharp", "Console.WriteLine(█);\n", "x + 1);", "x + 1"),  # no grammar: counted
    ("csharp", "var r = Foo(Bar(█)\n", "x))", "x)"),
]


@pytest.mark.parametrize("lang,doc,generated,expected", BRACKETS)
def test_brackets(lang: str, doc: str, generated: str, expected: str) -> None:
    result = complete(doc, generated, lang)
    assert result == expected
    prefix, suffix = split(doc)
    assert syntax_ok(prefix, result, suffix, lang)


# --------------------------------------------------------------------------------------------
# indentation

INDENT = [
    (  # lines written relative to column 0 instead of the cursor's column
        "python",
        "class A:\n    def f(self, xs):\n        █\n",
        "total = 0\nfor x in xs:\n    total += x\nreturn total",
        "total = 0\n        for x in xs:\n            total += x\n        return total",
    ),
    (
        "javascript",
        "function sum(xs) {\n  █\n}\n",
        "let t = 0;\nfor (const x of xs) {\n  t += x;\n}\nreturn t;",
        "let t = 0;\n  for (const x of xs) {\n    t += x;\n  }\n  return t;",
    ),
    (  # spaces in a tab-indented Go file
        "go",
        "package main\n\nfunc sum(xs []int) int {\n\t█\n}\n",
        "t := 0\n    for _, x := range xs {\n        t += x\n    }\n    return t",
        "t := 0\n\tfor _, x := range xs {\n\t\tt += x\n\t}\n\treturn t",
    ),
    (  # tabs in a space-indented Python file
        "python",
        "def f(xs):\n    if xs:\n        █\n",
        "n = len(xs)\n\t\treturn n",
        "n = len(xs)\n        return n",
    ),
    (  # the model repeated the whitespace already before the cursor
        "python",
        "def f():\n    x = 1\n    █\n",
        "    y = 2\n    return x + y",
        "y = 2\n    return x + y",
    ),
    (  # an empty Python body must be deeper than its header
        "python",
        "def f():\n█\n",
        "return 1",
        "    return 1",
    ),
    (  # Rust: correct absolute indentation is left alone
        "rust",
        "impl Stack {\n    fn push(&mut self, x: i32) {\n        █\n    }\n}\n",
        "if self.len < CAP {\n            self.items.push(x);\n        }",
        "if self.len < CAP {\n            self.items.push(x);\n        }",
    ),
]


@pytest.mark.parametrize("lang,doc,generated,expected", INDENT)
def test_indentation(lang: str, doc: str, generated: str, expected: str) -> None:
    assert complete(doc, generated, lang) == expected


def test_crlf_document_gets_crlf() -> None:
    doc = "int main() {\r\n    █\r\n}\r\n"
    assert complete(doc, "int a = 1;\nreturn a;\n}\n", "c") == "int a = 1;\r\n    return a;"


# --------------------------------------------------------------------------------------------
# special tokens

TOKENS = [
    ("<|fim_middle|>return x<|endoftext|>garbage", "return x"),
    ("return x<|file_sep|>other.py\nimport os\n", "return x"),
    ("<｜fim▁end｜>return x<｜end▁of▁sentence｜>", "return x"),
    ("<fim_middle>return x<fim_suffix>", "return x"),
    ("return x <EOT>", "return x"),
    ("return x<|endof", "return x"),  # cut short by the end of the stream
    ("<|endoftext|>return x", ""),  # the model ended at once
    ("return x<|im_end|>\n<|im_start|>assistant", "return x"),
]


@pytest.mark.parametrize("generated,expected", TOKENS)
def test_special_tokens(generated: str, expected: str) -> None:
    assert complete("def f(x):\n    █\n", generated, "python") == expected


def test_operators_that_look_like_tokens_survive() -> None:
    assert complete("main = █\n", "f <| g |> h", "elm") == "f <| g |> h"


def test_find_stop_at_a_token() -> None:
    prefix, suffix = split("x = █\n")
    assert find_stop("abc<|endoftext|>def", prefix, suffix, "python", "single") == 3
    assert find_stop("<|fim_middle|>abc<|endoftext|>", prefix, suffix, "python", "single") == len("<|fim_middle|>abc")


# --------------------------------------------------------------------------------------------
# syntax_ok

SYNTAX = [
    ("python", "def f(x):\n    █\n", "return x + 1", True),
    ("python", "def f(x):\n    █\n", "return (x + 1", False),
    ("javascript", "const s = fmt(█);\n", "name", True),
    ("javascript", "const s = fmt(█);\n", "name)", False),
    ("rust", "fn main() {\n    █\n}\n", "let x = 1;", True),
    ("rust", "fn main() {\n    █\n}\n", "let x = {;", False),
    ("go", "func f() int {\n\t█\n}\n", "return 1", True),
    ("go", "func f() int {\n\t█\n}\n", "return 1 +", False),
    ("java", "class A {\n    int f() {\n        █\n    }\n}\n", "return 1;", True),
    ("java", "class A {\n    int f() {\n        █\n    }\n}\n", "return 1;\n    }", False),
    ("cpp", "int main() {\n    █\n}\n", "std::vector<int> v{1, 2};", True),
    ("cpp", "int main() {\n    █\n}\n", "std::vector<int> v{1, 2;", False),
    ("csharp", "class A {\n    █\n}\n", "void F( {", True),  # no grammar: not judged
]


@pytest.mark.parametrize("lang,doc,completion,ok", SYNTAX)
def test_syntax_ok(lang: str, doc: str, completion: str, ok: bool) -> None:
    prefix, suffix = split(doc)
    assert syntax_ok(prefix, completion, suffix, lang) is ok


def test_syntax_ok_tolerates_existing_errors() -> None:
    # The document is already broken elsewhere; a clean completion is still ok.
    prefix, suffix = "def f(:\n    pass\n\ndef g():\n    ", "\n"
    assert syntax_ok(prefix, "return 1", suffix, "python")
    assert not syntax_ok(prefix, "return [1", suffix, "python")


# --------------------------------------------------------------------------------------------
# issue 3: post-processing by syntax (each list fails on the code before its fix)

DEDENT = [
    (  # a leading line break, then code below the cursor's column: the model left the block
        "python",
        "def mean(xs):\n    total = sum(xs)\n    █\n",
        "\ndef median(xs):\n    return sorted(xs)[len(xs) // 2]\n",
        "",
    ),
    (  # the cursor at column 0 inside a function body: a new top-level definition left it
        "python",
        'def sum_product(numbers):\n    """Sum and product."""\n█\n    for n in numbers:\n        s += n\n',
        '\ndef sum_product_empty(numbers):\n    """Sum and product of nothing."""\n    return 0, 1\n',
        "",
    ),
    (  # `else:` of the `if` whose body is being filled continues it (at the end of the function)
        "python",
        "def sign(x):\n    if x >= 0:\n        █\n",
        "s = 1\n    else:\n        s = -1\n",
        "s = 1\n    else:\n        s = -1",
    ),
    (  # issue 16: the author's next statement follows the `if` directly: its body was missing,
        # not a branch of the model's own (HumanEval single-line: 6 more whole answers right)
        "python",
        "def sign(x):\n    if x >= 0:\n        █\n    return s\n",
        "s = 1\n    else:\n        s = -1\n    return s\n",
        "s = 1",
    ),
    (
        "python",
        "def load(path):\n    try:\n        █\n    return data\n",
        "data = open(path).read()\n    except OSError:\n        data = ''\n    return data\n",
        "data = open(path).read()\n    except OSError:\n        data = ''",
    ),
    (  # a chain of branches; the next statement at the `if`'s column ends it
        "python",
        "def grade(n):\n    if n > 90:\n        █\n\n\nprint(grade(95))\n",
        "g = 'A'\n    elif n > 80:\n        g = 'B'\n    else:\n        g = 'C'\n    return g\n",
        "g = 'A'\n    elif n > 80:\n        g = 'B'\n    else:\n        g = 'C'",
    ),
    (  # `} else {`; the model's final `}` is the one the editor already added
        "rust",
        "fn sign(x: i32) -> i32 {\n    let s;\n    if x >= 0 {\n        █\n    }\n    s\n}\n",
        "s = 1;\n    } else {\n        s = -1;\n    }\n    s\n}\n",
        "s = 1;\n    } else {\n        s = -1;",
    ),
    (
        "go",
        "func abs(x int) int {\n\tif x < 0 {\n\t\t█\n\t}\n\treturn x\n}\n",
        "return -x\n\t} else {\n\t\treturn x\n\t}\n}\n",
        "return -x\n\t} else {\n\t\treturn x",
    ),
    (
        "javascript",
        "async function load(url) {\n  try {\n    █\n  }\n}\n",
        "const res = await fetch(url);\n    return await res.json();\n  } catch (err) {\n    return null;\n  }\n}\n",
        "const res = await fetch(url);\n    return await res.json();\n  } catch (err) {\n    return null;",
    ),
]

DEDENT_KEPT = [
    (  # a header whose body is the suffix
        "python",
        "import os\n\n█\n    return os.sep\n",
        "def separator():\n",
        "def separator():",
    ),
    (  # the suffix has its own `else`: a second branch would break it
        "python",
        "def sign(x):\n    if x >= 0:\n        █\n    else:\n        s = -1\n    return s\n",
        "s = 1\n    elif x < -5:\n        s = -2\n",
        "s = 1",
    ),
    (  # `else` two levels out belongs to the `for`, not to the `if` being filled
        "python",
        "def f(xs):\n    for x in xs:\n        if x:\n            █\n    return xs\n",
        "print(x)\n    else:\n        pass\n",
        "print(x)",
    ),
]

CHAT = [
    (  # a fence closes the answer; prose follows
        "python",
        "def add(a, b):\n    █\n",
        "return a + b\n```\n\nThis function adds two numbers.\n",
        "return a + b",
    ),
    (  # prose after top-level code, where no dedent ends it
        "python",
        "x = load()\n█\n",
        "print(x)\n\nThis prints the loaded value.\n",
        "print(x)",
    ),
    (
        "javascript",
        "const app = express();\n█\n",
        "app.listen(3000);\n\nThis starts the server on port 3000.\n",
        "app.listen(3000);",
    ),
    (
        "c",
        "#include <stdio.h>\n\n█\n",
        "int twice(int x) { return 2 * x; }\n\nHere is how it works: twice doubles x.\n",
        "int twice(int x) { return 2 * x; }",
    ),
    (  # a chat answer that opens with a fence: no code for the cursor
        "python",
        "def f(x):\n    █\n",
        "```python\ndef f(x):\n    return x\n```\n",
        "",
    ),
]

CHAT_KEPT = [
    (  # a fence inside a docstring is text
        "python",
        "def run():\n    █\n",
        '"""Run the job.\n\n    ```python\n    run()\n    ```\n    """\n    return 0\n',
        '"""Run the job.\n\n    ```python\n    run()\n    ```\n    """\n    return 0',
    ),
    (  # prose in a comment is code
        "python",
        "def f():\n    █\n",
        "x = 1\n\n    # This function returns the value of x.\n    return x\n",
        "x = 1\n\n    # This function returns the value of x.\n    return x",
    ),
    (  # markdown: fences and sentences are its content
        "markdown",
        "# Usage\n\n```sh\n█\n",
        "npm start\n```\n\nThen open the page in a browser.\n",
        "npm start\n```\n\nThen open the page in a browser.",
    ),
    (  # a fence inside a block comment
        "c",
        "int main(void) {\n    █\n}\n",
        "/* Usage:\n    ```\n    prog --run\n    ```\n    */\n    return run();\n}\n",
        "/* Usage:\n    ```\n    prog --run\n    ```\n    */\n    return run();",
    ),
]

PAIRS = [
    (  # `{|}` on one line: a block between the braces, the `}` back under its header
        "javascript",
        "function answer() {█}\n",
        "\n  return 42;\n}\n",
        "\n  return 42;\n",
    ),
    ("rust", "fn main() {█}\n", '\n    println!("hi");\n}\n', '\n    println!("hi");\n'),
    ("typescript", "items.forEach((item) => {█});\n", "\n  console.log(item);\n});\n", "\n  console.log(item);\n"),
    ("go", "func (s *Server) Close() error {█}\n", "\n\treturn s.ln.Close()\n}\n", "\n\treturn s.ln.Close()\n"),
    ("c", "int main(void) {█}\n", " return 0; }", " return 0;"),  # one line: the `}` is the suffix's
]

LOOPS = [
    (
        "python",
        "def parse(line):\n    █\n",
        "fields = line.split(',')\n" + "    # todo:\n" * 9,
        "fields = line.split(',')\n    # todo:",
    ),
    (
        "python",
        "def parse(line):\n    █\n",
        "fields = line.split(',')\n" + "    # todo: handle quotes\n" * 3,
        "fields = line.split(',')\n    # todo: handle quotes",
    ),
    (  # a group of two lines
        "javascript",
        "function setup(app) {\n  █\n}\n",
        "app.use(cors());\n" + "  app.use(json());\n  app.use(log);\n" * 3,
        "app.use(cors());\n  app.use(json());\n  app.use(log);",
    ),
    (  # a group of three lines, cut off in a fourth copy
        "rust",
        "fn main() {\n    █\n}\n",
        "let mut v = Vec::new();\n" + "    v.push(1);\n    v.push(2);\n    v.push(3);\n" * 3 + "    v.pu",
        "let mut v = Vec::new();\n    v.push(1);\n    v.push(2);\n    v.push(3);",
    ),
    (  # what follows a loop goes with it
        "go",
        "func main() {\n\t█\n}\n",
        "x := load()\n" + "\t// TODO: validate\n" * 3 + "\tfmt.Println(x)\n",
        "x := load()\n\t// TODO: validate",
    ),
]

LOOPS_KEPT = [
    (  # rows of numbers repeat legitimately
        "python",
        "def identity():\n    █\n",
        "m = [\n        [0, 0, 0],\n        [0, 0, 0],\n        [0, 0, 0],\n    ]\n    return m\n",
        "m = [\n        [0, 0, 0],\n        [0, 0, 0],\n        [0, 0, 0],\n    ]\n    return m",
    ),
    (  # so do closers
        "javascript",
        "function f() {\n  █\n}\n",
        "g(() => {\n    h(() => {\n      k(() => {\n        run();\n      });\n    });\n  });\n",
        "g(() => {\n    h(() => {\n      k(() => {\n        run();\n      });\n    });\n  });",
    ),
]

DRIFT = [
    (  # written from column 0 with 4-column levels; the block it opens closes at column 0
        "javascript",
        "function count(xs) {\n  let n = 0;\n  if (xs) {\n    n = 1;\n  }\n  █\n}\n",
        "for (const x of xs) {\n    n += x;\n}\nreturn n;",
        "for (const x of xs) {\n    n += x;\n  }\n  return n;",
    ),
    (  # right column, 4-column levels in a 2-column file
        "typescript",
        "export function total(items: Item[]): number {\n"
        "  let sum = 0;\n  if (items.length) {\n    sum = 1;\n  }\n  █\n}\n",
        "for (const item of items) {\n      sum += item.price;\n  }\n  return sum;",
        "for (const item of items) {\n    sum += item.price;\n  }\n  return sum;",
    ),
    (  # 2-column levels under a tab in a tab-indented file
        "go",
        "func sum(xs []int) int {\n\tt := 0\n\t█\n}\n",
        "for _, x := range xs {\n\t  t += x\n\t}\n\treturn t",
        "for _, x := range xs {\n\t\tt += x\n\t}\n\treturn t",
    ),
]

DRIFT_KEPT = [
    (  # aligned arguments are not levels
        "javascript",
        "function f(a, b) {\n  if (a) {\n    g();\n  }\n  █\n}\n",
        "const r = compute(a,\n                  b);\n  return r;",
        "const r = compute(a,\n                  b);\n  return r;",
    ),
]

LEADING_BREAK = [
    ("python", "def area(r):\n    pi = 3.14\n    █\n", "\n    return pi * r * r\n", "return pi * r * r"),
    ("python", "def area(r):\n    pi = 3.14\n    █", "\n    return pi * r * r\n", "return pi * r * r"),  # at the end
    (
        "python",
        "class Stack:\n    def push(self, x):\n        █\n",
        "\n        self.items.append(x)\n        return self\n",
        "self.items.append(x)\n        return self",
    ),
    ("go", "func inc(x int) int {\n\ty := x + 1\n\t█\n}\n", "\n\treturn y\n}\n", "return y"),
    (
        "javascript",
        "function f(xs) {\n  for (const x of xs) {\n    log(x);\n  }\n  █\n}\n",
        "\n  if (xs.length) {\n    return xs[0];\n  }\n}\n",
        "if (xs.length) {\n    return xs[0];\n  }",
    ),
]

LEADING_BREAK_KEPT = [
    # column 0: leading blank lines are spacing, not a line left behind
    ("python", "import os\n█\n", "\n\ndef main():\n    pass\n", "\n\ndef main():\n    pass"),
]

ISSUE3 = DEDENT + CHAT + PAIRS + LOOPS + DRIFT + LEADING_BREAK
ISSUE3_KEPT = DEDENT_KEPT + CHAT_KEPT + LOOPS_KEPT + DRIFT_KEPT + LEADING_BREAK_KEPT


@pytest.mark.parametrize("lang,doc,generated,expected", ISSUE3 + ISSUE3_KEPT)
def test_issue3_golden(lang: str, doc: str, generated: str, expected: str) -> None:
    result = complete(doc, generated, lang)
    assert result == expected
    prefix, suffix = split(doc)
    assert syntax_ok(prefix, result, suffix, lang)


def test_find_stop_stops_a_loop_early() -> None:
    """Generation stops once a loop is evident, not at max_tokens."""
    prefix, suffix = split("def parse(line):\n    █\n")
    generated = "fields = line.split(',')\n" + "    # todo:\n" * 3 + "    # todo:"
    assert find_stop(generated, prefix, suffix, "python", "multi") == len("fields = line.split(',')\n    # todo:")


def test_find_stop_leading_break_below_the_block_stops_at_once() -> None:
    prefix, suffix = split("def mean(xs):\n    total = sum(xs)\n    █\n")
    assert find_stop("\n", prefix, suffix, "python", "multi") is None
    assert find_stop("\nd", prefix, suffix, "python", "multi") == 0


def test_truncated_drops_the_half_line_in_multi_mode() -> None:
    prefix, suffix = split("def total(xs):\n    █\n")
    generated = "t = 0\n    for x in xs:\n        t += x\n    return t + compu"
    assert postprocess(generated, prefix, suffix, "python", "multi", truncated=True) == (
        "t = 0\n    for x in xs:\n        t += x"
    )
    # not truncated: the last line is whole (the default keeps it)
    assert postprocess(generated, prefix, suffix, "python", "multi").endswith("return t + compu")
    # only a half line: nothing
    # A first line alone stays (small maxTokens would otherwise never show anything in multi mode).
    assert postprocess("t = sum(x for x in", prefix, suffix, "python", "multi", truncated=True) == "t = sum(x for x in"
    # a special token ended the text: it is complete whatever the finish reason says
    assert postprocess("t = 0<|endoftext|>", prefix, suffix, "python", "multi", truncated=True) == "t = 0"


TRUNCATED_STATEMENTS = [
    # (lang, document, generated and cut by the token limit, expected): seen on repository cuts
    (
        "python",
        "class S:\n    def request(self, url, **kwargs):\n        █\n",
        '# Send the request.\n        send_kwargs = {\n            "timeout": 1,\n        }\n'
        "        send_kwargs.update(kwargs)\n        return self.send(\n            url,\n",
        '# Send the request.\n        send_kwargs = {\n            "timeout": 1,\n        }\n        send_kwargs.update(kwargs)',
    ),
    (
        "python",
        "def f(x):\n    █\n",
        "y = x + 1\n    if y > 2:\n",
        "y = x + 1",
    ),
    (
        "python",
        "def parse(text):\n█\n    return [group(x) for x in text.split()]\n",
        '    def group(s: str) -> int:\n        """Input is a string of nested parentheses.\n'
        "        For each group, output the deepest level\n",
        "    def group(s: str) -> int:",  # nothing whole: the first line, as for a cut first line
    ),
    (
        "javascript",
        "app.init = function init() {\n  █\n};\n",
        "this.router = {};\n  this.lazy = function lazy() {\n    this.router = {\n      add: 1,\n",
        "this.router = {};",
    ),
    (
        "go",
        "func f() {\n\t█\n}\n",
        "x := 1\n\tfor i := 0; i < 3; i++ {\n\t\tx += i\n\t}\n\tfmt.Println(\"x\",\n",
        "x := 1\n\tfor i := 0; i < 3; i++ {\n\t\tx += i\n\t}",
    ),
]


@pytest.mark.parametrize("lang,doc,generated,expected", TRUNCATED_STATEMENTS)
def test_truncated_block_ends_with_a_whole_statement(lang: str, doc: str, generated: str, expected: str) -> None:
    prefix, suffix = split(doc)
    got = postprocess(generated, prefix, suffix, lang, "multi", truncated=True)
    assert got == expected
    if "\n" in got:
        assert syntax_ok(prefix, got, suffix, lang)


def test_truncated_leaves_single_mode_alone() -> None:
    prefix, suffix = split("    total = compute(█)\n")
    assert postprocess("items, weights", prefix, suffix, "python", "single", truncated=True) == "items, weights"


HEALED = [
    # (document, healed, generated, expected): the prompt ended before `healed`
    ("def f(x):\n    y = 1\n    █\n", "    ", "    return y\n", "return y"),
    ("def f(x):\n    y = 1\n    █\n", "    ", "return y\n", ""),  # column 0: left the block
    ("def f(x):\n    if x:\n        █\n", "        ", "        return 1\n    return 0\n", "return 1"),
    ("def f(x):\n    return █\n", " ", " x + 1", "x + 1"),
    ("def f(x):\n    return █\n", " ", "x + 1", "x + 1"),  # the model wrote no space: nothing to drop
    ("func f() int {\n\t█\n}\n", "\t", "\treturn 1\n}\n", "return 1"),
]


@pytest.mark.parametrize("doc,healed,generated,expected", HEALED)
def test_healed_prompt_output_is_realigned(doc: str, healed: str, generated: str, expected: str) -> None:
    prefix, suffix = split(doc)
    lang = "go" if doc.startswith("func") else "python"
    mode = completion_mode(prefix, suffix, lang)
    assert postprocess(generated, prefix, suffix, lang, mode, healed=healed) == expected
    stop = _stream_stop(generated, prefix, suffix, lang, mode, 1, healed=healed)
    cut = generated if stop is None else generated[:stop]
    assert postprocess(cut, prefix, suffix, lang, mode, healed=healed) == expected


def test_healed_that_does_not_match_the_cursor_is_ignored() -> None:
    prefix, suffix = split("def f(x):\n    return █\n")
    assert postprocess(" x", prefix, suffix, "python", "single", healed="\t") == " x"


MODE_TREE = MODES + [
    ("python", 'x = """\n█\n"""\n', "single"),
    ("javascript", "const s = `\n  █\n`;\n", "single"),
    ("c", "/* a\n   █\n*/\nint x;\n", "single"),
    ("go", "func f() {\n\t// note\n\t█\n}\n", "multi"),
]


@pytest.mark.parametrize("lang,doc,mode", MODE_TREE)
def test_completion_mode_from_the_document_tree_matches_the_parse(lang: str, doc: str, mode: str) -> None:
    prefix, suffix = split(doc)
    document = Document(f"file:///x.{lang}", lang, prefix + suffix)
    tree = document.tree
    cursor_byte = document.byte_offset(len(prefix))
    assert completion_mode(prefix, suffix, lang) == mode
    assert completion_mode(prefix, suffix, lang, tree=tree, cursor_byte=cursor_byte) == mode


def test_completion_mode_from_the_tree_does_not_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    import context.cut.surroundings as pp  # where completion_mode parses

    prefix, suffix = split('def f():\n    """Sum.\n\n    █\n    """\n')
    document = Document("file:///x.py", "python", prefix + suffix)
    monkeypatch.setattr(pp, "parser_for", lambda lang: pytest.fail("parsed"))
    cursor_byte = document.byte_offset(len(prefix))
    assert completion_mode(prefix, suffix, "python", tree=document.tree, cursor_byte=cursor_byte) == "single"


# --------------------------------------------------------------------------------------------
# robustness

_PIECES = list("ab (){}[]\"'`:;,.=\n\t\r #/\\<|>_｜") + ["<|endoftext|>", "<|fim_middle|>", "    ", "def f():", "}"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=40).map("".join)
_LANGS = st.sampled_from(["python", "javascript", "rust", "go", "java", "cpp", "csharp", "", "plaintext"])


class _Failures(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@settings(max_examples=300, deadline=None)
@given(generated=_TEXT, prefix=_TEXT, suffix=_TEXT, lang=_LANGS, mode=st.sampled_from(["single", "multi"]))
def test_garbage_in_never_raises(generated: str, prefix: str, suffix: str, lang: str, mode: str) -> None:
    # The public functions swallow internal errors (and log them); none may happen here.
    failures = _Failures()
    logger = logging.getLogger("context.cut.postprocess")
    logger.addHandler(failures)
    try:
        stop = find_stop(generated, prefix, suffix, lang, mode)  # type: ignore[arg-type]
        assert stop is None or 0 <= stop <= len(generated)
        out = postprocess(generated, prefix, suffix, lang, mode)  # type: ignore[arg-type]
        assert isinstance(out, str)
        assert "<|endoftext|>" not in out and "<|fim_middle|>" not in out
        assert completion_mode(prefix, suffix, lang) in ("single", "multi")
        assert isinstance(syntax_ok(prefix, out, suffix, lang), bool)
    finally:
        logger.removeHandler(failures)
    assert not failures.records, [r.getMessage() for r in failures.records]


def _stream_stop(
    generated: str, prefix: str, suffix: str, lang: str, mode: str, chunk: int, healed: str = ""
) -> int | None:
    for end in range(chunk, len(generated) + chunk, chunk):
        stop = find_stop(generated[:end], prefix, suffix, lang, mode, healed=healed)  # type: ignore[arg-type]
        if stop is not None:
            return stop
    return None


@pytest.mark.parametrize("lang,doc,generated,expected", BLOCK_END + SUFFIX_ECHO + INDENT + ISSUE3 + ISSUE3_KEPT)
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_streaming_stop_agrees_with_postprocess(lang: str, doc: str, generated: str, expected: str, chunk: int) -> None:
    """Stopping where find_stop says, at any chunking, gives the same text as the whole output."""
    prefix, suffix = split(doc)
    mode = completion_mode(prefix, suffix, lang)
    stop = _stream_stop(generated, prefix, suffix, lang, mode, chunk)
    cut = generated if stop is None else generated[:stop]
    assert postprocess(cut, prefix, suffix, lang, mode) == expected  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# the public eval sets (skipped where they are not present)


def _rows(name: str) -> list[dict]:
    path = EVAL / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    return [json.loads(line) for line in path.open(encoding="utf-8")]


def _norm(text: str) -> str:
    lines = text.replace("\r\n", "\n").strip("\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).rstrip()


def _first_code_line(text: str) -> str:
    return next((line for line in text.split("\n") if line.strip()), "").rstrip("\r")


def _within_block(row: dict) -> bool:
    """Does the true middle stay inside the block it starts in? Random spans that climb out of
    it (common in HumanEval-Infilling) are cut at the dedent by design."""
    before = row["prefix"][row["prefix"].rfind("\n") + 1 :]
    lines = row["middle"].replace("\r\n", "\n").split("\n")
    base = _indent(before + lines[0]) if not before.strip() else _indent(before)
    code = [line for line in lines[1:] if line.strip() and not line.strip().startswith(("#", "//"))]
    return all(_indent(line) >= base for line in code)


def _indent(line: str) -> int:
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip())


@pytest.mark.parametrize("name", ["humaneval_infilling_dev.jsonl", "safim_dev.jsonl"])
def test_eval_middle_is_syntax_ok(name: str) -> None:
    rows = _rows(name)
    ok = sum(syntax_ok(r["prefix"], r["middle"], r["suffix"], r["language"]) for r in rows)
    assert ok / len(rows) >= 0.95


@pytest.mark.parametrize("name", ["humaneval_infilling_dev.jsonl", "safim_dev.jsonl"])
def test_eval_middle_recovered_from_junk(name: str) -> None:
    """The true middle followed by junk (the next line repeated; the suffix written again) comes
    back as the middle: in single mode its first line or its whole bracketed statement."""
    rows = _rows(name)
    counted = recovered = 0
    for r in rows:
        prefix, suffix, middle, lang = r["prefix"], r["suffix"], r["middle"], r["language"]
        mode = completion_mode(prefix, suffix, lang)
        if mode == "multi" and not _within_block(r):
            continue
        eol = "\r\n" if "\r\n" in prefix + suffix else "\n"
        rest = suffix.split("\n")[0].rstrip("\r")
        next_line = rest if rest.strip() else ("" if middle.endswith("\n") else eol) + _first_code_line(suffix)
        accepted = {_norm(middle), _norm(middle.split("\n")[0])} if mode == "single" else {_norm(middle)}
        for junk in (next_line + eol, suffix[:300]):
            counted += 1
            recovered += _norm(postprocess(middle + junk, prefix, suffix, lang, mode)) in accepted
    assert counted > 0.8 * 2 * len(rows)
    assert recovered / counted >= 0.97


@pytest.mark.parametrize("name", ["humaneval_infilling_dev.jsonl", "safim_dev.jsonl"])
def test_eval_completion_mode_from_the_tree_matches_the_parse(name: str) -> None:
    for r in _rows(name):
        prefix, suffix, lang = r["prefix"], r["suffix"], r["language"]
        document = Document("file:///x", lang, prefix + suffix)
        if document.tree is None:
            continue
        cursor_byte = document.byte_offset(len(prefix))
        tree_mode = completion_mode(prefix, suffix, lang, tree=document.tree, cursor_byte=cursor_byte)
        assert tree_mode == completion_mode(prefix, suffix, lang), r["id"]


@pytest.mark.parametrize(
    ("generated", "mode", "expected"),
    [
        ("x + 1\n    y = 2\n", "single", "x + 1"),
        ("\n    return x\n    y = 2", "single", "\n    return x"),
        ("\n\n", "single", ""),
        ("a = 1\nb = 2\nc = 3)", "multi", "a = 1\nb = 2\nc = 3)"),  # no block end, no bracket balance
        ("a = 1<|endoftext|>junk", "multi", "a = 1"),
    ],
)
def test_plain_baseline_cuts_at_line_breaks_only(generated: str, mode: Mode, expected: str) -> None:
    """The benchmark baseline (``postprocess: "plain"``) against which syntax_ok is measured."""
    assert plain_postprocess(generated, mode) == expected
    if mode == "multi" and "<|" not in generated:
        assert plain_stop(generated, mode) is None  # runs to the token limit


PARSE_CHECK = [
    # (document, generated, expected): seen with Qwen2.5-Coder on HumanEval infilling, the cursor
    # at column 0 of an empty line inside a block; the model's line is at the wrong depth.
    (  # HumanEval/56/L2: the loop's body would be empty
        'def correct(brackets):\n    depth = 0\n    for b in brackets:\n█\n            depth += 1\n'
        "        else:\n            depth -= 1\n    return depth == 0\n",
        "    return depth == 0\n",
        "",
    ),
    (  # HumanEval/124/L9: an `except` with no `try`, under an `if` that needs a body
        "def valid(date):\n    try:\n        day = int(date)\n        if day < 1 or day > 30:\n█\n"
        "        return True\n    except:\n        return False\n",
        "    except ValueError:\n        return False\n\n    return True\n",
        "",
    ),
    (  # the first lines parse, the rest leaves the block the suffix continues
        "def f(xs):\n    t = 0\n    for x in xs:\n█\n        t += 1\n    return t\n",
        "        if x:\n            t += x\n    else:\n",
        "        if x:\n            t += x",
    ),
]


@pytest.mark.parametrize("doc,generated,expected", PARSE_CHECK)
def test_a_block_that_breaks_the_parse_is_cut_back(doc: str, generated: str, expected: str) -> None:
    prefix, suffix = split(doc)
    assert completion_mode(prefix, suffix, "python") == "multi"
    got = postprocess(generated, prefix, suffix, "python", "multi")
    assert got.rstrip() == expected
    assert syntax_ok(prefix, got, suffix, "python")
    # while streaming (a preview) the parse check waits for the final text
    assert postprocess(generated, prefix, suffix, "python", "multi", partial=True).strip() != ""
