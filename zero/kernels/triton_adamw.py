"""A one-pass mixed-precision AdamW step in Triton (GPU): fp32 master, m and v updated and the
low-precision (bf16) parameter copy written, reading the gradient in whatever dtype it has.

Per element it reads the master (4 bytes), the gradient (2 or 4), m and v (8) and writes the
master, m, v (12) and the bf16 parameter (2): 28-30 bytes, at memory bandwidth. The bf16 copy is
rounded to nearest-even with integer arithmetic rather than with Triton's cast, so that it equals
``master.to(torch.bfloat16)`` bit for bit on every backend, Triton's CPU interpreter included
(``TRITON_INTERPRET=1``, which rounds its casts toward zero: that is how the tests run it without a
GPU). Import this module only where ``triton`` is installed (:func:`zero.runtime.step.stepper.triton_available`).

One launch steps a whole flat buffer (a bucket's chunk) made of *segments* (the pieces of its parameters),
each with its own hyperparameters (its parameter group's, and its own step count): a *block table* gives
each program its elements ``[start, end)`` and its segment, a *hyperparameter table* one row per segment
(:data:`HYPER`). Elements in no segment (padding, parameters without a gradient) are not touched. The
hyperparameters are computed on the host in float64 (``1 - beta2``, ``1 - lr * weight_decay``, the bias
corrections), as torch's step computes them, and stored as fp32, the precision torch's CPU and CUDA kernels
take them in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 1024
HYPER = ("decay", "weight_decay", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "step_size",
         "inv_sqrt_bias_correction2", "decoupled")


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, blocks_ptr, hyper_ptr,
    NUM_HYPER: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = blocks_ptr + tl.program_id(0).to(tl.int64) * 3
    start, end, segment = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    hyper = hyper_ptr + segment * NUM_HYPER
    decay, weight_decay = tl.load(hyper), tl.load(hyper + 1)
    one_minus_beta1, beta2, one_minus_beta2 = tl.load(hyper + 2), tl.load(hyper + 3), tl.load(hyper + 4)
    eps, step_size, inv_sqrt_bias_correction2 = tl.load(hyper + 5), tl.load(hyper + 6), tl.load(hyper + 7)
    decoupled = tl.load(hyper + 8)
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < end
    param = tl.load(param_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    grad = tl.where(decoupled != 0, grad, grad + weight_decay * param)  # Adam's L2 term ...
    param = tl.where(decoupled != 0, param * decay, param)  # ... or AdamW's decoupled decay
    exp_avg = exp_avg + one_minus_beta1 * (grad - exp_avg)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    denom = tl.sqrt(exp_avg_sq) * inv_sqrt_bias_correction2 + eps
    param = param - step_size * (exp_avg / denom)
    tl.store(param_ptr + offsets, param, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if HAS_OUT:  # round to nearest even: add 0x7FFF plus the lowest kept bit, keep the high half
        bits = param.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(out_ptr + offsets, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + numel)`` of the flat buffers, stepped with one set of hyperparameters."""

    start: int
    numel: int


def block_table(segments: list[Segment]) -> torch.Tensor:
    """The launch's block table (host, int64, one row ``(start, end, segment)`` per program)."""
    rows = [(s.start + b, s.start + min(b + BLOCK, s.numel), i)
            for i, s in enumerate(segments) for b in range(0, s.numel, BLOCK)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def hyper_row(*, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              decoupled: bool) -> list[float]:
    """One segment's row of the hyperparameter table (:data:`HYPER`'s order); ``step`` counts from 1."""
    step_size = lr / (1 - beta1**step)
    return [1 - lr * weight_decay, weight_decay, 1 - beta1, beta2, 1 - beta2, eps, step_size,
            1 / math.sqrt(1 - beta2**step), float(decoupled)]


def adamw_segments_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    out: torch.Tensor | None, blocks: torch.Tensor, hyper: torch.Tensor) -> None:
    """One step of every segment of the contiguous 1D fp32 ``param``, ``exp_avg``, ``exp_avg_sq`` in one launch;
    ``out`` (bf16, or ``None``) receives the updated ``param``. ``blocks`` (:func:`block_table`) and ``hyper``
    (fp32, a :func:`hyper_row` per segment) are on ``param``'s device."""
    numel = param.numel()
    tensors = [param, grad, exp_avg, exp_avg_sq] + ([out] if out is not None else [])
    assert all(t.is_contiguous() and t.numel() == numel for t in tensors), "contiguous tensors of one size"
    assert param.dtype == exp_avg.dtype == exp_avg_sq.dtype == hyper.dtype == torch.float32
    assert out is None or out.dtype == torch.bfloat16
    assert blocks.dtype == torch.int64 and hyper.shape[-1] == len(HYPER)
    if blocks.shape[0] == 0:
        return
    _adamw_kernel[(blocks.shape[0],)](
        param, grad, exp_avg, exp_avg_sq, out if out is not None else param, blocks, hyper,
        NUM_HYPER=len(HYPER), HAS_OUT=out is not None, BLOCK=BLOCK,
    )  # fmt: skip


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
    ``exp_avg_sq`` (one segment: :func:`adamw_segments_`); ``out`` (bf16, or ``None``) receives the updated
    ``param``. ``step`` counts from 1."""
    row = hyper_row(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                    decoupled=decoupled)
    blocks = block_table([Segment(0, param.numel())] if param.numel() else [])
    adamw_segments_(param, grad, exp_avg, exp_avg_sq, out, blocks.to(param.device),
                    torch.tensor([row], dtype=torch.float32).to(param.device))
