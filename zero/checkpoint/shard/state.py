"""One rank's optimizer shard as a ``state_dict`` (``ZeroOptimizer.state_dict`` / ``load_state_dict``): the header
of ``shard_header``, the wrapped optimizer's state over this rank's pieces (``"optimizer"``; with several optimizers
or one stepped whole, ``"optimizers"``: each one's state over its pieces or over the whole parameters this rank
owns), the fp32 master chunks under mixed precision, and the fp16 loss scale."""

from __future__ import annotations

from typing import Any

import torch

from zero.checkpoint.shard import header as shard_header
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.buffers.plan import Role
from zero.runtime.runtime import Runtime


def one_flat(runtime: Runtime) -> bool:
    """Whether the runtime wraps one elementwise optimizer (the shard's original layout: ``"optimizer"``)."""
    return len(runtime.inners) == 1 and not runtime.inners[0].whole


def header_of(runtime: Runtime) -> dict[str, Any]:
    single = one_flat(runtime)
    return shard_header.header(
        stage=runtime.config.stage,
        world_size=runtime.comm.world_size,
        rank=runtime.comm.rank,
        partition=runtime.partition,
        optimizer=runtime.inner if single else None,
        precision=runtime.config.precision.model_dump(include={"param_dtype", "reduce_dtype"}),
        inners=None if single else runtime.inners,
        owned=runtime.whole_parameter_step.owned(),
    )


def shard_state_dict(runtime: Runtime) -> dict[str, Any]:
    runtime.flush()
    states = [inner.optimizer.state_dict() for inner in runtime.inners]
    state = {**header_of(runtime), **({"optimizer": states[0]} if one_flat(runtime) else {"optimizers": states})}
    masters = _with_masters(runtime)
    if masters:
        for bucket in masters:
            bucket.adopt_edits()
        state["master"] = [bucket.master.clone() for bucket in masters]
    if runtime.scaler.enabled:
        state["loss_scale"] = runtime.scaler.state_dict()
    return state


def load_shard_state_dict(runtime: Runtime, state_dict: dict[str, Any]) -> tuple[Any, list[Bucket]]:
    """Check ``state_dict`` against this run and write its masters; the wrapped optimizers' states (one state dict,
    or a list: see :func:`finish_load`) and the buckets whose parameters must then be cast from the masters and
    shared."""
    shard_header.check_loadable(state_dict, header_of(runtime))
    runtime.flush()
    masters = _with_masters(runtime)
    with torch.no_grad():
        for bucket, saved in zip(masters, state_dict["master"] if masters else []):
            bucket.master.copy_(saved)
    return state_dict["optimizer"] if "optimizer" in state_dict else state_dict["optimizers"], masters


def finish_load(runtime: Runtime, inner_state: dict[str, Any] | list[dict[str, Any]],
                loss_scale: dict[str, Any] | None, buckets: list[Bucket] | None) -> None:
    """Load the wrapped optimizers' state (one ``torch.optim`` state dict for one optimizer, else a list of them, one
    per wrapped optimizer in order), then cast and share the parameters of ``buckets`` (default: every trainable
    bucket) from their masters, and the loss scale."""
    states = inner_state if isinstance(inner_state, list) else [inner_state]
    if len(states) != len(runtime.inners):
        raise ValueError(f"finish_load got {len(states)} optimizer states for the {len(runtime.inners)} optimizers "
                         "this ZeroOptimizer wraps; pass a list of state dicts, one per optimizer in order")
    for inner, state in zip(runtime.inners, states):
        inner.optimizer.load_state_dict(state)
    runtime.paging.adopt_state(runtime.trainable_buckets)  # offload to disk: the loaded state into the file
    runtime.share_masters(runtime.trainable_buckets if buckets is None else buckets)
    if runtime.scaler.enabled and loss_scale is not None:
        runtime.scaler.load_state_dict(loss_scale)


def _with_masters(runtime: Runtime) -> list[Bucket]:
    """The buckets whose plan gives the optimizer a master chunk of its own (saved beside the optimizer's state)."""
    return [b for b in runtime.trainable_buckets if b.plan.has(Role.MASTER)]
