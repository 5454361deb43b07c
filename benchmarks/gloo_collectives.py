"""Gloo's collectives on one bucket: alone, and next to computation, in turn in one run.

Times torch's ``all_reduce``, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (in place, as ``zero``'s
buckets use them) and one ``broadcast`` per rank (what ``zero.comm.communicator`` issues for an all-gather on gloo) on a
buffer of each size asked for. Each is timed alone (barrier to completion) and launched asynchronously
while the rank computes (matrix products of about the collective's duration): the computation's time then
says how much the collective slows it (on a machine with few cores gloo's threads share them with it).
Median over the rounds, max over ranks.

Run (CPU)::

    torchrun --standalone --nproc-per-node 2 benchmarks/gloo_collectives.py [--mb 13,25] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def collectives(x: torch.Tensor, rank: int, world: int) -> dict:
    c = x.numel() // world
    mine = x[rank * c : (rank + 1) * c]
    return {
        "none": lambda: [],
        "all_reduce": lambda: [dist.all_reduce(x, async_op=True)],
        "reduce_scatter": lambda: [dist.reduce_scatter_tensor(mine, x, async_op=True)],
        "all_gather": lambda: [dist.all_gather_into_tensor(x, mine, async_op=True)],
        "broadcasts": lambda: [dist.broadcast(x[r * c : (r + 1) * c], r, async_op=True) for r in range(world)],
    }


def timed(launch, compute) -> tuple[float, float]:
    """(ms to completion, ms of the computation run meanwhile)"""
    dist.barrier()
    start = time.perf_counter()
    works = launch()
    computed = compute()
    for work in works:
        work.wait()
    return (time.perf_counter() - start) * 1e3, computed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", default="13,25", help="buffer sizes in MiB (13: the 3.3M GPT's one bucket; 25: a full one)")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a = torch.randn(256, 256)

    def compute(k: int) -> float:
        start = time.perf_counter()
        for _ in range(k):
            a @ a
        return (time.perf_counter() - start) * 1e3

    for mb in map(float, args.mb.split(",")):
        x = torch.randn(int(mb * 2**20 / 4) // world * world)
        kinds = collectives(x, rank, world)
        alone = {k: [] for k in kinds}
        beside = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for kind, launch in kinds.items():
                alone[kind].append(timed(launch, lambda: 0.0)[0])
                beside[kind].append(timed(launch, lambda: compute(int(mb * 2)))[1])
        rows = torch.tensor([[statistics.median(alone[k][2:]), statistics.median(beside[k][2:])] for k in kinds])
        dist.all_reduce(rows, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"\n{mb:g} MiB, world {world}: {'alone ms':>10} {'compute ms beside it':>22}")
            for kind, (t, c) in zip(kinds, rows.tolist()):
                print(f"  {kind:<16}{t:>10.1f} {c:>22.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
