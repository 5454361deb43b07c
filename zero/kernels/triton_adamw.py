"""A one-pass mixed-precision AdamW step in Triton (GPU): fp32 master, m and v updated and the
low-precision (bf16) parameter copy written, reading the gradient in whatever dtype it has.

Per element it reads the master (4 bytes), the gradient (2 or 4), m and v (8) and writes the
master, m, v (12) and the bf16 parameter (2): 28-30 bytes, at memory bandwidth. The bf16 copy is
rounded to nearest-even with integer arithmetic rather than with Triton's cast, so that it equals
``master.to(torch.bfloat16)`` bit for bit on every backend, Triton's CPU interpreter included
(``TRITON_INTERPRET=1``, which rounds its casts toward zero: that is how the tests run it without a
GPU). Import this module only where ``triton`` is installed (:func:`zero.runtime.stepper.triton_available`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, numel,
    lr, beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bias_correction2,
    DECOUPLED: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    if DECOUPLED:
        param = param * (1.0 - lr * weight_decay)
    else:
        grad = grad + weight_decay * param
    exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) * inv_sqrt_bias_correction2 + eps
    param = param - step_size * (exp_avg / denom)
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if HAS_OUT:  # round to nearest even: add 0x7FFF plus the lowest kept bit, keep the high half
        bits = param.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + offsets, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
) -> None:
    """One AdamW (``decoupled``) or Adam step in place on contiguous 1D fp32 ``param``, ``exp_avg``,
    ``exp_avg_sq``; ``out`` (bf16, or ``None``) receives the updated ``param``. ``step`` counts from 1."""
    numel = param.numel()
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([out] if out is not None else [])
    assert all(t.is_contiguous() and t.numel() == numel for t in tensors), "contiguous tensors of one size"
    assert param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32
    assert out is None or out.dtype == torch.bfloat16
    if numel == 0:
        return
    _adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, out if out is not None else param, numel,
        lr, beta1, beta2, eps, weight_decay, lr / (1 - beta1**step), 1 / math.sqrt(1 - beta2**step),
        DECOUPLED=decoupled, HAS_OUT=out is not None, BLOCK=BLOCK,
    )  # fmt: skip
