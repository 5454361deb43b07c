"""benchmarks/gpu_check.py, the prepared GPU check, on a machine without a GPU: it runs a part in a process of its own
and writes what happened to the JSON (here the GPU tests, which skip), a part that fails is recorded and the next one
still runs, and its targets are computed from what was measured (none from figures that are missing). The GPU
figures themselves exist only where a session was lent a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.full_only  # --quick: the targets and the rendering below (the script's own run: every GPU test)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a GPU")
def test_a_run_without_a_gpu_records_each_part_and_keeps_going(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--parts", "tests,triton", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    tests, triton = data["parts"]["tests"], data["parts"]["triton"]
    assert tests["status"] == "ok" and tests["result"]["failed"] == 0, tests
    assert tests["result"]["skipped"] >= 20 and tests["result"]["passed"] == 0  # every GPU test skips here
    assert triton["status"] == "failed" and "CUDA" in triton["error"]  # it needs a GPU: recorded, not fatal
    assert data["targets"] == [] and data["run"]["device"] is None


def test_targets_are_the_issues_ratios_and_only_of_what_was_measured():
    gpu_check = _module()
    rows = [{"name": n, "median_ms": ms, "peak": peak} for n, ms, peak in (
        ("plain", 100.0, 10), ("zero-0", 101.0, 11), ("zero-3", 105.0, 9), ("fsdp2-bf16", 50.0, 6),
        ("zero-3-bf16", 49.0, 7), ("zero-2-bf16", 48.0, 7))]
    steps = {"zero-3-bf16": {"syncs_per_step": 1, "launches_per_step": 700},
             "fsdp2-bf16": {"syncs_per_step": 0, "launches_per_step": 765}, "zero-3": {"syncs_per_step": 3}}
    offload = [{"model": "2.6B", "cap_bytes": 4 * 2**30, "targets": {
        "auto_x_limit": 1.2, "full_x_auto": 3.5, "auto_3x_faster_than_full": True}},
        {"model": "1.28B", "cap_bytes": 16 * 2**30, "targets": {"auto_x_limit": 1.5, "full_x_auto": 2.0}}]
    parts = {"compare": {"result": {"rows": rows}}, "syncs": {"result": {"contenders": steps}},
             "offload": {"result": {"rows": offload}}}
    got = {t["check"]: (round(t["ratio"], 3), t["passed"]) for t in gpu_check.targets(parts)}
    assert got == {
        "zero-3-bf16 step vs fsdp2-bf16": (0.98, True), "zero-2-bf16 step vs fsdp2-bf16": (0.96, False),
        "zero-3-bf16 peak vs fsdp2-bf16": (1.167, False), "zero-0 step vs plain": (1.01, True),
        "zero-3 step vs plain": (1.05, False), "zero-3-bf16 launches vs fsdp2-bf16": (0.915, True),
        "zero-3-bf16 host syncs per step": (1, True), "zero-3 host syncs per step": (3, False),
        "offload auto step vs overlap limit, 2.6B under 4 GiB": (1.2, True),
        "full offload vs auto, 2.6B under 4 GiB": (3.5, True),
        "offload auto step vs overlap limit, 1.28B under 16 GiB": (1.5, False),
    }
    assert gpu_check.targets({}) == []


def test_the_gpu_section_renders_what_the_check_wrote():
    spec = importlib.util.spec_from_file_location("render_gpu", ROOT / "benchmarks" / "render_gpu.py")
    render_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_gpu)
    assert "has not run on a GPU yet" in "\n".join(render_gpu.gpu_section(None))
    rows = [{"name": "plain", "median_ms": 200.0, "peak": 2**31}, {"name": "zero-3-bf16", "median_ms": 50.0,
                                                                   "peak": 2**30}]
    compare = {"rows": rows, "params": 186e6, "world": 1, "run": {"batch": 8, "steps": 10},
               "config": {"d_model": 1024, "num_layers": 12, "vocab_size": 32768, "seq_len": 1024}}
    data = {"run": {"device": "NVIDIA H200", "date": "2026-11-27", "torch": "2.11.0", "triton": "3.6.0",
                    "commit": "abc1234"},
            "parts": {"tests": {"status": "ok", "seconds": 90.0, "result": {"passed": 30, "failed": 1, "skipped": 0,
                                                                             "failures": ["t::x: boom"]}},
                      "compare": {"status": "ok", "seconds": 120.0, "result": compare},
                      "syncs": {"status": "ok", "seconds": 40.0, "result": {"contenders": {
                          "zero-3-bf16": {"syncs_per_step": 1, "launches_per_step": 700}}}},
                      "cap": {"status": "timed out", "seconds": 150},
                      "offload": {"status": "ok", "seconds": 180, "result": {"rows": [{
                          "model": "2.6B", "cap_bytes": 4 * 2**30, "resident": {"error": "out of memory under the cap"},
                          "full": {"ratio": 1.0, "step_s": 3.6, "forward_backward_s": 1.0, "host_step_s": 2.0,
                                   "transfers_s": 0.5},
                          "auto": {"ratio": 0.5, "step_s": 1.1, "forward_backward_s": 0.8, "host_step_s": 1.0,
                                   "transfers_s": 0.3}}]}}},
            "targets": [{"check": "zero-3-bf16 host syncs per step", "ratio": 1, "limit": 1, "passed": True}]}
    text = "\n".join(render_gpu.gpu_section(data))
    assert "NVIDIA H200, 2026-11-27, torch 2.11.0, Triton 3.6.0, at commit `abc1234`" in text
    assert "30 passed, 1 failed, 0 skipped" in text and "- t::x: boom" in text and "`cap`: timed out" in text
    assert "| `zero-3-bf16` | 50.0 | 0.25 | 1.00 | 1 | 700 |" in text
    assert "| `plain` | 200.0 | 1.00 | 2.00 |  |  |" in text
    assert "| zero-3-bf16 host syncs per step | 1.000 | ≤ 1 | PASS |" in text
    assert "| 2.6B | 4 | resident | out of memory under the cap | | | | |" in text
    assert "| 2.6B | 4 | auto | 0.5 | 1.100 | 0.800 | 1.000 | 0.300 |" in text
