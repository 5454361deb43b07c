"""CPU offload from a GPU (NCCL, world size 1): the same numbers as without offload, and less GPU memory.
Skipped without CUDA. (The host step runs torch's CPU AdamW kernels, the device step its CUDA ones: they
may round differently, hence a tolerance instead of bit equality.)"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import CFG, train
from tests.readouts import master_weights
from zero import ZeroOptimizer
from zero.models import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _train(stage: int, offload: dict) -> tuple[torch.Tensor, int]:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, offload=offload,
        precision={"param_dtype": "bf16"}, step_kernel="torch",  # the Triton step is compared in test_cuda_step.py
    )
    train(model, opt, CFG, range(4), clip=1.0)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    return master_weights(opt).cpu(), held


@pytest.mark.parametrize("stage,what", [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")])
def test_cuda_offload_matches_and_frees_the_gpu(nccl_world_of_one, stage, what):
    expected, on_gpu = _train(stage, {})
    got, with_offload = _train(stage, {what: "cpu"})
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert with_offload < on_gpu / 2  # master, m and v (12 of 16 bytes per parameter) left the GPU
