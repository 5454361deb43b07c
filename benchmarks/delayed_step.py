"""How far the delayed step of CPU offload (``offload.delayed_step=True``) drifts from synchronous training.

Two copies of the benchmark GPT (same seed, same batches) train with stage 2 and optimizer offload in
one process, one synchronous, one with the one-step delayed update (``zero.runtime.step.delayed``), interleaved step
by step. Printed: each run's loss at a few steps, the largest relative loss gap, the final losses and the
relative distance between the final parameters; and the median step time of each (on a CPU-only machine
the background step competes with forward and backward for the same cores, so expect little gain
there: the mode is meant to hide a host step behind a GPU's forward).

Run::

    python benchmarks/delayed_step.py [--steps 50] [--lr 1e-3] [--d-model 256 --layers 4 --seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from zero import ZeroOptimizer
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import GPT, synthetic_batch


def build(cfg, delayed: bool, lr: float) -> tuple[GPT, ZeroOptimizer]:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=lr, fused=True), model, stage=2,
        offload={"optimizer": "cpu", "delayed_step": delayed},
    )
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", default=None)
    add_gpt_arguments(parser, vocab=256, seq_len=128, d_model=256, layers=4, heads=4)
    args = parser.parse_args()
    cfg = gpt_config(args)
    runs = {"synchronous": build(cfg, False, args.lr), "delayed": build(cfg, True, args.lr)}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.steps):
        x, y = synthetic_batch(step, args.batch, cfg)
        for name, (model, opt) in runs.items():
            start = time.perf_counter()
            loss = model.loss(x, y)
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss.item())
    for _, opt in runs.values():
        opt.flush()
    sync, late = losses["synchronous"], losses["delayed"]
    gaps = [abs(a - b) / abs(a) for a, b in zip(sync, late)]
    params = {name: torch.cat([p.detach().flatten() for p in model.parameters()]) for name, (model, _) in runs.items()}
    distance = ((params["delayed"] - params["synchronous"]).norm() / params["synchronous"].norm()).item()
    n = sum(p.numel() for p in runs["synchronous"][0].parameters())
    print(f"GPT {n / 1e6:.1f}M parameters, stage 2 + optimizer offload, AdamW lr {args.lr}, {args.steps} steps")
    for step in sorted({0, 1, 2, 4, 9, 19, args.steps - 1} & set(range(args.steps))):
        print(f"  step {step + 1:3d}: loss synchronous {sync[step]:.4f}  delayed {late[step]:.4f}")
    print(f"largest relative loss gap {max(gaps):.4f} (step {gaps.index(max(gaps)) + 1}); "
          f"final loss {sync[-1]:.4f} vs {late[-1]:.4f}; parameters differ by {distance:.2e} (relative L2)")
    median = {name: statistics.median(ts[2:]) for name, ts in times.items()}
    print("median step time: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in median.items())
          + f" (delayed / synchronous {median['delayed'] / median['synchronous']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"losses": losses, "largest_gap": max(gaps), "param_distance": distance, "median_s": median}, f)


if __name__ == "__main__":
    main()
