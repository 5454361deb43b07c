"""A managed parameter's *local* tensor: what this rank holds of it in memory, and what ``zero`` shards over dp.

A plain parameter is its own local tensor. A parameter that torch's tensor parallelism made (``parallelize_module``
over a tp mesh) is a ``DTensor``: its shape is the global one, its bytes are a local tensor (``_local_tensor``) laid
out by its placements (``Shard(d)``: this tp rank's slice of dimension ``d``; ``Replicate()``: all of it). ``zero``
packs, shards, gathers and steps the local tensor exactly as it would a plain parameter, and the module keeps seeing
the DTensor with its placements: only the local tensor's ``.data`` moves into the flat buffers.

Note: ``DTensor`` keeps one local tensor object for its whole life, and wrapping a local tensor in a new ``DTensor``
(:meth:`TensorParallelLocal.param_grad`) keeps that object too, so ``p.grad``'s local tensor *is* the view or guard
``zero`` put there, and identity checks on it (``grad is slot.grad_guard``) hold as for plain parameters.

:class:`PlainLocal` (a null object) and :class:`TensorParallelLocal` answer the same questions, so nothing downstream
asks whether a parameter is a DTensor.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from zero.runtime.buffers.sharded_grad import ShardedDTensorGrad, ShardedGrad
from zero.runtime.precision.parameters import dtensor_like, replace_parameters


class PlainLocal:
    """A plain parameter: its own local tensor, the same on every tp rank (if the model has a tp dimension)."""

    tp_sharded = False  # whether its local tensors over tp are disjoint pieces of it (their norms add up)
    tensor_parallel = False

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad

    def param_grad(self, local: torch.Tensor | None) -> torch.Tensor | None:
        return local

    def partial_grad(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` (``p.grad``) is still a partial sum over tp (to be summed before the dp reduction)."""
        return False


class TensorParallelLocal:
    """A DTensor parameter of a tensor-parallel model: the local tensor and the placements it has on its mesh."""

    tensor_parallel = True

    def __init__(self, param: DTensor):
        self.spec = param._spec
        self.mesh = param.device_mesh
        self.placements = tuple(param.placements)
        self.tp_sharded = any(isinstance(p, Shard) for p in self.placements)

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return param._local_tensor

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:
            return None
        if hasattr(grad, "wait"):  # an AsyncCollectiveTensor (a collective torch's TP left in flight)
            grad = grad.wait()
        return grad._local_tensor

    def param_grad(self, local: torch.Tensor | None) -> torch.Tensor | None:
        """``p.grad`` for a local gradient: a DTensor with the parameter's placements around the same object (around
        a guard, a guarded DTensor: :class:`~zero.runtime.buffers.sharded_grad.ShardedDTensorGrad`)."""
        if local is None:
            return None
        grad = DTensor(local, self.spec, requires_grad=False)
        if isinstance(local, ShardedGrad):
            grad.__class__ = ShardedDTensorGrad
        return grad

    def partial_grad(self, grad: torch.Tensor) -> bool:
        return tuple(grad.placements) != self.placements


def local_of(param: torch.Tensor) -> PlainLocal | TensorParallelLocal:
    """How ``zero`` reaches ``param``'s local tensor (a DTensor's is ``_local_tensor``; a plain one is itself)."""
    return TensorParallelLocal(param) if isinstance(param, DTensor) else PlainLocal()


def check_placements(name: str, param: DTensor) -> None:
    """Refuse placements torch's parallel styles do not produce for parameters (a ``Partial`` parameter, a strided
    shard of FSDP2's, several mesh dimensions): ``zero`` shards the local tensor over dp itself."""
    if param.device_mesh.ndim != 1:
        raise ValueError(
            f"parameter {name!r} is a DTensor on a {param.device_mesh.ndim}-D device mesh "
            f"{param.device_mesh.mesh_dim_names or ''}; zero expects parameters tensor-parallelized over one tp mesh "
            "(parallelize_module(model, mesh['tp'], plan)) and shards them over dp itself. Do not apply "
            "fully_shard() or distribute_tensor() over the dp dimension as well."
        )
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"parameter {name!r} has placement {placement} on its tp mesh; zero manages parameters that are "
                "Shard(dim) or Replicate() over tp (what ColwiseParallel, RowwiseParallel, SequenceParallel and "
                "PrepareModuleInput produce)."
            )


def whole_over_tp(grad: DTensor, placements: tuple) -> bool:
    """Whether ``grad`` differs from ``placements`` only by pending sums over tp (``Partial(sum)`` where the
    parameter is replicated or sharded): then an all-reduce of its local tensor makes it whole."""
    return all(g == p or (isinstance(g, Partial) and g.reduce_op == "sum" and isinstance(p, Replicate))
               for g, p in zip(grad.placements, placements))


def retype_parameters(model: torch.nn.Module, slots: list) -> None:
    """Mixed precision: a DTensor parameter whose local tensor now holds the compute dtype (a view of the bf16
    buffers) gets a new DTensor of that dtype around it, in every module holding it (a DTensor's dtype is fixed where
    it is made, so the parameter object cannot keep it, as a plain one does). The slot, the stage-3 guard and the
    ownership mark move to the new parameter; hooks are registered on it afterwards."""
    replaced: dict[int, DTensor] = {}
    for slot in slots:
        if slot.local.tensor_parallel and slot.tensor.dtype != slot.param.dtype:
            replaced[id(slot.param)] = slot.param = dtensor_like(slot.param, slot.tensor)
            slot.local = TensorParallelLocal(slot.param)
    replace_parameters(model, replaced)
