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


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("force", [False, True], ids=["fast_path", "real_collectives"])
def test_cuda_nccl_world_of_one_matches_plain_pytorch(nccl_world_of_one, stage, force):
    """With ``force_collectives`` every collective really goes through NCCL (a world of one), so every
    tensor the optimizer sends must be on the GPU: the end-of-backward flags, the clip norm, the buckets."""
    cfg = GPTConfig()
    torch.manual_seed(0)
    ref = GPT(cfg).cuda()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, bucket_size_mb=0.05,
        force_collectives=force,
    )
    for step in range(5):
        x, y = (t.cuda() for t in synthetic_batch(step, 4, cfg))
        ref.loss(x, y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        model.loss(x, y).backward()
        opt.clip_grad_norm_(1.0)
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    if force:
        assert opt.comm_stats["all_reduce"]["calls"] > 0  # really sent
    with opt.gathered_parameters():
        for a, b in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
