"""A pipeline part's step: the micro-batches of torch's ``ScheduleGPipe`` or ``Schedule1F1B`` on one part, priced.

``estimate(work, ..., pipeline=Pipeline(schedule, stages, stage_index, micro_batches))`` prices one rank of the
part ``work`` builds, trained by a ``ZeroOptimizer`` over the part's dp ranks under ``zero.pipelining.PipelineStage``:
every micro-batch's backward accumulates the gradients locally and whole, and one reduction after the last
(``opt.reduce_gradients``, at the schedule's gradient reduction) reduces them. The part's one micro-batch is traced as
its stage runs it (:func:`zero.estimator.timeline.record_step`: a part before the last has no loss, its backward
starts from the gradient of its output; the last part's output is kept, as the schedule keeps each micro-batch's);
:func:`compose` strings the forwards and backwards together in the schedule's order on this part, each point
carrying what the other micro-batches hold, and the result is replayed with the configuration's buffer schedule
(:func:`zero.estimator.schedule.replay`, the reduction held back to ``REDUCE``). What a part holds besides its own
forward and backward, as torch's schedules and stage hold it (``torch.distributed.pipelining``):

* each micro-batch in flight (forward run, backward not yet): what its forward left, its saved activations and its
  output (the stage keeps it for backward). GPipe runs all M forwards first, so M are in flight on every part; 1F1B
  at most ``stages - stage_index`` (``stages`` on the first part, 1 on the last);
* receive buffers, one per micro-batch, allocated at the first step and kept: the input activations (every part but
  the first) and the gradients of the output (every part but the last);
* what the schedule's sends hold until they are done with: the input gradient sent back (GPipe: every micro-batch's,
  until the step's end; 1F1B: the last one's, until the next backward has run) and, on GPipe, the outputs sent on;
* on the last part, every micro-batch's output until the next step (the schedule returns them merged into one: a
  copy after the reduction).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from zero.estimator.schedule import REDUCE
from zero.estimator.timeline import Point, Timeline

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Pipeline:
    """Where the priced part sits in a pipeline: torch's schedule (``"gpipe"``: ``ScheduleGPipe``, ``"1f1b"``:
    ``Schedule1F1B``), the number of parts (pp), this part's index (0: the first) and the micro-batches per step;
    ``reshard_after_backward=False``: stage 3's units kept gathered from backward to the step, over the step's later
    micro-batches (``ZeroOptimizer.set_reshard_after_backward(False)``)."""

    schedule: str
    stages: int
    stage_index: int
    micro_batches: int
    reshard_after_backward: bool = True

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"the estimator prices a pipeline part under the schedules {list(SCHEDULES)} "
                             f"(ScheduleGPipe, Schedule1F1B), got schedule={self.schedule!r}; interleaved and "
                             "zero-bubble schedules are not priced yet: measure them with zero.profile")
        whole = all(isinstance(n, int) and not isinstance(n, bool)
                    for n in (self.stages, self.stage_index, self.micro_batches))
        if not whole or self.stages < 1 or self.micro_batches < 1 or not 0 <= self.stage_index < self.stages:
            raise ValueError(f"a pipeline needs stages >= 1, 0 <= stage_index < stages and micro_batches >= 1, got "
                             f"stages={self.stages!r}, stage_index={self.stage_index!r}, "
                             f"micro_batches={self.micro_batches!r}")
        if not isinstance(self.reshard_after_backward, bool):
            raise ValueError(f"reshard_after_backward must be True or False, got {self.reshard_after_backward!r}")
        if self.schedule == "1f1b" and self.micro_batches < self.stages:
            raise ValueError(f"Schedule1F1B needs micro_batches >= stages (torch refuses fewer), got "
                             f"{self.micro_batches} micro-batches over {self.stages} stages")

    @classmethod
    def of(cls, value: "Pipeline | Mapping[str, Any] | None") -> "Pipeline | None":
        """``value`` as a ``Pipeline`` (a mapping of its fields, or ``None``: no pipeline)."""
        if value is None or isinstance(value, Pipeline):
            return value
        fields = ("schedule", "stages", "stage_index", "micro_batches")
        if not isinstance(value, Mapping) or not set(fields) <= set(value) <= {*fields, "reshard_after_backward"}:
            raise ValueError(f"pipeline must be a zero.estimator.Pipeline or a mapping of its fields {list(fields)} "
                             "(and reshard_after_backward), "
                             f"got {dict(value) if isinstance(value, Mapping) else type(value).__name__}")
        return cls(**value)

    @property
    def part(self) -> tuple[bool, bool]:
        """Whether this part is the first and the last (``Workload.timeline``'s ``part``)."""
        return self.stage_index == 0, self.stage_index == self.stages - 1

    @property
    def in_flight(self) -> int:
        """The most micro-batches whose forward has run and backward not, on this part."""
        if self.schedule == "gpipe":
            return self.micro_batches
        return min(self.micro_batches, self.stages - self.stage_index)

    def actions(self) -> list[tuple[str, int]]:
        """This part's forwards (``"F"``) and backwards (``"B"``) by micro-batch, in the schedule's order."""
        m = self.micro_batches
        if self.schedule == "gpipe":
            return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        warmup = self.in_flight
        out = [("F", j) for j in range(warmup)]
        for j in range(m):  # (1B1F: a backward, then the next forward while there is one)
            out.append(("B", j))
            if warmup + j < m:
                out.append(("F", warmup + j))
        return out


def check_part(workload: Any, pipe: Pipeline | None, tensor_parallel: int) -> None:
    """Refuse what the estimator does not price: a loss on a part before the last (or none on the last, or without a
    pipeline), a pipeline part under tensor parallelism."""
    if pipe is None:
        if workload.loss is None:
            raise ValueError("the workload has no loss, as a pipeline part before the last: price it with "
                             "estimate(..., pipeline=Pipeline(schedule, stages, stage_index, micro_batches)), or give "
                             "the Workload its loss")
        return
    last = pipe.part[1]
    if last and workload.loss is None:
        raise ValueError("the last part of a pipeline computes the loss (the schedule's loss_fn): give the Workload "
                         "its loss, loss(part, *batch), e.g. lambda part, x, y: loss_fn(part(x), y)")
    if not last and workload.loss is not None:
        raise ValueError(f"part {pipe.stage_index} of {pipe.stages} is not the last, whose schedule runs no loss on it "
                         "(its backward starts from the gradient of its output): give its Workload loss=None")
    if tensor_parallel != 1:
        raise ValueError("the estimator does not price a pipeline part under tensor parallelism yet; estimate the "
                         "part without tensor_parallel, or measure the step with zero.profile")


@dataclass(frozen=True)
class PartStep:
    """A pipeline part's step, as :func:`zero.estimator.schedule.replay` takes it."""

    timeline: Timeline  # every micro-batch's forward and backward in the schedule's order, then REDUCE
    buffers: float  # the receive buffers (bytes, the whole step)
    step_held: float  # what the schedule still holds during the optimizer step (bytes)


def compose(trace: Timeline, pipe: Pipeline) -> PartStep:
    """The part's step from the trace of one micro-batch (``Workload.timeline(..., part=pipe.part)``)."""
    first, last = pipe.part
    m = pipe.micro_batches
    split = next((i for i, p in enumerate(trace.points) if p.phase == "backward"), len(trace.points))
    forward, backward = trace.points[:split], trace.points[split:]
    end_forward = forward[-1] if forward else Point("forward", "op", "", "", 0, 0, 0)
    end = backward[-1] if backward else end_forward
    grad, out = trace.input_grads, trace.outputs
    left = end.temporaries - grad  # what a finished micro-batch leaves (on the last part: its output, kept)
    total = sum(trace.grad_bytes.values())
    gpipe = pipe.schedule == "gpipe"
    points: list[Point] = []
    in_flight = done = 0

    def sent(finished: int) -> int:
        """Bytes the schedule's sends (their handles) still hold of ``finished`` micro-batches."""
        if gpipe:  # (every send's handle kept until the step's end)
            return finished * (grad + (0 if last else out))
        warm = pipe.in_flight  # (1F1B: the warmup's send of micro-batch warm - 2 is held until the cooldown)
        held = out if not last and warm >= 2 and warm - 2 < finished <= m - warm else 0
        return held + (grad if finished else 0) + (out if finished == m and not last else 0)  # (the last ones')

    def shifted(p: Point, activations: int, temporaries: int, gradients: int) -> Point:
        return replace(p, activations=p.activations + activations, temporaries=p.temporaries + temporaries,
                       gradients=gradients)

    for kind, _ in pipe.actions():
        activations = in_flight * end_forward.activations
        if kind == "F":
            temporaries = in_flight * end_forward.temporaries + done * left + sent(done)
            points += [shifted(p, activations, temporaries, total if done else 0) for p in forward]
            in_flight += 1
            continue
        in_flight -= 1
        activations = in_flight * end_forward.activations
        temporaries = in_flight * end_forward.temporaries + done * left + sent(done)
        points += [shifted(p, activations, temporaries, p.gradients if not done else
                           total + (trace.grad_bytes.get(p.name, 0) if p.kind == "grad" else 0)) for p in backward]
        done += 1
    kept = done * left
    points.append(Point("backward", "op", REDUCE, "", 0, kept + sent(done), total))
    if last:  # the schedule's step returns the outputs merged: a copy of them all
        points.append(Point("backward", "op", "<outputs merged>", "", 0, kept + m * out, total))
    buffers = m * ((0 if first else grad) + (0 if last else out))
    return PartStep(Timeline(points, dict(trace.grad_bytes), trace.micro_batch), buffers, kept)
