"""Memory of LoRA on a frozen base at stage 3, per rank: measured with ``zero.profile``, next to the estimator.

A Hugging Face GPT-2 with PEFT LoRA adapters (rank 8 on every attention and MLP projection) trains with
AdamW over the adapters at stage 3, as rank 0 of a world of N in torch's fake process group (collectives
return at once; every byte rank 0 holds is real). For each N it prints:

* the frozen base's share per rank (its shards, padding included) over its bytes / N: stage 3 shards the
  frozen weights too, so this is 1 plus padding;
* the step's measured peak (the allocator's, over what the process held before) and the estimate
  (``zero.estimate`` of the same workload), and their ratio.

Run::

    python benchmarks/lora_memory.py [--world-sizes 2 4 8] [--d-model 256 --layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys

import torch
import torch.distributed as dist

import zero
from zero.estimator import Workload, estimate

VOCAB, SEQ, MICRO_BATCH = 2048, 128, 2


def build(d_model: int, layers: int):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=d_model, n_layer=layers,
                                      n_head=max(1, d_model // 64)))
    config = LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    return get_peft_model(base, config)


def loss_fn(model, x):
    return model(input_ids=x, labels=x).loss


def batch(micro: int) -> tuple:
    return (torch.randint(0, VOCAB, (micro, SEQ), generator=torch.Generator().manual_seed(micro)),)


def adamw(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4)


def measure(world_size: int, d_model: int, layers: int) -> dict:
    """Rank 0 of ``world_size`` in this process (run it in its own process: it sets the default group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    make = lambda: build(d_model, layers)  # noqa: E731
    gc.collect()
    torch.manual_seed(0)
    model = make()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    opt = zero.ZeroOptimizer(adamw(model.parameters()), model, stage=3)
    frozen_shards = sum(b.buffers["shard"].nbytes for b in opt.buckets if not b.trainable)
    with zero.profile(model, opt) as prof:
        for _ in range(2):
            loss_fn(model, *batch(MICRO_BATCH)).backward()
            opt.step()
            opt.zero_grad()
    measured = prof.allocator.peak_without_collectives - prof.samples[0].labels.get("other/alive on entry", 0)
    estimated = estimate(Workload(make, loss_fn, batch, adamw), stage=3, world_size=world_size,
                         micro_batch=MICRO_BATCH).peak
    dist.destroy_process_group()
    return {
        "world_size": world_size,
        "frozen_bytes": frozen,
        "frozen_shard_bytes_per_rank": frozen_shards,
        "frozen_share_over_ideal": frozen_shards / (frozen / world_size),
        "measured_peak": measured,
        "estimated_peak": estimated,
        "estimate_over_measured": estimated / measured,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # (a child process: one world size)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.d_model, args.layers)))
        return
    rows = []
    for n in args.world_sizes:  # one process per world size (each sets its own default group)
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--d-model", str(args.d_model),
                              "--layers", str(args.layers)], capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print("| N | frozen base per rank | ÷ (frozen bytes / N) | measured peak | estimate | estimate / measured |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world_size']} | {r['frozen_shard_bytes_per_rank'] / 2**20:.2f} MiB | "
              f"{r['frozen_share_over_ideal']:.4f} | {r['measured_peak'] / 2**20:.2f} MiB | "
              f"{r['estimated_peak'] / 2**20:.2f} MiB | {r['estimate_over_measured']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
