"""What a :class:`~zero.comm.communicator.Communicator` needs of its process group besides collectives: the device
it sends from, a refusal of a launcher's world without a process group, and aborting the group after a failed
collective."""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch
import torch.distributed as dist


def abort_group(group: dist.ProcessGroup) -> None:
    """Abort ``group`` after a failed collective, so that the process can exit.

    ``ProcessGroup.abort()`` (public) aborts NCCL's communicators, but gloo's is a no-op
    (torch 2.13): its worker thread stays blocked in the failed collective until the group's
    own timeout (30 min by default), and the group's destructor joins that thread, so
    ``destroy_process_group()`` or interpreter exit would wait that long. One reference to
    the group that is never released keeps that destructor from running, and the process
    exits at once. (``distributed_c10d._abort_process_group`` does no better for gloo.)
    """
    with contextlib.suppress(RuntimeError):  # a backend that cannot abort: the error to raise is the caller's
        group.abort()
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def resolve_device(device: torch.device | str | None, backend: str) -> torch.device:
    """The device a communicator sends from: ``device``, else the current GPU with NCCL, else the CPU."""
    if device is None:
        device = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"the process group's backend is nccl, which moves only CUDA tensors, but the device is {device}. "
            "Move the model to the GPU (model.cuda()) before wrapping it, or use the gloo backend for CPU training."
        )
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_launcher_world() -> None:
    """Refuse world size 1 when a launcher (torchrun) started several processes."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        raise ValueError(
            f"this script runs under a launcher with WORLD_SIZE={world} but never called "
            "torch.distributed.init_process_group(), so every rank would train its own unrelated model. "
            "Call torch.distributed.init_process_group() before building the ZeroOptimizer, or pass process_group=."
        )


MESH_DIMENSIONS = ("dp", "pp", "tp")  # a mesh's named dimensions ZeroOptimizer reads (tp: from the model)


def data_parallel_group(group: dist.ProcessGroup | None, mesh: object | None) -> dist.ProcessGroup | None:
    """The data-parallel group, given as a process group or as FSDP2 spells it, a 1-D ``DeviceMesh``
    (``mesh=mesh["dp"]``) or a mesh with a ``"dp"`` dimension; not both."""
    if mesh is None:
        return group
    if group is not None:
        raise ValueError("pass the data-parallel ranks once: process_group=... or mesh=..., not both")
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if getattr(mesh, "ndim", None) == 1:  # whatever its name, as FSDP2 takes it (one over tp is refused later)
        return mesh.get_group()
    if "dp" not in names or set(names) - set(MESH_DIMENSIONS):
        raise ValueError(
            f"mesh must be the data-parallel dimension of a device mesh (mesh['dp']) or a mesh whose dimensions are "
            f"named among {MESH_DIMENSIONS} with a 'dp' one, got {mesh}; zero shards over 'dp', adds the clip norm "
            "up over 'pp' (pipeline parallelism), and finds the tensor-parallel dimension from the model's DTensor "
            "parameters"
        )
    return mesh["dp"].get_group()


def pipeline_group(mesh: object | None) -> dist.ProcessGroup | None:
    """The pipeline's group of a mesh with a ``"pp"`` dimension besides others (``None`` without one)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["pp"].get_group() if "pp" in names and len(names) > 1 else None
