"""The step kernels (``zero.kernels``) and their selection (``zero.runtime.step.stepper``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.toy import Net
from zero import ZeroOptimizer
from zero.kernels.reference import adamw_reference
from zero.runtime.step.stepper import triton_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_reference_is_torch_adam_bit_for_bit(cls):
    """The reference is torch's single-tensor arithmetic (AdamW: decoupled decay; Adam: L2)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(257, generator=gen, requires_grad=True)
    opt = cls([p], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
    mine = [p.detach().clone(), torch.zeros(257), torch.zeros(257)]
    for step in range(1, 5):
        p.grad = torch.randn(257, generator=gen)
        opt.step()
        adamw_reference(mine[0], p.grad, mine[1], mine[2], step=step, lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6,
                        weight_decay=0.1, decoupled=cls is torch.optim.AdamW)
        assert torch.equal(mine[0], p.detach())
        assert torch.equal(mine[1], opt.state[p]["exp_avg"]) and torch.equal(mine[2], opt.state[p]["exp_avg_sq"])


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_step_under_the_interpreter():
    """The Triton kernel against the reference, and inside ZeroOptimizer (stages 1 and 3, two groups, clipping,
    a parameter without a gradient on some steps) against the torch step: run in Triton's CPU interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels_interpreted"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_step_kernel_choices():
    """'auto' on the CPU is torch's step; 'triton' where it cannot apply says why."""
    model = Net()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=1, precision={"param_dtype": "bf16"})
    assert not opt.runtime.stepper.triton
    bf16, host = {"precision": {"param_dtype": "bf16"}}, {"optimizer": "cpu"}
    cases = [
        (torch.optim.SGD, bf16, "Adam and AdamW only"),
        (torch.optim.AdamW, {}, "bf16 parameters"),
        (torch.optim.AdamW, {**bf16, "offload": host}, "offloaded step runs on the host"),
        (torch.optim.AdamW, bf16, "not CUDA"),
    ]
    if not triton_available():
        cases = [(torch.optim.AdamW, bf16, "needs the triton package")]
    for cls, settings, message in cases:
        model = Net()
        with pytest.raises(ValueError, match=message):
            ZeroOptimizer(cls(model.parameters(), lr=0.1), model, stage=2, step_kernel="triton", **settings)
