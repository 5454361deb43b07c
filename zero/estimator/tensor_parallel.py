"""Pricing a tensor-parallel run per rank (issue 47): ``estimate(work, world_size=dp * tp, tensor_parallel=tp)`` of a
:class:`~zero.estimator.Workload` given ``parallelize(model, tp_mesh)``, the function the training script splits the
model with (``parallelize_module(model, tp_mesh, plan)``).

torch's tensor parallelism needs a world: ``parallelize_module`` and the DTensors it makes read the rank's place on
the mesh, and redistribute through the mesh's process groups. The estimator never touches the caller's process-group
state (the caller may be a rank of a real world, with a default group of its own), so a tensor-parallel estimate is
priced in a child process of its own, which makes itself one rank of torch's fake process group of ``dp * tp`` ranks
(collectives return at once and move nothing), builds the ``(dp, tp)`` mesh, and runs the ordinary estimate there on
the split model: its DTensor parameters' *local* tensors are what the runtime packs, shards over dp, reduces, gathers
and steps (``zero.runtime.buffers.local_tensor``), so the buckets, units and optimizer steps priced are the runtime's
own over those; the traced step (:mod:`zero.estimator.timeline`) counts each DTensor's local storage and records the
local operators DTensor runs (sequence parallelism's all-gathers and reduce-scatters, the gathered activations, the
``Partial`` gradients summed over tp), so the activations sequence parallelism splits are counted as split.

The child is forked when this process has no default process group (the workload's functions, lambdas included, are
the caller's own), and spawned (a fresh interpreter) when it has one, since a forked child would inherit a world it
must not use: then the workload's functions must be importable (defined at a module's top level) to reach it.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from zero.estimator.traffic import communication_policy, secondary_size

MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """A run's ranks as a ``(dp, tp)`` mesh, rank ``r`` at ``divmod(r, tp)`` (``init_device_mesh``'s row-major
    order: the tp ranks of one dp position are consecutive)."""

    world_size: int
    tp: int

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    def coordinate(self, rank: int) -> tuple[int, int]:
        """``(dp position, tp position)`` of global ``rank``."""
        return divmod(rank, self.tp)


def check_tensor_parallel(parallelize: Any, world_size: int, tp: Any, config: Any) -> MeshShape | None:
    """The mesh of a tensor-parallel estimate (``None`` without tensor parallelism), or a ``ValueError`` for what
    does not compose: a ``tensor_parallel`` that does not divide ``world_size``, a workload without its
    ``parallelize`` (or with one, and no degree), and what the runtime refuses under tensor parallelism (offload to
    disk, hierarchical communication), with the runtime's own cause."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel must be a whole number >= 1 (the tp degree), got {tp!r}")
    if parallelize is None:
        if tp > 1:
            raise ValueError(f"tensor_parallel={tp} needs the workload's parallelize function: Workload(build, loss, "
                             "batch, parallelize=lambda model, tp_mesh: parallelize_module(model, tp_mesh, plan)), "
                             "the one the training script splits the model with")
        return None
    if world_size % tp:
        raise ValueError(f"world_size {world_size} is not a multiple of tensor_parallel {tp}: a tensor-parallel run "
                         "has dp x tp ranks (world_size = dp * tp)")
    policy, group = communication_policy(config.communication, world_size // tp)
    levels = group != world_size // tp or secondary_size(policy, world_size // tp) > 0  # (as the runtime's levels)
    refused = ["offload to disk" if config.offload.pages else None,
               "hierarchical communication (HSDP, hpZ)" if levels else None]
    refused = [r for r in refused if r]
    if refused:
        raise ValueError(f"zero does not yet compose tensor parallelism with {refused[0]}; with a model split by "
                         "parallelize_module, offload to 'cpu' at most, and use flat communication "
                         "(docs/parallelism.md)")
    return MeshShape(world_size, tp)


def price_in_child(price: Callable[..., Any], workload: Any, mesh: MeshShape, rank: int, kwargs: dict[str, Any]) -> Any:
    """``price(workload, **kwargs)`` (``zero.estimate``) run in a child process as global ``rank`` of a fake world
    of ``mesh``'s shape, on the workload made again there from its spec (see the module docstring); what it returns,
    or the error it raised, raised here."""
    context = multiprocessing.get_context("spawn" if dist.is_available() and dist.is_initialized() else "fork")
    receive, send = context.Pipe(duplex=False)
    args = (send, price, type(workload), workload.spec(), mesh, rank, kwargs, torch.get_num_threads())
    child = context.Process(target=_child, args=args, name="zero-estimate-tp")
    try:
        child.start()
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise ValueError(
            "a tensor-parallel estimate inside a process that already has a default process group runs in a fresh "
            f"interpreter, which the workload's functions must reach by import ({err}); define build, loss, batch, "
            "parallelize and the optimizers at a module's top level, or estimate before init_process_group"
        ) from None
    send.close()
    try:
        kind, value = receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"the estimator's tensor-parallel child process died (exit code {child.exitcode}) before "
                           "it priced the step") from None
    finally:
        receive.close()
    child.join()
    if kind == "error":
        raise value
    return value


def _child(send: Any, price: Callable[..., Any], kind: type, spec: dict[str, Any], mesh: MeshShape, rank: int,
           kwargs: dict[str, Any], threads: int) -> None:
    """The child: rank ``rank`` of a fake world, the ``(dp, tp)`` mesh, the estimate; sends ``(kind, value)``."""
    try:
        torch.set_num_threads(threads)  # (the CPU bf16 matmul's scratchpad is priced per thread)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh.world_size)
        workload = kind(**spec)
        workload.mesh = init_device_mesh(workload.device_type(), (mesh.dp, mesh.tp), mesh_dim_names=MESH_DIMS)
        result: tuple[str, Any] = ("ok", price(workload, **kwargs))
    except BaseException as err:  # (sent back whole when it pickles, else as text)
        result = ("error", err if _pickles(err) else RuntimeError("".join(traceback.format_exception(err))))
    send.send(result)
    send.close()


def _pickles(value: Any) -> bool:
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return False
    return True
