"""``zero report`` end to end: it launches its CPU ranks under torchrun (a real gloo world of one here), profiles a
step and prints the report, with no profiler chatter and counts in words (its argument errors and the filtering of
the ranks' stderr, in one process: ``tests/unit/test_cli.py``; the memory tracker: ``tests/unit/test_profiler.py``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def report_output(tmp_path_factory) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "zero", "report", "--world-size", "1", "--steps", "1", "--micro-batch", "1", "--coarse",
         "--vocab", "64", "--seq-len", "8", "--d-model", "16", "--layers", "1", "--heads", "2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path_factory.mktemp("report"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout + run.stderr


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_report_output_has_no_profiler_lines_and_counts_in_words(report_output):
    assert "profiler_start" not in report_output and "USDT:" not in report_output and "STAGE:" not in report_output
    assert "launching 1 CPU rank with torchrun" in report_output
    assert ", 1 rank, micro-batch 1; profiling 1 step\n" in report_output


def test_report_names_no_operators_and_counts_steps_in_words(report_output):
    assert not re.search(r"\b[a-z_]+\.(default|Tensor|Scalar|dim_IntList|int)\b", report_output)
    assert "1 optimizer steps" not in report_output and "aten::" not in report_output


def test_zero_report_command_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "zero", "report", "--world-size", "1", "--steps", "1", "--coarse", "--vocab", "128",
         "--seq-len", "16", "--d-model", "32", "--layers", "2", "--heads", "2", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 1/1" in out.stdout and "allocator total" in out.stdout and "estimated peak" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["steps"] == 1
