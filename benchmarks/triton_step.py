"""The Triton mixed-precision AdamW step (``zero.kernels.triton_adamw``) against the GPU's copy bandwidth
and against torch's fused CUDA AdamW followed by the cast to bf16, measured in one run (CUDA only).

The Triton step moves 30 bytes per element (fp32 master, m, v read and written; a bf16 gradient read; a
bf16 parameter written). Its bandwidth fraction is ``30 * numel / time`` over the bandwidth of a large
device-to-device copy (``dst.copy_(src)``: 8 bytes per fp32 element) timed in the same run. Target: >= 0.85.

    python benchmarks/triton_step.py [--numel 200_000_000] [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def timed(fn, rounds: int) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(n: int, rounds: int) -> float:
    """Bytes per second of a device-to-device copy of ``n`` fp32 elements (read + write)."""
    src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    return 8 * n / timed(lambda: dst.copy_(src), rounds)


def measure(n: int, rounds: int) -> dict:
    """The Triton step and torch's fused step + cast on ``n`` elements, and the copy bandwidth, in one run."""
    from zero.kernels.triton_adamw import adamw_step_

    bandwidth = copy_bandwidth(n, rounds)
    master, m, v = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    grad, low = torch.randn(n, device="cuda").bfloat16(), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    hyper = dict(step=10, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    triton_s = timed(lambda: adamw_step_(master, grad, m, v, low, **hyper), rounds)
    p = master.clone().requires_grad_()
    p.grad = grad.float()
    fused = torch.optim.AdamW([p], lr=1e-4, fused=True)

    def torch_step():
        fused.step()
        low.copy_(p.detach())

    torch_s = timed(torch_step, rounds)
    return {"numel": n, "device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bandwidth / 1e9,
            "triton_ms": triton_s * 1e3, "triton_x_copy_bandwidth": 30 * n / triton_s / bandwidth,
            "torch_fused_cast_ms": torch_s * 1e3, "torch_x_triton": torch_s / triton_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=200_000_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    r = measure(args.numel, args.rounds)
    print(f"{r['numel']:,} elements on {r['device']}: copy bandwidth {r['copy_bandwidth_gbs']:.0f} GB/s")
    print(f"  triton step       {r['triton_ms']:7.2f} ms  {r['triton_x_copy_bandwidth']:.2f} of copy bandwidth")
    print(f"  torch fused+cast  {r['torch_fused_cast_ms']:7.2f} ms  ({r['torch_x_triton']:.2f}x the Triton step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
