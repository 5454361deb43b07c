"""The fixture ``adamw_before_42/`` (a portable checkpoint) and ``adamw_before_42_shard.pth`` (a per-rank
``opt.state_dict()``), written by zero at commit ``31a5c7e``, before several optimizers and whole-parameter ones
(issue 42): :class:`Small` trained :data:`STEPS` AdamW steps at stage 1, world size 1, in two param groups.
``tests/unit/test_portable.py`` loads both with today's zero and checks every value against the same run made now.

Made with (from the repository root; the worktree of the old commit removed afterwards)::

    git worktree add /tmp/old42 31a5c7e
    PYTHONPATH=/tmp/old42 python tests/data/adamw_before_42.py
    git worktree remove /tmp/old42

Only the public API of that commit is used here, and nothing of ``tests``: the script runs against either version.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import zero

HERE = Path(__file__).resolve().parent
CHECKPOINT = HERE / "adamw_before_42"
SHARD = HERE / "adamw_before_42_shard.pth"
STEPS = 3


class Small(nn.Module):
    """Two linear layers and a buffer: 51 trainable elements."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 3)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x) * self.scale[1])).square().mean()


def build(seed: int = 0, stage: int = 1) -> tuple[Small, zero.ZeroOptimizer]:
    """``Small`` (seeded) and its ``ZeroOptimizer`` over AdamW: weights, and biases at half the rate without decay."""
    torch.manual_seed(seed)
    model = Small()
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")]},
              {"params": [p for n, p in named if n.endswith("bias")], "lr": 5e-3, "weight_decay": 0.0}]
    return model, zero.ZeroOptimizer(torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1), model, stage=stage)


def train(model: Small, opt: zero.ZeroOptimizer, steps: range) -> None:
    for step in steps:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    model, opt = build()
    train(model, opt, range(STEPS))
    zero.save_checkpoint(CHECKPOINT, model, opt, extra={"steps": STEPS}, progress=False)
    torch.save(opt.state_dict(), SHARD)
    print(f"wrote {CHECKPOINT} and {SHARD} with zero {zero.__version__} from {Path(zero.__file__).parent}")


if __name__ == "__main__":
    main()
