"""The CUDA tests' model and training loop: a GPT on synthetic batches, through ``ZeroOptimizer``'s own backward
and clip."""

from __future__ import annotations

import torch

from tests.recipes import MasterRecipe
from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab_size=512, seq_len=64, d_model=128, num_layers=4, num_heads=4)


def train(model: GPT, opt: ZeroOptimizer, cfg: GPTConfig, steps, clip: float | None = None) -> list[float]:
    """One step per entry of ``steps`` (the batch index), micro-batch 4 on the GPU; returns the losses."""
    losses = []
    for step in steps:
        x, y = (t.cuda() for t in synthetic_batch(step, 4, cfg))
        loss = model.loss(x, y)
        opt.backward(loss)
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def bf16_recipe(steps: int, master_device: str | None = None) -> torch.Tensor:
    """The hand-built recipe of ``train``'s GPT (no clipping): a bf16 copy for forward and backward, fp32 gradients on
    fp32 masters (on ``master_device``: default the GPU, ``"cpu"`` as with offload), AdamW, cast back; the masters."""
    torch.manual_seed(0)
    r = MasterRecipe(GPT(CFG).cuda(), torch.bfloat16, lambda params: torch.optim.AdamW(params, lr=1e-3),
                     master_device=master_device)
    for step in range(steps):
        x, y = (t.cuda() for t in synthetic_batch(step, 4, CFG))
        r.low.loss(x, y).backward()
        r.grads_to_master()
        r.step()
    return r.flat()
