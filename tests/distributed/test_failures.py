"""A rank that stops taking part fails its peers with a clear error instead of a hang."""

from __future__ import annotations

import re
import time

import torch
from torch import nn

from tests.distributed.harness import run_world
from zero import ZeroOptimizer


def _one_rank_skips_backward(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=2, timeout_s=3)
    assert opt.zero_stage.number == 2  # (and keeps the optimizer, whose hooks hold it weakly, alive)
    if rank == 1:
        time.sleep(8)  # never joins the reduction; rank 0 must give up on its own
        return "skipped"
    start = time.monotonic()
    try:
        model(torch.randn(4, 8)).sum().backward()
    except RuntimeError as err:
        return f"{time.monotonic() - start:.1f}s: {err}"
    return "no error"


def test_missing_rank_times_out_with_a_clear_error():
    message, skipped = run_world(_one_rank_skips_backward, 2, timeout_s=120)
    assert skipped == "skipped"
    seconds, _, text = message.partition("s: ")
    assert float(seconds) < 7, message  # the 3 s timeout, not the process group's 120 s
    assert "did not complete within 3s" in text, message
    assert re.search(r"(reduce-scatter of bucket \d+|all-reduce of which parameters)", text), message
    assert "ranks took different paths" in text


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))  # stage 3: one unit each
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return self.head(x).sum()


def _swapped_units(rank: int, world_size: int) -> str:
    """Stage 3 with ranks that run the same units in different orders (same sizes, so the
    forward gathers pair up without complaint)."""
    torch.manual_seed(0)
    model = TwoBlocks()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3, timeout_s=3)
    start = time.monotonic()
    try:
        model(torch.randn(4, 8), [1, 0] if rank == 1 else [0, 1]).backward()
        opt.step()
    except RuntimeError as err:
        return f"{time.monotonic() - start:.1f}s: {err}"
    return "no error"


def test_stage3_ranks_running_different_units_fail_with_a_clear_error():
    """Caught either by the gather fingerprint at the end of backward or, when the mismatch
    blocks a collective first, by its timeout; never a hang and never a silent step.
    (A rank that gathers a unit of a *different size* makes gloo abort that process; its
    peers then fail on the timeout, as in the test above.)"""
    for result in run_world(_swapped_units, 2, timeout_s=120):
        seconds, _, text = result.partition("s: ")
        assert text, result  # an error, not "no error"
        assert float(seconds) < 7, result
        assert "different stage-3 units" in text or re.search(r"all-gather of bucket \d+ .*within 3s", text), text
        assert "different paths" in text or "control flow" in text, text
