"""``zero.estimate(..., pipeline=Pipeline(...))`` of one part of a pipeline (issue 48 part 9), in one process: the
schedules' order and micro-batches in flight, what the part holds besides (receive buffers, the last part's outputs),
and what it refuses. Against measured peaks: ``tests/distributed/test_estimate_pipeline_world.py``."""

from __future__ import annotations

import pytest

from tests.distributed.estimate_pipeline_world import CFG, MICRO_BATCH, last_loss, workload
from zero.estimator import Pipeline, Workload, estimate
from zero.estimator.pipeline import compose

OUTPUT = MICRO_BATCH * CFG.seq_len * CFG.d_model * 4  # one micro-batch's activation between parts (fp32)


def priced(index: int, schedule: str, micro_batches: int, pp: int = 2, stage: int = 2, **settings):
    settings.setdefault("pipeline", Pipeline(schedule, pp, index, micro_batches))
    return estimate(workload(index, pp), stage=stage, world_size=2, micro_batch=MICRO_BATCH, **settings)


def test_schedules_run_in_torchs_order():
    """GPipe: every forward, then every backward; 1F1B: ``stages - stage_index`` forwards, then one backward and one
    forward, then the backwards left (torch's Schedule1F1B._step_microbatches)."""
    assert Pipeline("gpipe", 2, 1, 3).actions() == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    first = Pipeline("1f1b", 3, 0, 5)
    assert first.in_flight == 3
    assert first.actions() == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2),
                               ("B", 3), ("B", 4)]
    assert Pipeline("1f1b", 3, 2, 3).actions() == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert [Pipeline("1f1b", 4, i, 8).in_flight for i in range(4)] == [4, 3, 2, 1]
    assert Pipeline("gpipe", 4, 3, 8).in_flight == 8


def test_gpipe_holds_every_micro_batch_and_1f1b_the_pipeline_depth():
    """On the first part, 1F1B's peak does not grow with the micro-batches but by their receive buffers (one output
    gradient each); GPipe's grows by each micro-batch's activations too, and is above 1F1B's."""
    one_f, gpipe = (priced(0, s, 4) for s in ("1f1b", "gpipe"))
    assert priced(0, "1f1b", 8).peak - one_f.peak == 4 * OUTPUT
    grown = priced(0, "gpipe", 8).peak - gpipe.peak
    assert grown > 4 * OUTPUT * 4 and gpipe.peak > one_f.peak
    assert one_f.pipeline == Pipeline("1f1b", 2, 0, 4) and one_f.as_dict()["pipeline"]["schedule"] == "1f1b"


def test_what_a_part_holds_besides_its_micro_batches():
    """A part after the first receives every micro-batch's input (the buffers: communication), the last keeps every
    micro-batch's output through the optimizer step; the trace of one micro-batch says how large both are."""
    last = workload(1, 2)
    trace = last.timeline(MICRO_BATCH, part=(False, True))
    assert trace.input_grads == OUTPUT and trace.outputs == MICRO_BATCH * CFG.seq_len * CFG.vocab_size * 4
    part = compose(trace, Pipeline("gpipe", 2, 1, 4))
    assert part.buffers == 4 * OUTPUT and part.step_held == 4 * trace.outputs
    first = compose(workload(0, 2).timeline(MICRO_BATCH, part=(True, False)), Pipeline("1f1b", 2, 0, 4))
    assert first.buffers == 4 * OUTPUT and first.step_held == 0
    assert [p.name for p in part.timeline.points[-2:]] == ["<reduce gradients>", "<outputs merged>"]


def test_accepts_a_mapping_and_prices_stage_3_and_checkpointing():
    spec = {"schedule": "1f1b", "stages": 3, "stage_index": 1, "micro_batches": 4}
    e = estimate(workload(1, 3), stage=3, world_size=2, micro_batch=MICRO_BATCH, pipeline=spec)
    assert e.pipeline == Pipeline(**spec) and e.group_size == 2
    saved = estimate(workload(1, 3), stage=3, world_size=2, micro_batch=MICRO_BATCH, pipeline=spec,
                     checkpointing={"classes": ["LlamaBlock"]})
    assert saved.peak < e.peak


@pytest.mark.parametrize(("pipeline", "message"), [
    (Pipeline, "under the schedules ['gpipe', '1f1b']"),
    ({"schedule": "gpipe", "stages": 2, "stage_index": 2, "micro_batches": 4}, "0 <= stage_index < stages"),
    ({"schedule": "1f1b", "stages": 4, "stage_index": 0, "micro_batches": 2}, "Schedule1F1B needs micro_batches >="),
    ({"schedule": "gpipe", "stages": 2}, "a mapping of its fields"),
    ("gpipe", "a mapping of its fields"),
])
def test_refuses_what_it_cannot_price(pipeline, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        if pipeline is Pipeline:
            Pipeline("interleaved", 2, 0, 4)
        else:
            estimate(workload(0, 2), stage=1, world_size=2, micro_batch=MICRO_BATCH, pipeline=pipeline)


def test_refuses_a_loss_where_the_schedule_runs_none():
    with pytest.raises(ValueError, match="give its Workload loss=None"):
        estimate(Workload(workload(0, 2).build, last_loss, workload(0, 2).batch), stage=1, world_size=2,
                 micro_batch=MICRO_BATCH, pipeline=Pipeline("gpipe", 2, 0, 4))
    with pytest.raises(ValueError, match="the last part of a pipeline computes the loss"):
        estimate(Workload(workload(1, 2).build, None, workload(1, 2).batch), stage=1, world_size=2,
                 micro_batch=MICRO_BATCH, pipeline=Pipeline("gpipe", 2, 1, 4))
    with pytest.raises(ValueError, match="the workload has no loss, as a pipeline part before the last"):
        estimate(workload(0, 2), stage=1, world_size=2, micro_batch=MICRO_BATCH)
    with pytest.raises(ValueError, match="a pipeline part under tensor parallelism yet"):
        priced(0, "gpipe", 4, tensor_parallel=2)


def test_stage_3_units_kept_gathered_over_the_micro_batches():
    """``ZeroOptimizer.set_reshard_after_backward(False)`` (``Pipeline(..., reshard_after_backward=False)``): without
    prefetch, a block's parameters more on the first part, and 6 all-gathers per step instead of 14."""
    def gathers(keep: bool):
        e = priced(0, "1f1b", 4, stage=3, unit_classes=["LlamaBlock"], prefetch_units=0,
                   pipeline=Pipeline("1f1b", 2, 0, 4, reshard_after_backward=keep))
        return e.peak, e.traffic.comm_stats()["all_gather"]["calls"]

    (regathered, fourteen), (kept, six) = gathers(True), gathers(False)
    assert (fourteen, six) == (14, 6) and kept > regathered
