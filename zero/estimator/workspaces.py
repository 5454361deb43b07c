"""What kernels allocate inside themselves, where a fake-tensor trace cannot see it.

A fake tensor has the shape of what an operator returns, but buffers a kernel allocates for its own use and frees
before returning never reach Python. :func:`workspace_bytes` prices them from the operator's arguments: the bytes
the allocator holds at the kernel's highest point beyond what it holds once the operator has returned (its
outputs); :mod:`zero.estimator.timeline` records that point, as temporaries. Each price replays the allocations and
frees measured inside the kernel (PyTorch's CPU allocator through the profiler, as ``zero.profile`` reads it).

Measured on torch 2.13, CPU, AVX2, oneDNN 3.12, 1-4 threads (``tests/unit/test_estimator_workspaces.py`` measures
again): ``aten.convolution`` and ``aten.convolution_backward`` (1-D and 2-D) on the backend torch selects
(``torch._C._select_conv_backend``):

* oneDNN (fp32; bf16 where oneDNN has it), NCHW: the input, weight and output are reordered into oneDNN's blocked
  layout (channels padded to 8 on AVX2, ``nChw8c``; to 16 with AVX-512, not measured) and the result copied back;
  forward keeps an input of fewer channels than a block plain unless the kernel is 1x1. Backward reorders the
  output's gradient twice (for the input's gradient, then the weight's), the weight, the input's gradient (plain
  and copied twice when strided) and the input. The weight's gradient takes oneDNN's GEMM kernel when the kernel
  is taller than the input, dilated or 14 wide: per thread ``4 x`` the weight's bytes and the unfolded input
  ``C_in * kH * kW * H_out * W_out`` (once at batch 1). A 1x1 kernel without padding (the input a multiple of the
  stride) takes oneDNN's 1x1 kernel: strided, it gathers the input per thread; its weight gradient sums a copy of
  the weight per thread, and two pages. Channels-last: the weight alone is reordered, its gradient copied back.
* ``slow_conv2d`` (fp32 at batch 1 and small sizes; bf16 where oneDNN has none, as on AVX2): the unfolded input
  ``N * C_in * kH * kW * H_out * W_out`` in forward and again for the weight's gradient (none for a 1x1 kernel of
  stride 1 without padding); a bf16 bias gradient sums an fp32 copy of the output's gradient. (The input gradient's
  columns are per-thread buffers outside PyTorch's allocator: the profiler does not see them either.)

Not priced: oneDNN's other scratchpads, which do not grow with the batch (60-260 kB for a strided backward of the
input, with the width and the threads; a few pages for a small weight gradient's reduction; 12 kB channels-last);
3-D, transposed and grouped convolutions (0); every other operator (``None``) but the bf16 ``mm`` and ``addmm``
(oneDNN's scratchpad, priced by :mod:`zero.estimator.matmul_workspaces`). On CUDA nothing is priced yet:
cuDNN's convolution workspaces and cuBLAS's go through the caching allocator but were not measured here (cuBLAS's
persistent ones are the profiler's ``other/cuBLAS workspaces``, outside any step): add their rows to
:data:`WORKSPACES` from a measurement.
"""

from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence

import torch

from zero.estimator.matmul_workspaces import bf16_matmul

aten = torch.ops.aten


def _highest_over_end(events: Sequence[int]) -> int:
    """Allocations (+) and frees (-) in order: the highest running total over the final one."""
    live = highest = 0
    for nbytes in events:
        live += nbytes
        highest = max(highest, live)
    return highest - live


class _Conv:
    """One convolution's tensors in bytes: plain, and in oneDNN's blocked layout (channels padded to its block)."""

    def __init__(self, input: torch.Tensor, weight: torch.Tensor, out_spatial: Sequence[int], args: tuple) -> None:
        stride, padding, dilation, transposed, output_padding, groups = args
        block = 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8
        item = input.element_size()
        n, c_in, *spatial = input.shape
        c_out, _, *kernel = weight.shape
        out = n * prod(out_spatial) * item
        padded_in, padded_out = -(-c_in // block) * block, -(-c_out // block) * block
        backend = torch._C._select_conv_backend(input, weight, None, stride, padding, dilation, transposed,
                                                output_padding, groups, None).name
        self.onednn, self.slow = backend == "Mkldnn", backend == "Slow2d"
        self.item, self.strided = item, any(s != 1 for s in stride)
        self.x_plain, self.x = n * c_in * prod(spatial) * item, n * padded_in * prod(spatial) * item
        self.y_plain, self.y = c_out * out, padded_out * out
        self.w_plain, self.w = weight.numel() * item, padded_out * padded_in * prod(kernel) * item
        self.bias = c_out * item
        first = c_in < block and prod(kernel) > 1  # oneDNN's first-layer kernel keeps the input plain
        self.src = (0, padded_out * c_in * prod(kernel) * item) if first else (self.x, self.w)
        unfolded = c_in * prod(kernel) * out  # (per sample: out holds n)
        self.columns = 0 if prod(kernel) == 1 and not self.strided and not any(padding) else unfolded
        # oneDNN's direct kernel for the weight's gradient, else its GEMM one (unfolding, per-thread reductions)
        self.direct_weight_grad = all(d == 1 for d in dilation) and kernel[-1] < 14 and all(
            k <= s for k, s in zip(kernel[:-1], spatial[:-1]))
        threads = torch.get_num_threads()
        # oneDNN's 1x1 kernel: strided, it first gathers the input per thread ("reduce to unit stride"); its weight
        # gradient sums per-thread copies
        one_by_one = prod(kernel) == 1 and not any(padding) and all(s % t == 0 for s, t in zip(spatial, stride))
        self.rtus = threads * padded_in * prod(out_spatial) * item + 128 if one_by_one and self.strided else 0
        self.reduction = threads * self.w + 8320 if one_by_one and threads > 1 else 0
        per_thread = unfolded // n if n > 1 else 0
        self.gemm = threads * (4 * self.w_plain + per_thread) + 256 if n > 1 else unfolded
        self.channels_last = input.dim() == 4 and not input.is_contiguous() and input.is_contiguous(
            memory_format=torch.channels_last)


def _forward(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    input, weight = args[:2]
    if args[6] or args[8] != 1 or input.dim() not in (3, 4):  # transposed, grouped, 3-D: not priced
        return 0
    c = _Conv(input, weight, out.shape[2:], tuple(args[3:9]))
    if c.onednn and c.channels_last:
        return _highest_over_end([c.w, -c.w])
    if c.onednn:
        x, w = c.src
        return _highest_over_end([c.rtus, x, w, c.y, -w, -x, -c.rtus, c.y_plain, -c.y])
    return _highest_over_end([c.columns, c.y_plain, -c.columns]) if c.slow else 0


def _backward(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    grad_output, input, weight = args[:3]
    mask = args[10]
    if args[7] or args[9] != 1 or input.dim() not in (3, 4):  # transposed, grouped, 3-D: not priced
        return 0
    c = _Conv(input, weight, grad_output.shape[2:], tuple(args[4:10]))
    bias = c.bias if mask[2] else 0
    events: list[int] = []
    if c.onednn:
        if mask[0] and c.channels_last:
            events += [c.w, -c.w]
        elif mask[0] and c.strided:  # the input's gradient: made plain, then copied twice
            events += [c.y, c.w, c.x_plain, -c.w, -c.y, c.x_plain, c.x_plain, -c.x_plain, -c.x_plain]
        elif mask[0]:  # ... made blocked, then copied back
            events += [c.y, c.w, c.x, -c.w, -c.y, c.x_plain, -c.x]
        if mask[1] or mask[2]:  # the weight's and the bias's
            blocked = c.direct_weight_grad and not c.channels_last
            (x, w), gy = (c.src, c.y) if blocked else ((0, c.w_plain), 0)
            scratch = c.reduction + c.rtus if c.direct_weight_grad else c.gemm
            back = c.w_plain if c.channels_last else 0  # (copied back to channels-last)
            events += [gy, x, w, bias, scratch, -scratch, -x, -gy, bias, c.w_plain, back, -w, -bias, -back]
        return _highest_over_end(events)
    if not c.slow:
        return 0
    if mask[0]:
        events.append(c.x_plain)
    if mask[2]:
        upcast = c.y_plain * 4 // c.item if c.item < 4 else 0  # a bf16 sum over an fp32 copy
        events += [bias, upcast, -upcast]
    if mask[1]:
        events += [c.w_plain, c.columns, -c.columns]
    return _highest_over_end(events)


# device type -> operator -> bytes(func, args, kwargs, out) its kernel holds beyond its outputs at its highest point
# (None: not priced for these arguments)
WORKSPACES: dict[str, dict[Any, Callable[[Any, tuple, dict, Any], int | None]]] = {
    "cpu": {aten.convolution.default: _forward, aten.convolution_backward.default: _backward,
            aten.mm.default: bf16_matmul, aten.addmm.default: bf16_matmul},  # (bf16: zero.estimator.matmul_workspaces)
    "cuda": {},  # cuDNN / cuBLAS: not measured yet (see the module docstring)
}


def workspace_bytes(func: Any, args: tuple, kwargs: dict | None, out: Any) -> int | None:
    """Bytes ``func``'s kernel holds at its highest point beyond what it returns; ``None`` for an operator the table
    does not price on its arguments' device."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    price = WORKSPACES.get(device, {}).get(func) if device is not None else None
    return price(func, args, kwargs or {}, out) if price is not None else None
