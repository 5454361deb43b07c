"""The Triton AdamW step on a GPU: chosen by default for bf16 Adam/AdamW, equal to the reference within
rounding, and to torch's step inside ZeroOptimizer. Skipped without CUDA and Triton."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import CFG, train
from zero import ZeroOptimizer
from zero.kernels.reference import adamw_reference
from zero.models import GPT
from zero.runtime.stepper import triton_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and Triton"),
]


def test_triton_kernel_matches_the_reference_on_cuda():
    from zero.kernels.triton_adamw import adamw_step_

    gen = torch.Generator(device="cuda").manual_seed(0)
    numel = 3 * 2**20 + 5
    state = [torch.randn(numel, device="cuda", generator=gen), torch.zeros(numel, device="cuda"),
             torch.zeros(numel, device="cuda")]
    ref = [t.clone() for t in state]
    out = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
    for step in range(1, 4):
        grad = torch.randn(numel, device="cuda", generator=gen).bfloat16()
        hyper = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        adamw_step_(state[0], grad, state[1], state[2], out, **hyper)
        adamw_reference(ref[0], grad, ref[1], ref[2], **hyper)
        for got, want in zip(state, ref):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert torch.equal(out, state[0].bfloat16())


def test_zero_uses_triton_on_cuda_and_matches_torch(nccl_world_of_one):
    masters = {}
    for kernel in ("auto", "torch"):
        torch.manual_seed(0)
        model = GPT(CFG).cuda()
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=2, step_kernel=kernel,
                            precision={"param_dtype": "bf16"})
        assert bool(opt.runtime.stepper.triton) == (kernel == "auto")
        train(model, opt, CFG, range(3), clip=1.0)
        masters[kernel] = torch.cat(opt.state_dict()["master"])
    torch.testing.assert_close(masters["auto"], masters["torch"], rtol=1e-4, atol=1e-5)  # bf16 forward may round apart
