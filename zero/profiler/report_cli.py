"""``zero report``: train a few steps of a GPT on CPU ranks under ``zero.profile`` and print where memory goes."""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from zero.models import GPT, add_gpt_arguments, gpt_config, local_slice, synthetic_batch
from zero.optimizer import ZeroOptimizer
from zero.profiler.estimator import estimate, trace
from zero.profiler.tracker import profile

MiB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks to launch (default 2)")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=3, help="training steps to profile (default 3)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank (default 4)")
    add_gpt_arguments(parser, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    parser.add_argument("--coarse", action="store_true",
                        help="sample only at module boundaries, gradients and steps (faster; the peak's breakdown is approximate)")
    parser.add_argument("--json", type=str, default=None, help="write rank 0's report and timeline to this file")
    parser.add_argument("--plot", type=str, default=None, help="save rank 0's figure (PNG) to this file (needs matplotlib)")


def main(args: argparse.Namespace) -> int:
    if args.world_size < 1 or args.steps < 1 or args.micro_batch < 1:
        raise SystemExit("zero report: --world-size, --steps and --micro-batch must be >= 1")
    if "RANK" not in os.environ:
        print(f"zero report: launching {args.world_size} CPU ranks with torchrun (gloo on 127.0.0.1)", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}"]
        cmd += ["-m", "zero", "report"] + sys.argv[sys.argv.index("report") + 1 :]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
        return subprocess.call(cmd, env=env)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        return _run_rank(args)
    finally:
        dist.destroy_process_group()


def _run_rank(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = gpt_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=args.stage)
    say(f"GPT {cfg} ({opt.partition.numel / 1e6:.2f}M parameters), stage {args.stage}, {world} ranks, "
        f"micro-batch {args.micro_batch}; profiling {args.steps} steps", flush=True)
    x, y = synthetic_batch(0, args.micro_batch * world, cfg)
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    start = time.perf_counter()
    with profile(model, opt, every_op=not args.coarse) as prof:
        for step in range(args.steps):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
            say(f"  step {step + 1}/{args.steps} ({time.perf_counter() - start:.1f}s, {len(prof.samples)} samples)",
                flush=True)
    say(f"  reconciling with the allocator ({time.perf_counter() - start:.1f}s)", flush=True)
    peaks = opt.comm.all_gather_object((prof.allocator.peak, prof.peak.phase, prof.peak.module))
    say("\n" + prof.report())
    say("\nper rank: " + ", ".join(f"rank {r} {p / MiB:.2f} MiB ({ph}, {m or '-'})" for r, (p, ph, m) in enumerate(peaks)))
    traced = trace(lambda: GPT(cfg), lambda m, a, b: m.loss(a, b), synthetic_batch(0, 1, cfg))
    e = estimate(traced, stage=args.stage, world_size=world, micro_batch=args.micro_batch, traced_micro_batch=1)
    measured = prof.allocator.peak_without_collectives
    say(f"estimated peak (zero estimate): {e.peak / MiB:.2f} MiB at the {e.moment}; measured without gloo's own "
        f"buffers: {measured / MiB:.2f} MiB ({e.peak / measured:.3f}x)")
    if rank == 0 and args.json:
        prof.to_json(args.json)
        print(f"wrote {args.json}")
    if rank == 0 and args.plot:
        prof.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0
