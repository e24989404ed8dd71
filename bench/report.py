"""Print the results section of bench/README.md from the JSON files the benchmarks wrote.

    .venv/bin/python bench/report.py            # print the markdown to stdout
    .venv/bin/python bench/report.py --write    # put it between the markers in bench/README.md

Why this exists: the project's rule for bench/README.md is "nothing in the README that a script did
not print". Numbers copied by hand drift from the files they came from, lose the date, the machine
and the commit they were measured on, and get rounded differently from one edit to the next. So the
README's results are this script's output, regenerated after every benchmark run.

It reads bench/results/{prompt_stability,replay,load,daemon,peer}.json, quality-*.json and *-gpu.json.
Each section says when, where (CPU model, cores, load average: whatever the file recorded) and at
which commit the run was made, and the exact command or arguments it recorded; what a file did not
record is printed as "not recorded", never filled in from the machine this script runs on. Numbers
are formatted as the benchmark itself prints them. Files may be missing, half-written by a run in
progress, or written by an older version of a benchmark: a missing file is "(no results yet)", a
missing key is "-". It starts nothing: it can run while benchmarks do.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import bootstrap  # noqa: F401 - python bench/X.py: the checkout on sys.path

from bench.harness import RESULTS, ROOT, fmt, table

README = ROOT / "bench" / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
NO_RESULTS = "(no results yet)"

Json = dict[str, Any]
Row = list[str]


# ------------------------------------------------------------------------------------ reading


def read_json(path: Path) -> tuple[Json | None, str]:
    """The file's object, or None and why not (missing, being written, not an object)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, NO_RESULTS
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{NO_RESULTS}: {path.name} could not be read ({type(exc).__name__}; a run may be writing it)"
    if not isinstance(data, dict):
        return None, f"{NO_RESULTS}: {path.name} does not hold a JSON object"
    return data, ""


def get(data: Any, *keys: str | int, default: Any = None) -> Any:
    """``data[k1][k2]...``, or ``default`` where a level is missing: files from older runs lack keys."""
    for key in keys:
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data):
            data = data[key]
        else:
            return default
    return data


def obj(value: Any) -> Json:
    """``value`` if it is a JSON object, else an empty one (a key that held something else)."""
    return value if isinstance(value, dict) else {}


def seq(value: Any) -> list[Any]:
    """``value`` if it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


# ------------------------------------------------------------------------------------ formatting


def num(value: Any, spec: str = ".0f", scale: float = 1) -> str:
    """A number as the benchmarks print it (the harness' ``fmt``); ``-`` when absent or not a number."""
    return fmt(value if isinstance(value, (int, float)) and not isinstance(value, bool) else None, spec, scale)


def percent(value: Any) -> str:
    """A fraction as a percentage with one decimal (bench/quality.py's)."""
    return num(value, ".1f", 100)


def markdown(header: Row, rows: Iterable[Row], right_from: int = 1) -> list[str]:
    """The harness' markdown table, as lines."""
    return table(header, rows, right_from).split("\n")


def pair(a: str, b: str) -> str:
    """``a / b`` (p50 / p95 and the like), or ``-`` when both are missing."""
    return "-" if a == b == "-" else f"{a} / {b}"


def relative(path: Any) -> str:
    """A recorded path, shown relative to the repository when it is inside it."""
    text = str(path)
    prefix = str(ROOT) + os.sep
    return text[len(prefix):] if text.startswith(prefix) else text


def command_from_args(script: str, args: Json) -> str:
    """The command line that a recorded ``vars(argparse.Namespace)`` stands for (every key is an
    option's dest; ``None`` and ``False`` were left at their defaults, ``True`` is a flag)."""
    parts = [".venv/bin/python", script]
    for key, value in args.items():
        if value is None or value is False:
            continue
        option = "--" + key.replace("_", "-")
        if value is True:
            parts.append(option)
        elif isinstance(value, (list, tuple)):
            parts += [option, ":".join(num(v, "g") if isinstance(v, float) else str(v) for v in value)]
        else:
            parts += [option, relative(value)]
    return " ".join(parts)


def recorded_out(command: str) -> str:
    """The ``--out`` of a recorded command line, or ``""``."""
    words = command.split()
    for i, word in enumerate(words):
        if word.startswith("--out="):
            return word.split("=", 1)[1]
        if word == "--out" and i + 1 < len(words):
            return words[i + 1]
    return ""


def key_values(values: Json) -> str:
    """``k=v k=v``: a recorded configuration that is not a command line."""
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in values.items())


# ------------------------------------------------------------------------------------ provenance


def _git(*args: str) -> str:
    """Read-only git (no optional locks: others commit in this checkout while this runs)."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def file_written(path: Path) -> str:
    """When a results file that recorded no date was written: its last commit, or its file time
    when it is not committed as it is now. A fallback: the run itself may be older."""
    changed = _git("status", "--porcelain", "--", str(path))
    committed = _git("log", "-1", "--format=%h %cd", "--date=format-local:%Y-%m-%d %H:%M UTC", "--", str(path))
    if committed and not changed:
        commit, _, when = committed.partition(" ")
        return f"the results file was last committed {when} in {commit}"
    try:
        mtime = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc)
    except OSError:
        return "the results file's time is unknown"
    return f"the results file was written {mtime:%Y-%m-%d %H:%M} UTC (not committed as it is)"


def date_line(path: Path, recorded: Any, what: str = "") -> str:
    """The recorded date, else when the file was written, said to be only that."""
    if recorded:
        return f"- date: {recorded}{what}"
    return f"- date: not recorded; {file_written(path)}"


def machine_line(machine: Any) -> str:
    """CPU model, cores, memory, load average and platform, as far as the file recorded them."""
    if not isinstance(machine, dict) or not machine:
        return "- machine: not recorded"
    parts = [str(machine["cpu"]) if machine.get("cpu") else "CPU model not recorded"]
    cores = machine.get("cores", machine.get("cpus"))
    parts.append(f"{cores} cores" if cores else "cores not recorded")
    if machine.get("memory_gib"):
        parts.append(f"{machine['memory_gib']} GiB memory")
    loads = [(label, machine.get(key)) for key, label in (
        ("load_average", "at the end"), ("loadavg", "at the end"), ("loadavg_before", "before"), ("loadavg_after", "after"),
    )]
    recorded = [f"{' / '.join(num(v, '.2f') for v in value)} ({label})" for label, value in loads if isinstance(value, list)]
    parts.append("load average " + ", ".join(recorded) if recorded else "load average not recorded")
    for key in ("platform", "python"):
        if machine.get(key):
            parts.append(f"{key} {machine[key]}")
    return "- machine: " + "; ".join(parts)


def commit_line(commit: Any) -> str:
    if not commit:
        return "- commit: not recorded"
    return "- commit: " + ", ".join(c.strip()[:12] for c in str(commit).split(","))


def heading(title: str, path: Path) -> list[str]:
    png = path.with_suffix(".png")
    plot = f" (plot: [`{png.name}`](results/{png.name}))" if png.is_file() else ""
    return [f"### {title}", "", f"`{relative(path)}`{plot}", ""]


# ------------------------------------------------------------------------------------ sections


def prompt_stability(path: Path) -> list[str]:
    """Shared-prefix fraction per layout and language, ember's prompt next to the naive one."""
    data, problem = read_json(path)
    lines = heading("Prompt stability (bench/prompt_stability.py)", path)
    if data is None:
        return lines + [problem, ""]
    config = obj(get(data, "config"))
    lines += [
        date_line(path, data.get("date")),
        machine_line(data.get("machine")),
        commit_line(data.get("commit")),
        f"- recorded config: `{key_values(config)}`" if config else "- recorded config: not recorded",
        f"- tokenizer {get(data, 'tokenizer', default='-')}; sources {', '.join(str(s) for s in seq(get(data, 'sources'))) or '-'}",
        f"- took: {num(data.get('elapsed_s'))} s",
        "",
        f"{get(data, 'metric') or 'shared: not described'}; prefill = mean tokens left to prefill per request;"
        " tokens = mean prompt tokens.",
        "",
    ]
    rows: dict[tuple[str, str], dict[str, Json]] = {}
    for row in seq(get(data, "results")):
        if isinstance(row, dict):
            rows.setdefault((str(row.get("layout")), str(row.get("language"))), {})[str(row.get("strategy"))] = row
    if not rows:
        return lines + [NO_RESULTS, ""]

    def both(key: str, spec: str) -> list[str]:
        return [num(get(r, "ember", key), spec), num(get(r, "naive", key), spec)]

    header = ["layout", "language", "n", "median ember", "median naive", "p10 ember", "p10 naive",
              "prefill ember", "prefill naive", "tokens ember", "tokens naive"]
    body = []
    for (layout, language), r in rows.items():
        n = {num(get(s, "requests"), "d") for s in r.values()}
        body.append([layout, language, " / ".join(sorted(n)), *both("median", ".3f"), *both("p10", ".3f"),
                     *both("prefill_mean", ".1f"), *both("prompt_tokens_mean", ".0f")])
    lines += markdown(header, body, right_from=2)
    builds = obj(get(data, "build_ms"))
    if builds:
        lines.append("")
    for name, t in builds.items():
        lines.append(f"- build {name}: median {num(get(t, 'median'), '.2f')} ms, p90 {num(get(t, 'p90'), '.2f')} ms"
                     " (tokenizer counting included)")
    return lines + [""]


def replay_rows() -> list[tuple[str, Callable[[Json], str]]]:
    """bench/replay.py's ``print_table`` rows, reading keys that may be missing."""
    return [
        ("requests (along)", lambda s: f"{num(get(s, 'requests'), 'd')} ({num(get(s, 'along', 'requests'), 'd')})"),
        ("latency_ms p50 / p95", lambda s: pair(num(get(s, "latency_ms", "p50"), ".1f"), num(get(s, "latency_ms", "p95")))),
        ("ttft_ms p50 / p95 (mean)", lambda s: f"{pair(num(get(s, 'ttft_ms', 'p50')), num(get(s, 'ttft_ms', 'p95')))} "
                                               f"({num(get(s, 'ttft_ms', 'mean'))})"),
        ("requests kv_reuse < 0.5", lambda s: num(get(s, "low_reuse"), "d")),
        ("generated: latency p50 / p95", lambda s: pair(num(get(s, "generated_latency_ms", "p50")),
                                                        num(get(s, "generated_latency_ms", "p95")))),
        ("kv_reuse median (p10)", lambda s: f"{num(get(s, 'kv_reuse', 'median'), '.3f')} ({num(get(s, 'kv_reuse', 'p10'), '.2f')})"),
        ("prompt_tokens median", lambda s: num(get(s, "prompt_tokens_median"))),
        ("cache_hit rate", lambda s: num(get(s, "cache_hit_rate"), ".2f")),
        ("overhead ms p50 / p95", lambda s: pair(num(get(s, "overhead_ms", "p50"), ".1f"), num(get(s, "overhead_ms", "p95"), ".1f"))),
        ("along: cache <=10 ms", lambda s: num(get(s, "along", "fast_cache_fraction"), ".2f")),
        ("outcomes", lambda s: ",".join(f"{k}:{v}" for k, v in sorted(obj(get(s, "outcomes")).items())) or "-"),
    ]


def replay(path: Path, title: str = "Typing replay (bench/replay.py)") -> list[str]:
    """Latency, ttft, KV reuse and cache hits per configuration (ember, off, cold), and the targets."""
    data, problem = read_json(path)
    lines = heading(title, path)
    if data is None:
        return lines + [problem, ""]
    args = obj(get(data, "args") or get(data, "settings"))
    runs = obj(get(data, "runs"))
    took = "; ".join(f"{name}: model load {num(get(r, 'load_s'))} s, replay {num(get(r, 'replay_s'))} s"
                     for name, r in runs.items())
    lines += [
        date_line(path, data.get("date")),
        machine_line(data.get("machine")),
        commit_line(data.get("commit")),
        f"- command (from the recorded args): `{command_from_args('bench/replay.py', args)}`" if args
        else "- command: not recorded",
        f"- model: {args.get('model') or 'bundled SmolLM2-135M'}",
        f"- took: {took or 'not recorded'}",
        "",
    ]
    summary = obj(get(data, "summary"))
    if not summary:
        return lines + [NO_RESULTS, ""]
    names = list(summary)
    lines += markdown(["", *names], ([label, *(show(summary[n]) for n in names)] for label, show in replay_rows()))
    checks = obj(get(data, "targets"))
    if checks:
        lines += ["", "targets (ember):", ""]
        lines += markdown(["target", "value", "status"], (
            [key, num(get(c, "value"), ".3f"), "" if key.startswith("(") else "ok" if get(c, "ok") else "MISS"]
            for key, c in checks.items()
        ))
    return lines + [""]


def soak(path: Path) -> list[str]:
    """One editor session (or three windows) through thousands of completions and faults: the bounds and the fault rows."""
    data, problem = read_json(path)
    lines = heading(f"Soak (bench/soak.py, {path.name})", path)
    if data is None:
        return lines + [problem, ""]
    s = obj(get(data, "summary"))
    lines += [
        date_line(path, data.get("date")),
        machine_line(data.get("machine")),
        commit_line(data.get("commit")),
        f"- command: `{data.get('command') or 'not recorded'}`",
        f"- took: {num(get(s, 'run_s'))} s",
        "",
    ]
    if not s:
        return lines + [NO_RESULTS, ""]
    lat = obj(get(s, "latency_ms"))
    lines += [
        f"{num(get(s, 'requests'), 'd')} requests: {num(get(s, 'answered'), 'd')} answered, "
        f"{num(get(s, 'cancelled'), 'd')} cancelled, {num(get(s, 'errors'), 'd')} errors, latency p50 / p95 "
        f"{num(get(lat, 'p50'))} / {num(get(lat, 'p95'))} ms; engine counters at the end: "
        f"{key_values(obj(get(s, 'counters_end')))}",
        "",
    ]
    bounds = [
        [name, num(v.get("at_steady", v.get("second"))), num(v.get("end", v.get("last", v.get("value")))),
         "ok" if v.get("ok") else "MISS"]
        for name, v in obj(get(data, "verdicts")).items() if isinstance(v, dict) and "ok" in v
    ]
    lines += markdown(["bound", "from", "to", "verdict"], bounds)
    faults = seq(get(data, "faults"))
    if faults:
        lines.append("")
        header = ["fault", "at", "lasted s", "next good after end s", "engine answered after end s", "requests", "late", "told"]
        lines += markdown(header, (
            [str(get(f, "fault")), num(get(f, "at"), "d"), num(get(f, "lasted_s"), ".1f"),
             num(get(f, "next_good_after_end_s"), ".1f"), num(get(f, "next_answer_after_end_s"), ".1f"), num(get(f, "requests"), "d"),
             num(get(f, "without_answer_in_time"), "d"), "; ".join(seq(get(f, "told")))[:120] or "-"]
            for f in faults
        ))
    return lines + [""]

def daemon(path: Path) -> list[str]:
    """Editor windows sharing the per-user daemon vs each its own engine (--daemon off)."""
    data, problem = read_json(path)
    lines = heading("Editor windows: the shared daemon (bench/daemon.py)", path)
    if data is None:
        return lines + [problem, ""]
    lines += [
        date_line(path, data.get("date")),
        machine_line(get(data, "machine")),
        commit_line(data.get("commit")),
        f"- model: {data.get('model')}, max_tokens {data.get('max_tokens')}; seconds from launching `ember --stdio` "
        "to the first non-empty completion (in brackets: less the engine's time generating it)",
        "",
    ]

    def seconds(case: Any) -> str:
        return f"{num(get(case, 'first_completion_s'), '.2f')} ({num(get(case, 'without_generation_s'), '.2f')})"

    rows = [
        [
            get(r, "config"), seconds(get(r, "cold")), seconds(get(r, "second")), seconds(get(r, "restart")),
            num(get(r, "pss_1_window_mib")), num(get(r, "pss_3_windows_mib")), num(get(r, "pss_ratio_3_to_1"), ".2f"),
            f"{get(r, 'after_restart', 'cached_tokens')}/{get(r, 'after_restart', 'prompt_tokens')}",
        ]
        for r in seq(get(data, "results"))
    ]
    header = ["config", "(a) cold s", "(b) second window s", "(c) restart s", "PSS 1 window MiB", "PSS 3 windows MiB", "3/1", "cached after (c)"]
    lines += markdown(header, rows)
    targets = obj(get(data, "targets"))
    if targets:
        lines += ["", "targets: " + ", ".join(f"{k} {'ok' if v else 'MISS'}" for k, v in targets.items())]
    return lines + [""]


QUALITY_COLUMNS: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("EM line%", "exact_line", percent),
    ("EM%", "exact", percent),
    ("ES%", "edit_sim", percent),
    ("syntax%", "syntax_ok", percent),
    ("empty%", "empty", percent),
    ("p50 ms", "latency_p50_ms", num),
    ("p95 ms", "latency_p95_ms", num),
)


def quality(path: Path, title: str = "") -> list[str]:
    """Exact match, edit similarity, syntax and latency per case group, the strategies side by side."""
    data, problem = read_json(path)
    lines = heading(title or f"Quality: {path.stem.removeprefix('quality-')} (bench/quality.py)", path)
    if data is None:
        return lines + [problem, ""]
    lines += [
        date_line(path, data.get("started") or data.get("date"), " (run started)" if data.get("started") else ""),
        machine_line(data.get("machine")),
        commit_line(data.get("commit")),
        f"- command: `{data['command']}`" if data.get("command") else "- command: not recorded",
    ]
    out = recorded_out(str(data.get("command") or ""))
    if out and Path(out).name != path.name:
        lines.append(f"- the recorded command wrote {out} (this file has another name)")
    for key, label in (("merged_commands", "merged from"), ("combined_from", "combined from")):
        for where, command in obj(data.get(key)).items():
            lines.append(f"- {label} {relative(where)}: `{command}`")
    lines += [
        f"- model {data.get('model', '-')}, max_tokens {data.get('max_tokens', '-')}, limit {data.get('limit') or 'none'}, "
        f"seed {data.get('seed', '-')}; inputs {', '.join(Path(str(i)).name for i in seq(data.get('inputs'))) or '-'}",
        "- took: model load " + (", ".join(f"{k} {v} s" for k, v in obj(get(data, "load_s")).items()) or "not recorded"),
    ]
    if data.get("common_cases"):
        lines.append(f"- strategies compared on the {data['common_cases']} cases that every run had")
    if (data.get("concurrency") or 1) > 1:
        lines.append(
            f"- {data['concurrency']} cases in flight per server (engine batching): latencies include queueing, "
            "not single-user latencies"
        )
    summary = obj(get(data, "summary"))
    strategies = [s for s in summary if isinstance(summary[s], dict)]
    lines.append(f"- strategies: {' / '.join(strategies) or '-'}" + (f" ({STRATEGY_NOTE})" if len(strategies) > 1 else ""))
    if data.get("complete") is False:
        lines.append("- **incomplete**: the run was still going or was stopped when this was printed (the cases so far)")
    if data.get("warning"):
        lines.append(f"- warning: {data['warning']}")
    lines.append("")
    if not strategies:
        return lines + [NO_RESULTS, ""]
    groups = list(dict.fromkeys(g for s in strategies for g in summary[s]))
    label = " / ".join(strategies)
    header = ["group", "n", *(f"{name} ({label})" if len(strategies) > 1 else name for name, _, _ in QUALITY_COLUMNS)]
    rows = []
    for group in groups:
        per = [obj(get(summary, s, group)) for s in strategies]
        n = [num(get(p, "n"), "d") for p in per]
        row = [group, n[0] if len(set(n)) == 1 else " / ".join(n)]
        row += [" / ".join(show(get(p, key)) for p in per) for _, key, show in QUALITY_COLUMNS]
        rows.append(row)
    lines += markdown(header, rows) + [""]
    for name, row in obj(data.get("paired")).items():
        first, other = name.split(" vs ")
        parts = []
        for metric in ("exact_line", "exact", "syntax_ok"):
            wins, losses = seq(row.get(f"{metric}_split")) or ["-", "-"]
            parts.append(f"{metric} {wins} / {losses} (sign test p = {row.get(f'{metric}_sign_p', '-')})")
        lines.append(
            f"- case by case, {name} ({row.get('cases')} cases, {row.get('same_prompt_length')} with prompts of equal "
            f"length): cases only {first} / only {other} got right: " + "; ".join(parts)
        )
    if data.get("paired"):
        lines.append("")
    return lines


def peer_rows(rel: Json) -> list[tuple[str, Callable[[str, Json], str]]]:
    """bench/peer.py's ``print_table`` rows, reading keys that may be missing."""

    def pp(s: Json, *keys: str) -> str:
        return pair(num(get(s, *keys, "p50")), num(get(s, *keys, "p95")))

    short = {"engine": "gen", "client-cache": "ccache", "server-cache": "scache"}
    rows: list[tuple[str, Callable[[str, Json], str]]] = [
        ("requests (empty)", lambda n, s: f"{num(get(s, 'requests'), 'd')} ({num(get(s, 'empty'), 'd')})"),
        ("sources", lambda n, s: " ".join(f"{short.get(k, k)}:{v}" for k, v in sorted(obj(get(s, "sources")).items())) or "-"),
        ("visible_ms p50 / p95", lambda n, s: pp(s, "visible_ms")),
        ("first_line_ms p50 / p95", lambda n, s: pp(s, "first_line_ms")),
        ("total_ms p50 / p95", lambda n, s: pp(s, "total_ms")),
        ("generated: visible p50 / p95", lambda n, s: pp(s, "generated", "visible_ms")),
        ("generated: first_line p50/p95", lambda n, s: pp(s, "generated", "first_line_ms")),
    ]
    for label in ("visible_ms", "first_line_ms", "total_ms", "generated visible_ms", "generated first_line_ms"):
        rows.append((f"p50 {label} / peer", lambda n, s, label=label: num(get(rel, n, label), ".2f")))
    return rows


def peer(path: Path) -> list[str]:
    """Time to first visible text and first complete line, ember vs llama.cpp's server, in one run."""
    data, problem = read_json(path)
    lines = heading(f"ember vs llama.cpp server (bench/peer.py, {path.stem})", path)
    if data is None:
        return lines + [problem, ""]
    args = obj(get(data, "args") or get(data, "settings"))
    machine = obj(get(data, "machine"))
    others = obj(get(machine, "other_processes_during_replay"))
    runs = obj(get(data, "runs"))
    took = "; ".join(f"{name}: load {num(get(r, 'load_s'))} s, replay {num(get(r, 'replay_s'))} s" for name, r in runs.items())
    lines += [
        date_line(path, data.get("date")),
        machine_line(machine),
        commit_line(data.get("commit")),
        f"- command (from the recorded args): `{command_from_args('bench/peer.py', args)}`" if args
        else "- command: not recorded",
        f"- model {get(data, 'model', 'name', default='-')}, FIM template {get(data, 'model', 'fim_template', default='-')}; "
        f"peer {get(data, 'peer', 'server', default=None) or get(data, 'peer', 'package', default='-')}, "
        f"{get(data, 'peer', 'threads', default='-')} threads",
        f"- took: {took or 'not recorded'}",
        f"- other processes kept {num(get(others, 'foreign_cores_mean'), '.2f')} cores busy on average "
        f"(max {num(get(others, 'foreign_cores_max'), '.2f')}) during the replay"
        + (": NOT a quiet machine, timings are suspect"
           if isinstance(get(others, "foreign_cores_mean"), (int, float)) and others["foreign_cores_mean"] > 0.25 else ""),
        "",
    ]
    summary = obj(get(data, "summary"))
    if not summary:
        return lines + [NO_RESULTS, ""]
    rel = obj(get(data, "ratios_to_peer_p50"))
    names = list(summary)
    lines += markdown(["", *names], ([label, *(show(n, summary[n]) for n in names)] for label, show in peer_rows(rel)))
    lines += ["", "sources: gen = generated by the engine, ccache = llama.vim's client-side result cache, scache = ember's "
              "completion cache / typed-through reuse; ms measured at the client; \"generated\" rows: gen only."]
    for goal, check in obj(get(data, "goal")).items():
        lines += ["", f"goal: {goal}: ember {num(get(check, 'ember'), '.1f')}, peer {num(get(check, 'peer'), '.1f')}: "
                  f"{'ok' if get(check, 'ok') else 'MISS'}"]
    return lines + [""]


def gpu(results: Path) -> list[str]:
    """bench/gpu.sh's outputs (replay-gpu.json, quality-gpu.json, ...), when a GPU run happened."""
    files = sorted(results.glob("*-gpu.json"), key=lambda p: (not p.name.startswith("replay"), p.name))
    if not files:
        return ["### GPU (bench/gpu.sh)", "", f"`{relative(results / '*-gpu.json')}`", "", NO_RESULTS, ""]
    lines: list[str] = []
    for path in files:
        if path.name.startswith("replay"):
            lines += replay(path, f"GPU: typing replay (bench/gpu.sh, {path.name})")
        elif path.name.startswith("quality"):
            lines += quality(path, f"GPU: quality (bench/gpu.sh, {path.name})")
        else:
            lines += heading(f"GPU: {path.name}", path) + [f"(not a format this report knows: {path.name})", ""]
    return lines


QUALITY_FILES = ("quality-smollm2.json", "quality-qwen-coder.json", "quality-qwen-coder-compare.json")
STRATEGY_NOTE = (
    "ast: ember as built; naive: last-lines prompt with ember's post-processing; "
    "plain: last-lines prompt, output cut at line breaks only"
)


def report(results: Path = RESULTS) -> str:
    """The whole results section, one subsection per benchmark, in a fixed order."""
    extra_quality = sorted(p.name for p in results.glob("quality-*.json")
                           if p.name not in QUALITY_FILES and not p.name.endswith("-gpu.json"))
    lines = [
        "<!-- Printed by `.venv/bin/python bench/report.py --write` from bench/results/*.json; do not edit by hand. -->",
        "",
    ]
    lines += prompt_stability(results / "prompt_stability.json")
    lines += replay(results / "replay.json")
    for path in sorted(results.glob("soak-*.json")):
        lines += soak(path)
    lines += daemon(results / "daemon.json")
    for name in (*QUALITY_FILES, *extra_quality):
        lines += quality(results / name)
    lines += peer(results / "peer.json")
    for path in sorted(results.glob("peer-*.json")):  # other models (peer.py --model ... --out)
        lines += peer(path)
    lines += gpu(results)
    return "\n".join(lines).rstrip() + "\n"


def write_readme(readme: Path, section: str) -> None:
    """Replace what lies between the markers; the rest of the README is left as it is."""
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{relative(readme)}: no {BEGIN} ... {END} markers")
    new = text[: start + len(BEGIN)] + "\n" + section + text[end:]
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(readme)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"replace the results section of {relative(README)}")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of results files (default bench/results)")
    parser.add_argument("--readme", type=Path, default=README, help="README to write (default bench/README.md)")
    args = parser.parse_args(argv)
    section = report(args.results)
    if args.write:
        write_readme(args.readme, section)
        print(f"wrote the results section of {relative(args.readme)}")
    else:
        sys.stdout.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
