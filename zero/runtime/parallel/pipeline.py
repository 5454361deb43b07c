"""The pipeline dimension: the ranks that hold the model's other parts (pipeline parallelism, torch's
``torch.distributed.pipelining``), and this optimizer's parts among them.

A pipeline schedule runs each part's micro-batches with the gradient reduction held back, and reduces once per step
after the part's last backward (``zero.pipelining.PipelineStage`` calls :meth:`PipelineRanks.part_done`). With several
parts on one rank under one optimizer (interleaved schedules) the reduction waits for the last of them. The clip
norm adds up over the pipeline's ranks, each of which holds other parameters (:meth:`PipelineRanks.sum_over_pp`),
a weight tied across parts counted once (``zero.runtime.parallel.ties``: :meth:`PipelineRanks.connect` sets the tie
up, or refuses an undeclared one).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import ParamSlot
from zero.runtime.parallel.ties import Held, NoTie, Tie, plan_tie


class NoPipelineRanks:
    """No pipeline: this optimizer's model is the whole model."""

    size = 1
    group: dist.ProcessGroup | None = None  # (None: not in a pipeline)
    parts: tuple[int, ...] = ()
    tie = NoTie()

    def counts(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s gradient counts in the norm here (a tied weight's, on one of its ranks only)."""
        return self.tie.counts(slot)

    def sum_over_pp(self, partial: torch.Tensor, norm_type: float) -> torch.Tensor:
        return partial


class PipelineRanks:
    """The pipeline's ranks (one per part's position, this one among them) and this optimizer's parts on them."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.size = comm.world_size
        self.group = comm.group
        self.parts: list[int] = []  # the stage indices of this optimizer's parts, in the order they joined
        self.done: set[int] = set()  # those whose micro-batches of this step are all backward
        self.modules: list[torch.nn.Module] = []  # the joined parts
        self.declared: tuple[tuple[str, ...], ...] = ()  # the weights tied across parts, as the stages declare them
        self.tie: Tie | NoTie = NoTie()
        self.connected = False  # the ranks compared what they hold (connect)

    def join(self, stage_index: int, part: torch.nn.Module, tied_weights: tuple[tuple[str, ...], ...]) -> None:
        if stage_index in self.parts:
            raise ValueError(f"pipeline stage {stage_index} was built twice over this ZeroOptimizer's model; build "
                             "one PipelineStage per part")
        if self.parts and tied_weights != self.declared:
            raise ValueError(f"the pipeline stages of one rank declare different tied_weights ({self.declared} and "
                             f"{tied_weights}); pass the same list to every stage")
        self.parts.append(stage_index)
        self.modules.append(part)
        self.declared = tied_weights

    def connect(self, held: dict[str, Held], mine: dict[str, ParamSlot]) -> Tie | NoTie:
        """Every pp rank's parameters compared (one all-gather over the pipeline): the declared tie set up, an
        undeclared one refused (``zero.runtime.parallel.ties.plan_tie``)."""
        everyone = self.comm.all_gather_object(held)
        self.tie = plan_tie(self.declared, everyone, mine, self.comm)
        self.connected = True
        return self.tie

    def counts(self, slot: ParamSlot) -> bool:
        """Whether ``slot``'s gradient counts in the norm here (a tied weight's, on one of its ranks only)."""
        return self.tie.counts(slot)

    def part_done(self, stage_index: int) -> bool:
        """Part ``stage_index`` ran its last backward of this step; whether every part of this optimizer has (then
        the reduction is due, and the count starts over)."""
        self.done.add(stage_index)
        if len(self.done) < len(self.parts):
            return False
        self.done.clear()
        return True

    def sum_over_pp(self, partial: torch.Tensor, norm_type: float) -> torch.Tensor:
        """``partial`` (this rank's sum of ``|g| ** p``, or its maximum for the inf-norm) over every part."""
        op = "max" if norm_type == math.inf else "sum"
        self.comm.all_reduce(partial, op=op, what="all-reduce over the pipeline of the gradient norm").wait()
        return partial
