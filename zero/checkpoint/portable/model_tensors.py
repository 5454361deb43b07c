"""The model's tensors as a portable checkpoint sees them (:mod:`zero.checkpoint.portable`): each ``state_dict``
tensor once, managed in a bucket or kept whole, with its other names (tied parameters); a pipeline rank's parts
(:func:`parts_of`: their names together); what the checkpoint reads and calls of the ``ZeroOptimizer``
(:class:`Checkpointable`); the ranks a checkpoint spans (:class:`Grid`: dp, times tp for a tensor-parallel model, times
pp for a pipeline's parts). Shared by the save (:mod:`zero.checkpoint.portable.save`) and the load
(:mod:`zero.checkpoint.portable.load`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

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
    part: int = 0  # which of the rank's parts (:func:`parts_of`) holds it

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


Model = torch.nn.Module | Sequence[torch.nn.Module]  # a model, or a pipeline rank's parts


def parts_of(model: Model, opt: Checkpointable) -> list[torch.nn.Module]:
    """The modules whose ``state_dict`` names are this rank's checkpoint names: ``model`` itself; or a pipeline rank's
    parts, given as a list, or as the ``nn.ModuleList`` of them that the optimizer wraps once it knows its pipeline
    (a ``zero.pipelining.PipelineStage``, or ``mesh=`` with a ``"pp"`` dimension): each part's own names, without
    the ModuleList's index (parts cut as ``zero.models.pipeline_parts`` and torchtitan cut them keep the whole model's
    names)."""
    if isinstance(model, (list, tuple)):
        return list(model)
    if isinstance(model, torch.nn.ModuleList) and opt.runtime.pipeline.group is not None:
        return list(model)
    return [model]


def describe(parts: list[torch.nn.Module], opt: Checkpointable) -> tuple[list[ModelTensor], dict[str, str]]:
    """The ``state_dict`` tensors of ``parts`` by first name, and their other names (tied parameters):
    ``{alias: name}``. A module in two parts of this rank (the same tensor under the same name) counts once."""
    slot_of = {id(s.param): s for b in opt.buckets for s in b.slots}
    params = {id(p) for part in parts for p in part.parameters()}
    model_tensors: list[ModelTensor] = []
    first: dict[int, str] = {}
    named: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for index, part in enumerate(parts):
        for name, value in part.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"the model's state_dict entry {name!r} is a {type(value).__name__}, not a tensor; "
                                 "save it through extra= instead")
            if name in named:
                if named[name] is value:
                    continue
                raise ValueError(f"two parts of the model on this rank hold different tensors named {name!r}; cut "
                                 "the model into parts that keep the whole model's names (as "
                                 "zero.models.pipeline_parts does), each name one tensor")
            named[name] = value
            if id(value) in first:
                aliases[name] = first[id(value)]
                continue
            first[id(value)] = name
            slot = slot_of.get(id(value))
            model_tensors.append(ModelTensor(name, value, "param" if id(value) in params else "buffer", slot, index))
    missing = [s.name for s in slot_of.values() if id(s.param) not in first]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are managed by the optimizer but not in model.state_dict()")
    return model_tensors, aliases


def slot_names(model_tensors: list[ModelTensor]) -> dict[int, str]:
    """Each managed parameter's name in the checkpoint, by ``id`` of its slot (a slot's own name is the optimizer's
    module's: under a ModuleList of pipeline parts, with the part's index before it)."""
    return {id(h.slot): h.name for h in model_tensors if h.slot is not None}


def checked(model: Model, optimizer: Any) -> Checkpointable:
    """``optimizer``, if it is the ZeroOptimizer that trains ``model`` (known by its runtime): its module, or the list
    of the parts it wraps (the module itself, or the parts of the ``nn.ModuleList`` it wraps, in order)."""
    if not isinstance(getattr(optimizer, "runtime", None), Runtime):
        raise ValueError(f"save_checkpoint/load_checkpoint take the ZeroOptimizer that trains the model, got a "
                         f"{type(optimizer).__name__}; wrap it in zero.ZeroOptimizer first")
    if isinstance(model, (list, tuple)):
        module = optimizer.module
        wrapped = list(module) if isinstance(module, torch.nn.ModuleList) else [module]
        if len(model) != len(wrapped) or any(a is not b for a, b in zip(model, wrapped)):
            raise ValueError("these parts are not the ones this ZeroOptimizer wraps; pass its model, or the list of "
                             "the parts of the nn.ModuleList it wraps, in the same order")
    elif optimizer.module is not model:
        raise ValueError("this ZeroOptimizer was built for another model; pass the model it wraps")
    return optimizer


@dataclass
class Grid:
    """The ranks a checkpoint spans: the dp group zero shards over (``dp``) times, for a tensor-parallel model, the
    model's tp group (``tp``; else None), times, for a pipeline's part, the pipeline's pp group (``pp``; else None).
    Rank ``(pp rank x dp + dp rank) x tp + tp rank`` of ``pp x dp x tp`` writes that part, so that two ranks never
    write the same file."""

    dp: Communicator
    tp: Communicator | None = None
    pp: Communicator | None = None

    @staticmethod
    def of(opt: Checkpointable) -> "Grid":
        tensor_parallel, pipeline = opt.runtime.tensor_parallel, opt.runtime.pipeline
        return Grid(opt.comm, tensor_parallel.comm if tensor_parallel.size > 1 else None,
                    pipeline.comm if pipeline.size > 1 else None)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.world_size

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    @property
    def pp_size(self) -> int:
        return 1 if self.pp is None else self.pp.world_size

    @property
    def pp_rank(self) -> int:
        return 0 if self.pp is None else self.pp.rank

    @property
    def rank(self) -> int:
        return (self.pp_rank * self.dp.world_size + self.dp.rank) * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.pp_size * self.dp.world_size * self.tp_size

    def everywhere(self, fn: Callable[[], Any], what: str, *, share: bool = False) -> Any:
        """:meth:`zero.comm.communicator.Communicator.everywhere` over dp, then over tp, then over pp: an error on any
        rank of the grid is raised on all of them. With ``share``: every rank's result, by its rank in the grid."""
        def dp_tp() -> Any:
            if self.tp is None:
                return self.dp.everywhere(fn, what, share=share)
            outcome = self.tp.everywhere(lambda: self.dp.everywhere(fn, what, share=share), what, share=share)
            if not share:
                return outcome
            return [outcome[t][d] for d in range(self.dp.world_size) for t in range(self.tp_size)]

        if self.pp is None:
            return dp_tp()
        outcome = self.pp.everywhere(dp_tp, what, share=share)
        return [result for stage in outcome for result in stage] if share else outcome

    def over_pp(self, value: Any, what: str) -> list[Any]:
        """Every pp rank's ``value`` (JSON), by pp rank, heard by this rank (``[value]`` without a pipeline)."""
        return [value] if self.pp is None else self.pp.all_gather_json(value, what=what)
