"""``zero estimate``: which stage, offload, checkpointing and micro-batch fit a GPU, before a run."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any


from zero.config import ZeroConfig
from zero.models import add_gpt_arguments, gpt_config, positive_int
from zero.profiler import sources
from zero.profiler.estimator import GiB, Estimate, plan
from zero.profiler.workload import POLICIES, Workload

# ZeroConfig(precision=...) for each --precision the estimator prices
PRECISION_POLICIES: dict[str, dict[str, str]] = {
    name: policy.model_dump(exclude_defaults=True) for name, policy in POLICIES.items()
}

# a memory size on the command line: a number of GiB, or a number with a unit (case-insensitive)
SIZE_UNITS = {
    "": 2**30, "b": 1,
    "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
SIZE_HELP = "a bare number is GiB; or give a unit: 24GiB, 80G (= GiB), 80GB (10^9 bytes), 512MiB"


def memory_size(text: str) -> int:
    """An argparse ``type`` for memory sizes: bytes from ``24`` (GiB: a bare number is never bytes),
    ``24GiB``, ``80G`` (binary, like ``free -g``), ``80GB`` (decimal) or ``512MiB``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", text, re.IGNORECASE)
    if match is None or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} ({SIZE_HELP})")
    value = round(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"a memory size must be positive, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", type=memory_size, required=True, metavar="SIZE",
                        help=f"per-GPU memory, e.g. 24 or 80GB ({SIZE_HELP})")
    parser.add_argument("--world-size", type=positive_int, default=8, help="data-parallel ranks, i.e. GPUs (default 8)")
    parser.add_argument("--micro-batch", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                        help="sequences per rank; one or more sizes to try (default 1 2 4 8)")
    parser.add_argument("--precision", choices=sorted(PRECISION_POLICIES), default="mixed",
                        help="fp32; mixed (the ZeRO paper's: bf16 parameters, gradients and gradient reduction, "
                        "fp32 master weights; the default); mixed-fp32-reduce (bf16 parameters and gradients, "
                        "gradients reduced and kept in fp32)")
    add_gpt_arguments(parser, vocab=50304, seq_len=1024, d_model=2048, layers=24, heads=16)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="MODULE:FUNCTION",
                        help="plan for your own model: a function that returns it (a language model with "
                        "config.vocab_size, fed --seq-len tokens) or a zero.profiler.Workload; replaces the GPT "
                        "options but --seq-len")
    source.add_argument("--hf-config", metavar="PATH",
                        help="plan for a Hugging Face causal LM built from this config.json (or a directory "
                        "holding one), trained on its own loss; replaces the GPT options but --seq-len")
    parser.add_argument("--no-sync-accumulation", action="store_true",
                        help="gradient accumulation with opt.no_sync() (the Hugging Face Trainer's and Accelerate's "
                        "way): gradients stay whole until the last micro-batch, at stages 2-3 too")
    parser.add_argument("--show", type=positive_int, default=8,
                        help="how many fitting and how many rejected configurations to list (default 8)")
    parser.add_argument("--json", type=str, default=None, metavar="FILE",
                        help="also write every estimate to this file")


def zero_config_kwargs(e: Estimate) -> dict[str, Any]:
    """The ``ZeroConfig`` / ``ZeroOptimizer`` keyword arguments of the configuration ``e`` prices
    (only those that differ from the defaults, besides the stage)."""
    kwargs: dict[str, Any] = {"stage": e.stage}
    if PRECISION_POLICIES[e.precision]:
        kwargs["precision"] = PRECISION_POLICIES[e.precision]
    if e.offload:
        kwargs["offload"] = {"optimizer": "cpu"}
    if e.checkpointing:
        kwargs["activation_checkpointing"] = {}  # every block of the model's nn.ModuleList
    return kwargs


def zero_config(e: Estimate) -> ZeroConfig:
    """The validated :class:`zero.ZeroConfig` that runs the configuration ``e`` prices."""
    return ZeroConfig(**zero_config_kwargs(e))


def workload(args: argparse.Namespace) -> tuple[Workload, str]:
    """The model the options name, and how to describe it."""
    if args.model:
        return sources.from_callable(args.model, args.seq_len), f"{args.model} ({args.seq_len} tokens)"
    if args.hf_config:
        return sources.from_hf_config(args.hf_config, args.seq_len), f"{args.hf_config} ({args.seq_len} tokens)"
    cfg = gpt_config(args)
    return sources.gpt(cfg), f"a GPT ({cfg})"


def main(args: argparse.Namespace) -> int:
    try:
        return _plan_and_print(args)
    except ValueError as err:  # a model that cannot be loaded or traced: one line, no traceback
        print(f"zero estimate: {err}", file=sys.stderr)
        return 2


def _plan_and_print(args: argparse.Namespace) -> int:
    work, described = workload(args)
    print(f"tracing {described}: forward, loss and backward on fake tensors (no memory is allocated) ...",
          flush=True)
    start = time.perf_counter()
    model = work.model()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"  {numel / 1e9:.3f}B trainable parameters ({time.perf_counter() - start:.1f}s)", flush=True)
    progress = lambda what: print(f"  tracing {what} ({time.perf_counter() - start:.1f}s)", flush=True)  # noqa: E731
    result = plan(work, gpu_memory=args.gpu_memory, world_size=args.world_size, micro_batches=args.micro_batch,
                  precision=args.precision, no_sync=args.no_sync_accumulation, progress=progress)
    budget = 0.9 * args.gpu_memory
    print(f"\nper-rank peak, {args.precision} precision, {_count(args.world_size, 'rank')}, "
          f"budget {budget / GiB:.2f} GiB (90% of {args.gpu_memory / GiB:.2f} GiB)")
    shown = result.fits[: args.show]
    if shown:
        print(f"\nfits, best first ({len(result.fits)}):")
        _table(shown)
        zero_config(shown[0])  # validated as ZeroOptimizer will: a configuration it refuses would fail here
        kwargs = ", ".join(f"{k}={v!r}" for k, v in zero_config_kwargs(shown[0]).items())
        print(f"to run the first: ZeroOptimizer(optimizer, model, {kwargs})")
    else:
        print("\nnothing fits: even the smallest configuration is too large (see below); add ranks or memory")
    rejected = sorted(result.rejected, key=lambda r: r[0].peak)[: args.show]
    if rejected:
        print(f"\ndoes not fit ({len(result.rejected)}), smallest first:")
        for e, why in rejected:
            print(f"  {_label(e):<44} {why}")
    if args.json:
        data = {"fits": [{**e.as_dict(), "zero_config": zero_config_kwargs(e)} for e in result.fits],
                "rejected": [{**e.as_dict(), "zero_config": zero_config_kwargs(e), "why": why}
                             for e, why in result.rejected]}
        try:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=2)
        except OSError as err:
            print(f"zero estimate: cannot write {args.json}: {err.strerror or err}", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _label(e: Estimate) -> str:
    extras = [x for x, on in (("checkpointing", e.checkpointing), ("offload", e.offload)) if on]
    return f"stage {e.stage}, micro-batch {e.micro_batch}" + (f", {' + '.join(extras)}" if extras else "")


def _table(rows: list[Estimate]) -> None:
    columns = ("peak", "params", "grads", "optim", "activ", "temps", "comm", "host")
    print(f"  {'configuration':<44} " + " ".join(f"{c:>7}" for c in columns) + "  peak at  (GiB; host: CPU memory)")
    for e in rows:
        figures = [e.peak, e.parameters, e.gradients, e.optimizer_state, e.activations, e.temporaries,
                   e.communication, e.host]
        print(f"  {_label(e):<44} " + " ".join(f"{v / GiB:>7.2f}" for v in figures) + f"  {_where(e)}")


def _where(e: Estimate) -> str:
    return f"{e.phase}, {e.event}" + (f" in {e.module}" if e.module and e.phase != "step" else "")
