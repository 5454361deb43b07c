"""Every tensor a ``ZeroOptimizer`` owns, by model-state kind (``model_state_bytes``) and named for the memory
profiler (``named_memory``)."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils._pytree import tree_leaves

from zero.memory import MemoryItem, ModelStateBytes, storage_bytes
from zero.runtime.runtime import Runtime

KINDS = ("parameters", "gradients", "optimizer_state")


def model_state_bytes(runtime: Runtime) -> ModelStateBytes:
    """Bytes held in parameters, gradients and optimizer state (unique storages; fp32 master weights count as
    optimizer state, as in the ZeRO paper)."""
    kinds: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}
    for bucket in runtime.buckets:
        for kind, item in bucket.roles():
            kinds[kind].append(item.tensor)
    for kind, item in _unbucketed(runtime):
        kinds[kind].append(item.tensor)
    return ModelStateBytes(*(storage_bytes(kinds[k]) for k in KINDS))


def named_memory(runtime: Runtime) -> list[MemoryItem]:
    """Each bucket buffer by its role (parameters, master weights, gradient buffers and shards, buffers of
    collectives in flight), frozen parameters, the wrapped optimizer's state. Views of one storage may appear
    more than once; the first name wins."""
    gathering = runtime.gatherer.gathering_buckets()
    items = [item for b in runtime.buckets for _, item in b.roles(gathering=b in gathering)]
    return items + [item for _, item in _unbucketed(runtime)]


def _unbucketed(runtime: Runtime) -> Iterator[tuple[str, MemoryItem]]:
    """Frozen parameters kept whole (stages 0-2) and the wrapped optimizer's state."""
    for name, p in runtime.partition.frozen:
        yield "parameters", MemoryItem("parameters", "frozen", p, name.rpartition(".")[0])
    states = [inner.optimizer.state for inner in runtime.inners]
    whole = runtime.whole_parameter_step.owned()
    for bucket in runtime.trainable_buckets:  # (partial offload: some buckets' state is on the host, some not)
        host = bucket.placements.optimizer.where.suffix if bucket.offloaded else ""
        held = [piece.tensor for piece in bucket.pieces]  # the flat path's
        held += [stand_in for slot, stand_in in whole if slot.bucket is bucket]  # the whole path's
        for tensor in held:
            for key, value in (v for state in states for v in state.get(tensor, {}).items()):
                for leaf in tree_leaves(value):  # (a tensor, or lists of them: SOAP's per-dimension factors)
                    if isinstance(leaf, torch.Tensor):
                        yield "optimizer_state", MemoryItem("optimizer_state", key + host, leaf)
