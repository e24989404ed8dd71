"""The document model: UTF-16 positions, vscode-compatible edits, incremental tree-sitter sync."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_sitter import Node, Parser, Tree

from context.source.document import Document, PositionError

# ----- reference: vscode-languageserver-textdocument on UTF-16 code units ------------------------


def _units(s: str) -> list[int]:
    data = s.encode("utf-16-le", "surrogatepass")
    return [int.from_bytes(data[i : i + 2], "little") for i in range(0, len(data), 2)]


def _from_units(units: list[int]) -> str:
    return b"".join(u.to_bytes(2, "little") for u in units).decode("utf-16-le", "surrogatepass")


def _is_eol(u: int) -> bool:
    return u in (0x0A, 0x0D)


def _line_offsets(u: list[int]) -> list[int]:
    # computeLineOffsets(text, isAtLineStart=true)
    result, i = [0], 0
    while i < len(u):
        if _is_eol(u[i]):
            if u[i] == 0x0D and i + 1 < len(u) and u[i + 1] == 0x0A:
                i += 1
            result.append(i + 1)
        i += 1
    return result


def _ref_offset_at(u: list[int], line: int, character: int) -> int:
    # FullTextDocument.offsetAt, verbatim
    offsets = _line_offsets(u)
    if line >= len(offsets):
        return len(u)
    if line < 0:
        return 0
    line_offset = offsets[line]
    if character <= 0:
        return line_offset
    nxt = offsets[line + 1] if line + 1 < len(offsets) else len(u)
    offset = min(line_offset + character, nxt)
    while offset > line_offset and _is_eol(u[offset - 1]):
        offset -= 1
    return offset


def _snap(u: list[int], offset: int) -> int:
    # Python strings cannot hold half a pair: the document moves to after the pair.
    if 0 < offset < len(u) and 0xD800 <= u[offset - 1] < 0xDC00 and 0xDC00 <= u[offset] < 0xE000:
        return offset + 1
    return offset


def ref_apply(text: str, new: str, rng: tuple[tuple[int, int], tuple[int, int]]) -> str:
    u = _units(text)
    start, end = rng
    if start > end:
        start, end = end, start
    s = _snap(u, _ref_offset_at(u, *start))
    e = _snap(u, _ref_offset_at(u, *end))
    return _from_units(u[:s] + _units(new) + u[e:])


def ref_lines(text: str) -> list[str]:
    return re.split(r"\r\n|\r|\n", text)


def ref_position(text: str, offset: int) -> tuple[int, int]:
    if text[offset - 1 : offset + 1] == "\r\n":
        offset -= 1
    before = ref_lines(text[:offset])
    return len(before) - 1, len(_units(before[-1]))


# ----- trees --------------------------------------------------------------------------------------


def _shape(node: Node) -> list[tuple]:
    out = [
        (
            node.type,
            node.start_byte,
            node.end_byte,
            tuple(node.start_point),
            tuple(node.end_point),
            node.is_missing,
            node.has_error,
        )
    ]
    for child in node.children:
        out.extend(_shape(child))
    return out


def _ts_point(data: bytes, byte: int) -> tuple[int, int]:
    # tree-sitter's (row, byte column): rows advance on "\n" only
    return data.count(b"\n", 0, byte), byte - (data.rfind(b"\n", 0, byte) + 1)


def _nodes(node: Node) -> list[Node]:
    return [node, *(n for child in node.children for n in _nodes(child))]


class SpyParser:
    """Records the old tree handed to each parse and checks that tree.edit left its points
    consistent with the new bytes (a reparse recomputes points, so only here can bad edit
    points show)."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.old_trees: list[Tree | None] = []

    def parse(self, data: bytes, old_tree: Tree | None = None) -> Tree:
        self.old_trees.append(old_tree)
        if old_tree is None:
            return self.parser.parse(data)
        for node in _nodes(old_tree.root_node):
            assert tuple(node.start_point) == _ts_point(data, node.start_byte), node
            assert tuple(node.end_point) == _ts_point(data, node.end_byte), node
        return self.parser.parse(data, old_tree)


def spy_on(doc: Document) -> SpyParser:
    assert doc._parser is not None
    spy = SpyParser(doc._parser)
    doc._parser = spy  # type: ignore[assignment]
    return spy


def assert_same_tree(doc: Document) -> None:
    fresh = Document("file:///fresh", doc.language_id, doc.text)
    assert doc.tree is not None and fresh.tree is not None
    assert _shape(doc.tree.root_node) == _shape(fresh.tree.root_node)


# ----- property test ------------------------------------------------------------------------------

SEEDS = {
    "python": [
        "",
        "def f(a, b):\n    return a + b\n",
        "class A:\r\n    x = '中文'\r\n\r\n    def m(self):\r\n        pass\r\n",
        "import os\rprint('😀', os.sep)\r",
        "s = 'e\u0301'  # caf\u00e9\nfor i in range(3):\n    if i:\n        print(i)\n",
    ],
    "javascript": [
        "",
        "function f(a, b) {\n  return a + b;\n}\n",
        "const s = '😀中';\r\nlet x = () => {\r\n  if (x) { y(); }\r\n};\r\n",
        "// c\u0301omment\rclass A { m() { return [1, 2]; } }\r",
    ],
}

FRAGMENTS = [
    "a", "x", "_", " ", "    ", "\t", "\n", "\r\n", "\r", "(", ")", ":", ",", ".", "=", "1",
    "'", '"', "#", "//", "{", "}", "[", "]", ";", "def ", "return ", "if x:", "function ",
    "=>", "中文", "😀", "𝔸", "e\u0301", "\u0301", "é",
]

inserted = st.lists(st.sampled_from(FRAGMENTS), max_size=6).map("".join)


def _draw_position(data: st.DataObject, text: str) -> tuple[int, int]:
    lines = ref_lines(text)
    line = data.draw(st.integers(-1, len(lines)), label="line")
    width = len(_units(lines[line])) if 0 <= line < len(lines) else 3
    character = data.draw(st.integers(-1, width + 2), label="character")
    return line, character


@pytest.mark.parametrize("language", ["python", "javascript"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_edits_match_reference_and_fresh_parse(language: str, data: st.DataObject) -> None:
    text = data.draw(st.sampled_from(SEEDS[language]), label="seed")
    doc = Document(f"file:///t.{language}", language, text)
    spy = spy_on(doc)
    for step in range(data.draw(st.integers(1, 12), label="steps")):
        start = _draw_position(data, text)
        end = _draw_position(data, text)
        new = data.draw(inserted, label="new")
        text = ref_apply(text, new, (start, end))
        doc.apply_change(new, (start, end), version=step + 1)

        assert doc.text == text
        assert doc.version == step + 1
        lines = ref_lines(text)
        assert doc.line_count == len(lines)
        assert [doc.line_text(i) for i in range(doc.line_count)] == lines
        for i in range(doc.line_count):
            start_of_line = doc.offset_at(i, 0)
            assert doc.byte_offset(start_of_line) == len(text[:start_of_line].encode())
        offset = data.draw(st.integers(0, len(text)), label="offset")
        assert doc.byte_offset(offset) == len(text[:offset].encode())
        assert doc.offset_from_byte(doc.byte_offset(offset)) == offset
        assert doc.position_at(offset) == ref_position(text, offset)
        assert_same_tree(doc)
    assert all(tree is not None for tree in spy.old_trees)


# ----- positions ----------------------------------------------------------------------------------


def test_emoji_counts_two_units_and_mid_pair_snaps_forward() -> None:
    doc = Document("file:///a.txt", "plaintext", "a😀b\nc")
    assert doc.offset_at(0, 1) == 1
    assert doc.offset_at(0, 2) == 2  # between the halves: after the emoji
    assert doc.offset_at(0, 3) == 2
    assert doc.offset_at(0, 4) == 3
    assert doc.position_at(2) == (0, 3)
    assert doc.position_at(3) == (0, 4)
    with pytest.raises(PositionError, match=r"character 5 is past the end of line 0 \(4 UTF-16"):
        doc.offset_at(0, 5)
    assert doc.byte_offset(2) == 5


def test_edit_inside_surrogate_pair_keeps_the_pair() -> None:
    doc = Document("file:///a.py", "python", "x = '😀'\n")
    doc.apply_change("y", ((0, 6), (0, 6)))
    assert doc.text == "x = '😀y'\n"
    assert_same_tree(doc)


def test_cjk_and_combining_marks_are_one_unit_each() -> None:
    doc = Document("file:///a.txt", "plaintext", "中文x\ne\u0301y")
    assert doc.offset_at(0, 2) == 2
    assert doc.byte_offset(2) == 6
    assert doc.offset_at(1, 2) == 2 + 4  # "e" + combining acute, no grapheme merging
    assert doc.position_at(len(doc.text)) == (1, 3)
    assert doc.offset_from_byte(4) == 1  # inside 文: its start
    assert doc.offset_from_byte(len(doc.text.encode())) == len(doc.text)


def test_crlf_and_lone_cr_are_line_breaks() -> None:
    doc = Document("file:///a.txt", "plaintext", "a\r\nb\rc\nd")
    assert doc.line_count == 4
    assert [doc.line_text(i) for i in range(4)] == ["a", "b", "c", "d"]
    assert [doc.offset_at(i, 0) for i in range(4)] == [0, 3, 5, 7]
    assert doc.position_at(2) == (0, 1)  # between \r and \n: end of line 0
    assert doc.offset_at(0, 5, clamp=True) == 1  # before the terminator, never inside it
    assert Document("u", "", "a\n").line_count == 2
    assert Document("u", "", "").line_count == 1


def test_edits_that_join_or_split_crlf_reindex_lines() -> None:
    doc = Document("file:///a.txt", "plaintext", "a\rX\nb")
    assert doc.line_count == 3
    doc.apply_change("", ((1, 0), (1, 1)))  # delete X: "\r" + "\n" become one break
    assert doc.text == "a\r\nb"
    assert doc.line_count == 2
    assert doc.line_text(1) == "b"
    doc.apply_change("\r", ((1, 1), (1, 1)))  # "b\r" then "\n": insert at end of "b"
    doc.apply_change("\n", ((2, 0), (2, 0)))
    assert doc.text == "a\r\nb\r\n"
    assert doc.line_count == 3


def test_lone_cr_tree_points_follow_tree_sitter_rows() -> None:
    # tree-sitter counts rows by "\n" only; an edit after a lone "\r" must use its rows.
    doc = Document("file:///a.py", "python", "a = 1\rb = 2\nc = 中\n")
    spy_on(doc)
    doc.apply_change("xy", ((2, 4), (2, 5)))
    doc.apply_change("z", ((1, 0), (1, 1)))
    assert doc.text == "a = 1\rz = 2\nc = xy\n"
    assert_same_tree(doc)


def test_out_of_range_positions() -> None:
    doc = Document("file:///a.txt", "plaintext", "ab\ncd\n")  # 3 lines, the last empty
    with pytest.raises(PositionError, match=r"line 3 is past the end of the document \(3 lines\)"):
        doc.offset_at(3, 0)
    assert doc.offset_at(3, 0, clamp=True) == len(doc.text)
    assert doc.offset_at(99, 7, clamp=True) == len(doc.text)
    with pytest.raises(PositionError, match=r"character 3 is past the end of line 1 \(2 UTF-16"):
        doc.offset_at(1, 3)
    assert doc.offset_at(1, 3, clamp=True) == 5
    assert doc.offset_at(1, 2) == 5
    for line, character in [(-1, 0), (0, -1)]:
        with pytest.raises(PositionError, match="negative"):
            doc.offset_at(line, character, clamp=True)
    for offset in (-1, len(doc.text) + 1):
        with pytest.raises(PositionError, match=r"offset .* is outside the document \(0\.\.6\)"):
            doc.position_at(offset)
        with pytest.raises(PositionError):
            doc.byte_offset(offset)
    with pytest.raises(PositionError, match="line 3 is past the end"):
        doc.line_text(3)
    with pytest.raises(PositionError):
        doc.offset_from_byte(7)


def test_change_ranges_clamp_and_swap_like_vscode() -> None:
    doc = Document("file:///a.txt", "plaintext", "ab\r\ncd")
    doc.apply_change("!", ((9, 9), (12, 0)))  # past the end: append
    assert doc.text == "ab\r\ncd!"
    doc.apply_change("X", ((1, 1), (0, 1)))  # reversed: swapped
    assert doc.text == "aXd!"
    doc = Document("file:///a.txt", "plaintext", "ab\r\ncd")
    doc.apply_change("-", ((0, 7), (0, 9)))  # past the line's end: before its "\r\n"
    assert doc.text == "ab-\r\ncd"
    doc.apply_change("<", ((-3, 5), (0, -2)))  # negatives: document / line start
    assert doc.text == "<ab-\r\ncd"


def test_version_and_full_replacement() -> None:
    doc = Document("file:///a.py", "python", "x = 1\n", version=1)
    doc.apply_change("y", ((0, 0), (0, 1)))
    assert doc.version == 1
    doc.apply_change("def g():\r\n    return '😀'\r\n", version=7)
    assert doc.version == 7
    assert doc.line_count == 3
    assert doc.offset_at(1, 12) == 10 + 12
    assert doc.offset_at(1, 14) == 10 + 13
    assert_same_tree(doc)


# ----- invalid text, languages, size limit --------------------------------------------------------


def test_lone_surrogates_become_replacement_chars_keeping_positions() -> None:
    doc = Document("file:///a.py", "python", "x = '\ud800'\ny = 1\n")
    assert doc.text == "x = '\ufffd'\ny = 1\n"
    assert doc.tree is not None
    doc.apply_change("\ud83d\ude00", ((0, 5), (0, 6)))  # a pair held as two code points
    assert doc.text == "x = '😀'\ny = 1\n"
    assert doc.position_at(6) == (0, 7)
    doc.apply_change("\udc00", ((1, 0), (1, 0)))
    assert doc.text == "x = '😀'\n\ufffdy = 1\n"
    assert_same_tree(doc)


def test_binary_content_does_not_crash() -> None:
    junk = bytes(range(256)).decode("latin-1") * 3
    doc = Document("file:///a.py", "python", junk)
    assert doc.tree is not None
    doc.apply_change("\x00\xff\ufeff", ((2, 1), (5, 0)))
    assert doc.text == ref_apply(junk, "\x00\xff\ufeff", ((2, 1), (5, 0)))
    assert_same_tree(doc)


def test_language_without_grammar_has_no_tree_but_right_text() -> None:
    doc = Document("file:///notes.cob", "cobol", "MOVE A TO B.\n")
    assert doc.language_id == "cobol"
    assert doc.tree is None
    doc.apply_change("C", ((0, 5), (0, 6)))
    doc.apply_change("D", ((0, 10), (0, 11)), version=2)
    assert doc.text == "MOVE C TO D.\n"
    assert doc.tree is None


def test_language_id_is_normalized_and_guessed_from_uri() -> None:
    doc = Document("file:///a.js", "", "let x = 1;\n")
    assert doc.language_id == "javascript"
    assert doc.tree is not None and doc.tree.root_node.type == "program"
    assert Document("file:///a", "PY", "").language_id == "python"


def test_document_over_max_parse_bytes_has_no_tree_until_it_shrinks() -> None:
    text = "x = '" + "中" * 40 + "'\n"  # 47 characters, 127 UTF-8 bytes
    doc = Document("file:///a.py", "python", text, max_parse_bytes=100)
    assert doc.tree is None
    doc.apply_change("", ((0, 5), (0, 30)))
    assert doc.text == "x = '" + "中" * 15 + "'\n"
    assert doc.tree is not None
    assert_same_tree(doc)
    doc.apply_change("中" * 30, ((0, 5), (0, 5)))
    assert doc.tree is None
    doc.apply_change("y = 2\n")
    assert doc.tree is not None and doc.tree.root_node.end_byte == 6


def test_ranged_change_reparses_incrementally_full_change_from_scratch() -> None:
    doc = Document("file:///a.py", "python", "def f():\n    pass\n")
    spy = spy_on(doc)
    old_tree = doc.tree
    doc.apply_change("return 1", ((1, 4), (1, 8)))
    assert spy.old_trees == [old_tree]
    doc.apply_change("x = 1\n")
    assert spy.old_trees[1:] == [None]


def test_line_index_update_is_fast_on_a_2000_line_file() -> None:
    text = "".join(f"    value_{i} = compute(value_{i - 1}, '中')\n" for i in range(2000))
    doc = Document("file:///a.txt", "plaintext", text)  # no tree: time the index alone
    edits = 500
    began = time.perf_counter()
    for k in range(edits):
        line = (k * 37) % 2000
        doc.apply_change("\n" if k % 5 == 0 else "z", ((line, 4), (line, 4)))
    per_edit = (time.perf_counter() - began) / edits
    assert doc.line_count == 2001 + edits // 5
    assert per_edit < 1e-3


# ----- the memo of derived data ----------------------------------------------------------------


def test_memo_belongs_to_the_current_text_and_keeps_what_an_edit_did_not_touch() -> None:
    doc = Document("file:///a.py", "python", "import os\n\ndef f():\n    return 1\n")
    memo = doc.memo
    assert memo.describes(doc.text) and not memo.describes("".join(list(doc.text)))
    counter = object()
    memo.remember_count(counter, "window", 0, 11, 3, pinned=True)  # "import os\n\n"
    memo.remember_count(counter, "window", 22, 35, 4, pinned=True)  # after the edit below: pinned
    memo.remember_count(counter, "sample", 22, 35, 5)
    memo.remember("header", 0, 10, 100, "import os\n")
    memo.remember("header", 0, 30, 100, "spans the edit")
    doc.apply_change("g", ((2, 4), (2, 5)))  # f -> g at offset 15
    after = doc.memo
    assert after is not memo and after.describes(doc.text) and not memo.describes(doc.text)
    assert after.count(counter, "window", 0, 11) == 3
    assert after.count(counter, "window", 22, 35) is None
    assert after.count(counter, "sample", 22, 35) == 5  # same length: not moved
    assert after.derived("header", 0, 10, 100) == "import os\n"
    assert after.derived("header", 0, 30, 100) is None
    # The old text's memo is untouched (a request still holding it stays consistent).
    assert memo.derived("header", 0, 30, 100) == "spans the edit"


def test_memo_entries_after_an_insertion_move_with_the_text() -> None:
    doc = Document("file:///a.txt", "plaintext", "0123456789")
    counter = object()
    doc.memo.remember_count(counter, "sample", 5, 10, 2)
    doc.memo.remember_count(counter, "window", 5, 10, 2, pinned=True)
    doc.memo.remember("definitions", 0, 3, ("p", "x"), ())
    doc.apply_change("abc", ((0, 2), (0, 2)))
    assert doc.memo.count(counter, "sample", 8, 13) == 2 and doc.memo.count(counter, "sample", 5, 10) is None
    assert doc.memo.count(counter, "window", 8, 13) is None
    assert doc.memo.derived("definitions", 0, 3, ("p", "x")) is None  # spans the edit
    # Another counter's counts are not this one's.
    assert doc.memo.count(object(), "sample", 8, 13) is None


def test_full_replacement_starts_a_fresh_memo() -> None:
    doc = Document("file:///a.py", "python", "x = 1\n")
    doc.memo.remember("header", 0, 2, 1, "x")
    doc.apply_change("y = 2\n")
    assert doc.memo.describes(doc.text) and doc.memo.derived("header", 0, 2, 1) is None
