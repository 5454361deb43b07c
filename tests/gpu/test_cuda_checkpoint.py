"""Portable checkpoints on CUDA (NCCL, world size 1): saved from GPU shards, loaded into GPU shards and into
host-offloaded ones, the resumed run equal to the one that went on. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import zero
from tests.gpu.common import CFG, train
from zero.models import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _build(stage: int, seed: int, **overrides):
    torch.manual_seed(seed)
    model = GPT(CFG).cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, zero.ZeroOptimizer(inner, model, stage=stage, precision={"param_dtype": "bf16"},
                                     step_kernel="torch", **overrides)


@pytest.mark.parametrize("after", [{"stage": 3}, {"stage": 2, "offload": {"optimizer": "cpu"}}],
                         ids=["stage3", "offload"])
def test_cuda_resume(nccl_world_of_one, tmp_path, after):
    model, opt = _build(2, seed=0)
    train(model, opt, CFG, range(3))
    zero.save_checkpoint(tmp_path / "c", model, opt, progress=False)
    expected = train(model, opt, CFG, range(3, 6))
    model2, opt2 = _build(seed=1, **after)
    zero.load_checkpoint(tmp_path / "c", model2, opt2, progress=False)
    got = train(model2, opt2, CFG, range(3, 6))
    tolerance = 0 if "offload" not in after else 1e-5  # the host AdamW kernel may round unlike the CUDA one
    assert got == pytest.approx(expected, rel=tolerance, abs=0)
