"""Activation checkpointing policies on the benchmark GPT: peak activation bytes (``zero.profile``) and step
time, each against no checkpointing, measured in one run.

For each policy (none; every block; every 2nd block; selective: matmul outputs saved; every block with its
input offloaded to host; the plan :func:`zero.blocks_within_budget` picks for a budget of 60% of the
unchecked activations) the GPT is trained with ``ZeroOptimizer`` (stage 2, world size 1):

* peak activations: the largest ``activations`` figure over two profiled steps (every operator sampled),
  as a ratio to no checkpointing, next to the estimator's prediction for the plan
  (:func:`zero.estimator.activation_budget.saved_activation_bytes`), and the largest live total;
* step time: median of ``--steps`` steps, the policies interleaved step by step, as a ratio to none
  (target: every block <= 1.4x; selective in between).

    python benchmarks/activation_checkpointing.py [--steps 10] [--layers 8 --d-model 256 --seq-len 128 --batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zero
from zero import ZeroOptimizer
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.estimator.activation_budget import saved_activation_bytes
from zero.estimator.estimator import trace
from zero.models import GPT, synthetic_batch


def build(cfg, policy):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=2, activation_checkpointing=policy)
    return model, opt


def one_step(model, opt, x, y) -> None:
    model.loss(x, y).backward()
    opt.step()
    opt.zero_grad()


def peaks(cfg, policy, batch: int) -> tuple[int, int]:
    """The largest ``activations`` figure and the largest live total (the allocator's figure) over one step.
    (Selective checkpointing keeps its saved matmul outputs in its own cache, which the tracker does not
    attribute to activations: the total shows them.)"""
    model, opt = build(cfg, policy)
    with zero.profile(model, opt) as prof:
        one_step(model, opt, *synthetic_batch(0, batch, cfg))
    return max(s.categories["activations"] for s in prof.samples), max(s.allocated for s in prof.samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    add_gpt_arguments(parser, vocab=512, seq_len=128, d_model=256, layers=8, heads=4)
    args = parser.parse_args()
    cfg = gpt_config(args)
    x, y = synthetic_batch(0, args.batch, cfg)
    traced = trace(lambda: GPT(cfg), lambda m, a, b: m.loss(a, b), (x, y))
    blocks = [f"blocks.{i}" for i in range(cfg.num_layers)]
    budget = 0.6 * traced.activation_bytes
    planned = zero.blocks_within_budget(traced, budget)
    policies = {
        "none": (None, []),
        "every block": ({}, blocks),
        "every 2nd block": ({"every": 2}, blocks[1::2]),
        "selective": ({"selective": True}, blocks),
        "inputs offloaded": ({"offload_inputs": True}, blocks),
        f"budget ({len(planned)} blocks)": ({"modules": list(planned)}, list(planned)),
    }
    measured = {name: peaks(cfg, policy, args.batch) for name, (policy, _) in policies.items()}
    runs = {name: build(cfg, policy) for name, (policy, _) in policies.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.steps + 2):
        x, y = synthetic_batch(step, args.batch, cfg)
        names = list(runs)
        for name in names[step % len(names):] + names[: step % len(names)]:
            start = time.perf_counter()
            one_step(*runs[name], x, y)
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    n = sum(p.numel() for p in runs["none"][0].parameters())
    print(f"GPT {n / 1e6:.1f}M parameters, {cfg.num_layers} blocks, batch {args.batch} x {cfg.seq_len}, stage 2, "
          f"{torch.get_num_threads()} threads; budget {budget / 2**20:.1f} MiB (60% of the unchecked estimate)")
    (base_act, base_total), base_time = measured["none"], statistics.median(times["none"])
    print(f"{'policy':<26}{'activations':>15}{'x none':>8}{'predicted':>11}{'peak total':>14}{'x none':>8}"
          f"{'step time':>11}{'x none':>8}")
    for name, (policy, chosen) in policies.items():
        selective = bool(policy and policy.get("selective"))
        predicted = f"{saved_activation_bytes(traced, chosen, selective) / traced.activation_bytes:.2f}"
        act, total = measured[name]
        t = statistics.median(times[name])
        print(f"{name:<26}{act / 2**20:>11.1f} MiB{act / base_act:>8.2f}{predicted:>11}{total / 2**20:>10.1f} MiB"
              f"{total / base_total:>8.2f}{t * 1e3:>8.0f} ms{t / base_time:>8.2f}")
    act = measured[f"budget ({len(planned)} blocks)"][0]
    print(f"budget plan {list(planned)}: measured {act / 2**20:.1f} MiB of activations "
          f"= {act / budget:.2f} x the budget")


if __name__ == "__main__":
    main()
