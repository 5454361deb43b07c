"""CPU and disk offload in its own world (``test_offload_world.py``): each stage against the same run without it."""

from __future__ import annotations

import gc
import os
import tempfile

import torch

from tests.readouts import flat_params, master_weights
from tests.recipes import DelayedRecipe
from tests.toy import Net, batch
from zero import StepExample, ZeroOptimizer
from zero.estimator import Workload, estimate
from zero.memory import storage_bytes
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

CASES = [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")]
PRECISIONS = {"fp32": {}, "bf16": {"param_dtype": "bf16"}}


def run(rank: int, world_size: int, stage: int, offload: dict, precision: dict) -> torch.Tensor:
    """AdamW (fused: the recommended host step), ``no_sync`` accumulation of two micro-batches, clipping; this
    rank's view of the masters."""
    model = Net()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True), model, stage=stage,
        offload=offload, precision=precision, bucket_size_mb=1e-4,
    )
    return _train(opt, model, rank, world_size)


def run_auto(rank: int, world_size: int) -> dict:
    """``offload.ratio="auto"`` at stage 2 with a budget that differs by rank (rank 0's between the resident and the
    fully offloaded peaks, the others' just above full offload's): the ratio every rank takes, and the masters after
    training against no offload."""
    example = StepExample(loss=lambda m, x: m(x), batch=(local_slice(batch(0), rank, world_size),))
    workload = Workload(Net, example.loss, lambda micro: example.batch)
    kw = dict(stage=2, world_size=world_size, micro_batch=1, bucket_size_mb=1e-4)
    none, full = estimate(workload, **kw).peak, estimate(workload, offload="cpu", **kw).peak
    budget = (none + full) / 2 if rank == 0 else full * 1.01
    model = Net()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True), model, stage=2,
                        offload={"optimizer": "cpu", "ratio": "auto", "gpu_memory": budget / 0.9},
                        bucket_size_mb=1e-4, example=example)
    alone = estimate(workload, offload="cpu", offload_ratio=opt.config.offload.ratio, **kw).peak
    return {"ratio": opt.config.offload.ratio, "fits": alone <= budget, "got": _train(opt, model, rank, world_size),
            "expected": run(rank, world_size, 2, {}, {})}


def _train(opt: ZeroOptimizer, model: Net, rank: int, world_size: int) -> torch.Tensor:
    """Four steps of two micro-batches (the first under ``no_sync``), clipping; this rank's view of the masters."""
    for step in range(4):
        with opt.no_sync():
            opt.backward(model(local_slice(batch(step), rank, world_size)) / 2)
        opt.backward(model(local_slice(batch(step + 10), rank, world_size), step % 2 == 1) / 2)
        opt.clip_grad_norm_(0.1)
        opt.step()
        opt.zero_grad()
    return master_weights(opt)


def run_delayed(rank: int, world_size: int, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``offload.delayed_step`` with two backward passes per step and clipping, and the hand-built delayed
    update on the global batch: the whole parameters after each, flushed."""
    make = lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True)  # noqa: E731
    model = Net()
    opt = ZeroOptimizer(make(model.parameters()), model, stage=stage, bucket_size_mb=1e-4,
                        offload={"optimizer": "cpu", "delayed_step": True})
    reference = Net()
    recipe = DelayedRecipe(reference, make)
    for step in range(4):
        for k, use_aux in ((0, False), (10, step % 2 == 1)):
            model(local_slice(batch(step + k), rank, world_size), use_aux).div(2).backward()
            reference(batch(step + k), use_aux).div(2).backward()
        opt.clip_grad_norm_(0.1)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
        recipe.step()
    opt.flush()
    recipe.flush()
    return flat_params(model, opt), flat_params(reference)


def split_memory(rank: int, world_size: int, stage: int, what: str) -> dict:
    """Model-state bytes on the compute side and on the host after one bf16 step (bf16 reduction: the
    ZeRO paper's buffers), as the optimizer names them (host buffers end in "(host)")."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
    model = GPT(cfg)
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), fused=True), model, stage=stage, offload={what: "cpu"},
        precision={"param_dtype": "bf16", "reduce_dtype": "bf16"}, bucket_size_mb=0.01,
    )
    x, y = synthetic_batch(0, 6, cfg)
    opt.backward(model.loss(local_slice(x, rank, world_size), local_slice(y, rank, world_size)))
    opt.step()
    items = opt.named_memory()
    return {
        "compute": storage_bytes(i.tensor for i in items if not i.label.endswith("(host)")),
        "host": storage_bytes(i.tensor for i in items if i.label.endswith("(host)")),
        "numel": opt.partition.numel,
        "padded_numel": opt.partition.padded_numel,
    }


def offload_checks(rank: int, world_size: int) -> dict:
    """Per (stage, offloaded buffers, precision): (with offload, without), to CPU and to disk (a directory per
    rank); and the memory split."""
    plain = {(s, name): run(rank, world_size, s, {}, p) for s in (1, 2, 3) for name, p in PRECISIONS.items()}
    with tempfile.TemporaryDirectory() as path:
        on_disk = {
            (stage, what, name): run(rank, world_size, stage, {what: "disk", "path": path}, p)
            for stage, what in CASES
            for name, p in PRECISIONS.items()
        }
        gc.collect()  # (the optimizers and models of the runs above, held in reference cycles)
        left = os.listdir(path)  # every file removed as its optimizer was collected
    return {
        "parity": {
            (stage, what, name): (run(rank, world_size, stage, {what: "cpu"}, p), plain[stage, name])
            for stage, what in CASES
            for name, p in PRECISIONS.items()
        },
        "partial": {  # offload.ratio: half the buckets' optimizer side (and parameter shards) on the host
            (stage, what, name): (run(rank, world_size, stage, {what: "cpu", "ratio": 0.5}, p), plain[stage, name])
            for stage, what in CASES
            for name, p in PRECISIONS.items()
        },
        "disk": {key: (got, plain[key[0], key[2]]) for key, got in on_disk.items()},
        "disk_left": left,
        "memory": {(stage, what): split_memory(rank, world_size, stage, what) for stage, what in CASES},
        "delayed": {stage: run_delayed(rank, world_size, stage) for stage in (2, 3)},
        "auto": run_auto(rank, world_size),
    }
