"""Tensor parallelism around the data-parallel reduction: what the tp dimension adds to gradients and their norm.

A model split by torch's ``parallelize_module`` over a tp mesh, with ``zero`` sharding over the dp group, holds
three kinds of parameters (``zero.runtime.buffers.local_tensor``):

* ``Shard(d)`` DTensors: each tp rank holds a disjoint slice; its gradient is that slice's, whole.
* ``Replicate()`` DTensors (norms under ``SequenceParallel``): every tp rank holds all of it, but applied to a tp
  rank's share of the activations its gradient comes out ``Partial``: a sum over tp still to be taken. It is taken
  as the gradient arrives (:meth:`TensorParallel.make_whole`: one all-reduce over tp), so the dp reduction, clipping
  and the step see the whole gradient, as FSDP2 does before its reduce-scatter.
* plain parameters: replicated over tp, which is right only if their gradients are equal on every tp rank. A plain
  parameter applied to a tp rank's share of the heads (a per-head q/k norm, as in Qwen3) gets a different gradient
  on each, and training would drift silently; the first reduction compares them over tp
  (:meth:`TensorParallel.observe`) and refuses such a parameter by name, with the fix.

The gradient norm counts a tp-sharded parameter's slices once each (their squares summed over tp) and a replicated
one once (:meth:`TensorParallel.sum_over_tp`). Without a tp dimension, :class:`NoTensorParallel` (a null object)
does nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zero.comm.communicator import Communicator
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.buffers.local_tensor import check_placements, whole_over_tp

REPLICA_RTOL = 1e-4  # plain parameters' gradients may differ over tp by rounding, never by more


class NoTensorParallel:
    """No tp dimension: gradients are whole as they arrive, norms are summed over dp only."""

    size = 1

    def make_whole(self, slot: ParamSlot) -> None:
        pass

    def observe(self, bucket: Bucket, grads: torch.Tensor) -> None:
        pass

    def check_round(self, dp: Communicator) -> None:
        pass

    def check_agree(self, value: object, what: str) -> None:
        """Raise unless every tp rank has the same ``value`` (here: no tp ranks to disagree)."""

    def whole(self, slot: ParamSlot, local: torch.Tensor) -> torch.Tensor:
        """The global tensor of which ``local`` (in the slot's local shape) is this rank's part: here itself."""
        return local

    def local_part(self, slot: ParamSlot, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the global tensor ``whole`` (the inverse of :meth:`whole`): here itself."""
        return whole

    def sum_over_tp(self, sharded: torch.Tensor, replicated: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The gradient norm's partial sum (``|g| ** p`` summed, or the maximum for the inf-norm) of tp-sharded
        pieces and of replicated ones made one: here there are no tp-sharded pieces."""
        return _combine(sharded, replicated, norm_type)


class TensorParallel(NoTensorParallel):
    """The tp dimension of a tensor-parallel model: its communicator, and the first reduction's check."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.size = comm.world_size
        self.checked: set[str] = set()  # plain parameters compared over tp already
        self.compared = False  # some were compared in this round
        self.mismatched: list[str] = []  # ... and found different on this rank's tp group

    def make_whole(self, slot: ParamSlot) -> None:
        """A ``Partial`` gradient (a replicated DTensor applied to sharded activations) summed over tp, in place."""
        grad = slot.param.grad
        if grad is None or not slot.local.partial_grad(grad):
            return
        if whole_over_tp(grad, slot.local.placements):
            local = slot.local.local_grad(grad)
            self.comm.all_reduce(local, what=f"all-reduce over tp of the gradient of {slot.name!r}").wait()
        else:  # (any other placement change: torch's own redistribution)
            local = grad.redistribute(placements=slot.local.placements)._local_tensor
        slot.grad = local

    def observe(self, bucket: Bucket, grads: torch.Tensor) -> None:
        """Before the bucket's first dp reduction: the plain parameters' local gradients (their spans of ``grads``,
        the staged buffer) compared over tp, the largest and smallest of each element in one all-reduce."""
        plain = [s for s in bucket.slots if not s.local.tensor_parallel and s.name not in self.checked]
        if not plain:
            return
        self.compared = True
        spans = [grads.narrow(0, s.span.offset, s.span.numel).float() for s in plain]
        both = torch.cat([torch.cat(spans), -torch.cat(spans)])
        self.comm.all_reduce(both, op="max", what=f"all-reduce over tp comparing the gradients of {bucket}").wait()
        highest, negated_lowest = both.chunk(2)
        pairs = list(zip(*(t.split([span.numel() for span in spans]) for t in (highest, negated_lowest))))
        spread = torch.stack([(hi + neg_lo).max() for hi, neg_lo in pairs])  # max - min over tp, per element
        scale = torch.stack([torch.maximum(hi.abs().max(), neg_lo.abs().max()) for hi, neg_lo in pairs])
        differs = (spread > REPLICA_RTOL * scale).tolist()  # (one host read, in the first reduction only)
        self.checked.update(slot.name for slot in plain)
        self.mismatched += [slot.name for slot, bad in zip(plain, differs) if bad]

    def check_round(self, dp: Communicator) -> None:
        """After the round's reductions: refuse, on every rank, a plain parameter whose gradient differed over tp."""
        if not self.compared:
            return
        self.compared = False
        names = [n for found in dp.all_gather_json(self.mismatched, what="all-gather of the tp gradient check")
                 for n in found]
        self.mismatched = []
        if names:
            raise ValueError(
                f"zero: the gradient of the plain (non-DTensor) parameter {names[0]!r} differs across the "
                "tp ranks of this tensor-parallel model: it is applied to each tp rank's share of the activations "
                "(e.g. a per-head q/k norm), so its true gradient is their sum, and training it as replicated "
                "would drift apart silently. Declare it the torch way, as a replicated DTensor whose gradient "
                "torch sums over tp: parallelize its module with SequenceParallel(sequence_dim=<the sharded "
                "dimension>) (for per-head norms on (batch, seq, heads, head_dim) activations: sequence_dim=2)."
            )

    def check_agree(self, value: object, what: str) -> None:
        values = self.comm.all_gather_json(value, what=f"all-gather over tp of {what}")
        if any(v != values[0] for v in values):
            raise ValueError(
                f"the tp ranks disagree on {what}: their local tensors differ in size (a dimension that does not "
                "divide by the tp degree), so their buckets differ; split dimensions evenly over tp for this"
            )

    def whole(self, slot: ParamSlot, local: torch.Tensor) -> torch.Tensor:
        """A tp-sharded parameter's global tensor from every tp rank's ``local`` part (torch's all-gather over the tp
        mesh, uneven shards included; collective over tp); a replicated one's is ``local`` itself."""
        if not slot.local.tp_sharded:
            return local
        meta = slot.local.spec.tensor_meta  # (the global shape and stride)
        return DTensor.from_local(local, slot.local.mesh, slot.local.placements, run_check=False,
                                  shape=meta.shape, stride=meta.stride).full_tensor()

    def local_part(self, slot: ParamSlot, whole: torch.Tensor) -> torch.Tensor:
        if not slot.local.tp_sharded:
            return whole
        shape, offset = compute_local_shape_and_global_offset(whole.shape, slot.local.mesh, slot.local.placements)
        return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()

    def sum_over_tp(self, sharded: torch.Tensor, replicated: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The tp-sharded pieces' partial sum (or maximum) taken over tp as well; replicated pieces counted once."""
        op = "max" if norm_type == math.inf else "sum"
        self.comm.all_reduce(sharded, op=op, what="all-reduce over tp of the gradient norm").wait()
        return _combine(sharded, replicated, norm_type)


def _combine(sharded: torch.Tensor, replicated: torch.Tensor, norm_type: float) -> torch.Tensor:
    return torch.maximum(sharded, replicated) if norm_type == math.inf else sharded + replicated


def tensor_parallel_of(model: torch.nn.Module, dp: Communicator, timeout_s: float) -> NoTensorParallel:
    """The model's tp dimension, found from its DTensor parameters (:class:`NoTensorParallel` without any): every
    one on one 1-D mesh whose ranks meet the dp group in this rank alone (collective over that mesh)."""
    named = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if not named:
        return NoTensorParallel()
    mesh = named[0][1].device_mesh
    for name, p in named:
        check_placements(name, p)
        if p.device_mesh != mesh:
            raise ValueError(
                f"parameter {name!r} is a DTensor on mesh {p.device_mesh}, but {named[0][0]!r} is on {mesh}; zero "
                "composes with tensor parallelism over one tp mesh: parallelize the whole model over the same "
                "mesh['tp']."
            )
    group = mesh.get_group()
    if dp.group is not None:
        overlap = set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(dp.group))
        if overlap != {dist.get_rank()}:
            raise ValueError(
                f"the model's tp mesh (ranks {sorted(dist.get_process_group_ranks(group))}) overlaps the data-parallel "
                f"group (ranks {sorted(dist.get_process_group_ranks(dp.group))}); on a dp x tp mesh pass the dp "
                "dimension: ZeroOptimizer(opt, model, mesh=mesh['dp']) (or process_group=mesh['dp'].get_group())."
            )
    return TensorParallel(Communicator(group, timeout_s, device=dp.device))
