"""Step time of ZeRO stages 0-3 relative to DistributedDataParallel, measured in one run.

Every contender trains its own copy of the same GPT (same seed, same batches):

* ``ddp``        -- ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW`` (the baseline)
* ``zero-0..3``  -- ``zero.ZeroOptimizer(AdamW, model, stage=s)`` on the unwrapped model (stage 3:
                  one unit per block plus the root, the default; reshard after forward; prefetch 1)
* ``zero-3-keep`` -- stage 3 with ``reshard_after_forward=False`` (2Ψ traffic instead of 3Ψ)
* ``zero-ro``    -- ``torch.distributed.optim.ZeroRedundancyOptimizer`` over a DDP model (if importable)
* ``fsdp2``      -- ``torch.distributed.fsdp.fully_shard`` on each block and the root (the same units),
                  ``reshard_after_forward=True``, on ``init_device_mesh("cpu", ...)`` (if importable)

The measurement is interleaved: each step runs every contender once (the order rotates
from step to step), so drift in machine load hits all of them alike. A timed step is
forward + backward + ``step()`` + ``zero_grad()``, started after a barrier; its time is
the max over ranks (the slowest rank sets the pace). After ``--warmup`` untimed steps
the median of ``--steps`` timed steps is reported per contender, with its ratio to DDP.

Targets: stages 1 and 2 <= 1.05x DDP, stage 1 no slower than ZeroRedundancyOptimizer; stage 3
<= 1.15x DDP and no slower than FSDP2.

Run (CPU, gloo)::

    torchrun --standalone --nproc-per-node 2 benchmarks/step_time.py [--steps 40] [--warmup 3] \\
        [--d-model 256 --layers 4 --seq-len 128 --batch 8] [--threads 1] [--json out.json]

Defaults (a 3.3M-parameter GPT, 43 steps of 5 contenders) take about a minute on a 2-core
machine at world size 2. Step times there are noisy (see the IQR column): compare ratios
across a few runs before trusting a single PASS or FAIL near the 1.05 line.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zero import ZeroOptimizer
from zero.models import GPT, add_gpt_arguments, gpt_config, local_slice, synthetic_batch

try:
    from torch.distributed.optim import ZeroRedundancyOptimizer
except ImportError:  # pragma: no cover - depends on the torch build
    ZeroRedundancyOptimizer = None
try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - depends on the torch build
    fully_shard = None

LIMITS = {"zero-1": 1.05, "zero-2": 1.05, "zero-3": 1.15}  # allowed step-time ratios to DDP


@dataclass
class Contender:
    name: str
    module: torch.nn.Module  # what forward runs through (DDP wrapper or the bare model)
    optimizer: torch.optim.Optimizer
    times_ms: list[float] = field(default_factory=list)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        # Same as model.loss(x, y), but the forward goes through the DDP wrapper where there is one.
        logits = self.module(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def iqr_ms(self) -> float:
        """Interquartile range of the step times: how noisy the median is."""
        if len(self.times_ms) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times_ms, n=4)
        return q3 - q1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first")
    add_gpt_arguments(p, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="ZeroOptimizer bucket_size_mb")
    p.add_argument("--prefetch-units", type=int, default=1, help="ZeroConfig.prefetch_units (stage 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", type=str, default=None, help="write results and config to this file")
    return p.parse_args()


def adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)


def build_contenders(base: GPT, bucket_mb: float, prefetch: int) -> list[Contender]:
    contenders = []
    model = copy.deepcopy(base)
    contenders.append(Contender("ddp", DistributedDataParallel(model), adamw(model.parameters())))
    for stage in (0, 1, 2, 3):
        model = copy.deepcopy(base)
        opt = ZeroOptimizer(
            adamw(model.parameters()), model, stage=stage, bucket_size_mb=bucket_mb, prefetch_units=prefetch
        )
        contenders.append(Contender(f"zero-{stage}", model, opt))
    model = copy.deepcopy(base)  # stage 3 that keeps units gathered from forward to backward (2Ψ traffic)
    opt = ZeroOptimizer(adamw(model.parameters()), model, stage=3, reshard_after_forward=False, prefetch_units=prefetch)
    contenders.append(Contender("zero-3-keep", model, opt))
    if ZeroRedundancyOptimizer is not None:
        model = copy.deepcopy(base)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4, weight_decay=0.1
        )
        contenders.append(Contender("zero-ro", DistributedDataParallel(model), opt))
    if fully_shard is not None:
        model = copy.deepcopy(base)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        contenders.append(Contender("fsdp2", model, adamw(model.parameters())))
    return contenders


def timed_step(c: Contender, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step of ``c``; returns its wall time in ms, max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    c.train_step(x, y)
    elapsed = torch.tensor([(time.perf_counter() - start) * 1e3], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def report(contenders: list[Contender]) -> tuple[list[dict], list[dict]]:
    """Rows of the results table and the pass/fail checks (ratios are to DDP's median)."""
    by_name = {c.name: c for c in contenders}
    ddp = by_name["ddp"].median_ms
    rows, checks = [], []
    for c in contenders:
        ratio = c.median_ms / ddp
        row = {"contender": c.name, "median_ms": c.median_ms, "iqr_ms": c.iqr_ms, "ratio_to_ddp": ratio}
        limit = LIMITS.get(c.name)
        row["target"] = f"<= {limit:.2f}x DDP" if limit else None
        if limit:
            row["passed"] = ratio <= limit
            checks.append({"check": f"{c.name} vs ddp", "ratio": ratio, "limit": limit, "passed": row["passed"]})
        rows.append(row)
    for ours, peer in (("zero-1", "zero-ro"), ("zero-3", "fsdp2")):
        if peer in by_name:
            ratio = by_name[ours].median_ms / by_name[peer].median_ms
            checks.append({"check": f"{ours} vs {peer}", "ratio": ratio, "limit": 1.0, "passed": ratio <= 1.0})
    return rows, checks


def print_table(rows: list[dict], checks: list[dict]) -> None:
    print(f"\n{'contender':<11} {'median ms':>10} {'IQR ms':>7} {'x DDP':>7}  {'target':<14} result")
    for r in rows:
        verdict = ("PASS" if r["passed"] else "FAIL") if r["target"] else "-"
        figures = f"{r['median_ms']:>10.2f} {r['iqr_ms']:>7.2f} {r['ratio_to_ddp']:>7.3f}"
        print(f"{r['contender']:<11} {figures}  {r['target'] or '-':<14} {verdict}")
    print("\nchecks:")
    for c in checks:
        verdict = "PASS" if c["passed"] else "FAIL"
        print(f"  {c['check']:<20} ratio {c['ratio']:.3f}  (target <= {c['limit']:.2f})  {verdict}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)

    cfg = gpt_config(args)
    torch.manual_seed(0)
    base = GPT(cfg)
    contenders = build_contenders(base, args.bucket_mb, args.prefetch_units)
    n_params = sum(p.numel() for p in base.parameters())
    log(f"world {world}, {n_params / 1e6:.2f}M params, {cfg}, global batch {args.batch}, "
        f"{args.threads} thread(s)/rank, contenders: {', '.join(c.name for c in contenders)}")

    total = args.warmup + args.steps
    for step in range(total):
        x, y = (local_slice(t, rank, world) for t in synthetic_batch(step, args.batch, cfg))
        k = step % len(contenders)  # rotate the order so no contender always runs first
        for c in contenders[k:] + contenders[:k]:
            ms = timed_step(c, x, y)
            if step >= args.warmup:
                c.times_ms.append(ms)
        tag = " (warmup)" if step < args.warmup else ""
        log(f"step {step + 1}/{total}{tag}", flush=True)

    if rank == 0:
        rows, checks = report(contenders)
        print_table(rows, checks)
        if args.json:
            result = {
                "config": {**vars(args), "world_size": world, "params": n_params, "model": cfg.__dict__},
                "results": rows,
                "checks": checks,
                "times_ms": {c.name: c.times_ms for c in contenders},
            }
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"\nwrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
