"""Two ranks on one GPU over gloo (``shared_gpu_world``): every stage, fp32 and bf16, with and without optimizer
offload, against DDP over the same two ranks. Skipped without CUDA.

Tolerances: DDP all-reduces and ``zero`` reduce-scatters, so the summed gradients may round apart by an ulp; AdamW
(torch's single-tensor step on both sides) turns that into differences up to about the learning rate on elements
whose gradient is near zero, so 3 steps are compared in the L2 norm, relative to the masters' (1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_world
from tests.gpu.shared_gpu_world import CASES, shared_gpu_checks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def two_ranks():
    return run_world(shared_gpu_checks, 2, timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}{'-offload' if c[2] else ''}")
def test_two_ranks_sharing_a_gpu_train_like_ddp(two_ranks, case):
    _, precision, _ = case
    for rank, result in enumerate(two_ranks):
        ours, ddp = result[case], result[("ddp", precision)]
        assert torch.isfinite(ours).all()
        assert float((ours - ddp).norm()) <= 1e-4 * float(ddp.norm()), f"rank {rank}"
        assert torch.equal(ours, two_ranks[0][case]), f"rank {rank} holds other masters than rank 0"
