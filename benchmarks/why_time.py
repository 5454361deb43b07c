"""Where the step time goes: each phase of DDP, ``ZeroRedundancyOptimizer`` and ``zero``'s stages, with and
without communication, interleaved in one run.

Each contender is built twice: over the real process group and over PyTorch's fake one (every collective
returns at once), and all of them take turns step by step (the order rotating), so that the machine's noise
falls on every one alike. Per step and rank it times

* ``forward`` (to the loss), ``backward`` (``loss.backward()``, which ends when every gradient is reduced),
  ``step`` and ``zero_grad``;
* inside them, the time ``zero`` spent waiting on its collectives, by kind (``CommStats``' ``wait_s``:
  ``reduce_scatter`` and ``all_reduce`` in backward, ``all_gather`` of the updated parameters in step). DDP and
  ``ZeroRedundancyOptimizer`` wait inside autograd's engine and their own step, out of sight: their waits
  show only as real minus fake.

Prints, per contender, the median over steps of the mean over ranks of each phase (ms), real and fake, and
the step (barrier to barrier, max over ranks) as the median of its ratio to DDP's step of the same round.

Run (CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 benchmarks/why_time.py [--only zro,zero-1] [--steps 20]
        [--d-model 512 --layers 9 --heads 8 --vocab 8192]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from zero import ZeroOptimizer
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import GPT, local_slice, synthetic_batch

from compare import parse_zero

LR, WD = 3e-4, 0.1
PHASES = ("forward", "backward", "step", "zero_grad")


def build(name: str, base: GPT, group) -> tuple[torch.nn.Module, object]:
    model = copy.deepcopy(base)
    if name.startswith("zero-"):
        stage, config = parse_zero(name)
        inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        return model, ZeroOptimizer(inner, model, stage=stage, process_group=group, **config)
    ddp = DistributedDataParallel(model, process_group=group)
    if dist.get_backend(group) == "fake":  # the fake all-reduce returns nothing, which DDP refuses

        def no_op(_, bucket):
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        ddp.register_comm_hook(None, no_op)
    if name == "ddp":
        return ddp, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD,
                                  process_group=group)
    return ddp, opt


def one_step(model, opt, x, y) -> dict[str, float]:
    """Each phase's milliseconds and, for ``zero``, what it waited for its collectives in forward, backward and step
    (``CommStats``' ``wait_s``; a step's entries move from ``current`` to ``last_step`` as ``step()`` ends)."""
    stats = opt.comm.stats if isinstance(opt, ZeroOptimizer) else None
    times, waited, start = {}, {}, time.perf_counter()

    def lap(phase: str, entries=None) -> None:
        nonlocal start
        now = time.perf_counter()
        times[phase], start = (now - start) * 1e3, now
        if stats is not None and entries is not None:  # totals so far this step, by kind
            waited[phase] = {kind: entry.wait_s * 1e3 for kind, entry in entries.items()}

    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    lap("forward", stats and stats.current)
    loss.backward()
    lap("backward", stats and stats.current)
    opt.step()
    lap("step", stats and stats.last_step)
    opt.zero_grad()
    lap("zero_grad")
    waits, before = {}, {}
    for phase, totals in waited.items():  # each phase's share of the running totals
        for kind, ms in totals.items():
            waits[f"{phase}: {kind} wait"] = ms - before.get(kind, 0.0)
        before = totals
    return {**times, **waits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="zro,zero-1,zero-2", help="contenders beside ddp: zro, zero-0 .. zero-3, "
                   "with ZeroConfig overrides after slashes (zero-3/prefetch_units=0)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    p.add_argument("--no-fake", action="store_true", help="only the real process group (half the time)")
    add_gpt_arguments(p, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    fake = dist.new_group(backend="fake")
    cfg = gpt_config(args)
    torch.manual_seed(0)
    base = GPT(cfg)
    names = ["ddp", *args.only.split(",")]
    groups = {"real": None} if args.no_fake else {"real": None, "fake": fake}
    runs = {(n, kind): build(n, base, group) for n in names for kind, group in groups.items()}
    records: dict[tuple[str, str], list[dict[str, float]]] = {key: [] for key in runs}
    keys = list(runs)
    for step in range(args.warmup + args.steps):
        x, y = (local_slice(t, rank, world) for t in synthetic_batch(step, args.batch, cfg))
        k = step % len(keys)
        for key in keys[k:] + keys[:k]:
            dist.barrier()
            start = time.perf_counter()
            phases = one_step(*runs[key], x, y)
            phases["total"] = (time.perf_counter() - start) * 1e3
            if step >= args.warmup:
                records[key].append(phases)
    report(records, names, list(groups), sum(p.numel() for p in base.parameters()))
    dist.destroy_process_group()


def report(records: dict[tuple[str, str], list[dict[str, float]]], names: list[str], kinds: list[str],
           numel: int) -> None:
    """Median over steps of each phase, averaged over ranks; the step's total (max over ranks) also as the median
    of its ratio to DDP's step taken in the same round (paired, so slow spells of the machine cancel)."""
    columns = sorted({c for r in records.values() for step in r for c in step} - {"total", *PHASES})
    columns = [*PHASES, *columns, "total"]
    per_step = {}
    for key, steps in records.items():
        t = torch.tensor([[s.get(c, 0.0) for c in columns] for s in steps], dtype=torch.float64)
        total = t[:, -1].clone()
        dist.all_reduce(t)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        t /= dist.get_world_size()
        t[:, -1] = total
        per_step[key] = t
    if dist.get_rank() != 0:
        return
    ddp = per_step[("ddp", "real")][:, -1]
    print(f"GPT {numel / 1e6:.1f}M, world {dist.get_world_size()}: ms per step (median over {len(ddp)} steps, "
          "mean over ranks); x DDP: median of the per-step ratio")
    width = max(len(n) for n in names) + 6
    print(f"{'contender':<{width}}" + "".join(f"{c:>{max(10, len(c) + 2)}}" for c in columns) + f"{'x DDP':>8}")
    for name in names:
        for kind in kinds:
            t = per_step[(name, kind)]
            row = t.median(dim=0).values.tolist()
            ratio = (t[:, -1] / ddp).median().item()
            print(f"{name + ' ' + kind:<{width}}"
                  + "".join(f"{v:>{max(10, len(c) + 2)}.1f}" for c, v in zip(columns, row))
                  + f"{ratio:>8.2f}")


if __name__ == "__main__":
    main()
