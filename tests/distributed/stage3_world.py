"""What stage 3 adds to the parity world (``worlds.py``'s model and optimizers): its traffic per step with and without
regathering for backward, a model built on meta and initialized sharded, inference under ``no_grad``, ``torch.compile``
and Hugging Face models (GPT-2 and Llama, random weights) against single-process PyTorch."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.worlds import BUCKET_MB, CFG, GLOBAL_BATCH, build_model, make_optimizer
from tests.readouts import flat_params, max_diff
from tests.toy import tiny_hf
from zero import ZeroOptimizer, init_sharded
from zero.models import GPT, init_gpt_weights, local_slice, synthetic_batch


def stage3_traffic(rank: int, world_size: int, reshard_after_forward: bool) -> dict:
    """One stage-3 step's comm counters, with or without regathering for backward."""
    model = build_model()
    opt = ZeroOptimizer(
        make_optimizer("adamw", model), model, stage=3, reshard_after_forward=reshard_after_forward
    )
    for step in range(2):
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        model(local_slice(x, rank, world_size), local_slice(y, rank, world_size), True).backward()
        opt.step()
        opt.zero_grad()
    unit_numel, unit_buckets = {}, {}  # each unit's buckets: its trainable one, and a frozen one (the root)
    for b in opt.buckets:
        unit_numel[b.unit.name] = unit_numel.get(b.unit.name, 0) + b.layout.padded_numel
        unit_buckets[b.unit.name] = unit_buckets.get(b.unit.name, 0) + 1
    return {
        "comm_stats": opt.comm_stats,
        "padded_numel": opt.partition.padded_numel,
        "gathered_numel": sum(b.layout.padded_numel for b in opt.buckets),
        "unit_numel": unit_numel,
        "unit_buckets": unit_buckets,
    }


def hf_parity(rank: int, world_size: int, stage: int, family: str) -> dict | None:
    """Hugging Face GPT-2 or Llama (random weights, built from a config): ||params - single process||_2
    for ZeroOptimizer and for DDP (the noise floor), after a few AdamW steps."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None

    def run(mode: str) -> torch.Tensor:
        model = tiny_hf(family, seed=0).eval()  # eval: dropout off, so ranks and reference agree
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forward = model
        if mode == "ddp":
            forward = DistributedDataParallel(model)
        elif mode == "zero":
            opt = ZeroOptimizer(opt, model, stage=stage, bucket_size_mb=BUCKET_MB)
        for step in range(4):
            x, _ = synthetic_batch(step, GLOBAL_BATCH, CFG)
            if mode != "reference":
                x = local_slice(x, rank, world_size)
            forward(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model, opt)

    ref = run("reference")
    return {mode: float((run(mode) - ref).norm()) for mode in ("zero", "ddp")}


def meta_init_matches(rank: int, world_size: int) -> float:
    """Max |difference| between a GPT built normally and one built on meta + init_sharded (same seed)."""
    torch.manual_seed(1234)
    normal = flat_params(GPT(CFG))
    torch.manual_seed(1234)
    model, opt = init_sharded(
        lambda: GPT(CFG), lambda m: torch.optim.AdamW(m.parameters()), init_fn=init_gpt_weights
    )
    return max_diff(flat_params(model, opt), normal)


def inference_matches(rank: int, world_size: int) -> dict:
    """Stage-3 eval forward under no_grad vs the same model unsharded; and nothing stays gathered."""
    model = build_model().eval()
    x, y = synthetic_batch(0, GLOBAL_BATCH, CFG)
    with torch.no_grad():
        expected = model(x, y, True)
    opt = ZeroOptimizer(make_optimizer("adamw", model), model, stage=3)
    with torch.no_grad():
        got = model(x, y, True)
    gathered = sum(b.param_buffer.is_allocated for b in opt.buckets)
    return {"max_diff": max_diff(got, expected), "gathered_after": gathered}


def compiled_stage3_matches(rank: int, world_size: int) -> float:
    """Max |difference| between stage 3 under ``torch.compile(model)`` and stage 3 eager (3 SGD steps)."""

    def run(compiled: bool) -> torch.Tensor:
        torch._dynamo.reset()
        model = build_model()
        opt = ZeroOptimizer(make_optimizer("sgd", model), model, stage=3)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        for step in range(3):
            x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
            forward(local_slice(x, rank, world_size), local_slice(y, rank, world_size), step % 2 == 1).backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model, opt)

    return max_diff(run(True), run(False))


def stage3_checks(rank: int, world_size: int, compile_: bool = True) -> dict:
    """Everything this world runs (see the module docstring); ``compile_`` False (``--quick``): all but
    ``torch.compile``."""
    return {
        "traffic3": {keep: stage3_traffic(rank, world_size, keep) for keep in (True, False)},
        "gpt2": hf_parity(rank, world_size, 3, "gpt2"),
        "llama": hf_parity(rank, world_size, 3, "llama"),
        "meta_init": meta_init_matches(rank, world_size),
        "inference": inference_matches(rank, world_size),
        # compiling is most of this world's time: at 2 ranks only (the gathers are real; at 1 rank see
        # tests/unit/test_user_paths.py, and 3 ranks' uneven shards change nothing the compiled units see)
        "compiled3": compiled_stage3_matches(rank, world_size) if compile_ and world_size == 2 else None,
    }
