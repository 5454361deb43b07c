"""CUDA checks: NCCL at world size 1 and device-side exactness. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig, synthetic_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_cuda_nccl_world_of_one_matches_plain_pytorch(nccl_world_of_one, stage):
    cfg = GPTConfig()
    torch.manual_seed(0)
    ref = GPT(cfg).cuda()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, bucket_size_mb=0.05)
    for step in range(5):
        x, y = (t.cuda() for t in synthetic_batch(step, 4, cfg))
        for m, o in ((ref, ref_opt), (model, opt)):
            m.loss(x, y).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
