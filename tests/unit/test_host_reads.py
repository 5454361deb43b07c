"""The training step reads no device value on the host beyond one per step, whatever the model's size (issue 34):
on a GPU each read makes the host wait for everything queued, and the device then idles until the host launches
again. Counted on the CPU: every ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool/float/int(t)`` that
``zero``'s own code calls during a step (forward, backward, clip, step, zero_grad), with the Triton step run by
Triton's interpreter (``tests/host_reads.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero.runtime.step.stepper import triton_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_a_step_reads_the_device_once_whatever_the_model_size():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.host_reads"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    reads = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("stage2-bf16", "stage3-bf16", "stage3-fp32"):
        small, large = reads[f"{case}/2"], reads[f"{case}/6"]  # GPTs of 2 and 6 blocks
        assert len(small) <= 1 and len(large) == len(small), (case, small, large)
    # the one read: which parameters got a gradient on any rank, and the ranks' agreement, after backward
    (only,) = reads["stage3-bf16/6"]
    assert only.startswith("runtime/reduction/reducer.py:") and only.endswith(" tolist"), only
