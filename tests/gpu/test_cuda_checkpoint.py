"""Portable checkpoints on CUDA (NCCL, world size 1): saved from GPU shards (or host-offloaded ones), loaded into
another stage and placement; the masters equal bit for bit right after the load, and the resumed run equals the one
that went on, bit for bit where both step with the same kernels (on the device, or on the host). Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

import zero
from tests.gpu.common import CFG, train
from tests.readouts import master_weights
from zero.models import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HOST = {"offload": {"optimizer": "cpu"}}


def _build(stage: int, seed: int, **overrides):
    torch.manual_seed(seed)
    model = GPT(CFG).cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, zero.ZeroOptimizer(inner, model, stage=stage, precision={"param_dtype": "bf16"},
                                     step_kernel="torch", **overrides)


@pytest.mark.parametrize("before,after", [
    ({"stage": 2}, {"stage": 3}),  # device to device: the same kernels
    ({"stage": 2, **HOST}, {"stage": 3, "offload": {"params": "cpu"}}),  # host to host: the same kernels
    ({"stage": 2}, {"stage": 2, **HOST}),  # device to host: the masters equal; the kernels then differ
], ids=["device", "host", "device-to-host"])
def test_cuda_resume(nccl_world_of_one, tmp_path, before, after):
    model, opt = _build(seed=0, **before)
    train(model, opt, CFG, range(3))
    zero.save_checkpoint(tmp_path / "c", model, opt, progress=False)
    saved = master_weights(opt).cpu()
    expected = train(model, opt, CFG, range(3, 6))
    model2, opt2 = _build(seed=1, **after)
    zero.load_checkpoint(tmp_path / "c", model2, opt2, progress=False)
    assert torch.equal(master_weights(opt2).cpu(), saved)
    got = train(model2, opt2, CFG, range(3, 6))
    same_kernels = ("offload" in before) == ("offload" in after)
    assert got == pytest.approx(expected, rel=0 if same_kernels else 1e-2, abs=0)
