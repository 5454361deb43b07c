"""Rank 0 of 64 in torch's fake process group: a meta-built GPT-2-medium-sized model at stage 3.

Run in its own process (``python -m tests.distributed.fake_scale [bf16]``): it initializes the
default process group. Prints one JSON line with the measured bytes. With ``bf16`` the model trains
under ``MixedPrecision(param_dtype="bf16", reduce_dtype="bf16")``, the ZeRO paper's mixed precision.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import torch
import torch.distributed as dist

from tests.distributed.harness import init_fake_world

WORLD_SIZE = 64


def main(param_dtype: str | None) -> None:
    init_fake_world(WORLD_SIZE)
    import zero
    from zero.memory import live_tensor_bytes
    from zero.models import GPT, GPTConfig, init_gpt_weights, synthetic_batch

    # 153M parameters (bf16: 34M, two layers and an 8192-token vocabulary; CPU bf16 matmuls are slow, and the
    # formulas hold at any size)
    cfg = (GPTConfig(vocab_size=8192, seq_len=64, d_model=1024, num_layers=2, num_heads=16) if param_dtype
           else GPTConfig(vocab_size=50304, seq_len=64, d_model=1024, num_layers=8, num_heads=16))
    gc.collect()
    baseline = live_tensor_bytes()
    start = time.perf_counter()
    torch.manual_seed(0)
    precision = {"param_dtype": param_dtype, "reduce_dtype": param_dtype}
    model, opt = zero.init_sharded(
        lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), init_fn=init_gpt_weights,
        precision=precision if param_dtype else {},
    )
    after_init = live_tensor_bytes() - baseline
    init_s = time.perf_counter() - start
    x, y = synthetic_batch(0, 1, cfg)
    opt.backward(model.loss(x, y))
    opt.step()  # (the fake group moves no data, so the values are meaningless; the bytes are real)
    del x, y
    measured = live_tensor_bytes() - baseline
    state = opt.model_state_bytes()
    print(
        json.dumps(
            {
                "numel": opt.partition.numel,
                "padded_numel": opt.partition.padded_numel,
                "unit_numel": {b.unit.name: b.layout.padded_numel for b in opt.buckets},
                "num_layers": cfg.num_layers,
                "world_size": WORLD_SIZE,
                "measured": measured,
                "after_init": after_init,
                "held": state.total,
                "model_state": [state.parameters, state.gradients, state.optimizer_state],
                "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
                "comm_stats": opt.comm_stats,
                "init_s": init_s,
                "step_s": time.perf_counter() - start - init_s,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
