"""What the CPU's bf16 ``mm`` and ``addmm`` hold inside the kernel (``zero.estimator.matmul_workspaces``), against
the allocator: each product run on real tensors, every allocation and free inside ``aten::mm`` and ``aten::addmm``
read from the profiler (as ``zero.profile`` reads the CPU allocator), the highest point over what the operator leaves
allocated, on 1 and 2 threads, with the kernel this CPU runs (``bf16_kernel``). Where the CPU has AVX512_BF16
(oneDNN's brgemm), the same cases run again in processes that cap oneDNN below it (``ONEDNN_MAX_CPU_ISA``):
AVX512_CORE, as on an AVX-512 CPU without bf16 (oneDNN's gemm), and AVX2, as on a CPU without AVX-512 (ATen's own
loops). Then the points a trace gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.quick import full_only_beyond
from tests.unit.test_estimator_workspaces import _measured
from zero.estimator.matmul_workspaces import bf16_kernel
from zero.estimator.timeline import record_step
from zero.estimator.workspaces import workspace_bytes

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
OPS = ("aten::mm", "aten::addmm")


def _matrix(rows: int, cols: int, column_major: bool = False) -> torch.Tensor:
    """A bf16 matrix, row-major or a transposed view of a row-major one."""
    if column_major:
        return torch.randn(cols, rows, dtype=torch.bfloat16).T
    return torch.randn(rows, cols, dtype=torch.bfloat16)


def _mm(m: int, k: int, n: int, a_t: bool = False, b_t: bool = False) -> tuple:
    return aten.mm.default, (_matrix(m, k, a_t), _matrix(k, n, b_t)), {}


def _addmm(self: torch.Tensor, m: int, k: int, n: int, a_t: bool = False, b_t: bool = False, **kwargs) -> tuple:
    return aten.addmm.default, (self, _matrix(m, k, a_t), _matrix(k, n, b_t)), kwargs


CASES = {  # name -> (operator, arguments, keyword arguments)
    "muon-gram": lambda: _mm(32, 96, 32, a_t=True),  # X @ X.T, X a 96 x 32 gradient transposed: A copied
    "muon-gram-wide": lambda: _mm(32, 128, 32, a_t=True),
    "muon-polynomial": lambda: _addmm(_matrix(32, 32), 32, 32, 32, beta=-4.775, alpha=2.0315),  # alpha's scale
    "muon-update": lambda: _addmm(_matrix(32, 128, True), 32, 32, 128, b_t=True, beta=3.4445),  # self: a 60 x 60 copy
    "linear": lambda: _addmm(torch.randn(192, dtype=torch.bfloat16), 256, 64, 192, b_t=True),  # x @ W.T + b
    "input-gradient": lambda: _mm(256, 192, 64),
    "weight-gradient": lambda: _mm(192, 256, 64, a_t=True),  # grad.T @ x: A copied, N in chunks
    "k-blocks": lambda: _mm(40, 700, 300, a_t=True),  # K over 512: an accumulator per chunk of N
    "k-extended": lambda: _mm(48, 1536, 200),  # K over 1024, A row-major: blocks of 1024
    "k-split": lambda: _mm(64, 2048, 64, a_t=True),  # K a power of 2 from 2048, one block of N: threads over K
    "a-copied": lambda: _mm(1024, 4096, 64),  # K a power of 2 from 4096, M from 1024: A copied, row-major
    "vector": lambda: _mm(300, 700, 1),  # N == 1: the transposed product
    "row": lambda: _mm(1, 4097, 2),
    "outer": lambda: _mm(300, 1, 64, a_t=True),  # K == 1 (the first call of its shape: see the module docstring)
    "small": lambda: _mm(16, 16, 16),  # 16**3: ATen's loops
    "alpha-zero": lambda: _addmm(_matrix(64, 64, True), 64, 64, 64, alpha=0),  # ATen's loops, and self's copy
}
THREADS = (1, 2)


def _run(case: str, threads: int) -> tuple[int, int | None]:
    """One case on ``threads`` threads: (measured, priced)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        func, args, kwargs = CASES[case]()
        out = func(*args, **kwargs)  # (oneDNN's primitive made once, outside the measurement)
        measured = _measured(lambda: func(*args, **kwargs), OPS)[func.overloadpacket.__name__]
        return measured, workspace_bytes(func, args, kwargs, out)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(bf16_kernel() is None, reason="oneDNN's AMX and AVX2 bf16 kernels are not priced")
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("case", CASES)
def test_bf16_matmul_workspaces_are_what_the_allocator_holds(case, threads):
    measured, priced = _run(case, threads)
    assert priced == measured
    if bf16_kernel() != "aten" and case.startswith("muon"):
        assert priced > 0


@pytest.mark.skipif(bf16_kernel() != "brgemm", reason="capping oneDNN reaches the other kernels from AVX512_BF16")
# --quick: AVX512_CORE (oneDNN's gemm: every Muon product holds a workspace); AVX2 in the full run (ATen's loops, which
# --quick still prices in this process: the cases small and alpha-zero above)
@pytest.mark.parametrize("isa, kernel", full_only_beyond([("AVX512_CORE", "gemm"), ("AVX2", "aten")],
                                                         {("AVX512_CORE", "gemm")}))
def test_the_kernels_of_cpus_without_avx512_bf16(isa, kernel):
    """oneDNN's gemm (no AVX512_BF16) and ATen's loops (no AVX-512): every case in a process capped at ``isa``."""
    ran = subprocess.run([sys.executable, "-m", "tests.unit.test_estimator_workspaces_matmul"], cwd=ROOT,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa}, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    found = json.loads(ran.stdout.strip().splitlines()[-1])
    assert found["kernel"] == kernel
    for name, (measured, priced) in found["cases"].items():
        assert priced == measured, (isa, name)
    muon = [priced for name, (_, priced) in found["cases"].items() if name.startswith("muon")]
    assert all(p > 0 for p in muon) if kernel == "gemm" else muon == [0, 0, 0, 60 * 60 * 2] * len(THREADS)


def test_the_trace_counts_bf16_matmul_workspaces_inside_the_operator():
    """A bf16 linear layer's forward (``addmm``) and weight gradient (``mm``) each get a point of their own just
    before their usual one, their workspace in temporaries; fp32 products are not priced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kernel = bf16_kernel()
    for dtype in (torch.bfloat16, torch.float32):
        with FakeTensorMode():
            model = nn.Linear(64, 192, dtype=dtype)
            timeline = record_step(model, lambda m, x: m(x).float().sum(), (torch.randn(256, 64, dtype=dtype),))
        points = timeline.points
        inside = [(a, b) for a, b in zip(points, points[1:])
                  if a.kind == b.kind == "op" and a.name == b.name and a.name in ("mm", "addmm")]
        if dtype == torch.float32 or kernel is None:
            assert inside == []
            continue
        assert [a.name for a, _ in inside] == ["addmm", "mm"]
        for a, b in inside:
            assert (a.activations, a.gradients, a.phase) == (b.activations, b.gradients, b.phase)
            assert a.temporaries > b.temporaries if kernel != "aten" else a.temporaries == b.temporaries


if __name__ == "__main__":  # (run by test_the_kernels_of_cpus_without_avx512_bf16 under ONEDNN_MAX_CPU_ISA)
    cases = {f"{name}/{threads}": _run(name, threads) for threads in THREADS for name in CASES}
    print(json.dumps({"kernel": bf16_kernel(), "cases": cases}))
