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
def report(tmp_path_factory) -> tuple[str, str, dict]:
    """One ``zero report`` run (a launcher, torchrun and a rank: some 10 s) serves every test here: its stdout, its
    stdout and stderr together, and the report it wrote with ``--json``."""
    cwd = tmp_path_factory.mktemp("report")
    run = subprocess.run(
        [sys.executable, "-m", "zero", "report", "--world-size", "1", "--steps", "1", "--micro-batch", "1", "--coarse",
         "--vocab", "64", "--seq-len", "8", "--d-model", "16", "--layers", "1", "--heads", "2",
         "--json", str(cwd / "r.json")],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, run.stdout + run.stderr, json.loads((cwd / "r.json").read_text())


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_report_output_has_no_profiler_lines_and_counts_in_words(report):
    _, report_output, _ = report
    assert "profiler_start" not in report_output and "USDT:" not in report_output and "STAGE:" not in report_output
    assert "launching 1 CPU rank with torchrun" in report_output
    assert ", 1 rank, micro-batch 1; profiling 1 step\n" in report_output


def test_report_names_no_operators_and_counts_steps_in_words(report):
    _, report_output, _ = report
    assert not re.search(r"\b[a-z_]+\.(default|Tensor|Scalar|dim_IntList|int)\b", report_output)
    assert "1 optimizer steps" not in report_output and "aten::" not in report_output


def test_zero_report_command_runs(report):
    stdout, _, written = report
    assert "step 1/1" in stdout and "allocator total" in stdout and "estimated peak" in stdout
    assert written["steps"] == 1
