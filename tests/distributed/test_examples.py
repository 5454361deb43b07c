"""The scripts in ``examples/`` run as users run them (``torchrun`` or ``python``), at toy size, so they cannot rot:
exit code 0, the lines they promise, finite losses; nanoGPT saved at 2 ranks resumes at 1 rank from the saved step."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TINY_GPT = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
            "--log-interval", "1"]


def run(script: str, *args: str, ranks: int | None = None) -> str:
    """``torchrun --standalone --nproc-per-node RANKS examples/SCRIPT ARGS`` (``python examples/SCRIPT ARGS`` when
    ``ranks`` is None) from the repository root; its stdout and stderr, after checking it exited with 0."""
    launcher = [] if ranks is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *launcher, str(EXAMPLES / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} {' '.join(args)} exited with {done.returncode}:\n{output[-6000:]}"
    assert "Traceback" not in output, output[-6000:]
    return output


def nanogpt_steps(output: str) -> dict[int, float]:
    """nanogpt.py's log lines: {step: loss}, each loss finite."""
    steps = {int(s): float(v) for s, v in re.findall(r"^step +(\d+)/\d+ \| loss (\S+) \|", output, re.M)}
    assert steps and all(math.isfinite(v) for v in steps.values()), output
    return steps


def test_nanogpt_saves_at_two_ranks_and_resumes_at_one(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run("nanogpt.py", *TINY_GPT, "--stage", "3", "--checkpointing", "on", "--steps", "3", "--sample", "0",
                "--save", ckpt, ranks=2)
    assert "2 rank(s)" in saved and "stage 3, fp32, offload none, checkpointing on" in saved
    first = nanogpt_steps(saved)
    assert sorted(first) == [1, 2, 3]
    assert re.search(r"tok/s \| model state/rank [\d.]+ MiB \(params", saved)
    assert f"saved step 3 to {ckpt}" in saved

    resumed = run("nanogpt.py", *TINY_GPT, "--stage", "1", "--precision", "bf16", "--offload", "cpu", "--steps", "5",
                  "--sample", "8", "--resume", ckpt, ranks=1)
    assert f"resumed from {ckpt} at step 3 (saved by 2 ranks, now 1)" in resumed
    assert "stage 1, bf16, offload cpu" in resumed
    second = nanogpt_steps(resumed)
    assert sorted(second) == [4, 5]  # continues from the saved step
    assert second[4] < first[1] - 0.05  # from the trained weights, not a fresh model (ln(45) = 3.81 at the start)
    assert "sample:" in resumed


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_hf_lora_stage3(tmp_path):
    for module in ("transformers", "peft", "accelerate", "safetensors"):
        pytest.importorskip(module)
    from safetensors.torch import load_file

    output = run("hf_lora_stage3.py", "--steps", "2", "--rank", "4", "--out", str(tmp_path))
    losses = [float(v) for v in re.findall(r"'loss': '([^']+)'", output)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), output
    assert f"adapter saved to {tmp_path}/adapter" in output
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    a = {k: v for k, v in adapter.items() if "lora_A" in k}
    b = {k: v for k, v in adapter.items() if "lora_B" in k}
    assert a and len(a) == len(b) and all(v.shape[0] == 4 for v in a.values())  # whole adapters, not shards
    assert all(v.abs().sum() > 0 for v in b.values())  # trained (PEFT starts B at zero)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_accelerate_loop(tmp_path):
    pytest.importorskip("accelerate")
    output = run("accelerate_loop.py", "--stage", "2", "--steps", "2", "--save", str(tmp_path / "state"))
    losses = [float(v) for v in re.findall(r"^step \d+/2 \| loss (\S+) \|", output, re.M)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), output
    assert f"saved state to {tmp_path / 'state'}" in output
    assert (tmp_path / "state" / "zero_checkpoint" / "metadata.json").is_file()
