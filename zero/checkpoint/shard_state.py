"""One rank's optimizer shard as a ``state_dict`` (``ZeroOptimizer.state_dict`` / ``load_state_dict``): the header
of ``shard_header``, the wrapped optimizer's state over this rank's pieces, the fp32 master chunks under mixed
precision, and the fp16 loss scale."""

from __future__ import annotations

from typing import Any

import torch

from zero.checkpoint import shard_header
from zero.runtime.buffers.bucket import Bucket
from zero.runtime.runtime import Runtime


def header_of(runtime: Runtime) -> dict[str, Any]:
    return shard_header.header(
        stage=runtime.config.stage,
        world_size=runtime.comm.world_size,
        rank=runtime.comm.rank,
        partition=runtime.partition,
        optimizer=runtime.inner,
        precision=runtime.config.precision.model_dump(include={"param_dtype", "reduce_dtype"}),
    )


def shard_state_dict(runtime: Runtime) -> dict[str, Any]:
    runtime.flush()
    state = {**header_of(runtime), "optimizer": runtime.inner.state_dict()}
    masters = _with_masters(runtime)
    if masters:
        for bucket in masters:
            bucket.adopt_edits()
        state["master"] = [bucket.master_buffer.data.clone() for bucket in masters]
    if runtime.scaler.enabled:
        state["loss_scale"] = runtime.scaler.state_dict()
    return state


def load_shard_state_dict(runtime: Runtime, state_dict: dict[str, Any]) -> list[Bucket]:
    """Check ``state_dict`` against this run and write its masters; the buckets whose parameters must then be cast
    from them and shared (:func:`finish_load`)."""
    shard_header.check_loadable(state_dict, header_of(runtime))
    runtime.flush()
    masters = _with_masters(runtime)
    with torch.no_grad():
        for bucket, saved in zip(masters, state_dict["master"] if masters else []):
            bucket.master_buffer.data.copy_(saved)
    return masters


def finish_load(runtime: Runtime, inner_state: dict[str, Any], loss_scale: dict[str, Any] | None,
                buckets: list[Bucket] | None) -> None:
    """Load the wrapped optimizer's state, then cast and share the parameters of ``buckets`` (default: every
    trainable bucket) from their masters, and the loss scale."""
    runtime.inner.load_state_dict(inner_state)
    runtime.paging.adopt_state(runtime.trainable_buckets)  # offload to disk: the loaded state into the file
    runtime.share_masters(runtime.trainable_buckets if buckets is None else buckets)
    if runtime.scaler.enabled and loss_scale is not None:
        runtime.scaler.load_state_dict(loss_scale)


def _with_masters(runtime: Runtime) -> list[Bucket]:
    return [b for b in runtime.trainable_buckets if b.master_buffer is not None]
