"""The estimator's traffic (``zero.estimate(...).traffic``) against ``opt.comm_stats`` of real runs:

* flat worlds: folded into ``codec_world`` (2 and 3 ranks), which trains a GPT anyway with quantized weights and
  gradients (ZeRO++ qwZ, qgZ) and with the identity codec; it also runs ``MIXED_CASES`` here (the wire's dtype
  under both mixed-precision policies);
* hierarchical sharding: folded into ``hierarchy_world`` (4 ranks), which runs :func:`steady_step_stats` for
  the ``HIERARCHY_CASES`` as 2 shard groups of 2 (and one flat quantized case with 4-packet all-to-alls), and
  :func:`hpz_traffic_checks`: the ``HPZ_CASES`` (ZeRO++'s hpZ, groups of 2: forward's gathers over every rank,
  backward's and recomputation's inside the group, as ``intra_all_gather``).

A rank runs :func:`steady_step_stats`; the test builds the same model as a :class:`~zero.estimator.Workload`
(:func:`gpt_workload`) and the estimate's calls, elements and bytes of each kind must equal the measured ones.
"""

from __future__ import annotations

from typing import Any

import torch

from zero import ZeroOptimizer
from zero.estimator import Workload, estimate
from zero.estimator.workload import POLICIES
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

# (stage, precision, communication) of the extra runs in codec_world: the wire's dtype under mixed precision
MIXED_CASES = (
    (1, "mixed", {"quantized_gradients": True}),  # bf16 reduction, quantized: int8 packets of bf16 gradients
    (2, "mixed-fp32-reduce", {}),  # fp32 reduce-scatter, bf16 all-gather after the step
    (3, "mixed", {"quantized_weights": True}),  # int8 gathers of bf16 parameters, bf16 reduce-scatter
)
QUANTIZED = {"quantized_weights": True, "quantized_gradients": True, "block_size": 64}
HIERARCHY_CASES = (  # in a world of 4 ranks
    (1, "fp32", {"shard_size": 2}),
    (2, "mixed-fp32-reduce", {"shard_size": 2, "quantized_gradients": True}),
    (3, "fp32", {"shard_size": 2}),
    (3, "mixed", {"shard_size": 2, **QUANTIZED}),
    (3, "fp32", QUANTIZED),  # flat: 4 packets per all-to-all and all-gather
)
HPZ = {"shard_size": 2, "hierarchy": "hpz"}
HPZ_CASES = (  # stage 3 in a world of 4: (precision, communication, activation checkpointing)
    ("fp32", HPZ, True),  # recomputation gathers from the secondary copies too
    ("mixed", {**HPZ, **QUANTIZED}, False),  # int8 gathers over every rank, exact bf16 ones inside the group
)
WORLD_SIZE = 4
CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
GLOBAL_BATCH = 8
BUCKET_MB = 0.01  # ~2.6k fp32 elements: several buckets at stages 1-2
STEPS = 2  # the second is a steady step (the prefetch order known)


def measured(stats: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    """``opt.comm_stats`` without the time waited: calls, numel and bytes per kind."""
    return {kind: {k: int(v) for k, v in entry.items() if k != "wait_s"} for kind, entry in stats.items()}


def gpt_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model.loss(x, y)


def steady_step_stats(rank: int, world_size: int, cfg: GPTConfig, global_batch: int, bucket_mb: float,
                      stage: int, precision: str, communication: dict,
                      checkpointing: bool = False) -> dict[str, dict[str, int]]:
    """``opt.comm_stats`` of the last of ``STEPS`` AdamW steps of a GPT under this configuration (``checkpointing``:
    every block's activations, ``activation_checkpointing={}``)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, bucket_size_mb=bucket_mb,
                        precision=POLICIES[precision].model_dump(exclude_defaults=True), communication=communication,
                        activation_checkpointing={} if checkpointing else None)
    for step in range(STEPS):
        x, y = synthetic_batch(step, global_batch, cfg)
        gpt_loss(model, local_slice(x, rank, world_size), local_slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    stats = measured(opt.comm_stats)
    opt.close()
    return stats


def hpz_traffic_checks(rank: int, world_size: int) -> list[dict[str, dict[str, int]]]:
    assert world_size == WORLD_SIZE
    return [steady_step_stats(rank, world_size, CFG, GLOBAL_BATCH, BUCKET_MB, 3, *case) for case in HPZ_CASES]


def gpt_workload(cfg: GPTConfig) -> Workload:
    return Workload(lambda: GPT(cfg), gpt_loss, lambda micro: synthetic_batch(0, micro, cfg))


def estimated_stats(work: Workload, **config: Any) -> dict[str, dict[str, int]]:
    """The estimate's traffic of one step, per kind as ``opt.comm_stats`` names it (``config``: ``estimate``'s
    keyword arguments but the micro-batch, which traffic does not depend on)."""
    return estimate(work, micro_batch=2, **config).traffic.comm_stats()
