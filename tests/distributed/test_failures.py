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
