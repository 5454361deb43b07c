"""Checkpoints of a pipeline (issue 48, part 8), in one world of 4 ranks (``test_pipeline_checkpoint_world.py``).

``LlamaGPT`` of 4 blocks, cut by ``zero.models.pipeline_parts`` (parts keep the whole model's names), trains 2 steps
on a dp 2 x pp 2 mesh under torch's schedules at their defaults over ``zero.pipelining.PipelineStage`` (AdamW, clipped
at ``CLIP``, ``MICRO`` micro-batches, the same global batch of ``GLOBAL_BATCH`` sequences at every layout) and every
rank saves into one checkpoint of the whole model (``SAVES``): ``1f1b``, one part per rank, at stage 1; ``interleaved``,
two parts per rank under one ``ZeroOptimizer`` over their ``nn.ModuleList``, at stage 3. The same 4 ranks then load
each checkpoint into fresh models of other initial values at other pp and dp degrees and stages (``LOADS``) and train
2 more steps; each run reports the whole model's parameters (each pp rank's parts put together) right after the save
or the load and after the steps, and the losses. The single-process loads (the whole model under a ``ZeroOptimizer``
of one rank, a plain model, ``zero.consolidate``) and the single-process reference run in the test itself.

``refusals`` checks, without training, what a pipeline's save and load refuse, and that a buffer every part keeps
(torchtitan's ``freqs_cis``) is written once.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

import zero
from tests.distributed.harness import value_error
from zero.models import LlamaConfig, LlamaGPT, lm_loss, local_slice, pipeline_parts, synthetic_batch
from zero.pipelining import PipelineStage

CFG = LlamaConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=4, num_heads=4)
LR, CLIP = 1e-2, 0.5
MICRO = 4  # micro-batches per step
GLOBAL_BATCH = 16  # sequences per step, whatever the layout
SAVED_STEPS, MORE_STEPS = 2, 2
BUCKET_MB = 0.02  # a few buckets per part
# name -> (mesh (dp, pp), parts per pp rank, stage)
SAVES = {"1f1b": ((2, 2), 1, 1), "interleaved": ((2, 2), 2, 3)}
# name -> (the checkpoint (SAVES), mesh (dp, pp), parts per pp rank, stage, the pipeline given by mesh=mesh (else
# learned from the stages, built before the load))
LOADS = {
    "dp1xpp4-stage2": ("1f1b", (1, 4), 1, 2, True),  # another pp degree and dp degree
    "dp2xpp2-interleaved-stage0": ("1f1b", (2, 2), 2, 0, False),  # two parts per rank, from one part per rank
    "dp4-stage1": ("interleaved", (4, 1), 1, 1, False),  # the whole model on 4 dp ranks, no pipeline
}


def model(seed: int) -> LlamaGPT:
    torch.manual_seed(seed)
    return LlamaGPT(CFG)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(step, GLOBAL_BATCH, CFG, seed=5)


def reference(steps: int) -> dict:
    """Single-process training of the whole model on the global batch (the run that never stopped)."""
    whole = model(0)
    opt = torch.optim.AdamW(whole.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = whole.loss(*batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(whole.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": state(whole)}


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Run:
    """This rank's share of a run on a (dp, pp) mesh: its parts (part ``i`` on pp rank ``i % pp``) under one
    ``ZeroOptimizer`` (over a ModuleList of them with several), or the whole model without a pipeline (pp 1)."""

    def __init__(self, shape: tuple[int, int], per_rank: int, stage: int, seed: int, pipeline_by_mesh: bool = False):
        self.mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp"))
        self.dp, self.pp = shape
        whole = model(seed)
        if self.pp == 1:
            self.parts, self.mine, self.module = [whole], [0], whole
        else:
            self.parts = pipeline_parts(whole, self.pp * per_rank)
            rank = self.mesh["pp"].get_local_rank()
            self.mine = [i for i in range(len(self.parts)) if i % self.pp == rank]
            held = [self.parts[i] for i in self.mine]
            self.module = held[0] if len(held) == 1 else torch.nn.ModuleList(held)
        self.opt = zero.ZeroOptimizer(torch.optim.AdamW(self.module.parameters(), lr=LR), self.module, stage=stage,
                                      bucket_size_mb=BUCKET_MB,
                                      mesh=self.mesh if pipeline_by_mesh else self.mesh["dp"])
        self.schedule = None

    def build_schedule(self) -> None:
        if self.pp == 1:
            return
        stages = [PipelineStage(self.parts[i], i, len(self.parts), torch.device("cpu"),
                                group=self.mesh["pp"].get_group()) for i in self.mine]
        if len(stages) == 1:
            self.schedule = Schedule1F1B(stages[0], MICRO, loss_fn=lm_loss)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=lm_loss)

    def train(self, steps: range) -> list[float]:
        """Steps on the global batch, each dp rank its share; the losses (the mean over the global batch)."""
        dp_rank = self.mesh["dp"].get_local_rank()
        losses = []
        for step in steps:
            x, y = (local_slice(t, dp_rank, self.dp) for t in batch(step))
            if self.schedule is None:
                loss = self.module.loss(x, y)
                loss.backward()
            else:
                micro: list[torch.Tensor] = []
                first = self.mesh["pp"].get_local_rank() == 0
                self.schedule.step(*((x,) if first else ()), target=y, losses=micro)
                loss = torch.stack(micro).detach().mean() if micro else torch.zeros(())
            self.opt.clip_grad_norm_(CLIP)
            self.opt.step()
            self.opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)  # the last part's dp ranks hold the losses
            losses.append(float(total) / self.dp)
        return losses

    def whole_state(self) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict``: each pp rank's parts put together."""
        with self.opt.gathered_parameters():
            held = {k: v for i in self.mine for k, v in state(self.parts[i]).items()}
        if self.pp == 1:
            return held
        gathered: list = [None] * self.pp
        dist.all_gather_object(gathered, held, group=self.mesh["pp"].get_group())
        return {k: v for part in gathered for k, v in part.items()}


def save(path: str, name: str) -> dict:
    shape, per_rank, stage = SAVES[name]
    run = Run(shape, per_rank, stage, seed=0)
    run.build_schedule()
    losses = run.train(range(SAVED_STEPS))
    zero.save_checkpoint(path, run.module, run.opt, progress=False)
    return {"losses": losses, "params": run.whole_state()}


def load(path: str, name: str) -> dict:
    _, shape, per_rank, stage, by_mesh = LOADS[name]
    run = Run(shape, per_rank, stage, seed=1, pipeline_by_mesh=by_mesh)
    if not by_mesh:
        run.build_schedule()  # the stages tell the optimizer its pipeline
    zero.load_checkpoint(path, run.module, run.opt, progress=False)
    if by_mesh:
        run.build_schedule()
    loaded = run.whole_state()
    losses = run.train(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
    return {"loaded": loaded, "losses": losses, "params": run.whole_state()}


class Part(torch.nn.Module):
    """A toy part: ``layers.{index}`` and a buffer every part keeps (``freqs``, as torchtitan's ``freqs_cis``)."""

    def __init__(self, index: int, freqs: torch.Tensor, name: str | None = None):
        super().__init__()
        self.layers = torch.nn.ModuleDict({name or str(index): torch.nn.Linear(4, 4)})
        self.register_buffer("freqs", freqs)



def refusals(root: str) -> dict:
    """A shared buffer written once; a trained parameter under one name on two pp ranks, a shared buffer of other
    values, and parts of other optimizers, refused at save; a part loaded before its pipeline is known, refused."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp = mesh["pp"].get_local_rank()

    def saved(path: str, part: torch.nn.Module, optimizer=torch.optim.AdamW, **kwargs) -> str:
        opt = zero.ZeroOptimizer(optimizer(part.parameters(), lr=LR, **kwargs), part, stage=2, mesh=mesh)
        return value_error(lambda: zero.save_checkpoint(os.path.join(root, path), part, opt, progress=False))

    freqs = torch.arange(3.0)
    out = {"shared_buffer": saved("shared", Part(pp, freqs)),
           "same_parameter": saved("same", Part(pp, freqs, name="0")),
           "other_buffer": saved("other", Part(pp, freqs + pp)),
           "other_optimizer": saved("groups", Part(pp, freqs), weight_decay=0.1 * pp)}
    part = pipeline_parts(model(1), 2)[pp]
    opt = zero.ZeroOptimizer(torch.optim.AdamW(part.parameters(), lr=LR), part, stage=2, mesh=mesh["dp"])
    out["part_without_pipeline"] = value_error(lambda: zero.load_checkpoint(os.path.join(root, "1f1b"), part, opt,
                                                                       progress=False))
    return out


def checkpoint_checks(rank: int, world_size: int, root: str) -> dict:
    """Save as ``SAVES`` says, load as ``LOADS`` says, then the refusals; rank 0's results."""
    out: dict = {"saved": {name: save(os.path.join(root, name), name) for name in SAVES}}
    for name, (saved, *_) in LOADS.items():
        out[name] = load(os.path.join(root, saved), name)
    out["refusals"] = refusals(root)
    return out if rank == 0 else {}
