"""``zero estimate``: which stage, offload, checkpointing and micro-batch fit a GPU (and the host's memory), before
a run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.cli.types import SIZE_HELP, memory_size, whole_number, whole_number_range
from zero.comm.policy import Communication
from zero.config import ZeroConfig
from zero.estimator import sources
from zero.estimator.configuration import DISK_PATH, POLICIES, precision_name, priced_config
from zero.estimator.estimator import HEADROOM, Estimate, plan
from zero.estimator.offloading import BUFFER_COUNTS
from zero.estimator.traffic import Traffic, validated
from zero.estimator.workload import Workload
from zero.offload import target_of
from zero.sizes import MiB, TiB, format_bytes, format_count, size_range

# ZeroConfig(precision=...) for each --precision the estimator prices
PRECISION_POLICIES: dict[str, dict[str, str]] = {
    name: policy.model_dump(exclude_defaults=True) for name, policy in POLICIES.items()
}

# the accepted ranges (inclusive)
GPU_MEMORY = (MiB, 16 * TiB)
HOST_MEMORY = (MiB, 64 * TiB)
WORLD_SIZES = (1, 2**20)
MICRO_BATCHES = (1, 2**16)
SHOWN = (1, 10_000)
BLOCK_SIZES = (16, 2**20)  # as zero.Communication.block_size takes it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", type=memory_size(*GPU_MEMORY), required=True, metavar="SIZE",
                        help=f"per-GPU memory, e.g. 24 or 80GB, {size_range(*GPU_MEMORY)} ({SIZE_HELP})")
    parser.add_argument("--host-memory", type=memory_size(*HOST_MEMORY), default=None, metavar="SIZE",
                        help=f"host memory each rank may use for offloaded state, e.g. 64 or 200GB, "
                        f"{size_range(*HOST_MEMORY)} ({SIZE_HELP}); with it, offload to disk is priced too and a "
                        "configuration whose host bytes exceed it does not fit (default: no host budget)")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="the ZeroConfig your run uses (.json, .yaml or .yml, as ZeroConfig.from_file reads it): "
                        "its precision, units, prefetch, buckets, communication and checkpointing policy are priced; "
                        "the options below override it, and stage, offload and checkpointing are what the plan tries")
    parser.add_argument("--buffer-count", type=whole_number(*BUFFER_COUNTS), default=None,
                        help=f"with offload to disk: buckets mapped in host memory at a time (offload.buffer_count), "
                        f"{whole_number_range(*BUFFER_COUNTS)} (default 2)")
    parser.add_argument("--world-size", type=whole_number(*WORLD_SIZES), default=8,
                        help=f"data-parallel ranks, i.e. GPUs, {whole_number_range(*WORLD_SIZES)} (default 8)")
    parser.add_argument("--micro-batch", type=whole_number(*MICRO_BATCHES), nargs="+", default=[1, 2, 4, 8],
                        help=f"sequences per rank, each {whole_number_range(*MICRO_BATCHES)}; one or more sizes to try "
                        "(default 1 2 4 8)")
    parser.add_argument("--precision", choices=sorted(PRECISION_POLICIES), default=None,
                        help="fp32 (the default without --config, as ZeroOptimizer's own: no mixed precision); "
                        "mixed (the ZeRO paper's: bf16 parameters, gradients and gradient reduction, fp32 master "
                        "weights); mixed-fp32-reduce (bf16 parameters and gradients, gradients reduced and kept in "
                        "fp32)")
    add_gpt_arguments(parser, vocab=50304, seq_len=1024, d_model=2048, layers=24, heads=16)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="MODULE:FUNCTION",
                        help="plan for your own model: a function that returns it (a language model with "
                        "config.vocab_size, called the Hugging Face way on --seq-len tokens: model(input_ids=ids, "
                        "labels=ids).loss) or a zero.estimator.Workload(build, loss, batch) for any other forward; "
                        "replaces the GPT options but --seq-len")
    source.add_argument("--hf-config", metavar="PATH",
                        help="plan for a Hugging Face causal LM built from this config.json (or a directory "
                        "holding one), trained on its own loss; replaces the GPT options but --seq-len")
    parser.add_argument("--quantized-weights", action="store_true",
                        help="stage 3 only: all-gather parameters as int8 blocks with an fp32 scale each (ZeRO++ qwZ, "
                        "communication.quantized_weights); lossy, about 0.27x fp32's bytes")
    parser.add_argument("--quantized-gradients", action="store_true",
                        help="stages 1-3: reduce-scatter gradients as int8 blocks through one all-to-all (ZeRO++ qgZ, "
                        "communication.quantized_gradients); lossy")
    parser.add_argument("--gradient-bits", choices=("8", "4"), default=None,
                        help="with --quantized-gradients: 8 (int8, the default) or 4 (int4, two values a byte, "
                        "communication.gradient_bits; needs an even --block-size)")
    parser.add_argument("--block-size", type=whole_number(*BLOCK_SIZES), default=None,
                        help=f"elements per quantization block (one fp32 scale each), "
                        f"{whole_number_range(*BLOCK_SIZES)} (default 256)")
    parser.add_argument("--shard-size", type=whole_number(*WORLD_SIZES), default=None,
                        help=f"stages 1-3, hierarchical sharding (HSDP): shard the model states over groups of this "
                        f"many consecutive ranks (e.g. one machine's GPUs) and replicate across groups; must divide "
                        f"--world-size, {whole_number_range(*WORLD_SIZES)} (default: one group of every rank)")
    parser.add_argument("--hierarchy", choices=("hsdp", "hpz"), default=None,
                        help="with --shard-size: hsdp (the default) shards within each group and replicates across "
                        "groups; hpz (ZeRO++'s hierarchical partitioning, stage 3) shards over every rank and keeps a "
                        "secondary copy of 1/shard-size of the parameters per rank, from which backward gathers "
                        "inside the group (communication.hierarchy)")
    parser.add_argument("--no-sync-accumulation", action="store_true",
                        help="gradient accumulation with opt.no_sync() (the Hugging Face Trainer's and Accelerate's "
                        "way): gradients stay whole until the last micro-batch, at stages 2-3 too")
    parser.add_argument("--maybe-unused", nargs="+", default=[], metavar="NAME",
                        help="parameters that may get no gradient in a step (mixture-of-experts experts that may "
                        "receive no token), by name or module prefix: the estimate prices the worse of the step with "
                        "and without their gradients (default: every trainable parameter gets one)")
    parser.add_argument("--show", type=whole_number(*SHOWN), default=8,
                        help=f"how many fitting and how many rejected configurations to list, "
                        f"{whole_number_range(*SHOWN)} (default 8)")
    parser.add_argument("--json", type=str, default=None, metavar="FILE",
                        help="also write every estimate to this file")


def zero_config_kwargs(e: Estimate) -> dict[str, Any]:
    """The ``ZeroConfig`` / ``ZeroOptimizer`` keyword arguments of the configuration ``e`` prices, ``e.config`` (only
    those that differ from the defaults, besides the stage)."""
    return {"stage": e.config.stage, **e.config.model_dump(mode="json", exclude_defaults=True)}


def communication(args: argparse.Namespace, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``ZeroConfig(communication=...)``'s value for the options over ``base`` (``--config``'s; only what differs
    from the defaults; a rule they break is a ``ValueError`` with the rule's message)."""
    given = dict(quantized_weights=args.quantized_weights or None, quantized_gradients=args.quantized_gradients or None,
                 gradient_bits=int(args.gradient_bits) if args.gradient_bits else None, block_size=args.block_size,
                 shard_size=args.shard_size, hierarchy=args.hierarchy)
    fields = {**(base or {}), **{k: v for k, v in given.items() if v is not None}}
    return validated(fields).model_dump(exclude_defaults=True)


def base_config(args: argparse.Namespace) -> ZeroConfig:
    """The configuration the plan varies: ``--config``'s file (or the defaults) with the options applied."""
    try:
        config = ZeroConfig.from_file(args.config) if args.config else ZeroConfig()
    except OSError as err:
        raise ValueError(f"cannot read --config {args.config}: {err.strerror or err}") from err
    settings: dict[str, Any] = {"communication": communication(args, config.communication.model_dump(
        exclude_defaults=True))}
    if args.precision is not None:
        settings["precision"] = args.precision
    if args.buffer_count is not None:
        settings["buffer_count"] = args.buffer_count
    return priced_config(config, stage=3, **settings)  # (the plan tries every stage the policy runs at)


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
    base = base_config(args)  # (refused before the model is traced)
    work, described = workload(args)
    print(f"tracing {described}: forward, loss and backward on fake tensors (no memory is allocated) ...",
          flush=True)
    start = time.perf_counter()
    model = work.model()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"  {format_count(numel)} trainable parameters ({time.perf_counter() - start:.1f}s)", flush=True)
    progress = lambda what: print(f"  tracing {what} ({time.perf_counter() - start:.1f}s)", flush=True)  # noqa: E731
    result = plan(work, base, gpu_memory=args.gpu_memory, world_size=args.world_size, micro_batches=args.micro_batch,
                  no_sync=args.no_sync_accumulation, progress=progress, host_memory=args.host_memory,
                  maybe_unused=args.maybe_unused)
    budget = HEADROOM * args.gpu_memory
    host = "" if args.host_memory is None else f", host budget {format_bytes(args.host_memory)}"
    policy = base.communication
    print(f"\nper-rank peak, {precision_name(base.precision)} precision, {_ranks(args.world_size, policy)}"
          f"{_quantized(policy)}, "
          f"budget {format_bytes(budget)} ({HEADROOM:.0%} of {format_bytes(args.gpu_memory)}){host}")
    declared = work.declaring(base.elementwise_optimizers, base.per_parameter_optimizers)
    if declared.assignment().several_or_whole:  # (each rank holds different optimizer state: the worst one is shown)
        print("(several optimizers, or one stepped on whole parameters: the ranks differ, and each configuration is\n"
              " priced on its worst rank, `rank` in --json)")
    shown = result.fits[: args.show]
    if shown:
        print(f"\nfits, best first ({len(result.fits)}):")
        _table(shown)
        kwargs = ", ".join(f"{k}={v!r}" for k, v in zero_config_kwargs(shown[0]).items())
        print(f"to run the first: ZeroOptimizer(optimizer, model, {kwargs})")
        if target_of(shown[0].optimizer_offload).needs_path:
            print(f"  (the offload path {DISK_PATH!r} stands for yours, on a local NVMe disk: each rank's file takes "
                  f"{format_bytes(shown[0].disk)})")
    else:
        print("\nnothing fits: even the smallest configuration is too large (see below); add ranks or memory")
    rejected = sorted(result.rejected, key=lambda r: r[0].peak)[: args.show]
    if rejected:
        print(f"\ndoes not fit ({len(result.rejected)}), smallest first:")
        for e, why in rejected:
            print(f"  {_label(e):<44} {why}")
    first = shown[0] if shown else rejected[0][0] if rejected else None
    if first is not None:
        which = "first" if shown else "smallest"
        print(f"\ntraffic per step of the {which} ({_label(first)}; rank {first.rank}'s bytes on the wire, as "
              "opt.comm_stats counts them):")
        _traffic_table(first)
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


def _ranks(world_size: int, policy: Communication) -> str:
    ranks = _count(world_size, "rank")
    size = policy.group_size(world_size)
    if size == world_size:
        return ranks
    groups = world_size // size
    if policy.hierarchy == "hpz":
        return f"{ranks} (hpZ: secondary copies over {_count(groups, 'group')} of {size})"
    return f"{ranks} ({_count(groups, 'shard group')} of {size})"


def _quantized(policy: Communication) -> str:
    """", int8 weights and gradients (blocks of 256)" and the like; "" without quantization."""
    weights = ["int8 weights"] if policy.quantized_weights else []
    same = weights and policy.gradient_bits == 8  # "int8 weights and gradients"
    gradients = ["gradients" if same else f"int{policy.gradient_bits} gradients"] if policy.quantized_gradients else []
    what = weights + gradients
    return f", {' and '.join(what)} (blocks of {policy.block_size})" if what else ""


def _traffic_table(e: Estimate) -> None:
    """One row per collective kind, level and dtype on the wire, then the total (per level with hierarchy)."""
    traffic: Traffic = e.traffic
    if not traffic.collectives:
        print("  nothing: one rank (or one per group) sends no collective")
        return
    print(f"  {'collective':<15} {'level':<6} {'dtype':<6} {'calls':>6} {'elements':>9} {'bytes':>10}")
    for c in traffic.collectives:
        print(f"  {c.kind:<15} {c.level:<6} {c.dtype:<6} {c.calls:>6} {format_count(c.numel):>9} "
              f"{format_bytes(c.bytes):>10}")
    levels = ""
    if e.secondary_size:
        levels = (f" (intra {format_bytes(traffic.level_bytes('intra'))} over every rank, hpz "
                  f"{format_bytes(traffic.level_bytes('hpz'))} inside hpZ's groups of {e.secondary_size})")
    elif e.group_size < e.world_size:
        levels = (f" (intra {format_bytes(traffic.level_bytes('intra'))} inside the shard groups, inter "
                  f"{format_bytes(traffic.level_bytes('inter'))} across them)")
    print(f"  {'total':<15} {'':<6} {'':<6} {'':>6} {'':>9} {format_bytes(traffic.bytes):>10}{levels}")


def _label(e: Estimate) -> str:
    offload = (f"{target_of(e.optimizer_offload).name} offload" if e.paged else
               f"{e.offload_ratio:.0%} offload" if e.offload_ratio < 1 else "offload")
    extras = [x for x, on in (("checkpointing", e.checkpointing), (offload, e.offload)) if on]
    return f"stage {e.stage}, micro-batch {e.micro_batch}" + (f", {' + '.join(extras)}" if extras else "")


def _table(rows: list[Estimate]) -> None:
    disk = any(e.paged for e in rows)  # (a disk column only when offload to disk is shown)
    columns = ("peak", "params", "grads", "optim", "activ", "temps", "comm", "host") + ("disk",) * disk
    width = max(len(_label(e)) for e in rows)  # "stage 3, micro-batch 16, checkpointing + disk offload"
    legend = "(host: CPU memory; disk: the offload file)" if disk else "(host: CPU memory)"
    print(f"  {'configuration':<{width}} " + " ".join(f"{c:>9}" for c in columns) + f"  peak at  {legend}")
    for e in rows:
        figures = [e.peak, e.parameters, e.gradients, e.optimizer_state, e.activations, e.temporaries,
                   e.communication, e.host] + [e.disk] * disk
        print(f"  {_label(e):<{width}} " + " ".join(f"{format_bytes(v):>9}" for v in figures) + f"  {_where(e)}")


def _where(e: Estimate) -> str:
    return f"{e.phase}, {e.event}" + (f" in {e.module}" if e.module and e.phase != "step" else "")
