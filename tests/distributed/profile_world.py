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
MICRO_BATCHES = (2, 4)  # sequences per rank
STAGES = (0, 1, 2, 3)


def saved_tensor_bytes(micro_batch: int) -> int:
    """Bytes a plain forward saves for backward (distinct storages, parameters excluded)."""
    torch.manual_seed(0)
    model = GPT(BENCH)
    return forward_saved_bytes(model, *synthetic_batch(0, micro_batch, BENCH))


def profiled_run(rank: int, world_size: int, stage: int, micro_batch: int, every_op: bool) -> dict:
    gc.collect()
    torch.manual_seed(0)
    model = GPT(BENCH)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage)
    x, y = synthetic_batch(0, micro_batch * world_size, BENCH)
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


def profile_checks(rank: int, world_size: int) -> dict:
    """Every stage and micro-batch sampled at module boundaries (for the estimator), and, at world
    size 2, at every operator too (reconciliation and activations at the peak)."""
    workload = Workload(lambda: GPT(BENCH), lambda m, x, y: m.loss(x, y),
                        lambda micro: synthetic_batch(0, micro, BENCH))
    runs, estimates = {}, {}
    for stage in STAGES:
        for micro in MICRO_BATCHES:
            runs[(stage, micro, False)] = profiled_run(rank, world_size, stage, micro, every_op=False)
            estimates[(stage, micro)] = estimate(workload, stage=stage, world_size=world_size, micro_batch=micro).peak
        if world_size == 2:
            runs[(stage, 4, True)] = profiled_run(rank, world_size, stage, 4, every_op=True)
    return {"runs": runs, "estimates": estimates, "saved": {m: saved_tensor_bytes(m) for m in MICRO_BATCHES}}
