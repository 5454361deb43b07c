"""Activation checkpointing in its own world (``test_activations_world.py``): each stage with and without it."""

from __future__ import annotations

import torch

from tests.readouts import flat_params
from tests.toy import DropoutNet, batch
from zero import ZeroOptimizer
from zero.models import local_slice

POLICIES = {"every block": {}, "selective": {"selective": True}, "inputs offloaded": {"offload_inputs": True}}


def run(rank: int, world_size: int, stage: int, policy: dict | None) -> tuple[list[float], torch.Tensor]:
    """Three AdamW steps on this rank's slice; the losses and the whole parameters afterwards."""
    model = DropoutNet()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, stage=stage, bucket_size_mb=1e-4,
                        activation_checkpointing=policy)
    losses = []
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = model(local_slice(batch(step), rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, flat_params(model, opt)


def activation_checks(rank: int, world_size: int) -> dict:
    """Per (stage, policy): (with checkpointing, without)."""
    out = {}
    for stage in range(4):
        plain = run(rank, world_size, stage, None)
        for name, policy in POLICIES.items():
            out[(stage, name)] = (run(rank, world_size, stage, policy), plain)
    return out
