"""Memory-tracker runs for ``test_profile.py``'s world: the GPT benchmark model at every stage.

Each run trains two steps under ``zero.profile`` and returns plain numbers: the allocator's
peak, the breakdown at the peak sample and right after the last step, the largest unexplained
gap, the saved-tensor bytes of a plain forward (counted with ``saved_tensors_hooks``, outside
the tracker) and the estimator's prediction for the same configuration.
"""

from __future__ import annotations

import gc

import torch

import zero
from tests.readouts import forward_saved_bytes, profiled_steps
from zero.estimator import Workload, estimate
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

# benchmarks/compare.py's model: 3.3M parameters, one 12.7 MiB bucket
BENCH = GPTConfig(vocab_size=512, seq_len=128, d_model=256, num_layers=4, num_heads=4)
# the runs sampled after every operator: two blocks (stage 3 still prefetches the next unit in backward), half the
# operators and so half the samples of BENCH (each sample walks every tracked storage); measured at 2 ranks, the
# reconciliation's largest gap is 7e-8 of the peak and the activations at the peak 0.99995 of a forward's, as BENCH's
EVERY_OP = GPTConfig(vocab_size=512, seq_len=128, d_model=256, num_layers=2, num_heads=4)
MICRO_BATCHES = (2, 4)  # sequences per rank
STAGES = (0, 1, 2, 3)
# --quick: one micro-batch, and the runs sampled at every operator at stage 0 (every activation alive at the peak)
# and stage 3 (the peak after backward's prefetch); every run's samples still reconcile at stages 1 and 2
QUICK_ARGS = (MICRO_BATCHES[:1], (0, 3))


def micro_batches(world_size: int, at_two: tuple[int, ...] = MICRO_BATCHES) -> tuple[int, ...]:
    """The micro-batches priced at ``world_size``: ``at_two`` (both) at 2 ranks; one at 1 and 3 (the activations'
    scaling with the micro-batch is the same at any world size, the shards' arithmetic is what 1 and 3 add)."""
    return at_two if world_size == 2 else MICRO_BATCHES[:1]


def saved_tensor_bytes(cfg: GPTConfig, micro_batch: int) -> int:
    """Bytes a plain forward saves for backward (distinct storages, parameters excluded)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    return forward_saved_bytes(model, *synthetic_batch(0, micro_batch, cfg))


def profiled_run(rank: int, world_size: int, stage: int, micro_batch: int, every_op: bool) -> dict:
    gc.collect()
    torch.manual_seed(0)
    cfg = EVERY_OP if every_op else BENCH
    model = GPT(cfg)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage)
    x, y = synthetic_batch(0, micro_batch * world_size, cfg)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    prof = profiled_steps(model, opt, x, y, every_op=every_op)
    peak, rest = prof.peak, [s for s in prof.samples if s.event == "optimizer step ends"][-1]
    result = {
        "allocator_peak": prof.allocator.peak,
        "peak_without_collectives": prof.allocator.peak_without_collectives,
        "peak_categories": dict(peak.categories),
        "peak_allocated": peak.allocated,
        "rest_categories": dict(rest.categories),
        "max_unexplained": max(abs(s.unexplained) for s in prof.samples),
        "max_activations": max(s.categories["activations"] for s in prof.samples),
        "num_samples": len(prof.samples),
        # tensors the process held before, unrelated to this run (earlier checks' results)
        "unrelated": prof.samples[0].labels.get("other/alive on entry", 0),
        "numel": opt.partition.numel,
        "padded_numel": opt.partition.padded_numel,
    }
    del prof, opt, model, peak, rest
    gc.collect()
    return result


def profile_checks(rank: int, world_size: int, at_two: tuple[int, ...] = MICRO_BATCHES,
                   every_op_stages: tuple[int, ...] = STAGES) -> dict:
    """Every stage and micro-batch (:func:`micro_batches`) of BENCH sampled at module boundaries (for the estimator),
    and, at world size 2, EVERY_OP at ``every_op_stages`` sampled at every operator too (reconciliation and
    activations at the peak) with what its plain forward saves."""
    workload = Workload(lambda: GPT(BENCH), lambda m, x, y: m.loss(x, y),
                        lambda micro: synthetic_batch(0, micro, BENCH))
    runs, estimates = {}, {}
    for stage in STAGES:
        for micro in micro_batches(world_size, at_two):
            runs[(stage, micro, False)] = profiled_run(rank, world_size, stage, micro, every_op=False)
            estimates[(stage, micro)] = estimate(workload, stage=stage, world_size=world_size, micro_batch=micro).peak
        if world_size == 2 and stage in every_op_stages:
            runs[(stage, 4, True)] = profiled_run(rank, world_size, stage, 4, every_op=True)
    saved = {4: saved_tensor_bytes(EVERY_OP, 4)} if world_size == 2 else {}
    return {"runs": runs, "estimates": estimates, "saved": saved,
            "micro_batches": micro_batches(world_size, at_two), "every_op_stages": every_op_stages}
