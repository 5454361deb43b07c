"""2-D parallelism: ``ZeroOptimizer`` at stages 1-3 with tensor parallelism, against FSDP2 with tensor parallelism,
on the same dp x tp mesh and model: step time and peak memory per rank.

Every contender trains its own copy of the same Llama-style GPT (``zero.models.LlamaGPT``, same seed, same batches,
AdamW), split by ``parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence_parallel=True))``
(torchtitan's Llama plan: attention by heads, the MLP by hidden units, sequence-parallel norms) on
``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))``; each dp rank takes its share of the global
batch, the tp ranks of one dp rank the same share:

* ``fsdp2-tp``  ``fully_shard(layer, mesh=mesh["dp"])`` for each of ``model.layers``, then on the model (the
  baseline every ratio is to)
* ``zero-1-tp``, ``zero-2-tp``, ``zero-3-tp``  ``ZeroOptimizer(AdamW, model, stage=s, mesh=mesh["dp"])``, default
  configuration (stage 3's units: the same blocks, resharded after forward)

No gradient clipping: torch's ``clip_grad_norm_`` refuses FSDP2's parameters on two meshes (dp; dp x tp), so no
contender clips and all do the same work.

Measured as ``benchmarks/compare.py`` measures (its functions, reused):

* **step time**: forward + backward + step + zero_grad after a barrier, max over the ranks; the median of the timed
  steps, interleaved (each step runs every contender once, the order rotating), and their interquartile range;
* **peak memory** per rank (max over ranks): on CPU glibc's bytes in use (``mallinfo2``) read after every operator
  (a DTensor operator counts as one, with its redistribution) and around the step, over what was in use before the
  contender was built; on CUDA ``torch.cuda.max_memory_allocated``; each contender built and measured alone, twice
  in turn, the lower figure kept; also the bytes still in use after a step and ``zero_grad()`` (model state).

Before any figure is reported every contender's losses must agree with FSDP2 + TP's at every step (1e-3 relative).
Results: a table of ratios to ``fsdp2-tp`` with the absolute figures, ``--json`` (rows, every step time, and each
``zero`` contender's ``comm_stats`` of its last step, max over ranks) and ``--markdown`` (the table and its method in
a paragraph).

Run (CPU, gloo; 4 ranks: dp 2 x tp 2)::

    torchrun --standalone --nproc-per-node 4 benchmarks/compare_tp.py [--tp 2] [--steps 20]
        [--d-model 256 --layers 4 --heads 4] [--json benchmarks/results/compare_tp.json]
        [--markdown benchmarks/results/compare_tp.md]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from zero import ZeroOptimizer
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import LlamaConfig, LlamaGPT, tensor_parallel_plan

from compare import DEVICE, LOSS_RTOL, Contender, Spec, adamw, iqr, memory, run_record, run_steps

BASELINE = "fsdp2-tp"
STAGES = (1, 2, 3)
COMMAND = ("torchrun --standalone --nproc-per-node 4 benchmarks/compare_tp.py "
           "--json benchmarks/results/compare_tp.json --markdown benchmarks/results/compare_tp.md")


def _split(base: LlamaGPT, mesh: DeviceMesh) -> LlamaGPT:
    """A copy of ``base`` split over ``mesh["tp"]`` by torchtitan's Llama plan (sequence parallel)."""
    model = copy.deepcopy(base)
    return parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence_parallel=True))


def _fsdp2_tp(mesh: DeviceMesh) -> Callable[[LlamaGPT], Contender]:
    def build(base: LlamaGPT) -> Contender:
        model = _split(base, mesh)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return Contender(model, adamw(model.parameters()))

    return build


def _zero_tp(stage: int, mesh: DeviceMesh) -> Callable[[LlamaGPT], Contender]:
    def build(base: LlamaGPT) -> Contender:
        model = _split(base, mesh)
        return Contender(model, ZeroOptimizer(adamw(model.parameters()), model, stage=stage, mesh=mesh["dp"]))

    return build


def specs(mesh: DeviceMesh) -> list[Spec]:
    return [Spec(BASELINE, _fsdp2_tp(mesh), 3)] + [Spec(f"zero-{s}-tp", _zero_tp(s, mesh), s) for s in STAGES]


def comm_stats(contenders: dict[str, Contender]) -> dict[str, dict]:
    """Each ``zero`` contender's ``comm_stats`` of its last step (per collective kind: calls, numel, bytes, the
    seconds waited), max over ranks."""
    mine = {n: c.optimizer.comm_stats for n, c in contenders.items() if isinstance(c.optimizer, ZeroOptimizer)}
    everyone: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: {kind: {k: max(r[n].get(kind, {}).get(k, 0) for r in everyone) for k in stats}
                for kind, stats in kinds.items()} for n, kinds in mine.items()}


# ----- report -----------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    head = (f"{'contender':<12}{'step ms':>9}{'IQR':>7}{'x FSDP2+TP':>12}{'peak MiB':>10}{'x FSDP2+TP':>12}"
            f"{'loss gap':>10}")
    return "\n".join([head] + [
        f"{r['name']:<12}{r['median_ms']:>9.1f}{r['iqr_ms']:>7.1f}{r['time_x_fsdp2_tp']:>12.2f}"
        f"{r['peak'] / 2**20:>10.1f}{r['peak_x_fsdp2_tp']:>12.2f}{r['loss_deviation']:>10.1e}" for r in rows])


def describe(data: dict) -> str:
    cfg, run = data["config"], data["run"]
    return (f"LlamaGPT of {data['params'] / 1e6:.2f}M parameters (vocabulary {cfg['vocab_size']}, sequence "
            f"{cfg['seq_len']}, d_model {cfg['d_model']}, {cfg['num_layers']} layers, {cfg['num_heads']} heads), "
            f"{data['world']} {run['backend']} ranks as dp {data['mesh']['dp']} x tp {data['mesh']['tp']}, global "
            f"batch {run['batch']}, {run['threads']} thread(s) per rank, {run['cpu_count']} cores ({run['device']})")


def markdown(data: dict) -> str:
    """The table of ratios to FSDP2 + TP with the absolute figures, and the method in a paragraph."""
    run = data["run"]
    lines = ["| contender | step time × FSDP2+TP | peak memory × FSDP2+TP | step ms (IQR) | peak MiB |",
             "|---|--:|--:|--:|--:|"]
    for r in data["rows"]:
        lines.append(f"| `{r['name']}` | {r['time_x_fsdp2_tp']:.2f} | {r['peak_x_fsdp2_tp']:.2f} | "
                     f"{r['median_ms']:.1f} ({r['iqr_ms']:.1f}) | {r['peak'] / 2**20:.1f} |")
    method = (
        f"{describe(data)}. Every contender is the model split by `parallelize_module` over `mesh[\"tp\"]` with "
        "torchtitan's Llama plan (`zero.models.tensor_parallel_plan(model, sequence_parallel=True)`): `fsdp2-tp` "
        "then `fully_shard` on each block and the root over `mesh[\"dp\"]`, `zero-s-tp` "
        "`ZeroOptimizer(AdamW, model, stage=s, mesh=mesh[\"dp\"])`; AdamW, no gradient clipping, the same batches, "
        "losses checked equal to FSDP2 + TP's (1e-3) before any figure. Step time: forward, backward, step and "
        f"`zero_grad` after a barrier, max over ranks, median of {run['steps']} timed steps (after {run['warmup']} "
        "untimed) with the contenders interleaved, IQR in brackets. Peak memory per rank (max over ranks): glibc's "
        "bytes in use (`mallinfo2`) after every operator over what was in use before the contender was built, each "
        "contender built and measured alone, twice, the lower kept (`benchmarks/compare.py`'s method, its functions "
        f"reused). {data['world']} ranks share {run['cpu_count']} cores here, so single steps are noisy: the IQR says "
        f"how much, and ratios near 1 need a few runs. Reproduce: `{COMMAND}` (method: `benchmarks/compare_tp.py`'s "
        "docstring).")
    return "\n".join(lines) + "\n\n" + method + "\n"


# ----- main -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (dp = world size / tp)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=8, help="global batch (split over the dp ranks)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="write the rows, every step time and the comm stats here")
    p.add_argument("--markdown", default=None, help="write the Markdown table and its method here")
    add_gpt_arguments(p, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    args = p.parse_args(argv)
    args.only = None  # (compare.run_record's field: every contender runs)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", timeout=timedelta(minutes=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp or args.heads % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the world size ({world}) and --heads ({args.heads})")
    log = print if rank == 0 else (lambda *a, **k: None)
    g = gpt_config(args)
    cfg = LlamaConfig(g.vocab_size, g.seq_len, g.d_model, g.num_layers, g.num_heads)
    mesh = init_device_mesh(DEVICE.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = (mesh["dp"].get_local_rank(), mesh["dp"].size())
    torch.manual_seed(0)
    base = LlamaGPT(cfg).to(DEVICE)
    numel = sum(p.numel() for p in base.parameters())
    gc.freeze()  # torch's and zero's import-time objects: each gc.collect() below skips them (0.2-0.7 s each)
    chosen = specs(mesh)
    log(f"world {world} (dp {dp[1]} x tp {args.tp}), LlamaGPT {numel / 1e6:.2f}M params, global batch {args.batch}, "
        f"{args.threads} thread(s)/rank; contenders: {', '.join(s.name for s in chosen)}", flush=True)
    contenders = {s.name: s.build(base) for s in chosen}
    run_steps(contenders, cfg, args.batch, args.steps, args.warmup, real=True, dp=dp)
    ref = contenders[BASELINE].losses
    deviation = {n: max(abs(a / b - 1) for a, b in zip(c.losses, ref)) for n, c in contenders.items()}
    for name, gap in deviation.items():  # the same training, before any figure is reported
        if not gap <= LOSS_RTOL:
            raise SystemExit(f"{name}: losses differ from {BASELINE}'s by {gap:.2e} (> {LOSS_RTOL:.0e}); "
                             "not reporting figures")
    log(f"losses agree with {BASELINE}'s over {args.warmup + args.steps} steps", flush=True)
    results = {n: {"median_ms": statistics.median(c.times_ms), "iqr_ms": iqr(c.times_ms),
                   "loss_deviation": deviation[n]} for n, c in contenders.items()}
    times_ms = {n: c.times_ms for n, c in contenders.items()}
    stats = comm_stats(contenders)
    del contenders
    gc.collect()
    for _ in range(2):  # each contender twice, in turn, keeping its lower figures (compare.py's reason)
        for spec in chosen:
            measured = memory(spec, base, cfg, args.batch, dp=dp)
            kept = results[spec.name]
            kept.update({k: min(v, kept.get(k, v)) for k, v in measured.items()})
    anchor = results[BASELINE]
    rows = [{"name": s.name, **results[s.name], "time_x_fsdp2_tp": results[s.name]["median_ms"] / anchor["median_ms"],
             "iqr_x_fsdp2_tp": results[s.name]["iqr_ms"] / anchor["median_ms"],
             "peak_x_fsdp2_tp": results[s.name]["peak"] / anchor["peak"]} for s in chosen]
    log("\n" + table(rows))
    data = {"world": world, "mesh": {"dp": dp[1], "tp": args.tp}, "params": numel, "config": vars(cfg),
            "run": run_record(args), "rows": rows, "times_ms": times_ms, "comm_stats": stats}
    if rank == 0 and args.json:
        json.dump(data, open(args.json, "w"), indent=2)
    if rank == 0 and args.markdown:
        open(args.markdown, "w").write(markdown(data))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
