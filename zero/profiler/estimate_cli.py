"""``zero estimate``: which stage, offload, checkpointing and micro-batch fit a GPU, before a run."""

from __future__ import annotations

import argparse
import json
import time

import torch

from zero.models import GPT, add_gpt_arguments, gpt_config
from zero.profiler.estimator import GiB, PRECISIONS, Estimate, parse_size, plan, trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", type=_size, required=True, help="per-GPU memory, e.g. 24GiB or 80GB")
    parser.add_argument("--world-size", type=int, default=8, help="data-parallel ranks (GPUs)")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 2, 4, 8], help="sequences per rank")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="mixed",
                        help="fp32, or mixed (bf16/fp16 parameters and gradients, fp32 master weights)")
    add_gpt_arguments(parser, vocab=50304, seq_len=1024, d_model=2048, layers=24, heads=16)
    parser.add_argument("--show", type=int, default=8, help="how many fitting and rejected configurations to list")
    parser.add_argument("--json", type=str, default=None, help="also write every estimate to this file")


def _size(text: str) -> float:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(args: argparse.Namespace) -> int:
    if args.world_size < 1 or min(args.micro_batch) < 1:
        raise SystemExit("zero estimate: --world-size and --micro-batch must be >= 1")
    cfg = gpt_config(args)
    print(f"tracing a GPT ({cfg}) on fake tensors (no memory is allocated) ...", flush=True)
    start = time.perf_counter()
    tokens = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    traced = trace(lambda: GPT(cfg), lambda m, x, y: m.loss(x, y), (tokens, tokens))
    print(f"  {traced.numel / 1e9:.3f}B parameters, {traced.activation_bytes / GiB:.2f} GiB saved for backward "
          f"per sequence (fp32), {len(traced.unit_numels)} stage-3 units ({time.perf_counter() - start:.1f}s)")
    result = plan(traced, gpu_memory=args.gpu_memory, world_size=args.world_size, micro_batches=args.micro_batch,
                  traced_micro_batch=1, precision=args.precision)
    budget = 0.9 * args.gpu_memory
    print(f"\nper-rank peak, {args.precision} precision, {args.world_size} ranks, budget {budget / GiB:.2f} GiB "
          f"(90% of {args.gpu_memory / GiB:.2f} GiB)")
    if result.fits:
        print(f"\nfits, best first ({len(result.fits)}):")
        _table(result.fits[: args.show])
    else:
        print("\nnothing fits: even the smallest configuration is too large (see below); add ranks or memory")
    print(f"\ndoes not fit ({len(result.rejected)}), smallest first:")
    for e, why in sorted(result.rejected, key=lambda r: r[0].peak)[: args.show]:
        print(f"  {_label(e):<44} {why}")
    everything = result.fits + [r[0] for r in result.rejected]
    if any(e.moment != "start of backward" for e in everything):
        print("* peaks while a bucket's gradients are reduced, not at the start of backward")
    notes = sorted({n for e in everything for n in e.notes})
    for note in notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fits": [e.as_dict() for e in result.fits],
                       "rejected": [{**e.as_dict(), "why": why} for e, why in result.rejected]}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _label(e: Estimate) -> str:
    extras = [x for x, on in (("checkpointing", e.checkpointing), ("offload", e.offload)) if on]
    label = f"stage {e.stage}, micro-batch {e.micro_batch}" + (f", {' + '.join(extras)}" if extras else "")
    return label + (" *" if e.moment != "start of backward" else "")


def _table(rows: list[Estimate]) -> None:
    columns = ("peak", "params", "grads", "optim", "activ", "gather", "out-grad", "host")
    print(f"  {'configuration':<44} " + " ".join(f"{c:>8}" for c in columns) + "   (GiB; host: CPU memory)")
    for e in rows:
        figures = [e.peak, e.parameters, e.gradients, e.optimizer_state, e.activations, e.gathered_parameters,
                   e.output_gradient, e.host]
        print(f"  {_label(e):<44} " + " ".join(f"{v / GiB:>8.2f}" for v in figures))
