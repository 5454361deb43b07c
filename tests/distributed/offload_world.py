"""CPU offload in the shared worlds: each stage with offload against the same run without it."""

from __future__ import annotations

import torch

from tests.distributed.precision_world import masters_of
from tests.toy import Net, batch
from zero import ZeroOptimizer
from zero.models import local_slice

CASES = [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")]
PRECISIONS = {"fp32": {}, "bf16": {"param_dtype": "bf16"}}


def run(rank: int, world_size: int, stage: int, offload: dict, precision: dict) -> torch.Tensor:
    """AdamW (fused: the recommended host step), ``no_sync`` accumulation of two micro-batches, clipping; this rank's view of the masters."""
    model = Net()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True), model, stage=stage,
        offload=offload, precision=precision, bucket_size_mb=1e-4,
    )
    for step in range(4):
        with opt.no_sync():
            opt.backward(model(local_slice(batch(step), rank, world_size)) / 2)
        opt.backward(model(local_slice(batch(step + 10), rank, world_size), step % 2 == 1) / 2)
        opt.clip_grad_norm_(0.1)
        opt.step()
        opt.zero_grad()
    return masters_of(opt)


def offload_checks(rank: int, world_size: int) -> dict:
    """Per (stage, offloaded buffers, precision): (with offload, without)."""
    return {
        (stage, what, name): (run(rank, world_size, stage, {what: "cpu"}, p), run(rank, world_size, stage, {}, p))
        for stage, what in CASES
        for name, p in PRECISIONS.items()
    }
