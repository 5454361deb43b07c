"""``benchmarks/compare_tp.py`` at toy size, launched as users launch it (``torchrun``, 4 gloo ranks as dp 2 x tp 2):
every contender (FSDP2 + TP, zero stages 1-3 + TP) trains the same losses and its JSON carries finite, positive step
times and peak memory, as ratios to FSDP2 + TP and absolute, and the Markdown table names each (no full run; the
figures themselves: ``benchmarks/results/compare_tp.json``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# --quick: the parity it reports is checked once by tests/distributed/test_tensor_parallel_world.py
pytestmark = pytest.mark.full_only

ROOT = Path(__file__).resolve().parents[2]
CONTENDERS = ["fsdp2-tp", "zero-1-tp", "zero-2-tp", "zero-3-tp"]
STEPS = 2
TOY = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "4", "--batch", "4",
       "--steps", str(STEPS), "--warmup", "0"]


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_toy_run_reports_every_contender_against_fsdp2_tp(tmp_path):
    out, md = tmp_path / "compare_tp.json", tmp_path / "compare_tp.md"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "benchmarks" / "compare_tp.py"), *TOY, "--json", str(out), "--markdown", str(md)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    data = json.loads(out.read_text())
    assert data["world"] == 4 and data["mesh"] == {"dp": 2, "tp": 2} and data["params"] > 0
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == CONTENDERS
    for name, row in rows.items():
        for key in ("median_ms", "peak", "model_state", "time_x_fsdp2_tp", "peak_x_fsdp2_tp"):
            assert _positive(row[key]), (name, key, row[key])
        assert math.isfinite(row["iqr_ms"]) and row["iqr_ms"] >= 0, name
        assert row["loss_deviation"] <= 1e-3, name  # the same training (the script refuses to report otherwise)
        assert len(data["times_ms"][name]) == STEPS and all(_positive(t) for t in data["times_ms"][name]), name
    assert rows["fsdp2-tp"]["time_x_fsdp2_tp"] == 1.0 and rows["fsdp2-tp"]["peak_x_fsdp2_tp"] == 1.0
    for name in CONTENDERS[1:]:  # each zero contender's last step: its dp collectives, with bytes
        assert data["comm_stats"][name]["reduce_scatter"]["bytes"] > 0, name
    table = md.read_text()
    assert all(f"| `{name}` | {rows[name]['time_x_fsdp2_tp']:.2f} |" in table for name in CONTENDERS)
    assert "torchrun --standalone --nproc-per-node 4 benchmarks/compare_tp.py" in table
