"""Per-rank peak host memory during a training step: zero stage 3 next to FSDP2, same run, same units.

Both contenders train a copy of the same GPT with AdamW, one unit per block plus the root,
parameters released after forward (``reshard_after_forward=True``). Memory is the C
allocator's own figure: glibc's ``mallinfo2()`` bytes in use (heap + mmap'd chunks), which
covers every tensor, gloo's communication temporaries and Python objects alike. It is
sampled at the same points for both: every module's forward pre/post hook, every
parameter's gradient arrival and around ``optimizer.step()``. Figures are relative to
what was in use before the contender was built, and are per rank (max over ranks).

* ``rest``  in use between steps (model state: shards, gradients, optimizer state)
* ``peak``  the largest sample during a step; ``peak - rest`` is the step's working set
  (gathered units, activations, communication buffers, temporaries)

Each contender is measured twice, alternately; the first pass in the process also carries
one-time allocations (gloo, thread pools), so the verdict uses each contender's lower peak.

Target (issue 3): our peak <= FSDP2's.

Run (CPU, gloo, Linux/glibc)::

    torchrun --standalone --nproc-per-node 2 benchmarks/stage3_memory.py [--d-model 256 --layers 4] \\
        [--prefetch-units 1 --in-flight 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
from datetime import timedelta

import torch
import torch.distributed as dist

from zero import ZeroOptimizer
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]


def _allocator_in_use():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd  # heap bytes in use + mmap'd chunks

    return in_use


class Sampler:
    """Records the allocator's in-use bytes at hook points; keeps the maximum."""

    def __init__(self, in_use) -> None:
        self.in_use = in_use
        self.peak = 0
        self.where = ""

    def sample(self, where: str) -> None:
        now = self.in_use()
        if now > self.peak:
            self.peak, self.where = now, where

    def attach(self, model: torch.nn.Module) -> None:
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda *_, n=name: self.sample(f"before forward of {n or 'root'}"))
            module.register_forward_hook(lambda *_, n=name: self.sample(f"after forward of {n or 'root'}"))
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda *_, n=name: self.sample(f"gradient of {n}"))


def build(kind: str, base: GPT, zero_config: dict):
    model = copy.deepcopy(base)
    if kind == "zero-3":
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model, stage=3, **zero_config)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, opt


def measure(kind: str, base: GPT, cfg: GPTConfig, batch: int, in_use, zero_config: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    baseline = in_use()
    model, opt = build(kind, base, zero_config)
    sampler = Sampler(in_use)
    sampler.attach(model)

    def step(s: int) -> None:
        x, y = (local_slice(t, rank, world) for t in synthetic_batch(s, batch, cfg))
        model.loss(x, y).backward()
        sampler.sample("before step")
        opt.step()
        sampler.sample("after step")
        opt.zero_grad()

    for s in range(2):  # warm-up: optimizer state exists from here on
        step(s)
    gc.collect()
    rest = in_use() - baseline
    sampler.peak = 0
    step(2)
    figures = torch.tensor([rest, sampler.peak - baseline], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return {
        "contender": kind,
        "rest_mb": figures[0].item() / 2**20,
        "peak_mb": figures[1].item() / 2**20,
        "peak_at_rank0": sampler.where,  # (rank 0's own peak)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_arguments(p, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    p.add_argument("--prefetch-units", type=int, default=1, help="ZeroConfig.prefetch_units")
    p.add_argument("--in-flight", type=int, default=2, help="ZeroConfig.max_in_flight_buckets")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    cfg = gpt_config(args)
    torch.manual_seed(0)
    base = GPT(cfg)
    in_use = _allocator_in_use()
    zero_config = {"prefetch_units": args.prefetch_units, "max_in_flight_buckets": args.in_flight}
    rows = [measure(kind, base, cfg, args.batch, in_use, zero_config) for kind in ("zero-3", "fsdp2") * 2]
    if dist.get_rank() == 0:
        n = sum(p.numel() for p in base.parameters())
        print(f"zero-3: {zero_config}")
        print(f"world {dist.get_world_size()}, {n / 1e6:.2f}M params ({16 * n / dist.get_world_size() / 2**20:.1f} MiB "
              f"= 16Ψ/N), {cfg}, global batch {args.batch}")
        print(f"\n{'contender':<8} {'rest MiB':>9} {'peak MiB':>9} {'peak-rest':>10}  peak at (rank 0)")
        for r in rows:
            figures = f"{r['rest_mb']:>9.1f} {r['peak_mb']:>9.1f} {r['peak_mb'] - r['rest_mb']:>10.1f}"
            print(f"{r['contender']:<8} {figures}  {r['peak_at_rank0']}")
        ours = min(r["peak_mb"] for r in rows if r["contender"] == "zero-3")
        theirs = min(r["peak_mb"] for r in rows if r["contender"] == "fsdp2")
        verdict = "PASS" if ours <= theirs else "FAIL"
        print(f"\npeak zero-3 / fsdp2: {ours / theirs:.3f} (target <= 1.00) {verdict}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": vars(args), "rows": rows, "ratio": ours / theirs}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
