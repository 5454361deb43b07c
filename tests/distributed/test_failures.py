"""A rank that stops taking part fails its peers with a clear error instead of a hang."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.harness import ROOT, free_port, run_world
from tests.toy import Blocks
from zero import ZeroOptimizer
from zero.comm.communicator import Communicator


def _one_rank_skips_backward(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=2, timeout_s=3)
    assert opt.zero_stage == 2  # (and keeps the optimizer, whose hooks hold it weakly, alive)
    if rank == 1:
        time.sleep(8)  # never joins the reduction; rank 0 must give up on its own
        return "skipped"
    start = time.monotonic()
    try:
        model(torch.randn(4, 8)).sum().backward()
    except RuntimeError as err:
        return f"{time.monotonic() - start:.1f}s: {err}"
    return "no error"


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_missing_rank_times_out_with_a_clear_error():
    message, skipped = run_world(_one_rank_skips_backward, 2, timeout_s=120)
    assert skipped == "skipped"
    seconds, _, text = message.partition("s: ")
    assert float(seconds) < 7, message  # the 3 s timeout, not the process group's 120 s
    assert "did not complete within 3s" in text, message
    assert re.search(r"(reduce-scatter of bucket \d+|all-reduce of which parameters)", text), message
    assert "ranks took different paths" in text


def _swapped_units(rank: int, world_size: int) -> str:
    """Stage 3 with ranks that run the same units in different orders (same sizes, so the
    forward gathers pair up without complaint)."""
    torch.manual_seed(0)
    model = Blocks(2)  # stage 3: one unit each
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3, timeout_s=3)
    start = time.monotonic()
    try:
        model(torch.randn(4, 8), [1, 0] if rank == 1 else [0, 1]).backward()
        opt.step()
    except RuntimeError as err:
        return f"{time.monotonic() - start:.1f}s: {err}"
    return "no error"


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
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


def _frozen_peer_rank(rank: int, port: int) -> None:
    """One rank of a two-rank gloo world whose rank 1 freezes (SIGSTOP) after a first collective.

    Rank 0 then waits on an all-reduce that can never complete; its error must end the process
    (teardown in ``finally`` as a torchrun script does it), not leave it hanging on the frozen peer.
    """
    torch.set_num_threads(1)
    address, timeout = f"tcp://127.0.0.1:{port}", datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2, timeout=timeout)
    try:
        comm = Communicator(timeout_s=3)
        comm.all_reduce(torch.ones(4), what="the first all-reduce").wait()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(60)
        print(f"issuing at {time.time()}", flush=True)
        tensor = torch.ones(4)
        try:
            comm.all_reduce(tensor, what="the all-reduce with a frozen peer").wait()
        except RuntimeError:
            try:
                comm.broadcast(tensor, what="a later broadcast")
            except RuntimeError as later:
                print(f"later: {later}", flush=True)
            raise
    finally:
        dist.destroy_process_group()


def test_timeout_on_a_frozen_peer_lets_the_process_exit(tmp_path):
    """A frozen peer (stopped, not dead, so no connection closes) must not keep the survivor in
    process-group teardown until gloo's own 60 s timeout: under torchrun that is a hung job."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    code = f"import sys, tests.distributed.test_failures as t; t._frozen_peer_rank(int(sys.argv[1]), {port})"
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as out:
                command = [sys.executable, "-c", code, str(rank)]
                procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        try:
            returncode = procs[0].wait(timeout=25)
        except subprocess.TimeoutExpired:
            raise AssertionError("rank 0 did not exit:\n" + logs[0].read_text()) from None
        exited = time.time()
        output = logs[0].read_text()
        assert procs[1].poll() is None, logs[1].read_text()  # still frozen, never dead
    finally:
        for proc in procs:
            proc.kill()  # SIGKILL ends a stopped process too
            proc.wait(timeout=10)
    issued = float(re.search(r"issuing at ([\d.]+)", output).group(1))
    assert returncode != 0, output
    assert exited - issued < 3 + 4, (exited - issued, output)  # the 3 s timeout, then a prompt exit
    assert "the all-reduce with a frozen peer did not complete within 3s" in output, output
    assert "The process group was aborted" in output, output
    assert "later: zero: cannot run a later broadcast: the process group was aborted" in output, output
