"""The AdamW step in plain torch, one operation at a time: the reference the step kernels are tested against.

It follows ``torch.optim.AdamW``'s single-tensor arithmetic (and Adam's, with ``decoupled=False``: the
weight decay is then added to the gradient, L2-style). Everything is in ``param``'s dtype (fp32; float64 for a
reference of the reference); ``out``, when given, receives
the updated parameter cast to its dtype (the low-precision copy a mixed-precision step writes).
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def adamw_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
    out: torch.Tensor | None = None,
) -> None:
    """One step, in place on ``param``, ``exp_avg`` and ``exp_avg_sq`` (``step`` counts from 1)."""
    grad = grad.to(param.dtype)
    if weight_decay and decoupled:
        param.mul_(1 - lr * weight_decay)
    elif weight_decay:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if out is not None:
        out.copy_(param)
