"""What is alive at a contender's memory peak: ``zero`` stage 3 (at each prefetch depth asked for) next to FSDP2,
or any of ``compare.py``'s contenders (``--only zero-1,ds-1``).

Each contender trains a copy of the same GPT as in ``compare.py`` (stage 3 and FSDP2: one unit per block plus
the root, resharding after forward). Two passes per contender:

1. **Where the peak is.** glibc's bytes in use (``mallinfo2``, as ``compare.py`` and ``stage3_memory.py``
   measure) read after every operator of the last of ``--steps`` steps, over what was in use before the
   contender was built; at the highest reading it records the phase, the operator, and which units (ours) or
   ``fully_shard`` modules (FSDP2) hold whole parameters or have an all-gather in flight. Every contender is
   measured twice, in turn, and the lower peak kept (the first pass in a process carries one-time allocations).
2. **What it is made of.** The same steps again under a category tracker: ``zero.profile`` for ours
   (parameters, gradients, optimizer state, activations, communication, temporaries), torch's ``MemTracker``
   for the others (``zero.profile`` cannot follow FSDP2's resized storages): the breakdown at its own peak.

Per rank; rank 0 prints its figures (and the max over ranks of the allocator peak).

Run (CPU, gloo)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 benchmarks/why_memory.py
        [--only zero-3/prefetch_units=1,zero-3/prefetch_units=0,fsdp2] [--d-model 512 --layers 9 --heads 8 --vocab 8192]
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist

import zero
from zero import ZeroOptimizer
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import GPT, local_slice, synthetic_batch

from compare import Contender, EveryOp, _zero, in_use, parse_zero, specs

MiB = 2**20


def build(name: str, base: GPT) -> Contender:
    """One of compare.py's contenders, or ``zero-N/key=value/...`` (ZeroConfig integer overrides)."""
    if "/" in name:
        stage, config = parse_zero(name)
        return _zero(stage, **config)(base)
    return next(s for s in specs() if s.name == name).build(base)


def gathered(c: Contender) -> list[str]:
    """Units (ours) or ``fully_shard`` modules (FSDP2) not sharded right now."""
    if isinstance(c.optimizer, ZeroOptimizer):
        return [f"{u.name} ({u.state.value})" for u in c.optimizer.runtime.gatherer.units if u.state.value != "sharded"]
    out = []
    for name, module in c.module.named_modules():
        group = module._get_fsdp_state()._fsdp_param_group if hasattr(module, "_get_fsdp_state") else None
        if group is not None and group.is_unsharded:
            out.append(name or "<root>")
    return out


def train(c: Contender, cfg, args, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = (local_slice(t, rank, world) for t in synthetic_batch(step, args.batch, cfg))
        c.train_step(x, y)


def where_is_the_peak(name: str, base: GPT, cfg, args) -> tuple[float, str]:
    gc.collect()
    baseline = in_use()
    c = build(name, base)
    train(c, cfg, args, range(args.steps - 1))
    found = {"peak": 0, "where": "", "gathered": []}

    def sample(func) -> None:  # at the highest reading: what runs and what is gathered
        now = in_use() - baseline
        if now > found["peak"]:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward or step"
            found.update(peak=now, where=f"{phase}, {func.__name__}", gathered=gathered(c))

    with EveryOp(sample):
        train(c, cfg, args, range(args.steps - 1, args.steps))
    peak = torch.tensor([found["peak"]], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item(), (f"allocator peak {found['peak'] / MiB:.1f} MiB (max over ranks {peak.item() / MiB:.1f}) at "
                         f"{found['where']}; gathered: {', '.join(found['gathered']) or 'none'}")


def categories(name: str, base: GPT, cfg, args) -> str:
    c = build(name, base)
    if isinstance(c.optimizer, ZeroOptimizer):
        with zero.profile(c.module, c.optimizer) as prof:
            train(c, cfg, args, range(args.steps))
        peak = max(prof.samples, key=lambda s: s.total)
        top = sorted(peak.labels.items(), key=lambda kv: -kv[1])[:8]
        return (f"zero.profile peak {peak.total / MiB:.1f} MiB in {peak.phase} of {peak.module or '<root>'!r}: "
                + ", ".join(f"{k} {b / MiB:.1f}" for k, b in peak.categories.items() if b)
                + "\n    largest: " + ", ".join(f"{k} {b / MiB:.1f}" for k, b in top))
    from torch.distributed._tools.mem_tracker import MemTracker

    train(c, cfg, args, range(args.steps - 1))  # (MemTracker follows one iteration)
    optimizer = c.optimizer if c.engine is None else c.engine.optimizer.optimizer  # DeepSpeed's wrapped torch.optim
    tracker = MemTracker()  # (tensors made before it starts and not given here, such as DeepSpeed's own buffers,
    tracker.track_external(c.module, optimizer)  # are not seen)
    with tracker:
        train(c, cfg, args, range(args.steps - 1, args.steps))
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    total = snap.pop("Total")
    return (f"MemTracker peak {total / MiB:.1f} MiB: "
            + ", ".join(f"{getattr(k, 'value', k)} {v / MiB:.1f}" for k, v in snap.items() if v))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="zero-3/prefetch_units=1,zero-3/prefetch_units=0,fsdp2",
                   help="contenders: compare.py's names, or zero-N/key=value with ZeroConfig overrides")
    p.add_argument("--steps", type=int, default=3, help="steps per contender (the peak is the last one's)")
    p.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    add_gpt_arguments(p, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = gpt_config(args)
    torch.manual_seed(0)
    base = GPT(cfg)
    names = args.only.split(",")
    best: dict[str, tuple[float, str]] = {}
    for _ in range(2):  # in turn, twice: the lower of each contender's peaks
        for n in names:
            found = where_is_the_peak(n, base, cfg, args)
            best[n] = min(best.get(n, found), found)
    lines = {n: [best[n][1], categories(n, base, cfg, args)] for n in names}
    if dist.get_rank() == 0:
        for n in names:
            print(f"\n{n}:\n  " + "\n  ".join(lines[n]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
