"""Where the model's block meets the code after the cursor (part of context.cut.line_rules' block end).

A block the model writes into the middle of code that goes on below the cursor must stop where
the author's code takes over: before a line the suffix already has, before a ``return`` that
would make the suffix unreachable or a branch the suffix already has, after a header whose body
the suffix holds. These rules read the model's lines (indentation fixed, as
context.cut.line_rules gives them) and the suffix's next lines (``Surroundings.next_lines``).
"""

from __future__ import annotations

import re

from context.cut.surroundings import Surroundings, is_closer_line, is_comment, opens_block, same_line
from context.source.languages import indent_columns

# Statements after which nothing more of their block runs.
TERMINAL = re.compile(r"^(?:return|raise|throw|break|continue|goto)\b")


def header_end(lines: list[str], first: int, stop: int, site: Surroundings) -> int:
    """Where indentation is significant and the suffix's next line is indented one level deeper
    than the completion's first line, a header, that line is the header's body (``else:``, ``for
    x in xs:`` before the loop's body). A model that wrote on past the header without coming
    back to the suffix's line wrote its own body for it, which the suffix already holds: the
    completion is the header. Else ``stop``."""
    nxt = site.next_lines[0] if site.next_lines else None
    line = lines[first]
    if nxt is None or not site.info.indentation_significant or not opens_block(line, site.info) or is_comment(line.strip()):
        return stop
    width = indent_columns(site.before + line if first == 0 and site.blank_before else line)
    return first + 1 if 0 < indent_columns(nxt) - width <= max(site.indent_unit, 2) else stop


def repeats_suffix(line: str, base: int, site: Surroundings) -> bool:
    """Where the block goes on below the cursor (the suffix's next line is code at the block's
    column or deeper), does ``line`` repeat one of the suffix's next lines (indentation
    included) that is distinctive enough to count: not a closer, not a bare keyword
    (``else:``, ``break;``)? The model is then writing the code that follows. In an empty block
    body (the suffix goes on with its closer) a line like one further down is the author's
    habit (the other branch, a twin function), not the suffix coming back."""
    nxt = site.next_lines[0] if site.next_lines else None
    if nxt is None or is_closer_line(nxt.strip()) or indent_columns(nxt) < base:
        return False
    stripped = line.strip()
    if is_closer_line(stripped) or (len(stripped) < 8 and not any(c in stripped for c in "(=[")):
        return False
    return any(same_line(line, other) for other in site.next_lines[1:])


def statement_start(lines: list[str], i: int, first: int, base: int) -> int:
    """The line where the block-level statement holding line ``i`` starts (``i`` itself when it is
    at the block's level); within the first statement, ``i``: the first statement is kept."""
    for j in range(i, first, -1):
        if lines[j].strip() and not is_comment(lines[j].strip()) and indent_columns(lines[j]) <= base:
            return j
    return i


def suffix_continues(stripped: str, base: int, site: Surroundings) -> bool:
    """Would a statement at the block's level (``stripped``) clash with the code after the cursor?

    * A ``return`` / ``raise`` / ``break`` / ``continue`` / ``throw`` before code that goes on at
      the same level (the suffix's next line) would make that code unreachable: the model is
      writing its own ending of a block the suffix ends.
    * A branch (``elif``, ``else``, ``except``) when the suffix's next line at that level is a
      branch of the statement already: the author's branches follow.
    """
    nxt = site.next_lines[0] if site.next_lines else None
    if nxt is None or indent_columns(nxt) != base or is_closer_line(nxt.strip()):
        return False
    if site.info.branch.match(nxt.strip()):
        return bool(site.info.branch.match(stripped))
    return bool(TERMINAL.match(stripped))
