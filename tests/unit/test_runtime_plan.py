"""The core's seams, single-process: the stage plan (what each bucket holds), buffers with explicit states, and
placements (a recording double standing in for host memory trains to the same numbers and sees exactly the
planned buffers)."""

from __future__ import annotations

import pytest
import torch

from tests.toy import Net
from zero.config import ZeroConfig
from zero.precision import BufferDtypes, MixedPrecision
from zero.runtime.buffers.flat_buffer import BufferState, FlatBuffer
from zero.runtime.buffers.layout import plan_buckets
from zero.runtime.buffers.placement import DevicePlacement, HostPlacement, Placements, Where
from zero.runtime.buffers.plan import Role, plan_bucket
from zero.runtime.build import build_runtime
from zero.runtime.reduction.reduction_order import ReductionOrder
from zero.runtime.stages import make_stage

CPU = torch.device("cpu")
FP32 = BufferDtypes(torch.float32, torch.float32, torch.float32)
BF16 = BufferDtypes(torch.bfloat16, torch.float32, torch.float32)  # bf16 parameters, fp32 master and reduction


class RecordingPlacement(HostPlacement):
    """Host memory that records every allocation, release and restore (a test double for a placement)."""

    def __init__(self) -> None:
        super().__init__(pin=False)
        self.created: list[tuple[int, torch.dtype]] = []
        self.releases = 0
        self.restores = 0

    def new(self, numel: int, dtype: torch.dtype, *, allocate: bool) -> torch.Tensor:
        self.created.append((numel, dtype))
        return super().new(numel, dtype, allocate=allocate)

    def release(self, tensor: torch.Tensor) -> None:
        self.releases += 1
        super().release(tensor)

    def restore(self, tensor: torch.Tensor) -> None:
        self.restores += 1
        super().restore(tensor)


def _layout(num_shards: int):
    (layout,) = plan_buckets([10, 7], [("k",)] * 2, bucket_cap=100, num_shards=num_shards)
    return layout


def _roles(stage: int, dtypes: BufferDtypes, world: int = 2, placements: Placements | None = None):
    policy = make_stage(stage, MixedPrecision(param_dtype="bf16") if dtypes is BF16 else None).policy(world)
    placements = placements or Placements.on(DevicePlacement(CPU))
    plan = plan_bucket(policy, _layout(policy.num_shards), dtypes, True, placements)
    return {spec.role: spec for spec in plan.buffers}, plan


@pytest.mark.parametrize(
    "stage, dtypes, expected",
    [
        (0, FP32, {Role.PARAMS, Role.GRADS, Role.STAGING, Role.GRAD_SHARD}),
        (1, FP32, {Role.PARAMS, Role.GRADS, Role.STAGING, Role.GRAD_SHARD, Role.GRAD_CARRY}),
        (2, FP32, {Role.PARAMS, Role.STAGING, Role.GRAD_SHARD}),
        (3, FP32, {Role.PARAMS, Role.SHARD, Role.STAGING, Role.GRAD_SHARD}),
        (1, BF16, {Role.PARAMS, Role.MASTER, Role.GRADS, Role.STAGING, Role.GRAD_SHARD}),
        (3, BF16, {Role.PARAMS, Role.SHARD, Role.MASTER, Role.STAGING, Role.GRAD_SHARD}),
    ],
)
def test_the_plan_lists_what_each_stage_keeps(stage, dtypes, expected):
    roles, plan = _roles(stage, dtypes)
    assert set(roles) == expected
    padded, chunk = plan.layout.padded_numel, plan.layout.chunk_numel
    assert roles[Role.PARAMS].numel == padded and roles[Role.PARAMS].resident == (stage < 3)
    assert roles[Role.GRAD_SHARD].numel == chunk
    staged = stage >= 2 or dtypes is BF16
    assert (roles[Role.STAGING].view_of is None) == staged  # in place: a view of the gradient buffer
    assert roles[Role.STAGING].dtype == (dtypes.reduce if staged else dtypes.compute)
    if Role.MASTER in roles:
        assert roles[Role.MASTER].dtype == torch.float32 and roles[Role.MASTER].numel == chunk


def test_offload_moves_the_optimizer_side_to_the_host_in_the_plan():
    host = HostPlacement(pin=False)
    placements = Placements(device=DevicePlacement(CPU), optimizer=host, shard=host)
    roles, plan = _roles(3, FP32, placements=placements)
    assert {r for r, spec in roles.items() if spec.where is Where.HOST} == {Role.SHARD, Role.MASTER, Role.GRAD_SHARD}
    assert roles[Role.STAGING].where is Where.DEVICE
    assert plan.nbytes(Role.MASTER) == plan.layout.chunk_numel * 4


def test_buffer_states_are_checked_and_a_released_buffer_cannot_be_read():
    buffer = FlatBuffer(6, torch.float32, CPU, allocate=False, name="staging")
    assert buffer.state is BufferState.RELEASED
    with pytest.raises(RuntimeError, match="staging was read while released"):
        buffer.data
    buffer.allocate()
    assert buffer.data.abs().sum() == 0  # zeroed
    view = buffer.view(2, 3)
    buffer.start_collective()
    assert buffer.state is BufferState.IN_FLIGHT
    with pytest.raises(AssertionError, match="cannot free from in flight"):
        buffer.free()
    with pytest.raises(AssertionError, match="cannot allocate from in flight"):
        buffer.allocate()
    buffer.end_collective()
    view.fill_(2.0)
    buffer.free()
    assert buffer.storage_tensor.untyped_storage().size() == 0
    with pytest.raises(AssertionError, match="cannot end a collective from released"):
        buffer.end_collective()
    buffer.allocate(zero=False)
    assert view.untyped_storage().size() == 6 * 4  # views made before stay attached across free/allocate


def _train(stage: int, placements: Placements | None, steps: int = 3) -> list[torch.Tensor]:
    model = Net()
    runtime = build_runtime(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model,
        ZeroConfig(stage=stage, bucket_size_mb=1e-4),
        process_group=None,
        init_fn=None,
        device=None,
        placements=placements,
    )
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 6)).backward()
        runtime.clip_grad_norm_(0.5, 2.0, False)
        runtime.step({})
        runtime.zero_grad(True)
    runtime.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_recording_placement_for_the_optimizer_side_trains_the_same_numbers(stage):
    """A placement double behind the optimizer's side (and stage 3's shard): the same numbers as without offload,
    bit for bit (the optimizer steps the same fp32 values), and the double allocated exactly the planned buffers."""
    plain = _train(stage, None)
    recording = RecordingPlacement()
    placements = Placements(device=DevicePlacement(CPU), optimizer=recording, shard=recording)
    placed = _train(stage, placements)
    for a, b in zip(plain, placed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    model = Net()
    runtime = build_runtime(torch.optim.AdamW(model.parameters()), model, ZeroConfig(stage=stage, bucket_size_mb=1e-4),
                            process_group=None, init_fn=None, device=None, placements=placements)
    planned = [(spec.numel, spec.dtype) for bucket in runtime.partition.buckets for spec in bucket.plan.buffers
               if spec.side in ("optimizer", "shard") and spec.view_of is None]
    assert recording.created[-len(planned):] == planned
    assert recording.releases > 0 and recording.restores > 0  # transient buffers (gradient shard) came and went


def test_the_reduction_order_launches_complete_buckets_in_order_with_a_bounded_number_in_flight():
    """The one order the reducer runs and the estimator replays: a later bucket complete before an earlier one
    waits for it; launching beyond ``max_in_flight`` completes the oldest first; the end launches the rest."""
    order = ReductionOrder(["a", "b", "c", "d"], max_in_flight=2)
    complete = {"b"}
    assert list(order.ready(lambda x: x in complete)) == []  # "a" is not in: nothing may overtake it
    complete |= {"a", "c"}
    events = []
    for bucket in order.ready(lambda x: x in complete):
        if order.full:
            events.append(("complete", order.oldest()[0]))
            order.completed()
        order.launched(bucket, f"handle-{bucket}")
        events.append(("launch", bucket))
    assert events == [("launch", "a"), ("launch", "b"), ("complete", "a"), ("launch", "c")]
    assert list(order.rest()) == ["d"] and [b for b, _ in order.in_flight] == ["b", "c"]
    with pytest.raises(AssertionError, match="no reduction outstanding"):
        order.restart()
