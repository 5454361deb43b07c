"""The pipeline dimension: the ranks that hold the model's other parts (pipeline parallelism, torch's
``torch.distributed.pipelining``), and this optimizer's parts among them.

A pipeline schedule runs each part's micro-batches with the gradient reduction held back, and reduces once per step
after the part's last backward (``zero.pipelining.PipelineStage`` calls :meth:`PipelineRanks.part_done`). With several
parts on one rank under one optimizer (interleaved schedules) the reduction waits for the last of them. The clip
norm adds up over the pipeline's ranks, each of which holds other parameters (:meth:`PipelineRanks.sum_over_pp`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zero.comm.communicator import Communicator


class NoPipelineRanks:
    """No pipeline: this optimizer's model is the whole model."""

    size = 1
    group: dist.ProcessGroup | None = None  # (None: not in a pipeline)
    parts: tuple[int, ...] = ()

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

    def join(self, stage_index: int) -> None:
        if stage_index in self.parts:
            raise ValueError(f"pipeline stage {stage_index} was built twice over this ZeroOptimizer's model; build "
                             "one PipelineStage per part")
        self.parts.append(stage_index)

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
