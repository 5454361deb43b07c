"""The main job: train a small GPT with ZeroOptimizer on CPU ranks and show model-state memory.

``zero demo`` (or ``python -m zero demo``) relaunches itself under ``torchrun`` with the
requested number of ranks; each rank trains the same model at each requested stage on
its share of the same global batches, then rank 0 prints the losses (identical across
stages) and each rank's parameter, gradient and optimizer-state bytes next to the
ZeRO paper's formula; last, the memory report (``zero.profile``) of two steps at the last stage:
every live tensor byte by category, module and phase, reconciled with PyTorch's allocator.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.cli.report import CPU_RANKS, check_host_memory, launch_ranks
from zero.cli.types import real_number, real_number_range, whole_number, whole_number_range
from zero.memory import zero_model_state_bytes
from zero.models import GPT, local_slice, synthetic_batch
from zero.optimizer import ZeroOptimizer
from zero.profiler import profile

# the accepted ranges (inclusive; the learning rate's excludes 0)
STEPS = (1, 100_000)
BATCHES = (0, 2**16)
LEARNING_RATES = (0.0, 1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=whole_number(*CPU_RANKS), default=2,
                        help=f"CPU ranks to launch, {whole_number_range(*CPU_RANKS)} (default 2)")
    parser.add_argument("--stages", type=whole_number(0, 3), nargs="+", default=[0, 1, 2, 3], metavar="STAGE",
                        help=f"ZeRO stages to train, each {whole_number_range(0, 3)}, in this order "
                        "(default 0 1 2 3)")
    parser.add_argument("--steps", type=whole_number(*STEPS), default=30,
                        help=f"training steps per stage, {whole_number_range(*STEPS)} (default 30)")
    add_gpt_arguments(parser, vocab=512, seq_len=64, d_model=128, layers=2, heads=4)
    parser.add_argument("--batch", type=whole_number(*BATCHES), default=0,
                        help=f"global batch, {whole_number_range(*BATCHES)}: a multiple of --world-size, or 0 "
                        "(the default) for 4 per rank")
    parser.add_argument("--lr", type=real_number(*LEARNING_RATES), default=3e-3,
                        help=f"AdamW learning rate, {real_number_range(*LEARNING_RATES)} (default 3e-3)")


def check(args: argparse.Namespace) -> None:
    """What argparse cannot check alone (``ValueError``: the command line's error message)."""
    check_host_memory(gpt_config(args))
    world = int(os.environ.get("WORLD_SIZE", args.world_size)) if "RANK" in os.environ else args.world_size
    if args.batch % world:
        raise ValueError(f"--batch ({args.batch}) must be a multiple of the world size ({world}), "
                         "or 0 for 4 per rank")


def main(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ:
        return launch_ranks(args, "demo")
    return _run_rank(args)


def _run_rank(args: argparse.Namespace) -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = gpt_config(args)
    batch = args.batch or 4 * world
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"GPT: d_model={cfg.d_model} layers={cfg.num_layers} vocab={cfg.vocab_size} seq={cfg.seq_len}; "
        f"global batch {batch} over {world} rank{'' if world == 1 else 's'}; AdamW; "
        f"{args.steps} step{'' if args.steps == 1 else 's'} per stage", flush=True)
    losses, memory = {}, {}
    for stage in args.stages:
        losses[stage], memory[stage], numel = _train(stage, cfg, batch, args, rank, world, say)
    say(_loss_report(losses, args.stages))
    say(_memory_report(memory, numel, world))
    say(f"\nProfiling 2 steps at stage {args.stages[-1]} (zero.profile) ...", flush=True)
    say("\n" + _profile(args.stages[-1], cfg, batch, args, rank, world))
    dist.destroy_process_group()
    return 0


def _train(stage, cfg, batch, args, rank, world, say):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1), model, stage=stage)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x, y = synthetic_batch(step % 4, batch, cfg)  # a few batches, revisited: the loss visibly falls
        loss = model.loss(local_slice(x, rank, world), local_slice(y, rank, world))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated so the memory table shows them
        losses.append(sum(opt.comm.all_gather_object(loss.item())) / world)
        if step % 10 == 0 or step == args.steps - 1:
            say(f"  stage {stage}  step {step + 1:>3}/{args.steps}  loss {losses[-1]:.4f}  "
                f"({time.perf_counter() - start:.1f}s)", flush=True)
    per_rank = opt.comm.all_gather_object(opt.model_state_bytes())
    return losses, per_rank, opt.partition.numel


def _profile(stage, cfg, batch, args, rank, world) -> str:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1), model, stage=stage)
    x, y = (local_slice(t, rank, world) for t in synthetic_batch(0, batch, cfg))
    with profile(model, opt) as prof:
        for _ in range(2):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    return f"Rank {rank}'s memory, stage {stage}:\n" + prof.report()


def _loss_report(losses: dict, stages: list[int]) -> str:
    base = losses[stages[0]]
    lines = ["", "Loss (mean over the global batch)",
             f"{'stage':>5} {'first':>9} {'last':>9} {'max |diff| vs stage ' + str(stages[0]):>24}"]
    for stage in stages:
        diff = max(abs(a - b) for a, b in zip(losses[stage], base))
        lines.append(f"{stage:>5} {losses[stage][0]:>9.5f} {losses[stage][-1]:>9.5f} {diff:>24.2e}")
    return "\n".join(lines)


def _memory_report(memory: dict, numel: int, world: int) -> str:
    mib = 2**20
    lines = [
        "",
        f"Model-state memory per rank, measured (MiB); Ψ = {numel:,} parameters, N = {world}",
        f"{'stage':>5} {'rank':>4} {'params':>8} {'grads':>8} {'optim':>8} {'total':>8} {'formula':>8} {'ratio':>6}",
    ]
    for stage, per_rank in memory.items():
        formula = zero_model_state_bytes(numel, world, stage)
        for rank, m in enumerate(per_rank):
            lines.append(
                f"{stage:>5} {rank:>4} {m.parameters / mib:>8.2f} {m.gradients / mib:>8.2f} "
                f"{m.optimizer_state / mib:>8.2f} {m.total / mib:>8.2f} {formula / mib:>8.2f} {m.total / formula:>6.3f}"
            )
    lines.append("formula (fp32 Adam): stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N; "
                 "ratio > 1 is padding")
    return "\n".join(lines)
