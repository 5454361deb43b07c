"""The model's tensors as a portable checkpoint sees them (:mod:`zero.checkpoint.portable`): each ``state_dict``
tensor once, managed in a bucket or kept whole, with its other names (tied parameters); shared by the save
(:mod:`zero.checkpoint.save`) and the load (:mod:`zero.checkpoint.load`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zero.checkpoint import tensorfile
from zero.optimizer import ZeroOptimizer
from zero.runtime.buffers.bucket import ParamSlot


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

    def record(self) -> dict[str, Any]:
        """Its ``tensors`` entry in the metadata (:class:`zero.checkpoint.schema.TensorRecord`), pieces to come."""
        trainable = self.slot is not None and self.slot.bucket.trainable
        return {
            "kind": self.kind, "shape": list(self.tensor.shape), "dtype": tensorfile.dtype_code(self.saved_dtype),
            "trainable": trainable, "group": self.slot.group_index if trainable else -1, "pieces": [],
        }


def describe(model: torch.nn.Module, opt: ZeroOptimizer) -> tuple[list[ModelTensor], dict[str, str]]:
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


def checked(model: torch.nn.Module, optimizer: Any) -> ZeroOptimizer:
    if not isinstance(optimizer, ZeroOptimizer):
        raise ValueError(f"save_checkpoint/load_checkpoint take the ZeroOptimizer that trains the model, got a "
                         f"{type(optimizer).__name__}; wrap it in zero.ZeroOptimizer first")
    if optimizer.module is not model:
        raise ValueError("this ZeroOptimizer was built for another model; pass the model it wraps")
    return optimizer
