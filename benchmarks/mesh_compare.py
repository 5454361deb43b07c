"""What ``benchmarks/compare_tp.py`` and ``benchmarks/compare_pp.py`` share: ``zero`` against FSDP2 on a dp x tp or
dp x pp mesh of a Llama-style GPT, measured as ``benchmarks/compare.py`` measures (its functions, reused).

* :func:`parse_args`: the command line both take (the second dimension's degree, steps, warm-up, batch, threads,
  ``--json``, ``--markdown`` and the GPT's size), with a script's own arguments added after the degree;
* :func:`start`: the process group, the ``("dp", dim)`` mesh, the base model (seeded) and a log of rank 0;
* :func:`train`: every contender built from the base model and trained on the same batches, interleaved; the
  losses checked against the baseline's (nothing is reported otherwise); each contender's step times;
* :func:`rows`: each contender's peak memory (built and measured alone, twice in turn, the lower kept) and its
  figures as ratios to the baseline's;
* :func:`finish`: ``--json`` and ``--markdown`` written by rank 0, the process group destroyed.

Each script keeps what is its own: its contenders, its docstring (the method), its report and what else it counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import LlamaConfig, LlamaGPT

from compare import DEVICE, LOSS_RTOL, Contender, Spec, iqr, memory, run_steps


def parse_args(doc: str, dim: str, dim_help: str, batch: int, json_help: str, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The command line: ``--{dim}`` (the second dimension's degree, default 2), ``extra``'s arguments, then the
    shared ones (``--batch`` defaults to ``batch``)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument(f"--{dim}", type=int, default=2, help=dim_help)
    if extra is not None:
        extra(p)
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=batch, help="global batch (split over the dp ranks)"
                   if extra is None else "global batch (split over the dp ranks, then micro-batches)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help=json_help)
    p.add_argument("--markdown", default=None, help="write the Markdown table and its method here")
    add_gpt_arguments(p, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    args = p.parse_args(argv)
    args.only = None  # (compare.run_record's field: every contender runs)
    return args


@dataclass
class World:
    """This rank on the ``("dp", dim)`` mesh, with the base model every contender copies."""

    rank: int
    size: int
    mesh: DeviceMesh
    dp: tuple[int, int]  # (this rank's place in dp, dp's size)
    cfg: LlamaConfig
    base: LlamaGPT
    numel: int
    log: Callable[..., None]  # print on rank 0


def start(args: argparse.Namespace, dim: str, refuse: Callable[[int], str | None]) -> World:
    """The process group (NCCL on CUDA, else gloo), then, unless ``refuse(world size)`` gives a reason to stop, the
    mesh of ``("dp", dim)`` (``dim``'s degree: ``args.<dim>``) and the base model, seeded."""
    torch.set_num_threads(args.threads)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", timeout=timedelta(minutes=20))
    rank, size = dist.get_rank(), dist.get_world_size()
    reason = refuse(size)
    if reason:
        raise SystemExit(reason)
    g = gpt_config(args)
    cfg = LlamaConfig(g.vocab_size, g.seq_len, g.d_model, g.num_layers, g.num_heads)
    degree = getattr(args, dim)
    mesh = init_device_mesh(DEVICE.type, (size // degree, degree), mesh_dim_names=("dp", dim))
    torch.manual_seed(0)
    base = LlamaGPT(cfg).to(DEVICE)
    gc.freeze()  # torch's and zero's import-time objects: each gc.collect() below skips them (0.2-0.7 s each)
    return World(rank, size, mesh, (mesh["dp"].get_local_rank(), mesh["dp"].size()), cfg, base,
                 sum(p.numel() for p in base.parameters()), print if rank == 0 else (lambda *a, **k: None))


def train(world: World, chosen: list[Spec], args: argparse.Namespace,
          baseline: str) -> tuple[dict[str, Contender], dict[str, dict]]:
    """Every contender built and trained (``run_steps``: interleaved, the same batches); their losses checked equal
    to ``baseline``'s (the script stops otherwise); the contenders and each one's step-time figures."""
    contenders = {s.name: s.build(world.base) for s in chosen}
    run_steps(contenders, world.cfg, args.batch, args.steps, args.warmup, real=True, dp=world.dp)
    ref = contenders[baseline].losses
    deviation = {n: max(abs(a / b - 1) for a, b in zip(c.losses, ref)) for n, c in contenders.items()}
    for name, gap in deviation.items():  # the same training, before any figure is reported
        if not gap <= LOSS_RTOL:
            raise SystemExit(f"{name}: losses differ from {baseline}'s by {gap:.2e} (> {LOSS_RTOL:.0e}); "
                             "not reporting figures")
    world.log(f"losses agree with {baseline}'s over {args.warmup + args.steps} steps", flush=True)
    return contenders, {n: {"median_ms": statistics.median(c.times_ms), "iqr_ms": iqr(c.times_ms),
                            "loss_deviation": deviation[n]} for n, c in contenders.items()}


def rows(world: World, chosen: list[Spec], results: dict[str, dict], args: argparse.Namespace,
         baseline: str) -> list[dict]:
    """Each contender's peak memory added to its ``results`` (after the trained contenders are gone), and its row:
    the figures and their ratios to ``baseline``'s (``time_x_<baseline>``, ``iqr_x_...``, ``peak_x_...``)."""
    gc.collect()
    for _ in range(2):  # each contender twice, in turn, keeping its lower figures (compare.py's reason)
        for spec in chosen:
            measured = memory(spec, world.base, world.cfg, args.batch, dp=world.dp)
            kept = results[spec.name]
            kept.update({k: min(v, kept.get(k, v)) for k, v in measured.items()})
    anchor, suffix = results[baseline], baseline.replace("-", "_")
    return [{"name": s.name, **results[s.name], f"time_x_{suffix}": results[s.name]["median_ms"] / anchor["median_ms"],
             f"iqr_x_{suffix}": results[s.name]["iqr_ms"] / anchor["median_ms"],
             f"peak_x_{suffix}": results[s.name]["peak"] / anchor["peak"]} for s in chosen]


def finish(world: World, args: argparse.Namespace, data: dict, markdown: Callable[[dict], str]) -> None:
    """``data`` to ``--json`` and ``markdown(data)`` to ``--markdown`` (rank 0); the process group destroyed."""
    if world.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    if world.rank == 0 and args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(data))
    dist.destroy_process_group()
