"""What each rank runs in ``test_exit_world.py``: what a script's end needs of ``zero.comm.communicator`` (its module
Note on exit).

* ``released``: every kind of collective a communicator starts on gloo, many times over (the race it guards against
  is one of thread scheduling); for each, the tensor objects gloo was given and whether gloo's worker thread still
  held any of them when ``wait()`` returned (a tensor's ``_use_count()`` above 1: a holder besides Python's object).
* ``destroyed``: a ``ZeroOptimizer`` over a group of its own, which is then destroyed while the optimizer lives on:
  whether the group object outlived ``destroy_process_group(group)`` (the communicator held it), how many of gloo's
  worker threads the process had before the group, with it and after, the error a collective then raises, what the
  optimizer's finalizer raised when it is then dropped (nothing), and the error using the model then gives.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from zero import ZeroOptimizer
from zero.comm.communicator import Communicator
from zero.models import GPT, GPTConfig, synthetic_batch

ROUNDS = 40
CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, num_layers=1, num_heads=2)


def _gloo_workers() -> int:
    """This process's gloo worker threads (``pt_gloo_runloop``), from ``/proc``."""
    return sum(p.read_text().strip() == "pt_gloo_runloop" for p in Path("/proc/self/task").glob("*/comm"))


def _held(handle) -> list[torch.Tensor]:
    """The tensor objects that ``handle``'s gloo works were started on (``zero.comm.communicator.Settled``)."""
    works = [handle._work]
    held = []
    while works:
        work = works.pop()
        held += getattr(work, "_aliases", [])
        works += getattr(work, "works", [])
    return held


def released(rank: int, world_size: int) -> dict:
    comm = Communicator(force_collectives=True, timeout_s=60)
    n = 1 << 14
    still_held, started = {}, {}
    for _ in range(ROUNDS):
        flat = torch.ones(n * world_size)
        chunk = torch.ones(n)
        for kind, handle in {
            "all_reduce": comm.all_reduce(flat),
            "all_gather": comm.all_gather(flat, chunk),
            "reduce_scatter": comm.reduce_scatter(chunk, flat),
            "broadcast": comm.broadcast(chunk, 0),
        }.items():
            held = _held(handle)
            handle.wait()
            started[kind] = started.get(kind, 0) + len(held)
            still_held[kind] = still_held.get(kind, 0) + sum(t._use_count() > 1 for t in held)
    return {"started": started, "still_held": still_held, "json": comm.all_gather_json(rank),
            "objects": comm.all_gather_object(("rank", rank))}


def destroyed(rank: int, world_size: int) -> dict:
    before = _gloo_workers()
    group = dist.new_group(list(range(world_size)))
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3, process_group=group)
    x, y = synthetic_batch(0, 2 * world_size, CFG)
    model.loss(x, y).backward()
    opt.step()
    opt.zero_grad()
    with_group = _gloo_workers()
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    error = None
    try:
        opt.comm.group  # noqa: B018 - the property raises
    except RuntimeError as err:
        error = str(err)
    unraisable = []  # what the optimizer's finalizer raised when it was dropped (it must raise nothing)
    hook, sys.unraisablehook = sys.unraisablehook, lambda info: unraisable.append(repr(info.exc_value))
    try:
        del opt
        gc.collect()
    finally:
        sys.unraisablehook = hook
    try:  # the parameters kept their shards: using them says why
        model.loss(x, y)
        use = "no error"
    except RuntimeError as err:
        use = str(err)
    return {"before": before, "with_group": with_group, "after": _gloo_workers(),
            "group_outlived_destroy": alive() is not None, "error": error, "dropped_raised": unraisable,
            "use_after_drop": use}


def exit_checks(rank: int, world_size: int) -> dict:
    return {"released": released(rank, world_size), "destroyed": destroyed(rank, world_size)}
