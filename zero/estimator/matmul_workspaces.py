"""What the CPU's bf16 ``mm`` and ``addmm`` allocate inside the kernel, priced from the operator's shapes (rows of
:data:`zero.estimator.workspaces.WORKSPACES`): oneDNN's scratchpad, sized as oneDNN sizes it, and ATen's copy of a
transposed ``self``.

Measured on torch 2.13, oneDNN 3.12, 1-4 threads, every allocation inside ``aten::mm`` and ``aten::addmm`` read
from the profiler (``tests/unit/test_estimator_workspaces_matmul.py`` measures again, each kernel on the CPU it
runs on; oneDNN's AVX-512 one without bf16 under ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``):

* ATen hands a bf16 product of ``M x K`` by ``K x N`` to oneDNN where oneDNN has bf16 on the CPU
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 BW/VL/DQ, or AVX-NE-CONVERT), oneDNN is enabled,
  ``M * N * K > 16**3`` and ``alpha != 0``; otherwise it runs its own loops, which allocate nothing (AVX2 CPUs).
  For ``N == 1`` oneDNN computes the transposed product (``1 x M``).
* oneDNN allocates one scratchpad per call; each buffer in it is booked with 128 bytes for its alignment.

  - With AVX512_BF16 (``brg_matmul:avx512_core_bf16``), per thread: 16 batch entries of 40 bytes; B copied into
    blocks of 64 columns, ``2 * 64 * rnd_up(K_blk, 32)``; an fp32 accumulator ``4 * N_blk * M_blk`` (times the N
    chunks a thread takes when ``K > K_blk``; ``4 * N * M`` when K is split across threads); A copied,
    ``2 * M_blk * rnd_up(K_blk, 32)`` (plus 32 elements at a power of 2 from 512), when A is column-major or K a
    power of 2 from 4096 with ``M >= 1024``. ``N_blk = min(N, 64)``; ``K_blk = min(K, 512)``, 1024 when
    ``K > 1024`` and A is not column-major; ``M_blk`` (and the chunks and K split) are what oneDNN's balance
    heuristic picks (:func:`_blocking`, its float32 score): 16-256 rows, 16 for Muon's 32-row matrices on 2 threads
    (36,608 bytes for its ``32 x 96`` Gram matrix, 46,848 for ``32 x 128``, about 6% of the small GPT's step).
  - Without (AVX-512 only, ``gemm:jit:bf16``): an fp32 accumulator, each thread's share of ``M * N`` rounded down
    to whole rows and up to 64 elements (the jit GEMM's packing buffers are malloc'ed outside PyTorch's allocator:
    the profiler does not see them either).
  - An ``alpha`` other than 1: its 4-byte scale, held through the call.

* ``addmm`` with ``beta != 0`` first copies ``self`` into the result: a transposed ``M x N`` ``self`` of 3600
  elements or more goes through a 60 x 60 block buffer (ATen's copy, any CPU).

Not priced (``None``): oneDNN's AMX and AVX2 (AVX-NE-CONVERT) kernels, not measured; fp32 and fp16 products
(fp32 goes to MKL, whose buffers are outside PyTorch's allocator); ``bmm`` and ``baddbmm``. Nor is the copy ATen
makes of an operand neither row- nor column-major. oneDNN's primitive cache does not tell a ``K == 1`` product's two
layouts of A apart: the first call of a shape decides whether A is copied (priced here as a first call).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

aten = torch.ops.aten

ALIGNMENT = 128  # what oneDNN books for each scratchpad buffer's alignment
ONEDNN_LEVELS = ("AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16")  # oneDNN's ISAs, ascending
KERNELS = {"AVX512_CORE": "gemm", "AVX512_CORE_VNNI": "gemm", "AVX512_CORE_BF16": "brgemm"}  # the ones measured


def bf16_kernel() -> str | None:
    """The kernel a CPU bf16 ``mm`` runs on this machine: ``"aten"`` (ATen's loops), oneDNN's ``"brgemm"``
    (AVX512_BF16) or ``"gemm"`` (AVX-512 without it); ``None`` for one not measured (oneDNN's AMX or AVX2
    kernels). oneDNN's ISA is the CPU's, capped by ``ONEDNN_MAX_CPU_ISA`` as oneDNN reads it."""
    if not (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "aten"
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps.get("amx_tile") or caps.get("amx_bf16") or caps.get("avx512_fp16"):
        level = len(ONEDNN_LEVELS)  # (oneDNN's AMX kernels)
    elif caps.get("avx512_bf16"):
        level = ONEDNN_LEVELS.index("AVX512_CORE_BF16")
    elif all(caps.get(f"avx512_{x}") for x in ("f", "bw", "vl", "dq")):
        level = ONEDNN_LEVELS.index("AVX512_CORE_VNNI" if caps.get("avx512_vnni") else "AVX512_CORE")
    else:
        level = 0
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap in ONEDNN_LEVELS:
        level = min(level, ONEDNN_LEVELS.index(cap))
    return KERNELS.get(ONEDNN_LEVELS[level]) if level < len(ONEDNN_LEVELS) else None


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _up(x: int, to: int) -> int:
    return -(-x // to) * to


def _disbalance(work: Any, block: int) -> Any:
    """oneDNN's ``calculate_spatial_disbalance``, in float32."""
    mod = work % block
    return np.float32(np.where(work < block, block - mod, np.minimum(block - mod, mod))) / np.float32(block)


def _scores(m: int, n: int, k: int, threads: int, k_blk: int, m_blks: Any, n_chunks: int, threads_k: int) -> Any:
    """oneDNN's ``get_imbalance`` for each block of rows in ``m_blks``, in float32 as oneDNN computes it."""
    f32 = np.float32
    n_blk = min(n, 64)
    n_blocks = -(-n // n_blk)
    per_k = threads // threads_k
    m_chunks = -(-m // m_blks)
    tasks = _disbalance(m_chunks * -(-n // (n_blk * n_chunks)), per_k)
    rows_left = f32((m_blks * m_chunks) % m) / f32(m)
    chunks_left = f32(f32(f32(-(-n_blocks // n_chunks)) * f32(n_chunks)) - f32(n_blocks)) / f32(n_blocks)
    idle = f32(f32(threads - per_k * threads_k) / f32(threads)) if per_k * threads_k != threads else f32(0)
    over_k = _disbalance(np.int64(k), threads_k * k_blk)
    return ((((tasks + rows_left) + chunks_left) + idle) + over_k) / f32(5)


def _blocking(m: int, n: int, k: int, threads: int, k_blk: int, chunks: int, split_k: int) -> tuple[int, int, int]:
    """oneDNN's ``compute_blocking_heuristic_avx512`` for a bf16 product (blocks of 64 columns): the rows per block,
    the N chunks per task and the threads over K with the least imbalance, the first of equals in oneDNN's order."""
    n_blocks = -(-n // min(n, 64))
    m_blks = np.arange(min(m, 256), min(m, 16 if threads > n_blocks else 32) - 1, -1)
    best, best_score = None, np.float32(1.0)
    for threads_k in range(split_k, 0, -1):
        per_k, found = threads // threads_k, False
        for n_chunks in range(chunks, 0, -1):
            score = _scores(m, n, k, threads, k_blk, m_blks, n_chunks, threads_k)
            if split_k == 1:  # too few tasks for the threads, and not a multiple of them: skipped
                tasks = -(-m // m_blks) * -(-n // (min(n, 64) * n_chunks))
                score = np.where((tasks < 3 * per_k) & (tasks % per_k != 0), np.inf, score)
            i = int(np.argmin(score))
            if score[i] < best_score:
                best, best_score, found = (int(m_blks[i]), n_chunks, threads_k), score[i], True
        if not found:  # the smallest block, one chunk
            score = _scores(m, n, k, threads, k_blk, m_blks[-1:], 1, threads_k)[0]
            if score < best_score:
                best, best_score = (int(m_blks[-1]), 1, threads_k), score
    assert best is not None, f"oneDNN's heuristic finds no blocking for {m} x {k} by {k} x {n}"  # (m, n >= 1)
    return best


def _brgemm(m: int, n: int, k: int, threads: int, column_major: bool) -> int:
    """oneDNN's brgemm scratchpad (AVX512_BF16), in bytes (see the module docstring)."""
    if n == 1:  # ATen hands oneDNN the transposed product
        m, n, column_major = 1, m, False
    transposed_tag = m == 1 or column_major  # (how oneDNN reads A's layout: a row is transposed)
    copy_a = (column_major and m > 1) or (_pow2(k) and k >= 4096 and m >= 1024)
    n_blk = min(n, 64)
    k_blk = min(k, 1024 if k > 1024 and not transposed_tag else 512)
    low_parallel = threads > -(-n // n_blk)
    split_k = min(threads, 4) if low_parallel and transposed_tag and _pow2(k) and k >= 2048 else 1
    chunks = min(16 if copy_a else 1, -(-n // n_blk))
    m_blk, n_chunks, threads_k = _blocking(m, n, k, threads, k_blk, chunks, split_k)
    lda = _up(k_blk, 32)
    lda += 32 if lda >= 512 and _pow2(lda) else 0  # (a large power of 2 padded by a cache line)
    accumulator = 4 * n * m if threads_k > 1 else 4 * n_blk * m_blk * (n_chunks if k > k_blk else 1)
    buffers = [16 * 40, 2 * 64 * _up(k_blk, 32), accumulator] + ([2 * m_blk * lda] if copy_a else [])
    return sum(threads * b + ALIGNMENT for b in buffers)


def _gemm(m: int, n: int, threads: int) -> int:
    """oneDNN's gemm scratchpad (AVX-512 without bf16): the fp32 accumulator, in bytes."""
    if n == 1:
        m, n = 1, m

    def share(t: int) -> int:
        work = -(-m * n // t)
        return _up(min(m * n, work // n * n) if work >= n else work, 64)

    return 4 * max(threads * share(threads), share(1)) + ALIGNMENT


def _column_major(t: torch.Tensor) -> bool:
    """Whether ATen passes ``t`` to the BLAS transposed: not row-major, but column-major."""
    (rows, cols), (s0, s1) = t.shape, t.stride()
    return not (s1 == 1 and s0 >= max(1, cols)) and s0 == 1 and s1 >= max(1, rows)


def bf16_matmul(func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """``aten.mm`` and ``aten.addmm`` on bf16 CPU tensors: the bytes held inside the kernel beyond the result (see
    the module docstring); ``None`` for another dtype or a kernel not measured."""
    self, a, b = args[:3] if func is aten.addmm.default else (None, *args[:2])
    beta, alpha = (kwargs.get("beta", 1), kwargs.get("alpha", 1)) if self is not None else (0, 1)
    if a.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2:
        return None
    kernel = bf16_kernel()
    if kernel is None:
        return None
    (m, k), n = a.shape, b.shape[1]
    copy = 60 * 60 * 2 if (self is not None and beta != 0 and self.dim() == 2 and tuple(self.shape) == (m, n)
                           and self.stride() == (1, m) and self.dtype == a.dtype and m * n >= 60 * 60) else 0
    if kernel == "aten" or m * n * k <= 16**3 or np.float32(alpha) == 0:  # (ATen passes alpha as a float)
        return copy
    scratchpad = _brgemm(m, n, k, torch.get_num_threads(), _column_major(a)) if kernel == "brgemm" else _gemm(
        m, n, torch.get_num_threads())
    return max(copy, scratchpad + (4 if np.float32(alpha) != 1 else 0))
