"""Golden tests: completions end where the author's code ends (issue 16).

Each case is a document with the cursor marked by ``█``, the raw text a model wrote there (taken
from the kinds of answers Qwen2.5-Coder gives on the dev sets, moved to small programs), and the
text that must be inserted. Grouped by rule; each rule in Python, JavaScript/TypeScript, C++,
Java, Go and Rust.
"""

from __future__ import annotations

import pytest

from context.cut.brackets import InsertionCheck
from context.cut.postprocess import SyntaxCutter, completion_mode, find_stop, postprocess, syntax_ok
from context.cut.surroundings import surroundings_of

CURSOR = "█"


def complete(doc: str, generated: str, lang: str) -> str:
    prefix, suffix = doc.split(CURSOR)
    return postprocess(generated, prefix, suffix, lang, completion_mode(prefix, suffix, lang))


def check(lang: str, doc: str, generated: str, expected: str) -> None:
    got = complete(doc, generated, lang)
    assert got == expected
    prefix, suffix = doc.split(CURSOR)
    assert syntax_ok(prefix, got, suffix, lang)


# --------------------------------------------------------------------------------------------
# Between statements of a block that goes on below the cursor: a `return` (`raise`, `throw`,
# `break`, `continue`) at the block's level would make the code after the cursor unreachable.
# The model is writing its own ending of the block; the completion ends before it.

TERMINAL = [
    (
        "python",
        "def mad(xs):\n    █\n    return sum(abs(x - m) for x in xs) / len(xs)\n",
        "m = sum(xs) / len(xs)\n    return mad(xs, m)\n",
        "m = sum(xs) / len(xs)",
    ),
    (
        "javascript",
        "function mean(xs) {\n  █\n  return total / xs.length;\n}\n",
        "const total = xs.reduce((a, b) => a + b, 0);\n  return xs.length ? total / xs.length : 0;\n}\n",
        "const total = xs.reduce((a, b) => a + b, 0);",
    ),
    (
        "typescript",
        "function mean(xs: number[]): number {\n  █\n  return total / xs.length;\n}\n",
        "const total = xs.reduce((a, b) => a + b, 0);\n  return xs.length ? total / xs.length : 0;\n}\n",
        "const total = xs.reduce((a, b) => a + b, 0);",
    ),
    (
        "cpp",
        "int mean(const std::vector<int>& v) {\n    █\n    return s / (int)v.size();\n}\n",
        "int s = std::accumulate(v.begin(), v.end(), 0);\n    return v.empty() ? 0 : s / v.size();\n}\n",
        "int s = std::accumulate(v.begin(), v.end(), 0);",
    ),
    (
        "java",
        "class M {\n    int mean(int[] v) {\n        █\n        return s / v.length;\n    }\n}\n",
        "int s = Arrays.stream(v).sum();\n        return v.length == 0 ? 0 : s / v.length;\n    }\n",
        "int s = Arrays.stream(v).sum();",
    ),
    (
        "go",
        "func mean(v []int) int {\n\t█\n\treturn s / len(v)\n}\n",
        "s := sum(v)\n\treturn s / max(1, len(v))\n}\n",
        "s := sum(v)",
    ),
    (
        "rust",
        "fn mean(v: &[i64]) -> i64 {\n    █\n    return s / v.len() as i64;\n}\n",
        "let s: i64 = v.iter().sum();\n    return if v.is_empty() { 0 } else { s / v.len() as i64 };\n}\n",
        "let s: i64 = v.iter().sum();",
    ),
]


# --------------------------------------------------------------------------------------------
# A line the suffix already has (not only its first line): the model is writing code that
# follows the cursor. The completion ends before the statement (at the block's level) that
# holds that line.

SUFFIX_LINES = [
    (
        "python",
        "def exchange(a, b):\n    odd = 0\n█\n    for i in a:\n        if i % 2 == 1:\n            odd += 1\n"
        "    for i in b:\n        if i % 2 == 0:\n            even += 1\n    return odd <= even\n",
        "    even = 0\n    for i in b:\n        if i % 2 == 0:\n            even += 1\n",
        "    even = 0",
    ),
    (
        "javascript",
        "function sum(a) {\n  let n = a.length;\n  █\n  for (let i = 0; i < n; i++) {\n    s += a[i];\n  }\n  return s;\n}\n",
        "let s = 0;\n  while (n--) {\n    s += a[i];\n  }\n",
        "let s = 0;",
    ),
    (
        "cpp",
        "int sum(std::vector<int>& a) {\n    int n = a.size();\n    █\n    for (int i = 0; i < n; i++) {\n"
        "        s += a[i];\n    }\n    return s;\n}\n",
        "int s = 0;\n    while (n--) {\n        s += a[i];\n    }\n",
        "int s = 0;",
    ),
    (
        "java",
        "class S {\n    int sum(int[] a) {\n        int n = a.length;\n        █\n        for (int i = 0; i < n; i++) {\n"
        "            s += a[i];\n        }\n        return s;\n    }\n}\n",
        "int s = 0;\n        while (n-- > 0) {\n            s += a[i];\n        }\n",
        "int s = 0;",
    ),
    (
        "go",
        "func sum(a []int) int {\n\tn := len(a)\n\t█\n\tfor i := 0; i < n; i++ {\n\t\ts += a[i]\n\t}\n\treturn s\n}\n",
        "s := 0\n\tfor n > 0 {\n\t\ts += a[i]\n\t}\n",
        "s := 0",
    ),
    (
        "rust",
        "fn sum(a: &[i32]) -> i32 {\n    let n = a.len();\n    █\n    for i in 0..n {\n        s += a[i];\n    }\n    s\n}\n",
        "let mut s = 0;\n    while n > 0 {\n        s += a[i];\n    }\n",
        "let mut s = 0;",
    ),
]


# --------------------------------------------------------------------------------------------
# The suffix already has the statement's branches: the model's own `elif` / `else if` before
# the author's `else` ends the completion.

BRANCHES = [
    (
        "python",
        "def split(s):\n    o, c = [], []\n    for i, ch in enumerate(s):\n        █\n"
        "        else:\n            c.append(i)\n    return o, c\n",
        "if ch == '[':\n            o.append(i)\n        elif ch == ']':\n            c.append(i)\n",
        "if ch == '[':\n            o.append(i)",
    ),
    (
        "javascript",
        "function sign(x) {\n  █\n  else {\n    return 0;\n  }\n}\n",
        "if (x > 0) {\n    return 1;\n  }\n  else if (x < 0) {\n    return -1;\n  }\n",
        "if (x > 0) {\n    return 1;\n  }",
    ),
    (
        "java",
        "class A {\n    int sign(int x) {\n        █\n        else {\n            return 0;\n        }\n    }\n}\n",
        "if (x > 0) {\n            return 1;\n        }\n        else if (x < 0) {\n            return -1;\n        }\n",
        "if (x > 0) {\n            return 1;\n        }",
    ),
    (
        "cpp",
        "int sign(int x) {\n    █\n    else {\n        return 0;\n    }\n}\n",
        "if (x > 0) {\n        return 1;\n    }\n    else if (x < 0) {\n        return -1;\n    }\n",
        "if (x > 0) {\n        return 1;\n    }",
    ),
    (
        "go",
        "func sign(x int) int {\n\tif x > 0 {\n\t\treturn 1\n\t}\n\t█\n\telse {\n\t\treturn 0\n\t}\n}\n",
        "} else if x < 0 {\n\t\treturn -1\n\t}\n",
        "",
    ),
    (
        "rust",
        "fn sign(x: i32) -> i32 {\n    █\n    else {\n        0\n    }\n}\n",
        "if x > 0 {\n        1\n    }\n    else if x < 0 {\n        -1\n    }\n",
        "if x > 0 {\n        1\n    }",
    ),
]


@pytest.mark.parametrize("lang,doc,generated,expected", BRANCHES, ids=[c[0] for c in BRANCHES])
def test_the_suffix_has_the_branches(lang: str, doc: str, generated: str, expected: str) -> None:
    got = complete(doc, generated, lang)
    assert got == expected


# --------------------------------------------------------------------------------------------
# The suffix's next line is indented deeper than the cursor (Python): it is the body of a header
# the completion must end with. A model that writes the header and then a body of its own ends
# after the header.

HEADERS = [
    (
        "def count7(s):\n    ans = 0\n█\n        ans += c == '7'\n    return ans\n",
        "    for c in s:\n        if c == '7':\n            ans += 1\n    return ans\n",
        "    for c in s:",
    ),
    (
        "def bisect(f, lo, hi):\n    while hi - lo > 1e-9:\n        mid = (lo + hi) / 2\n        if f(mid) * f(lo) > 0:\n"
        "            lo = mid\n█\n            hi = mid\n    return lo\n",
        "        else:\n            lo = lo\n",
        "        else:",
    ),
]


# --------------------------------------------------------------------------------------------
# Inside a statement (text before the cursor on its line): the rest of the node the cursor is
# in. Where inserting the model's text would break the parse and a shorter start of it does
# not, the node ended there and the suffix takes over.

NODE_END = [
    (
        "python",
        "def f(self, l, r):\n    for i in range(3):\n        if ((l >> i) << i) != l: self.push(l >> i)\n"
        "        if █ self.push((r - 1) >> i)\n",
        "((r >> i) << i) != r: self.update((r - 1) >> i)",
        "((r >> i) << i) != r:",
    ),
    (
        "java",
        "class R {\n    void f(long n, java.util.Scanner sc) {\n        long[] a = new long[(int) n];\n"
        "        for(█)\n        {\n            a[i] = sc.nextLong();\n        }\n    }\n}\n",
        "int i=0; i<n; i++package com.example;",
        "int i=0; i<n; i++",
    ),
    (
        "cpp",
        "int f(int* a, int n) {\n    int c = 0;\n    for (int i = 0; i < n; i++)\n"
        "        if (█)\n            c++;\n    return c;\n}\n",
        "a[i] > 0 then",
        "a[i] > 0",
    ),
    (
        "javascript",
        "function f(xs) {\n  let c = 0;\n  for (const x of xs) {\n    if (█) {\n      c++;\n    }\n  }\n  return c;\n}\n",
        "x > 0 then",
        "x > 0",
    ),
    (
        "go",
        "func f(xs []int) int {\n\tc := 0\n\tfor _, x := range xs {\n\t\tif █ {\n\t\t\tc++\n\t\t}\n\t}\n\treturn c\n}\n",
        "x > 0 then",
        "x > 0",
    ),
    (
        "rust",
        "fn f(xs: &[i32]) -> i32 {\n    let mut c = 0;\n    for x in xs {\n"
        "        if █ {\n            c += 1;\n        }\n    }\n    c\n}\n",
        "*x > 0 then",
        "*x > 0",
    ),
]


NODE_END += [
    (  # a number the model ran on from
        "java",
        "class B {\n    void f(int p) {\n        if (█) {\n            System.out.println(p);\n        }\n    }\n}\n",
        "p==0package amd;",
        "p==0",
    ),
    (  # the rest of a statement before the suffix's `;`
        "cpp",
        "void SetBit(mpz_class& value, size_t index) {\n  █;  // Sets a bit\n}\n",
        "mpz_setbit(value.get_mpz_t(), index) : ClearBit(value.get_mpz_t(), index);  // Sets or clears a bit",
        "mpz_setbit(value.get_mpz_t(), index)",
    ),
    (  # an argument before the suffix's ` / unit,`: the cut leaves the suffix's start, which goes too
        "java",
        "class P {\n    double[] f(double[] l) {\n        return new double[] {\n"
        "            StatUtils.percentile(l, 90.0d) / 1e6,  // p90\n            █ / 1e6,  // p95\n"
        "            StatUtils.percentile(l, 99.0d) / 1e6,  // p99\n        };\n    }\n}\n",
        "StatUtils.percentile(l, 95.0d) / 1e6  // Calculate the 95th percentile",
        "StatUtils.percentile(l, 95.0d)",
    ),
]


def test_find_stop_agrees_on_the_new_block_ends() -> None:
    """The streamed stop comes where the final text ends, so generation stops there."""
    lang, doc, generated, expected = TERMINAL[0]
    prefix, suffix = doc.split(CURSOR)
    stop = find_stop(generated, prefix, suffix, lang, "multi")
    assert stop is not None and generated[:stop].rstrip() == expected


# --------------------------------------------------------------------------------------------
# Indentation of the block (Python): what follows a header is its body. A first line written at
# the header's column goes in at the body's column: the suffix's next line's when the suffix
# holds the body, one level in when the body is empty (also right before an `else:`).

UNDER_HEADER = [
    (
        "def depth(s):\n    d = m = 0\n    for c in s:\n        if c == '(':\n█\n            m = max(d, m)\n"
        "        else:\n            d -= 1\n    return m\n",
        "        d += 1\n",
        "            d += 1",
    ),
    (
        "def count(bs):\n    d = 0\n    for b in bs:\n        if b == '<':\n█        else:\n            d -= 1\n    return d\n",
        "        d += 1\n",
        "            d += 1\n",
    ),
]


# --------------------------------------------------------------------------------------------
# What the rules leave alone.

KEPT = [
    (  # the block ends below the cursor (its next line is dedented): the `return` is its own ending
        "python",
        "def mad(xs):\n    m = sum(xs) / len(xs)\n    █\n\n\nprint(mad([1, 2]))\n",
        "d = [abs(x - m) for x in xs]\n    return sum(d) / len(xs)\n",
        "d = [abs(x - m) for x in xs]\n    return sum(d) / len(xs)",
    ),
    (  # ... and nothing after it at the block's level
        "python", "def f(xs):\n    █\n", "return sorted(xs)\n    print(xs)\n", "return sorted(xs)",
    ),
    (  # `else:` / `break` repeat legitimately: only distinctive lines of the suffix stop a block
        "python",
        "def f(xs):\n    for x in xs:\n        █\n        if x < 0:\n            break\n    return xs\n",
        "if x == 0:\n            break\n        print(x)\n",
        "if x == 0:\n            break\n        print(x)",
    ),
    (  # the model that comes back to the suffix's line wrote what was missing: all of it stays
        "python",
        "def valid(d):\n█\n            return False\n    return True\n",
        "    try:\n        m = int(d)\n        if m < 1 or m > 12:\n            return False\n",
        "    try:\n        m = int(d)\n        if m < 1 or m > 12:",
    ),
    (  # a `try` keeps its `except` before the code that follows
        "python",
        "def load(path):\n    try:\n        █\n    return data\n",
        "data = open(path).read()\n    except OSError:\n        data = ''\n    return data\n",
        "data = open(path).read()\n    except OSError:\n        data = ''",
    ),
    (  # a right answer that parses is not cut
        "python", "def f(xs):\n    return [x for x in xs if █]\n", "x > 0 and x % 2 == 0", "x > 0 and x % 2 == 0",
    ),
    (  # C# has no grammar wheel: no parse check; the closer the suffix has goes (bracket rules)
        "csharp",
        "class A {\n    int F(int[] a) {\n        if (█)\n        {\n"
        "            return 1;\n        }\n        return 0;\n    }\n}\n",
        "a.Length > 0)",
        "a.Length > 0",
    ),
    (  # an empty block body: a line like one further down (a twin function) is the author's habit
        "java",
        "class A {\n    void f(int x) {\n        for (int i = 0; i < x; i++) {\n            █\n        }\n    }\n"
        "    void g(int x) {\n        for (int i = 0; i < x; i++) {\n            int s = i + x;\n"
        "            System.out.println(s);\n        }\n    }\n}\n",
        "int s = i + x;\n            System.out.println(s);\n        }\n",
        "int s = i + x;\n            System.out.println(s);",
    ),
]


# Each rule's table, checked the same way: the text inserted, and it parses in place.
GOLDEN = [
    pytest.param(*case, id=f"{rule}-{case[0]}-{i}")
    for rule, table in (
        ("terminal", TERMINAL),
        ("suffix-line", SUFFIX_LINES),
        ("node-end", NODE_END),
        ("header", [("python", *case) for case in HEADERS]),
        ("under-header", [("python", *case) for case in UNDER_HEADER]),
        ("kept", KEPT),
    )
    for i, case in enumerate(table)
]


@pytest.mark.parametrize("lang,doc,generated,expected", GOLDEN)
def test_golden(lang: str, doc: str, generated: str, expected: str) -> None:
    check(lang, doc, generated, expected)


def test_a_stream_stopped_at_the_suffix_line_keeps_the_block_it_came_back_from() -> None:
    """The streaming cutter stops before the model's copy of the suffix's line, so its final text
    no longer shows that line: it tells post-processing it stopped there (``stopped``), and the
    block stays whole. Without that, the same text would end after its first header."""
    doc = "def tri(n):\n█\n        return [1]\n    return [1, 3]\n"
    prefix, suffix = doc.split(CURSOR)
    cutter = SyntaxCutter(prefix, suffix, "python", completion_mode(prefix, suffix, "python"))
    generated = "    if n == 0:\n        return []\n    elif n == 1:\n        return [1]\n    return [1, 3]\n"
    assert any(cutter.feed(generated[i : i + 5]) for i in range(0, len(generated), 5))
    whole = "    if n == 0:\n        return []\n    elif n == 1:"
    assert cutter.finish(truncated=False) == whole
    assert postprocess(cutter.raw, prefix, suffix, "python", "multi") == "    if n == 0:"
    assert postprocess(cutter.raw, prefix, suffix, "python", "multi", stopped=True) == whole


# ------------------------------------------------------------------------------------------------
# where the parse cannot judge a single-line answer's end

_DOCSTRING_BEING_TYPED = (
    "class Session:\n    def post(self, url, data=None):\n        r\"\"\"Sends a POST request. Returns ",
    "\n\n    def put(self, url, data=None):\n        r\"\"\"Sends a PUT request.\n\n        :param url: URL.\n"
    "        \"\"\"\n        return self.request(\"PUT\", url, data=data)\n",
)
_HALF_TYPED_BODY = (
    "def f(xs):\n    total = (\n    for x in xs:\n        if x > (:\n            total += [x\n    y = ",
    "\n    return total, y\n",
)


@pytest.mark.parametrize("prefix,suffix", [_DOCSTRING_BEING_TYPED, _HALF_TYPED_BODY], ids=["docstring", "broken body"])
def test_single_line_answers_are_not_cut_by_a_parse_that_cannot_judge(monkeypatch, prefix, suffix):
    """Prose in a string, or a window with errors of its own: the answer is kept as the line
    rules left it, and no cut is tried (each reparse of such a window costs milliseconds)."""
    check = InsertionCheck.of(prefix, suffix, surroundings_of(prefix, suffix, "python"), "")
    assert check is not None and not check.judges_ends()
    tried: list[str] = []
    counting = InsertionCheck.errors
    monkeypatch.setattr(InsertionCheck, "errors", lambda self, candidate: tried.append(candidate) or counting(self, candidate))
    answer = "the response (a :class:`Response`), or None if it failed"
    assert postprocess(answer, prefix, suffix, "python", "single") == answer
    assert tried == []


def test_the_parse_judges_ends_in_code_it_can_read():
    prefix, suffix = "def f(xs, r):\n    for x in xs:\n        if ", " self.push(x)\n    return xs\n"
    check = InsertionCheck.of(prefix, suffix, surroundings_of(prefix, suffix, "python"), "")
    assert check is not None and check.judges_ends()
