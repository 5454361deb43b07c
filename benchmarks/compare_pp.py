"""Pipeline parallelism: ``ZeroOptimizer`` at stages 1-3 with torch's pipeline schedules, against FSDP2 with
torch's pipelining, on the same dp x pp mesh and model: step time, peak memory per rank and gradient collectives per
step.

Every contender trains its own copy of the same Llama-style GPT (``zero.models.LlamaGPT``, same seed, same batches,
AdamW, gradients clipped at 1.0 over the whole model), cut by ``zero.models.pipeline_parts`` into ``pp`` parts (two
per rank, ``2 pp``, under ``--schedule interleaved``; part ``i`` on pp rank ``i % pp``) on
``init_device_mesh(device, (dp, pp), mesh_dim_names=("dp", "pp"))``; each dp rank takes its share of the global
batch, which the schedule (``Schedule1F1B`` by default, ``--schedule gpipe|1f1b|interleaved``) splits into
``--micro-batches`` (4) micro-batches, with torch's defaults (``scale_grads=True``, ``zero.models.lm_loss``: a mean
loss per micro-batch):

* ``fsdp2-pp``  ``fully_shard(block, mesh=mesh["dp"])`` for each block of the part, then on the part, and torch's
  ``PipelineStage`` (which holds FSDP2's reduction back to the step's last backward); clipped as torchtitan clips
  under pipelining (``get_total_norm`` of the part, squared and summed over pp, ``clip_grads_with_norm_``). The
  baseline every ratio is to
* ``zero-1-pp``, ``zero-2-pp``, ``zero-3-pp``  ``ZeroOptimizer(AdamW, part, stage=s, mesh=mesh["dp"])`` and
  ``zero.pipelining.PipelineStage`` (torch's arguments; one gradient reduction per step), ``opt.clip_grad_norm_``
  (the whole pipeline's norm); default configuration (25 MB buckets), except stage 3's units: the blocks
  (``unit_classes=["LlamaBlock"]``, resharded after forward), the modules FSDP2 shards on its own. zero's default
  units are the modules held in an ``nn.ModuleList``; a part's blocks are in an ``nn.ModuleDict`` (the whole model's
  names kept, as torchtitan cuts it), so by default the whole part is one unit, gathered once per step and kept
* ``zero-2-pp-torchstage``  stage 2 with torch's own ``PipelineStage`` (``ZeroOptimizer(..., mesh=mesh)``, the mesh
  of dp and pp: the clip learns the pipeline from it): torch holds the reduction back only for DDP and FSDP modules,
  so this one reduces once per micro-batch

Measured as ``benchmarks/compare.py`` measures (its functions, reused; the command line, the mesh, the training and
the memory rows are ``benchmarks/mesh_compare.py``'s, shared with ``compare_tp.py``):

* **step time**: the schedule's step (every micro-batch's forward and backward) + clip + step + zero_grad after a
  barrier, max over the ranks; the median of the timed steps, interleaved (each step runs every contender once, the
  order rotating), and their interquartile range;
* **peak memory** per rank (max over ranks): on CPU glibc's bytes in use (``mallinfo2``) read after every operator
  (collectives and the pipeline's sends and receives included) and around the step, over what was in use before the
  contender was built; on CUDA ``torch.cuda.max_memory_allocated``; each contender built and measured alone, twice
  in turn, the lower figure kept; also the bytes still in use after a step and ``zero_grad()`` (model state);
* **gradient collectives per step**, counted the same way for every contender: one more step of each (after the
  timed ones) under a ``TorchDispatchMode`` that records every ``c10d`` operator it dispatches (torch.distributed's
  collectives on a process group, gloo's and NCCL's alike, dispatch as ``c10d`` operators: FSDP2's reduce-scatters
  and zero's, the pipeline's sends and receives), by the phase of the step it ran in (the schedule's step; the clip;
  the optimizer's step and ``zero_grad``). The gradient collectives are the reductions of floating-point tensors
  (``allreduce_``, ``reduce_scatter_``, ``_reduce_scatter_base_``, ...) outside the clip (whose all-reduces of a
  norm are counted apart); their bytes are the bytes of the tensors reduced (the unsharded gradients, before the
  scatter). On gloo zero's reduce-scatter is an all-reduce of its input (``zero/comm/communicator.py``), so it
  dispatches as ``allreduce_``. Reductions of integers are counted apart as flags: zero's agreement on which
  parameters got gradients, a few bytes once per reduction round. For the ``zero`` contenders the gradient
  reductions are checked equal, calls and bytes, to ``opt.comm_stats``' reduce-scatters of that step (the JSON
  carries it, and the number of the optimizer's buckets). The parameter gathers (all-gathers and broadcasts
  outside the clip, with the bytes gathered; zero's all-gather on gloo is one broadcast per dp rank) are counted
  the same way. Each figure is per rank (the parts differ: the first holds the embedding, the last the head); the
  table shows the largest over the ranks.

Before any figure is reported every contender's losses must agree with FSDP2 + pipelining's at every step (1e-3
relative). Results: a table of ratios to ``fsdp2-pp`` with the absolute figures, ``--json`` (rows, every step time,
each rank's collectives) and ``--markdown`` (the table and its method in a paragraph).

Run (CPU, gloo; 4 ranks: dp 2 x pp 2)::

    torchrun --standalone --nproc-per-node 4 benchmarks/compare_pp.py [--pp 2] [--schedule 1f1b]
        [--micro-batches 4] [--steps 20] [--d-model 256 --layers 4 --heads 4]
        [--json benchmarks/results/compare_pp.json] [--markdown benchmarks/results/compare_pp.md]
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zero.pipelining
from zero import ZeroOptimizer
from zero.models import LlamaGPT, lm_loss, local_slice, pipeline_parts, synthetic_batch

import mesh_compare
from compare import DEVICE, Contender, Spec, adamw, run_record

BASELINE = "fsdp2-pp"
STAGES = (1, 2, 3)
TORCH_STAGE = "zero-2-pp-torchstage"
CLIP = 1.0
UNIT = "LlamaBlock"  # stage 3's units: the blocks FSDP2 shards (zero's default finds none in a part's ModuleDict)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
PHASES = ("schedule", "clip", "optimizer")
COMMAND = ("torchrun --standalone --nproc-per-node 4 benchmarks/compare_pp.py "
           "--json benchmarks/results/compare_pp.json --markdown benchmarks/results/compare_pp.md")


class Layout:
    """The pipeline on ``mesh``: its schedule, its micro-batches, and which parts this rank holds."""

    def __init__(self, mesh: DeviceMesh, schedule: str, micro_batches: int):
        self.mesh, self.schedule, self.micro = mesh, schedule, micro_batches
        self.pp, self.pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
        self.num_parts = self.pp * (2 if schedule == "interleaved" else 1)
        self.mine = [i for i in range(self.num_parts) if i % self.pp == self.pp_rank]

    def parts(self, base: LlamaGPT) -> list[torch.nn.Module]:
        """Copies of this rank's parts of ``base`` (only they are copied)."""
        cut = pipeline_parts(base, self.num_parts)
        return [copy.deepcopy(cut[i]) for i in self.mine]

    def build_schedule(self, parts: list[torch.nn.Module], stage_class) -> object:
        stages = [stage_class(part, i, self.num_parts, DEVICE, group=self.mesh["pp"].get_group())
                  for part, i in zip(parts, self.mine)]
        return SCHEDULES[self.schedule](stages if len(stages) > 1 else stages[0], self.micro, loss_fn=lm_loss)


class PipelineContender(Contender):
    """A contender whose step is a pipeline schedule's: ``train_step`` runs every micro-batch through the schedule,
    clips, steps and zeroes the gradients; it returns the dp rank's mean loss times pp on the last part's ranks and
    0 on the others, so that ``run_steps``' mean over the world is the mean loss over dp."""

    def __init__(self, module: torch.nn.Module, optimizer: object, schedule: object, clip: Callable[[], object],
                 layout: Layout):
        super().__init__(module, optimizer)
        self.schedule, self.clip, self.layout = schedule, clip, layout
        self.first = layout.pp_rank == 0
        self.phase: Callable[[str], None] = lambda _name: None  # told each phase's start (the collectives' count)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        micro: list[torch.Tensor] = []
        self.phase("schedule")
        self.schedule.step(*((x,) if self.first else ()), target=y, losses=micro)
        self.phase("clip")
        self.clip()
        self.phase("optimizer")
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(torch.stack(micro).detach().mean()) * self.layout.pp if micro else 0.0


def _module(parts: list[torch.nn.Module]) -> torch.nn.Module:
    return parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)


@torch.no_grad()
def _clip_fsdp2(params: list[torch.nn.Parameter], pp_group) -> torch.Tensor:
    """torchtitan's clip under pipelining: the part's norm (over dp, DTensor's), squared and summed over pp."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    norm = norm.pow(2)
    dist.all_reduce(norm, group=pp_group)
    norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, CLIP, norm)
    return norm


def _fsdp2_pp(layout: Layout) -> Callable[[LlamaGPT], Contender]:
    def build(base: LlamaGPT) -> Contender:
        parts = layout.parts(base)
        for part in parts:
            for block in part.layers.values():
                fully_shard(block, mesh=layout.mesh["dp"])
            fully_shard(part, mesh=layout.mesh["dp"])
        module = _module(parts)
        params = list(module.parameters())
        group = layout.mesh["pp"].get_group()
        return PipelineContender(module, adamw(params), layout.build_schedule(parts, TorchPipelineStage),
                                 lambda: _clip_fsdp2(params, group), layout)

    return build


def _zero_pp(stage: int, layout: Layout, bucket_mb: float,
             torch_stage: bool = False) -> Callable[[LlamaGPT], Contender]:
    def build(base: LlamaGPT) -> Contender:
        parts = layout.parts(base)
        module = _module(parts)
        mesh = layout.mesh if torch_stage else layout.mesh["dp"]
        units = {"unit_classes": [UNIT]} if stage == 3 else {}
        opt = ZeroOptimizer(adamw(module.parameters()), module, stage=stage, mesh=mesh, bucket_size_mb=bucket_mb,
                            **units)
        stage_class = TorchPipelineStage if torch_stage else zero.pipelining.PipelineStage
        return PipelineContender(module, opt, layout.build_schedule(parts, stage_class),
                                 lambda: opt.clip_grad_norm_(CLIP), layout)

    return build


def specs(layout: Layout, bucket_mb: float) -> list[Spec]:
    return ([Spec(BASELINE, _fsdp2_pp(layout), 3)]
            + [Spec(f"zero-{s}-pp", _zero_pp(s, layout, bucket_mb), s) for s in STAGES]
            + [Spec(TORCH_STAGE, _zero_pp(2, layout, bucket_mb, torch_stage=True), 2)])


# ----- gradient collectives ---------------------------------------------------------------------------------


def kind(op: str) -> str:
    """The kind of a :class:`Collectives` key: ``reduction`` (all-reduces, reduce-scatters, reduces of floating-point
    tensors: gradients, norms), ``flags`` (reductions of integers: zero's agreement on which parameters got
    gradients, once per reduction round), ``gather`` (all-gathers, broadcasts), ``p2p`` (sends, receives),
    ``other`` (barriers, ...)."""
    name, _, dtype = op.partition("[")
    if "reduce" in name:
        return "flags" if dtype else "reduction"
    if "gather" in name or "broadcast" in name:
        return "gather"
    if name.startswith(("send", "recv", "batch_isend")):
        return "p2p"
    return "other"


class Collectives(TorchDispatchMode):
    """Counts the ``c10d`` operators dispatched (torch.distributed's collectives on a process group) by phase and
    operator: ``{phase: {op: {"calls", "bytes"}}}`` (``op[int32]``: an operator on integer tensors only), ``bytes``
    those of the larger of its first two arguments' tensors (a reduction's input, before any scatter; a gather's
    output)."""

    def __init__(self):
        super().__init__()
        self.phase, self.counts = PHASES[0], {p: {} for p in PHASES}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name()) if hasattr(func, "name") else str(func)
        if name.startswith(("c10d::", "_c10d_functional::")):
            tensors = [[t for t in tree_leaves(a) if isinstance(t, torch.Tensor)] for a in args[:2]]
            key = name.split("::")[-1].split(".")[0]
            if tensors[0] and not any(t.is_floating_point() for ts in tensors for t in ts):
                key += f"[{tensors[0][0].dtype}]".replace("torch.", "")
            op = self.counts[self.phase].setdefault(key, {"calls": 0, "bytes": 0})
            op["calls"] += 1
            op["bytes"] += max((sum(t.numel() * t.element_size() for t in ts) for ts in tensors), default=0)
        return func(*args, **(kwargs or {}))


def count_collectives(contenders: dict[str, PipelineContender], cfg, batch: int, step: int,
                      dp: tuple[int, int]) -> dict[str, list[dict]]:
    """One more step of each contender under :class:`Collectives`: per contender, each rank's counts by phase, its
    gradient reductions (calls and bytes outside the clip), and for ``zero`` its ``comm_stats`` of that step and its
    number of buckets (a list over the global ranks)."""
    x, y = (local_slice(t, *dp).to(DEVICE) for t in synthetic_batch(step, batch, cfg))
    mine: dict[str, dict] = {}
    for name, c in contenders.items():
        dist.barrier()
        counter = Collectives()
        c.phase = lambda p: setattr(counter, "phase", p)
        with counter:
            c.train_step(x, y)
        c.phase = lambda _p: None
        outside_clip = [(op, s) for phase in ("schedule", "optimizer") for op, s in counter.counts[phase].items()]
        reductions = [s for op, s in outside_clip if kind(op) == "reduction"]
        record = {"phases": counter.counts, "grad_reductions": sum(s["calls"] for s in reductions),
                  "grad_reduction_bytes": sum(s["bytes"] for s in reductions),
                  "flag_reductions": sum(s["calls"] for op, s in outside_clip if kind(op) == "flags"),
                  "gathers": sum(s["calls"] for op, s in outside_clip if kind(op) == "gather"),
                  "gather_bytes": sum(s["bytes"] for op, s in outside_clip if kind(op) == "gather")}
        if isinstance(c.optimizer, ZeroOptimizer):
            record |= {"buckets": len(c.optimizer.buckets), "comm_stats": c.optimizer.comm_stats}
        mine[name] = record
    everyone: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: [r[name] for r in everyone] for name in mine}


def check_counts(collectives: dict[str, list[dict]]) -> None:
    """zero's own count of its gradient reductions (``comm_stats``' reduce-scatters: calls and bytes) and the
    dispatcher's agree, on every rank."""
    for name, ranks in collectives.items():
        for rank, r in enumerate(ranks):
            if "comm_stats" not in r:
                continue
            own = r["comm_stats"].get("reduce_scatter", {})
            own = (own.get("calls", 0), own.get("bytes", 0))
            if own != (r["grad_reductions"], r["grad_reduction_bytes"]):
                raise SystemExit(f"{name}, rank {rank}: comm_stats counts {own[0]} reduce-scatters of {own[1]} bytes, "
                                 f"the dispatcher {r['grad_reductions']} reductions of {r['grad_reduction_bytes']} "
                                 f"bytes; not reporting figures")


# ----- report -----------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    head = (f"{'contender':<22}{'step ms':>9}{'IQR':>7}{'x FSDP2+PP':>12}{'peak MiB':>10}{'x FSDP2+PP':>12}"
            f"{'grad reductions':>17}{'MiB':>8}{'flags':>7}{'loss gap':>10}")
    return "\n".join([head] + [
        f"{r['name']:<22}{r['median_ms']:>9.1f}{r['iqr_ms']:>7.1f}{r['time_x_fsdp2_pp']:>12.2f}"
        f"{r['peak'] / 2**20:>10.1f}{r['peak_x_fsdp2_pp']:>12.2f}{r['grad_reductions']:>17d}"
        f"{r['grad_reduction_bytes'] / 2**20:>8.2f}{r['flag_reductions']:>7d}{r['loss_deviation']:>10.1e}"
        for r in rows])


def describe(data: dict) -> str:
    cfg, run = data["config"], data["run"]
    return (f"LlamaGPT of {data['params'] / 1e6:.2f}M parameters (vocabulary {cfg['vocab_size']}, sequence "
            f"{cfg['seq_len']}, d_model {cfg['d_model']}, {cfg['num_layers']} layers, {cfg['num_heads']} heads) in "
            f"{data['parts']} parts, {data['world']} {run['backend']} ranks as dp {data['mesh']['dp']} x pp "
            f"{data['mesh']['pp']}, `{run['schedule']}` with {run['micro_batches']} micro-batches, global batch "
            f"{run['batch']}, {run['threads']} thread(s) per rank, {run['cpu_count']} cores ({run['device']})")


def markdown(data: dict) -> str:
    """The table of ratios to FSDP2 + pipelining with the absolute figures, and the method in a paragraph."""
    run = data["run"]
    lines = ["| contender | step time × FSDP2+PP | peak memory × FSDP2+PP | gradient reductions per step (MiB) | "
             "flag all-reduces per step | parameter gathers per step (MiB) | step ms (IQR) | peak MiB |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in data["rows"]:
        lines.append(f"| `{r['name']}` | {r['time_x_fsdp2_pp']:.2f} | {r['peak_x_fsdp2_pp']:.2f} | "
                     f"{r['grad_reductions']} ({r['grad_reduction_bytes'] / 2**20:.2f}) | {r['flag_reductions']} | "
                     f"{r['gathers']} ({r['gather_bytes'] / 2**20:.2f}) | "
                     f"{r['median_ms']:.1f} ({r['iqr_ms']:.1f}) | {r['peak'] / 2**20:.1f} |")
    method = (
        f"{describe(data)}. Each rank's part: `fsdp2-pp` `fully_shard` on each block and the part over "
        "`mesh[\"dp\"]` with torch's `PipelineStage`, clipped as torchtitan clips under pipelining; `zero-s-pp` "
        "`ZeroOptimizer(AdamW, part, stage=s, mesh=mesh[\"dp\"])` with `zero.pipelining.PipelineStage` and "
        f"`opt.clip_grad_norm_` (25 MB buckets; stage 3's units the blocks, `unit_classes=[\"{UNIT}\"]`); "
        f"`{TORCH_STAGE}` stage 2 with torch's own `PipelineStage` "
        "(`mesh=mesh`), which reduces once per micro-batch. AdamW, clipped at 1.0 over the whole model, the same "
        "batches, losses checked equal to FSDP2 + pipelining's (1e-3) before any figure. Step time: the schedule's "
        f"step, clip, step and `zero_grad` after a barrier, max over ranks, median of {run['steps']} timed steps "
        f"(after {run['warmup']} untimed) with the contenders interleaved, IQR in brackets. Peak memory per rank "
        "(max over ranks): glibc's bytes in use (`mallinfo2`) after every operator over what was in use before the "
        "contender was built, each built and measured alone, twice, the lower kept (`benchmarks/compare.py`'s method, "
        "its functions reused). Gradient reductions per step: the all-reduces and reduce-scatters of floating-point "
        "tensors dispatched as `c10d` operators in one more step of each contender outside the clip (counted by a "
        "`TorchDispatchMode`, the same for every contender; on gloo zero's reduce-scatter is an all-reduce), the "
        "largest over the ranks, with the bytes reduced (unsharded); zero's are checked equal to its "
        "`opt.comm_stats`; flag all-reduces: "
        "all-reduces of integers, zero's agreement on which parameters got gradients (a few bytes, one per "
        "reduction round); parameter gathers: all-gathers and broadcasts outside the clip, with the bytes "
        "gathered (on gloo zero's all-gather is one broadcast per dp rank, so it counts dp per all-gather). "
        f"{data['world']} ranks share {run['cpu_count']} cores here, so single steps are noisy: the IQR says how "
        f"much, and ratios near 1 need a few runs. Reproduce: `{COMMAND}` (method: `benchmarks/compare_pp.py`'s "
        "docstring).")
    return "\n".join(lines) + "\n\n" + method + "\n"


# ----- main -------------------------------------------------------------------------------------------------


def _pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="torch's pipeline schedule")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="zero's bucket size (ZeroConfig's default: 25)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return mesh_compare.parse_args(__doc__, "pp", "pipeline-parallel degree (dp = world size / pp)", 16,
                                   "write the rows, every step time and the collectives here", argv,
                                   extra=_pipeline_arguments)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    parts = args.pp * (2 if args.schedule == "interleaved" else 1)

    def refuse(size: int) -> str | None:
        dp_size = size // args.pp if size % args.pp == 0 else 0
        if not dp_size or args.layers < parts or args.batch % (dp_size * args.micro_batches):
            return (f"--pp {args.pp} must divide the world size ({size}), --layers ({args.layers}) must be at least "
                    f"the parts ({parts}), and --batch ({args.batch}) a multiple of dp x --micro-batches")
        return None

    world = mesh_compare.start(args, "pp", refuse)
    layout = Layout(world.mesh, args.schedule, args.micro_batches)
    chosen = specs(layout, args.bucket_mb)
    world.log(f"world {world.size} (dp {world.dp[1]} x pp {args.pp}), LlamaGPT {world.numel / 1e6:.2f}M params in "
              f"{parts} parts, {args.schedule} x {args.micro_batches} micro-batches, global batch {args.batch}, "
              f"{args.threads} thread(s)/rank; contenders: {', '.join(s.name for s in chosen)}", flush=True)
    contenders, results = mesh_compare.train(world, chosen, args, BASELINE)
    collectives = count_collectives(contenders, world.cfg, args.batch, args.warmup + args.steps, world.dp)
    check_counts(collectives)
    for n, ranks in collectives.items():
        results[n].update({k: max(r[k] for r in ranks) for k in ("grad_reductions", "grad_reduction_bytes",
                                                                 "flag_reductions", "gathers", "gather_bytes")})
    times_ms = {n: c.times_ms for n, c in contenders.items()}
    losses = {n: c.losses for n, c in contenders.items()}
    del contenders
    rows = mesh_compare.rows(world, chosen, results, args, BASELINE)
    world.log("\n" + table(rows))
    data = {"world": world.size, "mesh": {"dp": world.dp[1], "pp": args.pp}, "parts": parts, "params": world.numel,
            "config": vars(world.cfg), "run": run_record(args) | {"schedule": args.schedule,
                                                                 "micro_batches": args.micro_batches,
                                                                 "bucket_mb": args.bucket_mb, "clip": CLIP},
            "rows": rows, "times_ms": times_ms, "losses": losses, "collectives": collectives}
    mesh_compare.finish(world, args, data, markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
