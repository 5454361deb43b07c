"""A GPT of over a billion parameters (tied embedding) at stage 3 on 64 ranks of torch's fake process
group, built on ``meta`` and materialized shard by shard: rank 0's measured peak (``zero.profile``)
next to the estimate, at two sequence lengths.

Run in its own process (``python -m tests.distributed.estimate_scale SEQ_LEN``): it initializes the
default process group. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

WORLD_SIZE = 64


def main(seq_len: int) -> None:
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
    model, opt = zero.init_sharded(
        lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), init_fn=init_gpt_weights,
    )
    (x,) = tokens(1)
    with zero.profile(model, opt, every_op=False) as prof:
        for _ in range(2):  # the second step has the optimizer state (the estimate's steady state)
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
    peak = prof.peak
    print(json.dumps({
        "numel": opt.partition.numel,
        "seq_len": seq_len,
        "measured": prof.allocator.peak_without_collectives - prof.samples[0].labels.get("other/alive on entry", 0),
        "categories": {k: v for k, v in peak.categories.items() if v},
        "where": f"{peak.phase} {peak.module} {peak.event}",
        "estimated": e.peak,
        "estimated_categories": {k: v for k, v in e.categories.items() if v},
        "estimated_where": f"{e.phase} {e.module} {e.event}",
        "estimate_s": estimate_s,
        "run_s": time.perf_counter() - start - estimate_s,
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
