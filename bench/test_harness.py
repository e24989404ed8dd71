"""The harness' pure parts (no server, no model): ``python -m pytest -q bench/test_harness.py``.
Here and not in tests/, since nothing in tests/ imports bench."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

from bench.harness import add_model_args, ember_command, fmt, percentile, resolve_model, table, write_results


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.1, 0.9, 0.5, 0.7, 0.2, 0.4]])
def test_percentile_is_linear_between_ranks_and_its_p50_the_median(values: list[float]) -> None:
    assert percentile(values, 0.5) == statistics.median(values)
    assert percentile(values, 0.0) == min(values) and percentile(values, 1.0) == max(values)
    if len(values) > 1:
        deciles = statistics.quantiles(values, n=10, method="inclusive")
        assert percentile(values, 0.1) == pytest.approx(deciles[0])
        assert percentile(values, 0.9) == pytest.approx(deciles[-1])


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 0.5) is None


def test_fmt_and_table() -> None:
    assert fmt(None) == "-"
    assert fmt(12.345, ".1f") == "12.3"
    assert fmt(0.1234, ".1f", 100) == "12.3"
    assert fmt("x", "") == "x"
    assert table(["", "n"], [["a|b", 3]]).split("\n") == ["|  | n |", "| --- | ---: |", "| a\\|b | 3 |"]


def test_ember_command_and_model_args() -> None:
    parser = argparse.ArgumentParser()
    add_model_args(parser, "bundled")
    args = parser.parse_args(["--engine", "llamacpp", "--engine-arg", "n_ctx=1024"])
    command = ember_command(resolve_model(args.model, args.engine)[1], args.engine, args.engine_arg)
    assert command[:3] == [sys.executable, "-m", "lsp"]
    assert command[3:] == ["--stdio", "--daemon", "off", "--log-level", "WARNING", "--model", "bundled",
                           "--engine", "llamacpp", "--engine-arg", "n_ctx=1024"]  # fmt: skip
    assert "--daemon" not in ember_command(daemon=None)
    assert "--engine" not in ember_command(engine="auto")
    assert resolve_model(None) == ("default", None)
    assert resolve_model("/models/q.gguf") == ("q", "/models/q.gguf")


def test_write_results_records_commit_machine_and_settings(tmp_path: Path) -> None:
    out = write_results(tmp_path / "r.json", {"summary": {"p50": 1.0}}, argparse.Namespace(requests=3, out=tmp_path / "r.json"))
    data = json.loads(out.read_text())
    assert data["summary"] == {"p50": 1.0}
    assert data["settings"] == {"requests": 3, "out": str(tmp_path / "r.json")}
    assert {"date", "command", "commit", "machine"} <= data.keys()
    assert {"cpu", "cores", "platform", "python"} <= data["machine"].keys()
