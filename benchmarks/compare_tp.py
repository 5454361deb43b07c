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

Measured as ``benchmarks/compare.py`` measures (its functions, reused; the command line, the mesh, the training and
the memory rows are ``benchmarks/mesh_compare.py``'s, shared with ``compare_pp.py``):

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
import sys
from typing import Callable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from zero import ZeroOptimizer
from zero.models import LlamaGPT, tensor_parallel_plan

import mesh_compare
from compare import Contender, Spec, adamw, run_record

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
    return mesh_compare.parse_args(__doc__, "tp", "tensor-parallel degree (dp = world size / tp)", 8,
                                   "write the rows, every step time and the comm stats here", argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = mesh_compare.start(args, "tp", lambda size: (
        f"--tp {args.tp} must divide the world size ({size}) and --heads ({args.heads})"
        if size % args.tp or args.heads % args.tp else None))
    chosen = specs(world.mesh)
    world.log(f"world {world.size} (dp {world.dp[1]} x tp {args.tp}), LlamaGPT {world.numel / 1e6:.2f}M params, "
              f"global batch {args.batch}, {args.threads} thread(s)/rank; contenders: "
              f"{', '.join(s.name for s in chosen)}", flush=True)
    contenders, results = mesh_compare.train(world, chosen, args, BASELINE)
    times_ms = {n: c.times_ms for n, c in contenders.items()}
    stats = comm_stats(contenders)
    del contenders
    rows = mesh_compare.rows(world, chosen, results, args, BASELINE)
    world.log("\n" + table(rows))
    data = {"world": world.size, "mesh": {"dp": world.dp[1], "tp": args.tp}, "params": world.numel,
            "config": vars(world.cfg), "run": run_record(args), "rows": rows, "times_ms": times_ms,
            "comm_stats": stats}
    mesh_compare.finish(world, args, data, markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
