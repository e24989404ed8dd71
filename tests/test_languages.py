"""context.source.languages: one description per language family, and indentation in columns."""

from __future__ import annotations

import pytest

from context.source.languages import (
    BRANCH,
    BRANCH_HEADERS,
    CUT_CONTINUATION,
    STATEMENT_CONTINUATION,
    TAB_WIDTH,
    bracket_depth,
    indent_columns,
    language_info,
    normalize_language_id,
)


def test_families_group_the_ids_that_import_each_other():
    families = {lang: language_info(lang).family for lang in ("javascript", "javascriptreact", "typescript", "typescriptreact")}
    assert set(families.values()) == {"javascript"}
    assert language_info("typescript") is language_info("javascript")
    assert language_info("c").family == "c" and language_info("cpp").family == "cpp"


def test_an_unknown_language_gets_the_defaults_as_a_family_of_its_own():
    kotlin, swift = language_info("kotlin"), language_info("swift")
    assert kotlin.family == "kotlin" and swift.family == "swift"
    assert kotlin.line_comment == "//" and kotlin.block_comment == ("/*", "*/")
    assert not kotlin.indentation_significant and not kotlin.prose
    # Ids are looked up as given: normalize them first (an alias is not an id).
    assert language_info("py").family == "py"
    assert language_info(normalize_language_id("py")) is language_info("python")


@pytest.mark.parametrize(
    "lang,comment,quotes,openers",
    [
        ("python", "#", "\"'`", ('"""', "'''")),
        ("javascript", "//", "\"'`", ("/*", "`")),
        ("go", "//", "\"'`", ("/*", "`")),
        ("rust", "//", '"`', ("/*",)),
        ("java", "//", "\"'`", ("/*",)),
        ("ruby", "#", "\"'`", ("/*",)),
        ("shellscript", "#", "\"'`", ("/*",)),
    ],
)
def test_lexical_facts(lang, comment, quotes, openers):
    info = language_info(lang)
    assert info.line_comment == comment
    assert info.quotes == quotes
    assert info.multiline_openers == openers
    for opener in openers:
        assert info.multiline_closer(opener) == ("*/" if opener == "/*" else opener)


@pytest.mark.parametrize(
    "lang,scanned",
    [("python", "#"), ("javascript", "//"), ("rust", "//"), ("kotlin", "//"), ("ruby", "//"), ("shellscript", "//")],
)
def test_the_bracket_scan_skips_the_comment_marker_it_always_has(lang, scanned):
    # Not line_comment: Ruby and shell scripts keep the C-like `//` post-processing scanned them with.
    assert language_info(lang).scan_line_comment == scanned


def test_python_is_the_indentation_language_and_elides_bodies_with_dots():
    python = language_info("python")
    assert python.indentation_significant and python.block_comment is None
    assert python.elided_body == " ..." and language_info("go").elided_body == " { ... }"
    assert python.multiline_tokens.findall('x = "a#b"  # c """') == ['"a#b"', "#", '"""']
    assert language_info("c").multiline_tokens.findall('s = "/*"; /* c */ `') == ['"/*"', "/*", "*/", "`"]


def test_prose_languages():
    assert all(language_info(lang).prose for lang in ("markdown", "plaintext", "yaml", "html"))
    assert not any(language_info(lang).prose for lang in ("python", "go", "kotlin"))


def test_the_two_readings_of_a_continuation_line():
    # Prompt building: a cut before these splits a construct (Ruby/Lua `end` included).
    for line in (")", "} else {", "elif x:", "except E:", "finally:", "catch (e) {", "end"):
        assert CUT_CONTINUATION.match(line), line
    # Post-processing: continues a statement whose block was closed (do-while, not `end`).
    assert STATEMENT_CONTINUATION.match("while (x);") and not CUT_CONTINUATION.match("while (x);")
    assert not STATEMENT_CONTINUATION.match("while (x) {")
    assert CUT_CONTINUATION.match("end") and not STATEMENT_CONTINUATION.match("end")
    assert language_info("python").cut_continuation is CUT_CONTINUATION
    assert language_info("python").statement_continuation is STATEMENT_CONTINUATION


def test_branches_and_the_headers_they_continue():
    m = BRANCH.match("} else {")
    assert m is not None and m.group(1) == "else"
    assert BRANCH_HEADERS["else"].match("} else if (y) {") and BRANCH_HEADERS["elif"].match("if x:")
    assert not BRANCH_HEADERS["except"].match("if x:")
    assert language_info("java").branch_headers is BRANCH_HEADERS


@pytest.mark.parametrize(
    "line,columns,chars",
    [
        ("", 0, 0),
        ("x = 1", 0, 0),
        ("    x", 4, 4),
        ("\tx", 4, 1),
        ("  \tx", 4, 3),
        ("\t  x", 6, 3),
        ("\t\tx", 8, 2),
        ("   \t \tx", 8, 6),
        ("      ", 6, 6),
    ],
)
def test_indent_columns_tabs_go_to_the_next_multiple(line, columns, chars):
    assert TAB_WIDTH == 4
    assert indent_columns(line) == columns
    assert indent_columns(line, tab_width=1) == chars == len(line) - len(line.lstrip(" \t"))
    assert indent_columns("\t x", tab_width=8) == 9


def test_bracket_depth():
    assert bracket_depth("from x import (") == 1
    assert bracket_depth("f(a[0], {b})") == 0
    assert bracket_depth(")}") == -2
