"""The estimator at scale: a GPT of over a billion parameters at stage 3, rank 0 of 64 in torch's fake process group.

The model (vocabulary 50304, width 2048, 20 layers, 16 heads, tied embedding: 1.1B parameters) is built on ``meta``
and materialized shard by shard; for each sequence length, ``zero.estimate`` prices one step on fake tensors (timed),
then ``zero.profile`` measures two real steps of rank 0 (the second has the optimizer state, as the estimate does).
Collectives of the fake process group return at once and move nothing, so every byte rank 0 holds is real. Reported:
estimate / measured (the allocator's peak over what the process held on entry, collectives' own buffers left out)
and the estimate's wall time. Each sequence length runs in its own process (the fake group is the default one).

Run (about 4 minutes on 2 cores)::

    python benchmarks/estimate_scale.py [--seq-lens 64,512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.distributed as dist

WORLD_SIZE = 64


def one(seq_len: int) -> dict:
    """This process as rank 0 of the fake world: the estimate and the measurement at ``seq_len``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD_SIZE, store=FakeStore())
    import zero
    from zero.estimator import Workload, estimate
    from zero.models import GPT, GPTConfig, init_gpt_weights

    cfg = GPTConfig(vocab_size=50304, seq_len=seq_len, d_model=2048, num_layers=20, num_heads=16)
    tokens = lambda micro: (torch.zeros(micro, seq_len, dtype=torch.long),)  # noqa: E731
    start = time.perf_counter()
    e = estimate(Workload(lambda: GPT(cfg), lambda m, x: m.loss(x, x), tokens), stage=3, world_size=WORLD_SIZE,
                 micro_batch=1)
    estimate_s = time.perf_counter() - start
    torch.manual_seed(0)
    model, opt = zero.init_sharded(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4),
                                   init_fn=init_gpt_weights)
    (x,) = tokens(1)
    with zero.profile(model, opt, every_op=False) as prof:
        for _ in range(2):
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    measured = prof.allocator.peak_without_collectives - prof.samples[0].labels.get("other/alive on entry", 0)
    dist.destroy_process_group()
    return {"numel": opt.partition.numel, "seq_len": seq_len, "estimated": e.peak, "measured": measured,
            "ratio": e.peak / measured, "estimate_s": estimate_s, "run_s": time.perf_counter() - start - estimate_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", default="64,512", help="comma-separated sequence lengths")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one)))
        return
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        print(f"sequence length {seq_len}: estimating and measuring rank 0 of {WORLD_SIZE} ...", flush=True)
        done = subprocess.run([sys.executable, __file__, "--one", str(seq_len)], capture_output=True, text=True,
                              check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"  {r['numel'] / 1e9:.2f}B parameters: estimate / measured {r['ratio']:.7f} "
              f"({r['estimated'] / 2**30:.3f} / {r['measured'] / 2**30:.3f} GiB), estimate in {r['estimate_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": WORLD_SIZE, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
