"""What activation checkpointing keeps (:func:`saved_activation_bytes`) and the fewest blocks that fit an activation
budget (:func:`blocks_within_budget`, ``zero.blocks_within_budget``), from the per-unit activations of the
estimator's trace (:func:`zero.estimator.estimator.trace`)."""

from __future__ import annotations

from typing import Any


def saved_activation_bytes(trace: Any, blocks: list[str] | tuple[str, ...], selective: bool = False) -> float:
    """Peak activation bytes of one step with ``blocks`` checkpointed (``trace``: from
    :func:`zero.estimator.estimator.trace`), the larger of two moments:

    * the end of forward: the traced total, less each checkpointed block's own activations, plus its input
      (``selective``: and its matmul outputs);
    * the recomputation of a checkpointed block ``j`` in backward: the activations outside the blocks, what
      the blocks before ``j`` kept (their inputs, or their activations when not checkpointed), and ``j``'s
      own activations, alive again (the blocks after ``j`` have been through backward and freed theirs).
    """
    own, inputs = trace.unit_activation_bytes, trace.unit_input_bytes
    order = [u for u in own if u]  # forward order; "" is the root, never a block
    chosen = set(blocks)
    matmuls = trace.unit_matmul_bytes if selective else {}
    kept = {u: inputs.get(u, 0) + matmuls.get(u, 0) if u in chosen else own[u] for u in order}
    outside = trace.activation_bytes - sum(own[u] for u in order)
    peak = outside + sum(kept.values())
    before = outside
    for u in order:
        if u in chosen:
            peak = max(peak, before + own[u])
        before += kept[u]
    return float(peak)


def blocks_within_budget(trace: Any, budget_bytes: float) -> tuple[str, ...]:
    """The fewest blocks (stage 3's default units, from :func:`zero.estimator.estimator.trace`) to checkpoint so
    that :func:`saved_activation_bytes` fits ``budget_bytes``, checkpointing first the blocks that save the
    most (the least recomputation for the memory); a ``ValueError`` naming the minimum if none fits."""
    own = {u: b for u, b in trace.unit_activation_bytes.items() if u}  # "" is the root, never a block
    order = sorted(own, key=lambda u: own[u] - trace.unit_input_bytes.get(u, 0), reverse=True)
    plans = [order[:k] for k in range(len(order) + 1)]
    for chosen in plans:
        if saved_activation_bytes(trace, chosen) <= budget_bytes:
            return tuple(sorted(chosen, key=list(own).index))
    minimum = min(saved_activation_bytes(trace, chosen) for chosen in plans)
    raise ValueError(
        f"an activation budget of {budget_bytes / 2**20:.2f} MiB is below the minimum this model needs with its "
        f"blocks checkpointed, about {minimum / 2**20:.2f} MiB per micro-batch; use a smaller micro-batch or a "
        "larger budget"
    )
