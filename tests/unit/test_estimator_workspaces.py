"""What kernels allocate inside themselves (``zero.estimator.workspaces``), against the allocator: one convolution
forward and backward on real tensors, every allocation and free inside ``aten::convolution`` and
``aten::convolution_backward`` read from the profiler's memory events (as ``zero.profile`` reads the CPU allocator),
the highest point over what the operator leaves allocated; and the trace's point inside the kernel.

The prices were measured on AVX2 (oneDNN's 8-channel blocks); elsewhere the kernels oneDNN picks differ, and the
comparison is skipped."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.utils._python_dispatch import TorchDispatchMode

from zero.estimator.timeline import record_step
from zero.estimator.workspaces import workspace_bytes

OPS = ("aten::convolution", "aten::convolution_backward")
measured_here = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX2" or not torch.backends.mkldnn.is_available(),
    reason="the prices were measured on AVX2 with oneDNN")


def _measured(run, ops: tuple[str, ...] = OPS) -> dict[str, int]:
    """Each operator in ``ops``' highest point over what it leaves allocated (bytes), read from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    found: dict[str, int] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.name not in ops or (event.parent is not None and event.parent.name in ops):
            continue
        allocations, inside = [], [event]
        while inside:
            e = inside.pop()
            inside.extend(e.children)
            if e.typed[0] == _EventType.Allocation:
                allocations.append((e.start_time_ns, e.typed[1].alloc_size))
        live = highest = 0
        for _, nbytes in sorted(allocations):
            live += nbytes
            highest = max(highest, live)
        found[event.name.removeprefix("aten::")] = highest - live
    return found


class _Priced(TorchDispatchMode):
    """Prices each convolution operator as the trace does, from the same arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.priced: dict[str, int | None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("convolution", "convolution_backward"):
            self.priced[name] = workspace_bytes(func, args, kwargs, out)
        return out


def _conv(batch: int, c_in: int, c_out: int, size: int, kernel: int, stride: int = 1, *, bias: bool = True,
          input_grad: bool = True, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """One convolution's forward and backward: (measured, priced), by operator."""
    torch.manual_seed(0)
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=bias).to(dtype)
    x = torch.randn(batch, c_in, size, size, dtype=dtype, requires_grad=input_grad)

    def step() -> None:
        out = conv(x)
        out.backward(torch.ones_like(out))

    step()  # (oneDNN's primitives made once, outside the measurement)
    measured = _measured(step)
    with _Priced() as priced:
        step()
    return measured, priced.priced


THREADS = 2  # the prices read torch's thread count; a test elsewhere may leave it at 1, so each case fixes it


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


SCRATCHPAD = 96 * 1024 * THREADS  # the most an unpriced scratchpad of oneDNN's held here

CASES = {  # (batch, in channels, out channels, size, kernel, stride), options
    "first-layer": ((2, 3, 16, 32, 3), {"input_grad": False}),  # the input stays plain in forward
    "3x3": ((2, 16, 32, 16, 3), {}),  # blocked input, weight and output, and their gradients
    "3x3-channels-padded": ((2, 12, 20, 16, 3), {"bias": False}),  # 12 -> 16, 20 -> 24 channels
    "1x1": ((4, 16, 32, 8, 1), {}),  # oneDNN's 1x1 kernel: its weight gradient sums per-thread copies
    "1x1-strided": ((2, 64, 16, 32, 1, 2), {"input_grad": False}),  # ... and gathers the strided input first
    "gemm-weight-gradient": ((2, 64, 64, 2, 3), {}),  # a 3x3 kernel over a 2x2 input: oneDNN's GEMM kernel
    "slow-batch-of-one": ((1, 16, 32, 8, 3), {}),  # slow_conv2d: the unfolded columns
    "bf16": ((2, 16, 32, 16, 3), {"dtype": torch.bfloat16}),  # slow_conv2d on AVX2, and an fp32 bias sum
}


@measured_here
@pytest.mark.parametrize("case", CASES)
def test_convolution_workspaces_are_what_the_allocator_holds(case):
    shape, options = CASES[case]
    measured, priced = _conv(*shape, **options)
    assert set(measured) == set(priced) == {"convolution", "convolution_backward"}
    assert priced == measured
    assert priced["convolution"] > 0 and priced["convolution_backward"] > 0


@measured_here
def test_unpriced_scratchpads_are_small_and_do_not_grow_with_the_batch():
    """A strided backward of the input holds a scratchpad of oneDNN's that is not priced: the estimate is low by at
    most its size (tens of kB on 2 threads, whatever the batch), and not at all once the tensors outgrow it."""
    gaps = []
    for batch in (2, 8):
        measured, priced = _conv(batch, 16, 32, 16, 3, 2)
        assert priced["convolution"] == measured["convolution"]
        gaps.append(measured["convolution_backward"] - priced["convolution_backward"])
    assert 0 < gaps[0] <= SCRATCHPAD
    assert gaps[1] == 0


def test_the_trace_counts_the_workspace_inside_the_operator():
    """Each priced operator gets a point of its own just before its usual one, its workspace in temporaries."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        batch = (torch.randn(2, 3, 8, 8),)
        timeline = record_step(model, lambda m, x: m(x).sum(), batch)
    points = timeline.points
    inside = [(a, b) for a, b in zip(points, points[1:]) if a.kind == b.kind == "op" and a.name == b.name
              and a.name.startswith("convolution")]
    assert [a.name for a, _ in inside] == ["convolution", "convolution", "convolution_backward",
                                           "convolution_backward"]
    for a, b in inside:
        assert (a.activations, a.gradients, a.phase) == (b.activations, b.gradients, b.phase)
        assert a.temporaries >= b.temporaries
    assert all(a.temporaries > b.temporaries for a, b in inside if a.name == "convolution")
    assert workspace_bytes(torch.ops.aten.mm.default, (torch.ones(2, 2), torch.ones(2, 2)), {}, None) is None
