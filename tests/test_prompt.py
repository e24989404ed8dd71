"""Golden tests for context.prompt.builder and context.prompt.fim on real-looking code in several languages.

Each source marks the cursor with ``█``. Budgets are small so that the window has to choose: the
anchor must sit on a top-level boundary, the enclosing function must be whole, the imports must
come along, and no line may be cut in half. Typing is simulated through a real Document (with its
incremental tree), as the server sees it.
"""

from __future__ import annotations

import re
import statistics
import time

import pytest

from context.cut.control_tokens import strip_control_tokens
from context.prompt.builder import (
    MIDDLE_MAX_LINES,
    MIDDLE_STEP_LINES,
    PromptBudget,
    PromptRequest,
    anchored_prompt,
    build_naive_prompt,
    build_prompt,
    heal_middle,
)
from context.prompt.fim import PREFIX_ONLY, TEMPLATES, choose_template, neutralize_control_tokens
from context.prompt.snippets import Snippet, select_snippets
from context.prompt.window import ApproxCounter, cut_suffix
from context.source.definitions import definitions, js_imports, python_imports
from context.source.document import Document

CURSOR = "█"

PYTHON = '''"""Parsing of HTTP header values."""

import re
from collections.abc import Iterator
from dataclasses import dataclass

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


@dataclass(frozen=True)
class Parameter:
    name: str
    value: str


def split_list(value: str) -> list[str]:
    """Split a comma-separated header value, honouring quoted strings."""
    items: list[str] = []
    current = []
    quoted = False
    for ch in value:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    items.append("".join(current).strip())
    return [item for item in items if item]


def unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1].replace('\\\\"', '"')
    return value


class HeaderParser:
    """Parses ``Content-Type``-like headers into a value and parameters."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def parameters(self, text: str) -> Iterator[Parameter]:
        for part in text.split(";"):
            name, _, value = part.partition("=")
            name = name.strip().lower()
            if not _TOKEN.fullmatch(name):
                if self.strict:
                    raise ValueError(f"bad parameter name {name!r}")
                continue
            yield Parameter(name, unquote(value.strip()))

    def parse(self, header: str) -> tuple[str, dict[str, str]]:
        value, _, rest = header.partition(";")
        params = {}
        for param in self.parameters(rest):
            █
        return value.strip().lower(), params
'''

TYPESCRIPT = """import { EventEmitter } from "node:events";
import type { Logger } from "./logger";
import { retry, sleep } from "./util/timing";

export interface Job {
  id: string;
  attempts: number;
  payload: unknown;
}

export type Handler = (job: Job) => Promise<void>;

const DEFAULT_CONCURRENCY = 4;

function backoff(attempt: number): number {
  const base = Math.min(30_000, 2 ** attempt * 100);
  return base / 2 + Math.random() * (base / 2);
}

export class Queue extends EventEmitter {
  private readonly pending: Job[] = [];
  private running = 0;

  constructor(
    private readonly handler: Handler,
    private readonly log: Logger,
    private readonly concurrency = DEFAULT_CONCURRENCY,
  ) {
    super();
  }

  push(job: Job): void {
    this.pending.push(job);
    this.emit("queued", job.id);
    void this.drain();
  }

  private async drain(): Promise<void> {
    while (this.running < this.concurrency && this.pending.length > 0) {
      const job = this.pending.shift()!;
      this.running += 1;
      this.run(job).finally(() => {
        this.running -= 1;
        void this.drain();
      });
    }
  }
}

export async function runOnce(job: Job, handler: Handler, log: Logger): Promise<boolean> {
  try {
    await retry(() => handler(job), 3);
    return true;
  } catch (err) {
    log.warn(`job ${job.id} failed`, err);
    await sleep(backoff(job.attempts));
    █
  }
}
"""

RUST = """use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead};

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    Str(String),
    List(Vec<Value>),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(n) => write!(f, "{n}"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::List(items) => {
                write!(f, "[")?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{item}")?;
                }
                write!(f, "]")
            }
        }
    }
}

pub struct Store {
    values: HashMap<String, Value>,
}

impl Store {
    pub fn new() -> Self {
        Store { values: HashMap::new() }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }
}

pub fn load<R: BufRead>(reader: R) -> io::Result<Store> {
    let mut store = Store::new();
    for line in reader.lines() {
        let line = line?;
        let Some((key, raw)) = line.split_once('=') else {
            continue;
        };
        let value = match raw.trim().parse::<i64>() {
            Ok(n) => Value::Int(n),
            Err(_) => Value::Str(raw.trim().to_string()),
        };
        █
    }
    Ok(store)
}
"""

GO = """package cache

import (
	"container/list"
	"sync"
	"time"
)

type entry struct {
	key     string
	value   []byte
	expires time.Time
}

// LRU is a size-bounded cache with per-entry expiry.
type LRU struct {
	mu    sync.Mutex
	max   int
	order *list.List
	items map[string]*list.Element
}

func New(max int) *LRU {
	return &LRU{max: max, order: list.New(), items: make(map[string]*list.Element)}
}

func (c *LRU) Get(key string) ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.items[key]
	if !ok {
		return nil, false
	}
	e := el.Value.(*entry)
	if time.Now().After(e.expires) {
		c.order.Remove(el)
		delete(c.items, key)
		return nil, false
	}
	c.order.MoveToFront(el)
	return e.value, true
}

func (c *LRU) Put(key string, value []byte, ttl time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[key]; ok {
		el.Value.(*entry).value = value
		c.order.MoveToFront(el)
		return
	}
	el := c.order.PushFront(&entry{key: key, value: value, expires: time.Now().Add(ttl)})
	c.items[key] = el
	█
}
"""

# language id, source, prefix budget, first line of the window, the enclosing function's first
# line, an import. The budgets leave the window a few hundred characters: it must choose.
CASES = [
    ("python", PYTHON, 250, "class HeaderParser:", "    def parse(self, header: str)", "from collections.abc import Iterator"),
    ("typescript", TYPESCRIPT, 200, "export async function runOnce(", "export async function runOnce(", 'import { retry, sleep } from "./util/timing";'),
    ("rust", RUST, 200, "pub fn load<R: BufRead>", "pub fn load<R: BufRead>", "use std::io::{self, BufRead};"),
    ("go", GO, 200, "func (c *LRU) Put(", "func (c *LRU) Put(", '"container/list"'),
]
SMALL = PromptBudget(prefix_tokens=200, suffix_tokens=40, header_tokens=60)


def open_doc(language: str, source: str) -> tuple[Document, int]:
    offset = source.index(CURSOR)
    doc = Document(f"file:///src/example.{language}", language, source.replace(CURSOR, ""))
    return doc, offset


def prompt_at(
    doc: Document, offset: int, budget: PromptBudget = SMALL, template=PREFIX_ONLY, builder=build_prompt, heal=False,
    layout="append",
):
    return builder(
        doc.text,
        offset,
        uri=doc.uri,
        language_id=doc.language_id,
        tree=doc.tree,
        cursor_byte=doc.byte_offset(offset),
        template=template,
        counter=ApproxCounter(),
        budget=budget,
        heal=heal,
        layout=layout,
    )


def top_level_rows(doc: Document) -> set[int]:
    assert doc.tree is not None
    return {child.start_point[0] for child in doc.tree.root_node.children}


# ------------------------------------------------------------------------------------------------
# window choice


@pytest.mark.parametrize("language,source,tokens,first_line,enclosing,an_import", CASES, ids=[c[0] for c in CASES])
def test_window_is_anchored_whole_and_has_the_header(language, source, tokens, first_line, enclosing, an_import):
    doc, offset = open_doc(language, source)
    budget = PromptBudget(prefix_tokens=tokens, suffix_tokens=40, header_tokens=60)
    prompt = prompt_at(doc, offset, budget)
    text = doc.text
    start = offset - len(prompt.window_prefix)

    assert text[start:offset] == prompt.window_prefix
    assert start > 0, "the budget is small: the window must not start at the top"
    assert text[start - 1] == "\n", "the window starts at a line start"
    assert prompt.window_prefix.startswith(first_line)
    assert enclosing in prompt.window_prefix, "the enclosing function is in the window whole"
    assert prompt.key.anchor_line in top_level_rows(doc), "the anchor is a top-level boundary"
    assert prompt.key.anchor_line == text.count("\n", 0, start)
    # The imports precede the window, whole lines, and are not repeated inside it.
    head = prompt.text[: prompt.text.index(prompt.window_prefix)]
    assert an_import in head
    assert all(text.find(line) == 0 or "\n" + line in text for line in head.splitlines() if line)
    assert prompt.extra["window_tokens"] <= tokens
    assert prompt.text.endswith(prompt.window_prefix), "prefix-only: the cursor is at the very end"


def test_header_leaves_out_prose_in_a_docstring_that_reads_like_an_import():
    source = '"""Helpers kept apart. To keep the\nimport time of the package down, they load late.\n"""\nimport os\nfrom io import StringIO\n\n'
    source += "".join(f"def f{i}(x):\n    return os.path.join(x, '{i}')\n\n\n" for i in range(40)) + "def g(y):\n    return " + CURSOR + "y\n"
    doc, offset = open_doc("python", source)
    prompt = prompt_at(doc, offset, PromptBudget(prefix_tokens=120, header_tokens=60))
    head = prompt.text[: prompt.text.index(prompt.window_prefix)]
    assert "import os\nfrom io import StringIO\n" in head
    assert "import time of" not in head


def test_python_window_shows_the_enclosing_class_line_and_scope():
    doc, offset = open_doc("python", PYTHON)
    prompt = prompt_at(doc, offset, PromptBudget(prefix_tokens=120, header_tokens=60))
    # The window starts inside the class (the class does not fit): its line is shown above it.
    assert prompt.window_prefix.startswith("    def parse(")
    assert "class HeaderParser:\n    def parse(" in prompt.text
    assert prompt.key.scope == ("HeaderParser", "parse")
    assert prompt.key.routing_key == f"{doc.uri}#{prompt.key.anchor_line}"


def test_window_fits_when_the_estimate_is_far_off():
    """A tokenizer that makes each character a token: the window must still fit."""

    class PerChar:
        def count(self, text: str) -> int:
            return len(text)

    doc, offset = open_doc("go", GO)
    prompt = build_prompt(doc.text, offset, tree=doc.tree, counter=PerChar(), budget=PromptBudget(prefix_tokens=300))
    assert len(prompt.window_prefix) <= 300
    start = offset - len(prompt.window_prefix)
    assert start == 0 or doc.text[start - 1] == "\n"


def test_a_minified_line_is_cut_inside_but_stays_put_while_typing():
    line = "var a=" + ",".join(f"f{i}=function(x){{return x+{i}}}" for i in range(400)) + ";"
    text = line + "\n"
    offset = len(line)
    budget = PromptBudget(prefix_tokens=200, suffix_tokens=50)
    first = build_prompt(text, offset, template=TEMPLATES["starcoder2"], budget=budget)
    assert 0 < first.extra["window_tokens"] <= 200
    assert len(first.window_prefix) < len(line)
    typed = text[:offset] + "g" + text[offset:]
    second = build_prompt(typed, offset + 1, template=TEMPLATES["starcoder2"], budget=budget)
    assert second.window_prefix == first.window_prefix + "g"
    # A PSM prompt falls back to the classic layout there: the whole window is the cursor's
    # line, and the FIM prefix would be left empty.
    qwen = build_prompt(text, offset, template=TEMPLATES["qwen2.5-coder"], budget=budget)
    assert qwen.layout == "classic" and qwen.text.endswith("<|fim_middle|>")
    short = build_prompt("x = 1\n" + text[:60], 66, template=TEMPLATES["qwen2.5-coder"], budget=budget)
    assert short.layout == "append"


class RecordingCounter(ApproxCounter):
    def __init__(self) -> None:
        self.counted = 0

    def count(self, text: str) -> int:
        self.counted += len(text)
        return super().count(text)


def test_a_keystroke_counts_only_the_cursor_line():
    text = long_python_file()
    offset = text.index("    \n    return counts") + 4
    doc = Document("file:///src/long.py", "python", text)
    counter = RecordingCounter()
    anchored_prompt(PromptRequest(doc.text, offset, counter=counter, memo=doc.memo))
    assert counter.counted > 3000, "the first request counts the window"
    for typed in ("f", "o", "r v in values:\n        "):
        line, col = doc.position_at(offset)
        doc.apply_change(typed, ((line, col), (line, col)))
        offset += len(typed)
        counter.counted = 0
        with_memo = anchored_prompt(PromptRequest(doc.text, offset, counter=counter, memo=doc.memo))
        # Typing on a line, or Enter: only the cursor line and the line just finished are counted.
        assert counter.counted <= 80, typed
        # Plain strings (no memo) count the window afresh, to the same prompt.
        counter.counted = 0
        fresh = build_prompt(doc.text, offset, counter=counter)
        assert counter.counted > 3000
        assert (fresh.text, fresh.key, fresh.stable_chars) == (with_memo.text, with_memo.key, with_memo.stable_chars)


def test_a_memo_is_only_read_for_its_own_text():
    text = long_python_file()
    offset = text.index("    \n    return counts") + 4
    doc = Document("file:///src/long.py", "python", text)
    counter = RecordingCounter()
    anchored_prompt(PromptRequest(doc.text, offset, counter=counter, memo=doc.memo))
    other = text.replace("counts", "totals")
    counter.counted = 0
    stale = anchored_prompt(PromptRequest(other, offset, counter=counter, memo=doc.memo))
    assert counter.counted > 3000, "another text does not use the memo"
    assert stale == build_prompt(other, offset, counter=counter)


def test_whole_file_when_it_fits():
    doc, offset = open_doc("rust", RUST)
    prompt = prompt_at(doc, offset, PromptBudget())
    assert prompt.key.anchor_line == 0
    assert prompt.window_prefix == doc.text[:offset]
    assert prompt.text == doc.text[:offset]


def test_without_a_tree_indentation_stands_in_for_syntax():
    doc, offset = open_doc("python", PYTHON)
    budget = PromptBudget(prefix_tokens=250, header_tokens=60)
    plain = build_prompt(doc.text, offset, counter=ApproxCounter(), budget=budget)
    assert plain.window_prefix.startswith("class HeaderParser:")
    assert plain.window_prefix == prompt_at(doc, offset, budget).window_prefix
    # With less room, the least indented line within reach wins: a whole statement of the loop.
    budget = PromptBudget(prefix_tokens=150)
    tight = build_prompt(doc.text, offset, counter=ApproxCounter(), budget=budget)
    assert tight.window_prefix.startswith("            name = name.strip().lower()\n")
    assert tight.window_prefix == prompt_at(doc, offset, budget).window_prefix


# ------------------------------------------------------------------------------------------------
# stability while typing


def long_python_file() -> str:
    body = PYTHON.replace(CURSOR, "pass")
    # Many top-level definitions: the window (1024 tokens) covers only part of the file.
    parts = [body.split("class HeaderParser")[0]]
    # Many small top-level definitions: a window that slid with the cursor would cross one every
    # few keystrokes.
    for i in range(80):
        parts.append(f"\ndef helper_{i}(value: str) -> str:\n    return value.strip() + '{i}'\n")
    parts.append("\ndef target(values: list[str]) -> dict[str, int]:\n    counts: dict[str, int] = {}\n    \n    return counts\n")
    return "".join(parts)


TYPED = (
    "for value in values:\n"
    "        key = value.strip().lower()\n"
    "        if not key:\n"
    "            continue\n"
    "        counts[key] = counts.get(key, 0) + 1\n"
    "        if len(counts) > 1000:\n"
    "            raise ValueError('too many distinct values')\n"
)


def type_through(builder, template=PREFIX_ONLY, budget=PromptBudget(prefix_tokens=400), heal=False, layout="append"):
    text = long_python_file()
    doc = Document("file:///src/long.py", "python", text)
    offset = text.index("    \n    return counts") + 4
    prompts = []
    for ch in TYPED[:200]:
        line, col = doc.position_at(offset)
        doc.apply_change(ch, ((line, col), (line, col)))
        offset += 1
        prompts.append(prompt_at(doc, offset, budget, template, builder, heal, layout))
    return prompts


def test_anchor_changes_rarely_while_typing_200_chars():
    prompts = type_through(build_prompt)
    anchors = [p.key.anchor_line for p in prompts]
    changes = sum(1 for a, b in zip(anchors, anchors[1:]) if a != b)
    assert changes <= 1, anchors
    # The head (imports, scope lines) and everything above the cursor line stay byte-identical
    # between keystrokes on the same line: the prompt only grows at its end.
    grows = sum(1 for a, b in zip(prompts, prompts[1:]) if b.text.startswith(a.text))
    assert grows >= len(prompts) - 1 - changes


def test_naive_window_slides_while_typing_the_same_200_chars():
    prompts = type_through(build_naive_prompt)
    anchors = [p.key.anchor_line for p in prompts]
    changes = sum(1 for a, b in zip(anchors, anchors[1:]) if a != b)
    assert changes >= 3, "the baseline slides by lines; if it did not, the comparison would be moot"


@pytest.mark.parametrize("name", ["starcoder2", "codestral"])
def test_spm_typing_only_appends(name):
    prompts = type_through(build_prompt, TEMPLATES[name])
    anchors = [p.key.anchor_line for p in prompts]
    for a, b, anchor_a, anchor_b in zip(prompts, prompts[1:], anchors, anchors[1:]):
        if anchor_a == anchor_b:
            tail = TEMPLATES[name].middle if TEMPLATES[name].spm_join is not None else ""
            assert b.text.startswith(a.text[: len(a.text) - len(tail)])


def test_classic_psm_keeps_the_prefix_and_only_rewrites_the_suffix_part():
    prompts = type_through(build_prompt, TEMPLATES["qwen2.5-coder"], layout="classic")
    assert {p.layout for p in prompts} == {"classic"}
    for a, b in zip(prompts, prompts[1:]):
        if a.key.anchor_line == b.key.anchor_line:
            before = a.text[: a.text.index("<|fim_suffix|>")]
            assert b.text.startswith(before)


@pytest.mark.parametrize("name", ["qwen2.5-coder", "deepseek-coder", "codellama"])
def test_append_psm_typing_only_appends(name):
    """The suffix is prefilled once per body, not once per keystroke: while typing 200 characters
    of a function body (seven lines, nested blocks and dedents among them), each prompt extends
    the one before it (less the one character that healing holds back): the middle anchor stays
    at the body's start."""
    template = TEMPLATES[name]
    prompts = type_through(build_prompt, template, heal=True)
    assert {p.layout for p in prompts} == {"append"}
    moved = extended = 0
    for a, b in zip(prompts, prompts[1:]):
        assert b.text.startswith(b.text[: b.stable_chars]) and b.text[: b.stable_chars].endswith(template.middle)
        if a.text[: a.stable_chars] != b.text[: b.stable_chars]:
            moved += 1
            continue
        extended += 1
        assert b.text.startswith(a.text[: len(a.text) - len(a.healed)])
    assert TYPED[:200].count("\n") >= 4 and moved <= 1, moved  # at most the window's own anchor moved
    assert extended >= len(prompts) - 2
    middle = template.middle + "    counts: dict[str, int] = {}\n"  # the body's first line starts the middle
    assert all(middle in p.text for p in prompts)


def test_append_middle_anchor_moves_in_steps_outside_a_short_body():
    """Top-level code, or a body begun more than MIDDLE_MAX_LINES above the cursor: the middle
    starts at a line that moves every MIDDLE_STEP_LINES lines."""
    qwen = TEMPLATES["qwen2.5-coder"]
    top = "".join(f"x{i} = {i}\n" for i in range(40))
    middles = []
    for n in range(20, 30):
        text = top[: top.index(f"x{n} =")] + "y"
        prompt = build_prompt(text, len(text), template=qwen, counter=ApproxCounter())
        middles.append(prompt.text.split("<|fim_middle|>")[1].split("\n")[0])
    assert len(set(middles)) <= -(-10 // MIDDLE_STEP_LINES) + 1 and len(set(middles)) >= 2, middles
    body = "def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(MIDDLE_MAX_LINES + 6)) + "    y"
    prompt = build_prompt(body, len(body), template=qwen, counter=ApproxCounter())
    assert not prompt.text.split("<|fim_middle|>")[1].startswith("    x0 = 0")  # the body began too far up


def test_append_layout_moves_the_cursors_lines_after_the_middle_token():
    doc, offset = open_doc("go", GO)
    classic = prompt_at(doc, offset, template=TEMPLATES["qwen2.5-coder"], layout="classic")
    append = prompt_at(doc, offset, template=TEMPLATES["qwen2.5-coder"])
    head, rest = append.text.split("<|fim_suffix|>")
    suffix, typed = rest.split("<|fim_middle|>")
    assert suffix == classic.window_suffix and typed and append.window_prefix.endswith(typed)
    assert classic.window_prefix == append.window_prefix
    # The same text in another order: head + typed + suffix is the classic prompt's.
    assert head + typed + "<|fim_suffix|>" + suffix + "<|fim_middle|>" == classic.text
    assert append.text[: append.stable_chars] == head + "<|fim_suffix|>" + suffix + "<|fim_middle|>"
    # SPM and prefix-only layouts have nothing to move.
    for name in ("starcoder2", "prefix-only"):
        assert prompt_at(doc, offset, template=TEMPLATES[name]).text == prompt_at(
            doc, offset, template=TEMPLATES[name], layout="classic"
        ).text


def test_heal_middle_ends_the_prompt_where_a_token_would():
    assert heal_middle("        ") == ("       ", " ")  # seven spaces, then the model's " word"
    assert heal_middle("def f():\n\t\t") == ("def f():\n\t", "\t")
    assert heal_middle("x = 1\n    return ") == ("x = 1\n    return", " ")
    assert heal_middle("x = 1\n    retu") == ("x = 1\n    retu", "")
    assert heal_middle("x = 1\n") == ("x = 1\n", "")
    assert heal_middle("") == ("", "")
    # A lone mark joins the word after it ("(a", ".name"): the model writes it; a run does not.
    assert heal_middle("\t\tif(") == ("\t\tif", "(")
    assert heal_middle("    x = self.") == ("    x = self", ".")
    assert heal_middle("    f((") == ("    f((", "")
    assert heal_middle("    return x ->") == ("    return x ->", "")


def test_stable_part_is_a_prefix_of_the_prompt_and_hash_follows_it():
    prompts = type_through(build_prompt, TEMPLATES["starcoder2"])
    for a, b in zip(prompts, prompts[1:]):
        same_line = a.text[: a.stable_chars] == b.text[: b.stable_chars]
        assert same_line == (a.key.stable_hash == b.key.stable_hash)
    assert prompts[-1].text[: prompts[-1].stable_chars].endswith("\n")


# ------------------------------------------------------------------------------------------------
# token healing: the prompt ends before the whitespace that ends the cursor's line


def test_heal_keeps_the_indentation_of_an_indented_empty_line():
    """The indentation says which block the model writes in (a small model given a prompt that
    ends at the line start writes at column 0)."""
    doc, offset = open_doc("python", "def area(r):\n    pi = 3.14\n    █\n\n\ndef other():\n    pass\n")
    plain = prompt_at(doc, offset)
    healed = prompt_at(doc, offset, heal=True)
    assert plain.text.endswith("pi = 3.14\n    ") and plain.healed == ""
    assert healed.text == plain.text and healed.healed == ""
    qwen = prompt_at(doc, offset, template=TEMPLATES["qwen2.5-coder"], heal=True, layout="classic")
    assert "pi = 3.14\n    <|fim_suffix|>" in qwen.text and qwen.healed == ""
    # After the middle token the prompt ends where a token would: the last space is the model's.
    appended = prompt_at(doc, offset, template=TEMPLATES["qwen2.5-coder"], heal=True)
    assert appended.text.endswith("<|fim_middle|>    pi = 3.14\n   ") and appended.healed == " "


def test_heal_drops_trailing_spaces_after_code_and_tabs():
    doc, offset = open_doc("go", "package main\n\nfunc f(x int) int {\n\treturn █\n}\n")
    healed = prompt_at(doc, offset, heal=True)
    assert healed.text.endswith("\treturn") and healed.healed == " "
    doc, offset = open_doc("go", "package main\n\nfunc f(x int) int {\n\tx := 1 \t█\n}\n")
    healed = prompt_at(doc, offset, template=TEMPLATES["starcoder2"], heal=True)
    assert healed.text.endswith("x := 1") and healed.healed == " \t"
    # Nothing to heal: nothing changes.
    doc, offset = open_doc("go", "package main\n\nfunc f(x int) int {\n\treturn x█\n}\n")
    assert prompt_at(doc, offset, heal=True).text == prompt_at(doc, offset).text


@pytest.mark.parametrize("name", ["prefix-only", "starcoder2", "codestral"])
def test_healed_prompts_still_only_grow_while_typing(name):
    template = TEMPLATES[name]
    prompts = type_through(build_prompt, template, heal=True)
    assert any(p.healed for p in prompts)  # the typed indentation was healed
    tail = template.middle if template.spm_join is not None else ""
    for a, b in zip(prompts, prompts[1:]):
        if a.key.anchor_line == b.key.anchor_line:
            assert b.text.startswith(a.text[: len(a.text) - len(tail)])


# ------------------------------------------------------------------------------------------------
# templates and rendering


def test_fim_layouts():
    doc, offset = open_doc("go", GO)
    qwen = prompt_at(doc, offset, template=TEMPLATES["qwen2.5-coder"], layout="classic")
    star = prompt_at(doc, offset, template=TEMPLATES["starcoder2"])
    mistral = prompt_at(doc, offset, template=TEMPLATES["codestral"])
    assert qwen.window_suffix == star.window_suffix == mistral.window_suffix
    suffix = qwen.window_suffix
    assert suffix.startswith("\n}") and suffix.endswith("\n")
    window = qwen.window_prefix
    # PSM: <pre> head prefix <suf> suffix <mid>
    assert re.fullmatch(r"<\|fim_prefix\|>(.*)<\|fim_suffix\|>(.*)<\|fim_middle\|>", qwen.text, re.S)
    assert qwen.text.endswith(window + "<|fim_suffix|>" + suffix + "<|fim_middle|>")
    # BigCode SPM: <pre><suf> suffix <mid> head prefix -- the prefix is last
    assert star.text.startswith("<fim_prefix><fim_suffix>" + suffix + "<fim_middle>")
    assert star.text.endswith(window)
    # Mistral SPM: [SUFFIX] suffix [PREFIX] head prefix
    assert mistral.text.startswith("[SUFFIX]" + suffix + "[PREFIX]")
    assert mistral.text.endswith(window)
    # The head (imports) sits between the markers and the window in every layout.
    for prompt in (qwen, star, mistral):
        assert '"container/list"' in prompt.text[: prompt.text.index(window)]
    assert star.stop == TEMPLATES["starcoder2"].stop


def test_prefix_only_has_no_suffix_and_no_markers():
    doc, offset = open_doc("typescript", TYPESCRIPT)
    prompt = prompt_at(doc, offset)
    assert prompt.window_suffix == ""
    assert prompt.template == "prefix-only"
    assert "fim" not in prompt.text and "  }\n}" not in prompt.text


def test_suffix_is_cut_at_line_ends_preferring_definition_ends():
    suffix = "value)\n        return result\n\n    def other(self):\n        return 1\n\n\ndef top():\n    return 2\n\n\ndef more():\n    return 3\n"
    for budget, cut_before in ((95, "def more():"), (75, "def top():")):
        cut = cut_suffix(suffix, budget)
        assert len(cut) <= budget and cut.endswith("\n") and suffix.startswith(cut)
        # The cut goes before a line at column 0 (a new top-level definition), the latest one.
        assert suffix[len(cut) :].lstrip("\n").startswith(cut_before), (budget, cut)
    assert cut_suffix(suffix, len(suffix)) == suffix
    # The rest of the cursor's line is kept even when it alone exceeds the budget, up to twice it.
    assert cut_suffix("a" * 15 + "\nnext\n", 10) == "a" * 15 + "\n"
    assert cut_suffix("a" * 50 + "\nnext\n", 10) == "a" * 20


def test_snippets_go_first_in_the_given_order():
    doc, offset = open_doc("python", PYTHON)
    snippets = (Snippet("pkg/a.py", "def a(): ..."), Snippet("pkg/b.py", "def b(): ..."))
    prompt = build_prompt(doc.text, offset, language_id="python", tree=doc.tree, snippets=snippets, budget=SMALL)
    assert prompt.text.startswith("# pkg/a.py\ndef a(): ...\n\n# pkg/b.py\ndef b(): ...\n\n")
    js = build_prompt(doc.text, offset, language_id="typescript", snippets=snippets[:1], budget=SMALL)
    assert js.text.startswith("// pkg/a.py\n")


def test_control_tokens_in_the_document_never_reach_the_prompt_as_markers():
    source = 'MARKERS = ["<|fim_prefix|>", "<|fim_middle|>", "<fim_suffix>", "<|endoftext|>"]\n\ndef f():\n    █\n'
    doc, offset = open_doc("python", source)
    for name in ("qwen2.5-coder", "starcoder2", "prefix-only"):
        template = TEMPLATES[name]
        prompt = prompt_at(doc, offset, template=template)
        for marker in ("<|fim_prefix|>", "<|fim_middle|>", "<fim_suffix>", "<|endoftext|>"):
            own = sum(marker == m for m in (template.prefix, template.suffix, template.middle))
            own += marker == template.prefix + template.suffix  # BigCode's SPM lead
            assert prompt.text.count(marker) == own, (name, marker)
        assert prompt.window_prefix == doc.text[:offset], "what post-processing compares stays raw"
    assert neutralize_control_tokens("plain code") == "plain code"
    assert strip_control_tokens("x = 1<|fim_middle|><file_sep>") == "x = 1"
    # A broken-up marker the model copies from the prompt comes back as the user's own text.
    copied = neutralize_control_tokens('EOS = "<|endoftext|>"')
    assert copied != 'EOS = "<|endoftext|>"'
    assert strip_control_tokens(copied) == 'EOS = "<|endoftext|>"'


# ------------------------------------------------------------------------------------------------
# the naive baseline


def test_naive_prompt_is_the_last_and_next_lines():
    doc, offset = open_doc("python", PYTHON)
    prompt = prompt_at(doc, offset, template=TEMPLATES["qwen2.5-coder"], builder=build_naive_prompt)
    start = offset - len(prompt.window_prefix)
    assert doc.text[start - 1] == "\n"
    assert prompt.text.startswith("<|fim_prefix|>" + prompt.window_prefix), "no header, no snippets"
    assert prompt.extra["window_tokens"] <= SMALL.prefix_tokens
    # The most lines that fit: one more line above would not.
    room = int(SMALL.prefix_tokens * 3.5 * 0.92)
    above = doc.text.rfind("\n", 0, start - 1) + 1
    assert len(prompt.window_prefix) <= room < offset - above
    n_before = prompt.window_prefix.count("\n") + 1
    # As many lines after as before, or fewer when the file ends or the suffix budget is spent.
    assert prompt.window_suffix.count("\n") <= n_before
    assert doc.text[offset:].startswith(prompt.window_suffix)
    assert prompt.window_suffix.endswith("\n")
    ember = prompt_at(doc, offset, template=TEMPLATES["qwen2.5-coder"])
    assert ember.text != prompt.text


# ------------------------------------------------------------------------------------------------
# cross-file snippets

MODELS_PY = '''from dataclasses import dataclass


@dataclass
class User:
    name: str
    email: str

    def display(self) -> str:
        return f"{self.name} <{self.email}>"

    def _secret(self) -> str:
        return "hidden"


def load_users(path: str) -> list[User]:
    with open(path) as handle:
        return [User(*line.split(",")) for line in handle]


MAX_USERS = 100
'''

STORAGE_PY = '''import sqlite3


class Storage:
    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path)

    def save(self, key: str, value: bytes) -> None:
        self.db.execute("insert into kv values (?, ?)", (key, value))


def open_storage(path: str) -> Storage:
    return Storage(path)
'''

CURRENT_PY = '''from app.models import User, load_users
import os


def main() -> None:
    users = load_users(os.environ["USERS"])
    █
'''


def test_select_snippets_prefers_imported_definitions_in_path_order():
    others = [
        ("file:///w/app/storage.py", STORAGE_PY),
        ("file:///w/app/models.py", MODELS_PY),
        ("file:///w/web/index.ts", "export function main(): void {}\n"),
    ]
    snippets = select_snippets(CURRENT_PY.replace(CURSOR, ""), "python", others, 2000)
    assert [s.path for s in snippets] == ["/w/app/models.py", "/w/app/storage.py"]
    imported = snippets[0].text
    # Imported names come whole (small), in file order; what is not imported is left out.
    assert imported.startswith("@dataclass\nclass User:")
    assert 'return f"{self.name} <{self.email}>"' in imported
    assert "def load_users(path: str) -> list[User]:\n    with open(path)" in imported
    assert "MAX_USERS" not in imported
    # Not imported: signatures only, private members left out.
    assert snippets[1].text == (
        "class Storage:\n    def __init__(self, path: str) -> None: ...\n    def save(self, key: str, value: bytes) -> None: ...\n"
        "def open_storage(path: str) -> Storage: ..."
    )
    # The same inputs in another order give the same snippets (they stay in the engine's cache).
    assert select_snippets(CURRENT_PY, "python", list(reversed(others)), 2000) == snippets


def test_select_snippets_respects_the_budget_with_whole_definitions():
    others = [("/w/app/models.py", MODELS_PY), ("/w/app/storage.py", STORAGE_PY)]
    snippets = select_snippets(CURRENT_PY, "python", others, 200)
    total = sum(len(s.path) + len(s.text) + 8 for s in snippets)
    assert 0 < total <= 200
    for snippet in snippets:
        for piece in snippet.text.split("\n\n"):
            assert piece.strip().endswith((")", "...", "]", ":")) or piece.endswith("handle]")


def test_select_snippets_for_typescript_relative_imports():
    current = 'import { formatDate } from "./util/dates";\nimport React from "react";\nconst x = require("../lib/conf.js");\n'
    dates = "export function formatDate(d: Date): string {\n  return d.toISOString();\n}\n\nexport function parseDate(s: string): Date {\n  return new Date(s);\n}\n"
    conf = "module.exports.load = function load(path) {\n  return JSON.parse(path);\n};\n"
    other = "export class Widget {\n  render(): string {\n    return '';\n  }\n}\n"
    assert js_imports(current) == {"./util/dates": ("formatDate",), "../lib/conf": ()}
    snippets = select_snippets(
        current, "typescript", [("/p/src/widget.ts", other), ("/p/src/util/dates.ts", dates), ("/p/lib/conf.js", conf), ("/p/a.py", "x = 1\n")], 4000
    )
    assert [s.path for s in snippets] == ["/p/lib/conf.js", "/p/src/util/dates.ts", "/p/src/widget.ts"]
    assert snippets[0].text == "module.exports.load = function load(path) { ... }"
    assert snippets[1].text == "export function formatDate(d: Date): string {\n  return d.toISOString();\n}"
    assert snippets[2].text == "export class Widget {\n  render(): string { ... }\n}"


def test_python_imports_and_definitions_of_rust_and_go():
    found = python_imports("from . import models\nfrom .db import (\n    connect,\n    Session as S,\n)\nimport a.b as c, os\n")
    assert found[".db"] == ("Session", "connect")
    assert found[".models"] == () and found["a.b"] == () and found["os"] == ()
    rust = {d.name: d.signature for d in definitions(RUST.replace(CURSOR, ""), "rust")}
    assert rust["load"] == "pub fn load<R: BufRead>(reader: R) -> io::Result<Store> { ... }"
    assert rust["Store"].startswith("impl Store {\n    pub fn new() -> Self { ... }") or rust["Store"].startswith("pub struct Store")
    go = {d.name: d.signature for d in definitions(GO.replace(CURSOR, ""), "go")}
    assert go["Get"] == "func (c *LRU) Get(key string) ([]byte, bool) { ... }"
    assert go["entry"].startswith("type entry struct {")



def test_definitions_are_remembered_with_their_document():
    doc = Document("file:///src/store.rs", "rust", RUST.replace(CURSOR, ""))
    first = definitions(doc.text, "rust", doc.uri, doc.memo)
    assert definitions(doc.text, "rust", doc.uri, doc.memo) is first
    assert definitions(doc.text, "rust", doc.uri) == first and definitions(doc.text, "rust", doc.uri) is not first
    doc.apply_change("\n// more\n", ((doc.line_count - 1, 0), (doc.line_count - 1, 0)))
    assert definitions(doc.text, "rust", doc.uri, doc.memo) is not first
    # Snippets read the memos of the documents given whole.
    other = Document("file:///src/pkg/util.py", "python", "def helper(x):\n    return x\n")
    picked = select_snippets("from pkg.util import helper\n", "python", [(other.uri, other.text)], 500, {other.uri: other.memo})
    assert picked == select_snippets("from pkg.util import helper\n", "python", [(other.uri, other.text)], 500)
    assert other.memo.derived("definitions", 0, len(other.text), (other.uri, "python", False)) is not None


# ------------------------------------------------------------------------------------------------
# template choice


@pytest.mark.parametrize(
    "tokens,name",
    [
        (["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"], "qwen2.5-coder"),
        (["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"], "starcoder2"),
        (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"], "deepseek-coder"),
        (["▁<PRE>", "▁<SUF>", "▁<MID>"], "codellama"),
        (["[PREFIX]", "[SUFFIX]", "</s>"], "codestral"),
        (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "prefix-only"),
    ],
)
def test_choose_template_from_special_tokens(tokens, name):
    assert choose_template(tokens).name == name


@pytest.mark.parametrize(
    "model,name",
    [
        ("Qwen/Qwen2.5-Coder-1.5B", "qwen2.5-coder"),
        ("bigcode/starcoder2-3b", "starcoder2"),
        ("deepseek-ai/deepseek-coder-1.3b-base", "deepseek-coder"),
        ("codellama/CodeLlama-7b-hf", "codellama"),
        ("mistralai/Codestral-22B-v0.1", "codestral"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "prefix-only"),
    ],
)
def test_choose_template_from_model_names(model, name):
    assert choose_template([], model).name == name


def test_choose_template_override():
    assert choose_template(["<fim_prefix>"], "starcoder2", override="qwen2.5-coder").name == "qwen2.5-coder"
    with pytest.raises(ValueError, match="unknown FIM template"):
        choose_template([], override="nope")


# ------------------------------------------------------------------------------------------------
# cost


def test_build_is_cheap_on_a_2000_line_file():
    unit = PYTHON.replace(CURSOR, "params[param.name] = param.value")
    text = (unit * (2000 // unit.count("\n") + 1))
    doc = Document("file:///big.py", "python", text)
    offset = text.rindex("params[param.name]")
    assert text.count("\n") >= 2000
    times = []
    for _ in range(15):
        started = time.perf_counter()
        prompt_at(doc, offset, PromptBudget(), TEMPLATES["starcoder2"])
        times.append(time.perf_counter() - started)
    # ~0.5 ms here; the bound only catches a build that became linear in something it should not.
    assert statistics.median(times) < 0.02


def test_cross_file_selection_follows_the_snippet_budget():
    # 880 characters for the 256 tokens of a 2048-token context, as before; more with more context.
    assert PromptBudget.for_model(2048, 48).snippet_chars == 880
    assert PromptBudget.for_model(8192, 48).snippet_chars == 4 * 880
    assert PromptBudget.for_model(2048, 48, snippet_tokens=64).snippet_chars == 220


def test_definitions_without_a_grammar_take_a_line_that_starts_with_a_bracket():
    # A shell subshell at column 0 used to raise IndexError (found indexing editors/*.sh).
    found = definitions('(cd "$here" && npm ci)\nbuild() {\n  make\n}\n', "shellscript", "install.sh")
    assert [d.name for d in found] == ["", "build"]
