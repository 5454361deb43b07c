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

from tests.distributed.estimate_world import estimated, measured
from tests.distributed.harness import init_fake_world
from tests.readouts import profiled_steps

WORLD_SIZE = 64


def main(seq_len: int) -> None:
    init_fake_world(WORLD_SIZE)
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
    prof = profiled_steps(model, opt, x, x, every_op=False)  # the second step has the optimizer state (the estimate's)
    print(json.dumps({
        "numel": opt.partition.numel,
        "seq_len": seq_len,
        **measured(prof),
        **estimated(e),
        "estimate_s": estimate_s,
        "run_s": time.perf_counter() - start - estimate_s,
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
