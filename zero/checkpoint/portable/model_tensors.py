"""The model's tensors as a portable checkpoint sees them (:mod:`zero.checkpoint.portable`): each ``state_dict``
tensor once, managed in a bucket or kept whole, with its other names (tied parameters); and what the checkpoint
reads and calls of the ``ZeroOptimizer`` (:class:`Checkpointable`); the ranks a checkpoint spans (:class:`Grid`: dp,
times tp for a tensor-parallel model). Shared by the save (:mod:`zero.checkpoint.portable.save`) and the load
(:mod:`zero.checkpoint.portable.load`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

import zero.checkpoint.portable.tensorfile as tensorfile
from zero.checkpoint.portable.boxes import Box, local_box
from zero.comm.communicator import Communicator
from zero.config import ZeroConfig
from zero.runtime.buffers.bucket import Bucket, ParamSlot
from zero.runtime.runtime import Runtime


class Checkpointable(Protocol):
    """What a portable checkpoint reads and calls of a :class:`zero.ZeroOptimizer` (the facade, :mod:`zero.optimizer`,
    sits above the checkpoints and is not imported: it saves and loads its own per-rank shard through
    :mod:`zero.checkpoint.shard`)."""

    module: torch.nn.Module
    config: ZeroConfig
    runtime: Runtime
    comm: Communicator
    param_groups: list[dict[str, Any]]

    @property
    def buckets(self) -> list[Bucket]: ...

    @property
    def loss_scaler(self) -> Any: ...

    def prepare_for_checkpoint(self) -> None: ...

    def finish_load(self, inner_state: dict[str, Any] | list[dict[str, Any]], loss_scale: dict[str, Any] | None,
                    buckets: list[Bucket] | None = None) -> None: ...


@dataclass
class ModelTensor:
    """One tensor of the model's ``state_dict``: managed in a bucket (``slot``) or kept whole."""

    name: str
    tensor: torch.Tensor
    kind: str  # "param" or "buffer"
    slot: ParamSlot | None = None

    @property
    def saved_dtype(self) -> torch.dtype:
        if self.slot is None:
            return self.tensor.dtype
        bucket = self.slot.bucket
        return bucket.master.dtype if bucket.trainable else bucket.shard.dtype

    @property
    def box(self) -> Box | None:
        """The box of its global shape this rank holds (a DTensor's local tensor), or None: all of it."""
        return local_box(self.tensor)

    def record(self, boxes: bool = False) -> dict[str, Any]:
        """Its ``tensors`` entry in the metadata (:class:`zero.checkpoint.portable.schema.TensorRecord`), pieces (or
        with ``boxes``, format 4's boxes) to come."""
        trainable = self.slot is not None and self.slot.bucket.trainable
        return {
            "kind": self.kind, "shape": list(self.tensor.shape), "dtype": tensorfile.dtype_code(self.saved_dtype),
            "trainable": trainable, "group": self.slot.group_index if trainable else -1,
            ("boxes" if boxes else "pieces"): [],
        }


def describe(model: torch.nn.Module, opt: Checkpointable) -> tuple[list[ModelTensor], dict[str, str]]:
    """The model's ``state_dict`` tensors by first name, and its other names (tied parameters): ``{alias: name}``."""
    slot_of = {id(s.param): s for b in opt.buckets for s in b.slots}
    params = {id(p) for p in model.parameters()}
    model_tensors: list[ModelTensor] = []
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"the model's state_dict entry {name!r} is a {type(value).__name__}, not a tensor; "
                             "save it through extra= instead")
        if id(value) in first:
            aliases[name] = first[id(value)]
            continue
        first[id(value)] = name
        slot = slot_of.get(id(value))
        model_tensors.append(ModelTensor(name, value, "param" if id(value) in params else "buffer", slot))
    missing = [s.name for s in slot_of.values() if s.name not in first.values()]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are managed by the optimizer but not in model.state_dict()")
    return model_tensors, aliases


def checked(model: torch.nn.Module, optimizer: Any) -> Checkpointable:
    """``optimizer``, if it is the ZeroOptimizer that trains ``model`` (known by its runtime)."""
    if not isinstance(getattr(optimizer, "runtime", None), Runtime):
        raise ValueError(f"save_checkpoint/load_checkpoint take the ZeroOptimizer that trains the model, got a "
                         f"{type(optimizer).__name__}; wrap it in zero.ZeroOptimizer first")
    if optimizer.module is not model:
        raise ValueError("this ZeroOptimizer was built for another model; pass the model it wraps")
    return optimizer


@dataclass
class Grid:
    """The ranks a checkpoint spans: the dp group zero shards over (``dp``) times, for a tensor-parallel model, the
    model's tp group (``tp``; else None). Rank ``dp rank x tp degree + tp rank`` of ``dp x tp`` writes that part, so
    two tp ranks never write the same file."""

    dp: Communicator
    tp: Communicator | None = None

    @staticmethod
    def of(opt: Checkpointable) -> "Grid":
        tensor_parallel = opt.runtime.tensor_parallel
        return Grid(opt.comm, tensor_parallel.comm if tensor_parallel.size > 1 else None)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.world_size

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    @property
    def rank(self) -> int:
        return self.dp.rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.dp.world_size * self.tp_size

    def everywhere(self, fn: Callable[[], Any], what: str, *, share: bool = False) -> Any:
        """:meth:`zero.comm.communicator.Communicator.everywhere` over dp, then over tp: an error on any rank of the
        grid is raised on all of them. With ``share``: every rank's result, by its rank in the grid."""
        if self.tp is None:
            return self.dp.everywhere(fn, what, share=share)
        outcome = self.tp.everywhere(lambda: self.dp.everywhere(fn, what, share=share), what, share=share)
        if not share:
            return outcome
        return [outcome[t][d] for d in range(self.dp.world_size) for t in range(self.tp_size)]
