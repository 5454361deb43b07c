"""``zero report``: train a few steps of a GPT on CPU ranks under ``zero.profile`` and print where memory goes."""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.cli.types import whole_number, whole_number_range
from zero.estimator import sources
from zero.estimator.estimator import Estimate, estimate
from zero.memory import CATEGORIES
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch
from zero.optimizer import ZeroOptimizer
from zero.profiler.sample import Sample
from zero.profiler.tracker import profile
from zero.runtime.offload.host import available_host_bytes
from zero.sizes import format_bytes, format_count

MiB = 2**20


# the accepted ranges (inclusive); zero demo launches as many CPU ranks
CPU_RANKS = (1, 64)
STEPS = (1, 1000)
MICRO_BATCHES = (1, 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=whole_number(*CPU_RANKS), default=2,
                        help=f"CPU ranks to launch, {whole_number_range(*CPU_RANKS)} (default 2)")
    parser.add_argument("--stage", type=whole_number(0, 3), default=2,
                        help=f"ZeRO stage, {whole_number_range(0, 3)} (default 2)")
    parser.add_argument("--steps", type=whole_number(*STEPS), default=3,
                        help=f"training steps to profile, {whole_number_range(*STEPS)} (default 3)")
    parser.add_argument("--micro-batch", type=whole_number(*MICRO_BATCHES), default=4,
                        help=f"sequences per rank, {whole_number_range(*MICRO_BATCHES)} (default 4)")
    add_gpt_arguments(parser, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    parser.add_argument("--coarse", action="store_true",
                        help="sample only at module boundaries, gradients and steps "
                             "(faster; the peak's breakdown is approximate)")
    parser.add_argument("--json", type=str, default=None, metavar="FILE",
                        help="write rank 0's report and timeline to this file")
    parser.add_argument("--plot", type=str, default=None, metavar="FILE",
                        help='save rank 0\'s figure (PNG) to this file; needs matplotlib: pip install "zero-dp[plot]"')


def check(args: argparse.Namespace) -> None:
    """What argparse cannot check alone (``ValueError``: the command line's error message)."""
    check_host_memory(gpt_config(args))


def check_host_memory(cfg: GPTConfig) -> None:
    """``ValueError`` if this machine cannot hold the training state of ``cfg`` even once across its CPU ranks
    (fp32 weights, gradients and AdamW's two moments: 16 bytes per parameter, at any stage and world size)."""
    with torch.device("meta"):  # counts the parameters without allocating them
        numel = sum(p.numel() for p in GPT(cfg).parameters())
    available = available_host_bytes()
    if available is not None and 16 * numel > available:
        raise ValueError(
            f"a GPT of {format_count(numel)} parameters needs at least {format_bytes(16 * numel)} to train (16 bytes "
            f"per parameter: fp32 weights, gradients and AdamW's two moments), more than the {format_bytes(available)} "
            "this machine has available: choose a smaller --vocab, --d-model or --layers"
        )


def main(args: argparse.Namespace) -> int:
    if args.plot and not matplotlib_installed():  # before anything is launched or profiled
        print('zero report: --plot needs matplotlib, which is not installed: pip install "zero-dp[plot]"',
              file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        return launch_ranks(args, "report")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        return _run_rank(args)
    finally:
        dist.destroy_process_group()


def matplotlib_installed() -> bool:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


# Kineto (torch.profiler's backend) logs every profiler start and stop to stderr, at its highest level
# ("USDT:2026-01-01 12:00:00 123:123 SyncActivityProfilerHandler.cpp:52] profiler_start"; KINETO_LOG_LEVEL=5
# still prints them, and a higher one would silence its errors too), so the ranks' stderr is passed on without them.
KINETO_CHATTER = re.compile(r"(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


def launch_ranks(args: argparse.Namespace, command: str) -> int:
    """Run ``zero COMMAND`` with the same arguments (``args.argv``, set by ``zero.cli.main.main``) on
    ``args.world_size`` CPU ranks under torchrun; returns its exit code."""
    ranks = f"{args.world_size} CPU rank{'' if args.world_size == 1 else 's'}"
    print(f"zero {command}: launching {ranks} with torchrun (gloo on 127.0.0.1)", flush=True)
    argv = getattr(args, "argv", None) or sys.argv[1:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
           "-m", "zero", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        for line in proc.stderr:
            if not KINETO_CHATTER.match(line):
                sys.stderr.write(line)
                sys.stderr.flush()
        return proc.wait()
    except KeyboardInterrupt:  # torchrun got it too (same process group) and stops the ranks
        proc.wait()
        return 130


def _run_rank(args: argparse.Namespace) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = gpt_config(args)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=args.stage)
    say(f"GPT {cfg} ({opt.partition.numel / 1e6:.2f}M parameters), stage {args.stage}, "
        f"{world} rank{'' if world == 1 else 's'}, micro-batch {args.micro_batch}; "
        f"profiling {args.steps} step{'' if args.steps == 1 else 's'}", flush=True)
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
    say("\nper rank: " + ", ".join(f"rank {r} {p / MiB:.2f} MiB ({ph}, {m or '-'})"
                                   for r, (p, ph, m) in enumerate(peaks)))
    e = estimate(sources.gpt(cfg), stage=args.stage, world_size=world, micro_batch=args.micro_batch)
    measured = prof.allocator.peak_without_collectives
    say(f"estimated peak (zero estimate): {e.peak / MiB:.2f} MiB ({e.phase}, {e.event}); measured without gloo's "
        f"own buffers: {measured / MiB:.2f} MiB ({e.peak / measured:.3f}x)")
    say(side_by_side(e, prof.peak))
    if rank == 0 and args.json:
        prof.to_json(args.json)
        print(f"wrote {args.json}")
    if rank == 0 and args.plot:
        prof.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def side_by_side(e: Estimate, peak: Sample) -> str:
    """The estimate's categories next to those of the measured peak sample (MiB), and where each is."""
    lines = [f"  {'':<16} {'estimated':>10} {'measured':>10}"]
    for category in CATEGORIES:
        got, measured = e.categories.get(category, 0), peak.categories.get(category, 0)
        if got or measured:
            lines.append(f"  {category:<16} {got / MiB:>10.2f} {measured / MiB:>10.2f}")
    lines.append(f"  estimated at: {e.phase}, {e.event}{' in ' + e.module if e.module else ''}; measured sample: "
                 f"{peak.phase}, {peak.event}{' in ' + peak.module if peak.module else ''}")
    return "\n".join(lines)
