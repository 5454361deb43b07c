"""``zero.estimate`` of a pipeline part against ``zero.profile`` in a real dp x pp world of gloo ranks (issue 48 part
9; ``test_estimate_pipeline_world.py`` compares them).

Each rank trains its part of ``zero.models.LlamaGPT`` (cut by ``pipeline_parts``) under
``ZeroOptimizer(AdamW, part, stage=s, process_group=dp)`` and ``zero.pipelining.PipelineStage``, with torch's
``ScheduleGPipe`` or ``Schedule1F1B`` at ``MICRO`` micro-batches, for ``STEPS`` steps (``CASES``: dp 2 x pp 2, and pp 3
on three of the ranks), and returns its peak: the allocator's, without the collectives' own buffers, less what the
process held before (as ``estimate_world.measured``). The estimates are priced from the same functions
(``workload``): the first part takes tokens, a later one the activation before it, and only the last has a loss.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import zero
import zero.pipelining
from zero.estimator import Workload, estimate
from zero.models import LlamaConfig, LlamaGPT, lm_loss, local_slice, pipeline_parts

CFG = LlamaConfig(vocab_size=128, seq_len=16, d_model=64, num_layers=4, num_heads=4)
MICRO = 4  # micro-batches per step
MICRO_BATCH = 2  # sequences per micro-batch
BUCKET_MB = 0.05  # several buckets per part
STEPS = 2
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
STAGES = (1, 2, 3)
UNITS = {"unit_classes": ["LlamaBlock"]}  # stage 3: a unit per block, as torchtitan shards a part
# besides the plain cases (ZeroConfig's fields, and the pipeline's reshard_after_backward): every block checkpointed;
# stage 3's units kept gathered from backward to the step (ZeroOptimizer.set_reshard_after_backward(False)), without
# prefetch (where keeping them costs a block's parameters: 0.2 MB above regathering them, 6 all-gathers instead of 14)
VARIANTS = {"": ({}, True), "checkpointing": ({"activation_checkpointing": {"classes": ["LlamaBlock"]}}, True),
            "kept": ({"prefetch_units": 0}, False)}
# (schedule, ZeRO stage, pp, variant): dp 2 x pp 2 on every rank at stages 1-3, GPipe at stage 3 checkpointed and
# 1F1B at stage 3 with its units kept; a pp 3 pipeline on ranks 0-2 (dp 1; its middle part receives activations and
# gradients both) at stage 2
CASES = ([(name, stage, 2, "") for name in SCHEDULES for stage in STAGES]
         + [("gpipe", 3, 2, "checkpointing"), ("1f1b", 3, 2, "kept")] + [(name, 2, 3, "") for name in SCHEDULES])


def fields(stage: int, variant: str) -> dict:
    """The ``ZeroConfig`` fields of a case."""
    return {**(UNITS if stage == 3 else {}), **VARIANTS[variant][0]}


def whole() -> LlamaGPT:
    torch.manual_seed(0)
    return LlamaGPT(CFG)


def tokens(micro: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, CFG.vocab_size, (micro, CFG.seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def first_batch(micro: int) -> tuple[torch.Tensor]:
    return (tokens(micro)[0],)


def later_batch(micro: int) -> tuple[torch.Tensor]:
    return (torch.randn(micro, CFG.seq_len, CFG.d_model),)


def last_batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(micro, CFG.seq_len, CFG.d_model), tokens(micro)[1]


def last_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(x), y)


def workload(index: int, pp: int) -> Workload:
    """Part ``index`` of ``pp``: the first takes tokens, a later part the activation before it; only the last has a
    loss (and the targets)."""
    build = lambda: pipeline_parts(whole(), pp)[index]  # noqa: E731
    if index == pp - 1:
        return Workload(build, last_loss, last_batch)
    return Workload(build, None, first_batch if index == 0 else later_batch)


def priced(index: int, name: str, stage: int, pp: int, variant: str, dp: int) -> dict:
    """The estimate of part ``index`` in one case, as plain data."""
    e = estimate(workload(index, pp), stage=stage, world_size=dp, micro_batch=MICRO_BATCH, bucket_size_mb=BUCKET_MB,
                 pipeline={"schedule": name, "stages": pp, "stage_index": index, "micro_batches": MICRO,
                           "reshard_after_backward": VARIANTS[variant][1]}, **fields(stage, variant))
    return {"estimated": e.peak, "estimated_categories": {k: v for k, v in e.categories.items() if v},
            "estimated_where": f"{e.phase} {e.module} {e.event}", "pipeline": e.pipeline}


def measure(name: str, stage: int, variant: str, index: int, pp: int, dp_group, pp_group) -> dict:
    """This rank's measured peak of ``STEPS`` steps of part ``index`` of ``pp`` under schedule ``name``."""
    gc.collect()
    dp_rank, dp = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    module = pipeline_parts(whole(), pp)[index]
    opt = zero.ZeroOptimizer(torch.optim.AdamW(module.parameters(), lr=1e-3), module, stage=stage,
                             bucket_size_mb=BUCKET_MB, process_group=dp_group, **fields(stage, variant))
    opt.set_reshard_after_backward(VARIANTS[variant][1])
    pipe = zero.pipelining.PipelineStage(module, index, pp, torch.device("cpu"), group=pp_group)
    schedule = SCHEDULES[name](pipe, MICRO, loss_fn=lm_loss)
    batches = [tuple(local_slice(t, dp_rank, dp) for t in tokens(dp * MICRO * MICRO_BATCH, step))
               for step in range(STEPS)]
    with zero.profile(module, opt, every_op=False) as prof:
        for x, y in batches:
            schedule.step(*((x,) if index == 0 else ()), target=y)
            opt.step()
            opt.zero_grad()
    peak = prof.peak
    out = {"measured": prof.allocator.peak_without_collectives - prof.samples[0].labels.get("other/alive on entry", 0),
           "categories": {k: v for k, v in peak.categories.items() if v},
           "where": f"{peak.phase} {peak.module} {peak.event}", "index": index}
    opt.close()
    del prof, opt, module, pipe, schedule
    gc.collect()
    return out


def checks(rank: int, world_size: int) -> dict:
    """Every case's measured peak on this rank (``CASES``): dp ``world_size // 2`` x pp 2, then pp 3 on ranks 0-2."""
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "pp"))
    three = dist.new_group([0, 1, 2])
    alone = [dist.new_group([r]) for r in range(world_size)]
    out = {}
    for case in CASES:
        name, stage, pp, variant = case
        if pp == 2:
            out[case] = measure(name, stage, variant, mesh["pp"].get_local_rank(), pp, mesh["dp"].get_group(),
                                mesh["pp"].get_group())
        elif rank < 3:
            out[case] = measure(name, stage, variant, rank, pp, alone[rank], three)
    dist.barrier()
    return out
