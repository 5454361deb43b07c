"""``benchmarks/compare_pp.py`` at toy size, launched as users launch it (``torchrun``, 4 gloo ranks as dp 2 x pp 2,
1F1B, 4 micro-batches): every contender (FSDP2 + pipelining, zero stages 1-3 with ``zero.pipelining.PipelineStage``,
zero stage 2 with torch's own stage) trains the same losses and its JSON carries finite, positive step times and peak
memory, as ratios to FSDP2 + pipelining and absolute; zero's stage reduces each bucket once per step at stages 1-2,
torch's stage once per micro-batch, and FSDP2 once per ``fully_shard``'ed module, as the dispatcher counts them on
every rank; the Markdown table names each (no full run; the figures themselves:
``benchmarks/results/compare_pp.json``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

# --quick: the parity it reports is checked once by tests/distributed/test_pipeline_world.py
pytestmark = pytest.mark.full_only

ROOT = Path(__file__).resolve().parents[2]
CONTENDERS = ["fsdp2-pp", "zero-1-pp", "zero-2-pp", "zero-3-pp", "zero-2-pp-torchstage"]
STEPS, MICRO = 2, 4
TOY = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "4", "--batch", "8",
       "--steps", str(STEPS), "--warmup", "0", "--micro-batches", str(MICRO),
       "--bucket-mb", "0.01"]  # a few buckets per part: 7 on the first, 6 on the last


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_toy_run_reports_every_contender_against_fsdp2_pp(tmp_path):
    out, md = tmp_path / "compare_pp.json", tmp_path / "compare_pp.md"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "benchmarks" / "compare_pp.py"), *TOY, "--json", str(out), "--markdown", str(md)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    data = json.loads(out.read_text())
    assert data["world"] == 4 and data["mesh"] == {"dp": 2, "pp": 2} and data["parts"] == 2 and data["params"] > 0
    assert data["run"]["schedule"] == "1f1b" and data["run"]["micro_batches"] == MICRO
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == CONTENDERS
    for name, row in rows.items():
        for key in ("median_ms", "peak", "model_state", "time_x_fsdp2_pp", "peak_x_fsdp2_pp", "grad_reductions",
                    "grad_reduction_bytes"):
            assert _positive(row[key]), (name, key, row[key])
        assert math.isfinite(row["iqr_ms"]) and row["iqr_ms"] >= 0, name
        assert row["loss_deviation"] <= 1e-3, name  # the same training (the script refuses to report otherwise)
        assert len(data["times_ms"][name]) == STEPS and all(_positive(t) for t in data["times_ms"][name]), name
        assert len(data["losses"][name]) == STEPS and all(_positive(v) for v in data["losses"][name]), name
    assert rows["fsdp2-pp"]["time_x_fsdp2_pp"] == 1.0 and rows["fsdp2-pp"]["peak_x_fsdp2_pp"] == 1.0

    collectives = data["collectives"]
    assert list(collectives) == CONTENDERS and all(len(ranks) == 4 for ranks in collectives.values())
    for rank in range(4):
        # FSDP2: one reduce-scatter per fully_shard'ed module per step (the part's one block, and the part)
        fsdp2 = collectives["fsdp2-pp"][rank]
        assert fsdp2["grad_reductions"] == 2 and fsdp2["phases"]["schedule"]["_reduce_scatter_base_"]["calls"] == 2
        for name in ("zero-1-pp", "zero-2-pp"):  # zero's stage: each bucket reduced once per step
            r = collectives[name][rank]
            assert r["buckets"] > 1 and r["grad_reductions"] == r["buckets"], (name, rank, r)
            assert r["comm_stats"]["reduce_scatter"]["calls"] == r["buckets"], (name, rank)
            assert r["flag_reductions"] == 1, (name, rank)
        torch_stage, zero2 = collectives["zero-2-pp-torchstage"][rank], collectives["zero-2-pp"][rank]
        assert torch_stage["buckets"] == zero2["buckets"]  # torch's own stage: each bucket once per micro-batch
        assert torch_stage["grad_reductions"] == MICRO * torch_stage["buckets"] == \
            torch_stage["comm_stats"]["reduce_scatter"]["calls"], (rank, torch_stage)
        assert torch_stage["grad_reduction_bytes"] == MICRO * zero2["grad_reduction_bytes"], rank
        assert torch_stage["flag_reductions"] == MICRO, rank
        zero3 = collectives["zero-3-pp"][rank]  # stage 3: each unit (the block, the part) once per step
        assert zero3["grad_reductions"] == zero3["buckets"] == zero3["comm_stats"]["reduce_scatter"]["calls"] == 2
    table = md.read_text()
    assert all(f"| `{name}` | {rows[name]['time_x_fsdp2_pp']:.2f} |" in table for name in CONTENDERS)
    assert "torchrun --standalone --nproc-per-node 4 benchmarks/compare_pp.py" in table
