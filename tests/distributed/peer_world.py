"""What each rank runs in ``test_peer_world.py``: paths from the peers' own suites that need several ranks.

* two ZeroOptimizers over disjoint parts of one model (FSDP2 ``test_fully_shard_ignore_params``);
* a stage-3 optimizer dropped without ``close()``, the model wrapped again (DeepSpeed
  ``test_zero_optimizer.py::test_load_immediate_save``);
* DistributedDataParallel around a managed model, before or after the optimizer (refused).

Batches: rank r of N takes rows ``r::N`` of the global batch, whose mean loss is the reference's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.readouts import flat_params
from tests.toy import batch
from zero import ZeroOptimizer

GLOBAL_BATCH = 6


class TwoParts(nn.Module):
    """Two stacks trained by separate optimizers (a part trained apart)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.ModuleList(nn.Linear(5, 5) for _ in range(2))
        self.head = nn.ModuleList([nn.Linear(5, 7), nn.Linear(7, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in [*self.encoder, *self.head]:
            x = torch.tanh(layer(x))
        return x.square().mean()


def global_batch(step: int) -> torch.Tensor:
    return batch(step, GLOBAL_BATCH, width=5)


def local_batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    return global_batch(step)[rank::world_size]


def two_optimizers(rank: int, world_size: int, stages: tuple[int, int] | None, steps: int = 3) -> torch.Tensor:
    """The encoder with one optimizer, the head with another; ``None``: plain torch on the global batch."""
    model = TwoParts()
    opts = [torch.optim.SGD(model.encoder.parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(model.head.parameters(), lr=1e-2)]
    if stages is not None:
        opts = [ZeroOptimizer(opt, model, stage=stage) for opt, stage in zip(opts, stages)]
    for step in range(steps):
        x = global_batch(step) if stages is None else local_batch(step, rank, world_size)
        model(x).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if stages is None:
        return flat_params(model)
    for opt in opts:
        opt.close()
    return flat_params(model)


def dropped_and_wrapped_again(rank: int, world_size: int, second: int | None) -> tuple[torch.Tensor, str]:
    """Stage 3 for two steps, dropped without close(); the parameters refuse use until a new optimizer (stage
    ``second``) takes the model and trains two more steps. ``second=None``: the plain reference."""
    model = TwoParts()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if second is not None:
        opt = ZeroOptimizer(opt, model, stage=3)
    refusal = ""
    for step in range(4):
        if step == 2:
            del opt
            if second is not None:
                try:
                    model(local_batch(step, rank, world_size))
                except RuntimeError as err:
                    refusal = str(err)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if second is not None:
                opt = ZeroOptimizer(opt, model, stage=second)
        model(global_batch(step) if second is None else local_batch(step, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    if second is not None:
        opt.close()
    return flat_params(model), refusal


def ddp_refusals(rank: int, world_size: int, stage: int) -> list[str]:
    """DDP around the model before the optimizer, and after it (found at the first forward)."""
    messages = []
    model = TwoParts()
    try:
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), DistributedDataParallel(model), stage=stage)
    except ValueError as err:
        messages.append(str(err))
    model = TwoParts()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
    try:
        wrapped = DistributedDataParallel(model)
        wrapped(local_batch(0, rank, world_size)).backward()
    except (ValueError, RuntimeError) as err:
        messages.append(str(err))
    opt.close()
    return messages


def peer_checks(rank: int, world_size: int) -> dict:
    return {
        "two_optimizers": {stages: two_optimizers(rank, world_size, stages) for stages in [(3, 3), (3, 1), (0, 2)]},
        "wrapped_again": {second: dropped_and_wrapped_again(rank, world_size, second) for second in (3, 2)},
        "ddp": {stage: ddp_refusals(rank, world_size, stage) for stage in (0, 2, 3)},
    }
