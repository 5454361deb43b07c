"""The stage plan: what exists per bucket, computed once, before anything is allocated.

For each bucket the plan lists its buffers (:class:`BufferSpec`: role, size, dtype, where it lives, whether
it is resident or allocated only while in use, or a view of another buffer) and the collectives that move
them. The runtime builds each bucket's buffers from its plan (``zero.runtime.buffers.bucket``), and the estimator
prices the same plans (``zero.estimator``), so the two cannot drift apart.

Sizes in elements: ``P`` is the bucket's padded size, ``C = P / num_shards`` one rank's chunk.

============  ======  ========  ===========  ===================================================================
role          size    dtype     where        what it holds
============  ======  ========  ===========  ===================================================================
params        P       compute   device       the full parameters (resident at stages 0-2; stage 3: while gathered)
shard         C       compute   shard side   stage 3: this rank's chunk of the parameters, the all-gather's source
master        C       master    optimizer    the chunk the optimizer steps, when it is not the parameters' own
                                             (mixed precision, or offloaded)
grads         P       compute   device       stages 0-1: persistent local gradients (``p.grad`` views)
staging       P       reduce    device       what the gradient collective reduces (a view of ``grads`` when the
                                             reduction is in place)
grad_shard    C       reduce    optimizer    this rank's reduced, averaged chunk (a view of ``staging``'s chunk
                                             when in place)
grad_carry    C       compute   device       stage 1: reduced gradients set aside while another pass adds to them
master_grad   C       master    optimizer    the optimizer's gradients when ``grad_shard`` cannot be them
secondary     P / g   compute   device       stage 3 with hpZ: this rank's chunk of the parameters within its group
                                             of ``g`` ranks, refreshed by forward's gathers, backward's source
============  ======  ========  ===========  ===================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from zero.precision import BufferDtypes
from zero.runtime.buffers.layout import BucketLayout
from zero.runtime.buffers.placement import Placements, Where


class Role(str, Enum):  # (a str: ``bucket.buffers["master"]`` reads as the table above)
    PARAMS = "params"
    SHARD = "shard"
    MASTER = "master"
    GRADS = "grads"
    STAGING = "staging"
    GRAD_SHARD = "grad_shard"
    GRAD_CARRY = "grad_carry"
    MASTER_GRAD = "master_grad"
    SECONDARY = "secondary"


SIDES = {Role.SHARD: "shard", Role.MASTER: "optimizer", Role.GRAD_SHARD: "optimizer", Role.MASTER_GRAD: "optimizer"}


@dataclass(frozen=True)
class BufferSpec:
    """One planned buffer of a bucket."""

    role: Role
    numel: int
    dtype: torch.dtype
    where: Where
    resident: bool  # allocated from construction on (else only while in use)
    view_of: Role | None = None  # a view of another buffer (no bytes of its own)

    @property
    def side(self) -> str:
        """Which of a run's placements holds it (``zero.runtime.buffers.placement.Placements``)."""
        return SIDES.get(self.role, "device")

    @property
    def nbytes(self) -> int:
        return 0 if self.view_of is not None else self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class StagePolicy:
    """What a ZeRO stage keeps per bucket (each stage class states it; see ``zero.runtime.stages``)."""

    number: int
    num_shards: int
    persistent_grads: bool  # local gradients in a persistent full-size buffer (stages 0-1)
    staged: bool  # reductions copy into a transient staging buffer in the reduce dtype
    carries: bool  # reduced gradients set aside while another pass accumulates (in-place stage 1)
    sharded_params: bool  # stage 3: only a chunk of the parameters persists
    reduce: str  # the gradient collective
    gather: str | None  # the parameters' collective: "after the step" (stages 1-2), "per unit" (stage 3)
    secondary_shards: int = 1  # hpZ: the group size of the secondary copy of the parameters (1: none)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket's buffers and collectives."""

    layout: BucketLayout
    dtypes: BufferDtypes
    trainable: bool
    buffers: tuple[BufferSpec, ...]
    reduce: str | None  # None: a frozen bucket sends no gradient
    gather: str | None

    def spec(self, role: Role) -> BufferSpec | None:
        return next((b for b in self.buffers if b.role is role), None)

    def has(self, role: Role) -> bool:
        """Whether the bucket has ``role``'s buffer (one of its own, or a view of another)."""
        return any(b.role is role for b in self.buffers)

    def nbytes(self, role: Role) -> int:
        """Bytes of ``role``'s buffer (0 when absent or a view of another)."""
        spec = self.spec(role)
        return spec.nbytes if spec is not None else 0


@dataclass(frozen=True)
class StagePlan:
    """Every bucket's plan on one rank, with the stage policy they follow."""

    policy: StagePolicy
    shard_index: int
    buckets: tuple[BucketPlan, ...]


def plan_bucket(
    policy: StagePolicy, layout: BucketLayout, dtypes: BufferDtypes, trainable: bool, placements: Placements
) -> BucketPlan:
    """The buffers of one bucket under ``policy`` (the decisions the module docstring's table describes)."""
    P, C = layout.padded_numel, layout.chunk_numel
    device, optimizer, shard_side = placements.device.where, placements.optimizer.where, placements.shard.where
    buffers = [BufferSpec(Role.PARAMS, P, dtypes.compute, device, resident=not policy.sharded_params)]
    if policy.sharded_params:
        buffers.append(BufferSpec(Role.SHARD, C, dtypes.compute, shard_side, resident=True))
    if policy.secondary_shards > 1:
        buffers.append(BufferSpec(Role.SECONDARY, P // policy.secondary_shards, dtypes.compute, device, resident=True))
    if not trainable:
        return BucketPlan(layout, dtypes, False, tuple(buffers), None, policy.gather)
    offloaded = placements.optimizer_offloaded
    if dtypes.separate_master or offloaded:
        buffers.append(BufferSpec(Role.MASTER, C, dtypes.master, optimizer, resident=True))
    if policy.persistent_grads:
        buffers.append(BufferSpec(Role.GRADS, P, dtypes.compute, device, resident=True))
    if policy.staged:
        buffers.append(BufferSpec(Role.STAGING, P, dtypes.reduce, device, resident=False))
        buffers.append(BufferSpec(Role.GRAD_SHARD, C, dtypes.reduce, optimizer, resident=False))
    else:  # reduced in place in the gradient buffer (the reduce dtype is the parameters')
        buffers.append(BufferSpec(Role.STAGING, P, dtypes.compute, device, resident=True, view_of=Role.GRADS))
        buffers.append(BufferSpec(Role.GRAD_SHARD, C, dtypes.compute, device, resident=True, view_of=Role.GRADS))
        if policy.carries:
            buffers.append(BufferSpec(Role.GRAD_CARRY, C, dtypes.compute, device, resident=False))
    # the optimizer's own gradients: another dtype, or an offloaded step whose gradient shard is on the device
    if dtypes.reduce != dtypes.master or (offloaded and not policy.staged):
        buffers.append(BufferSpec(Role.MASTER_GRAD, C, dtypes.master, optimizer, resident=False))
    return BucketPlan(layout, dtypes, True, tuple(buffers), policy.reduce, policy.gather)
