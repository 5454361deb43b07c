"""Stage 3 with a rank that skips a unit: that rank says so at once, and no rank hangs."""

from __future__ import annotations

import time
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_world_outcomes
from tests.toy import Blocks
from zero import ZeroOptimizer

BOTH, SKIP_FIRST = [0, 1], [1]  # Blocks(2)'s orders: every unit, or one fewer


def _rank_one_skips_a_unit(rank: int, world_size: int, outdir: str) -> dict:
    warnings.showwarning = partial(_record, Path(outdir) / f"warnings{rank}.txt")  # survives an abort
    torch.manual_seed(0)
    model = Blocks(2)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3, timeout_s=3)
    model(torch.randn(4, 8), BOTH).backward()  # the first step: every rank runs both blocks
    opt.step()
    opt.zero_grad()
    start = time.monotonic()
    try:
        model(torch.randn(4, 8), SKIP_FIRST if rank == 1 else BOTH).backward()
        opt.step()
        error = "no error"
    except RuntimeError as err:
        error = str(err)
    return {"seconds": time.monotonic() - start, "error": error}


def _record(path: Path, message, category, filename, lineno, file=None, line=None) -> None:
    with open(path, "a") as f:
        f.write(f"{message}\n")


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_a_rank_that_skips_a_unit_warns_at_once_and_nobody_hangs(tmp_path):
    """Rank 1 runs one unit fewer on its second step. It warns before its first mismatched collective; then
    each rank either raises an error (the fingerprint check, or a timeout naming the collective) or is
    aborted by gloo on a size mismatch, which of them depends on how the mismatched collectives pair up:
    never a hang, never a silent step."""
    start = time.monotonic()
    outcomes = run_world_outcomes(_rank_one_skips_a_unit, 2, str(tmp_path), timeout_s=120)
    assert time.monotonic() - start < 60  # spawning included; a hang would wait for the 120 s limit
    warned = (tmp_path / "warnings1.txt").read_text()
    assert "rank 1 ran unit 'blocks.1' as unit #1" in warned
    assert "where its first forward pass ran unit 'blocks.0'" in warned
    assert not (tmp_path / "warnings0.txt").exists()  # rank 0 kept its order
    for outcome in outcomes:
        if "ok" in outcome:  # an error within the timeout (3 s), not a silent step
            assert outcome["ok"]["error"] != "no error", outcome
            assert outcome["ok"]["seconds"] < 3 + 5, outcome
        else:  # aborted by gloo (a collective of another size): loud, and not a hang
            assert outcome.get("exitcode") not in (None, 0), outcome


def _rank_one_skips_a_step(rank: int, world_size: int) -> dict[str, str]:
    """Stage 0 (plain data parallelism, in full and mixed precision): rank 1 skips step() once; the next
    backward's reduction must say so on every rank. (At stages 1-3 a skipped step leaves the step's parameter
    all-gather unmatched: the next collective fails or times out, as the test above shows for a skipped unit.)"""
    errors = {}
    for name, precision in (("fp32", {}), ("bf16", {"param_dtype": "bf16"})):
        torch.manual_seed(0)
        model = Blocks(2)
        opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=0, precision=precision)
        errors[name] = "no error"
        try:
            for step in range(3):
                model(torch.randn(4, 8), BOTH).backward()
                if not (rank == 1 and step == 1):
                    opt.step()
                opt.zero_grad()
        except RuntimeError as err:
            errors[name] = str(err)
        opt.close()
    return errors


def test_a_rank_that_skips_step_is_detected_at_stage_0():
    """Issue 24 item 9: DDP (and stage 0 before) let ranks drift apart silently when one skips step()."""
    for outcome in run_world_outcomes(_rank_one_skips_a_step, 2, timeout_s=120):
        for name, error in outcome["ok"].items():
            assert "ranks have taken different numbers of optimizer steps" in error, (name, error)
