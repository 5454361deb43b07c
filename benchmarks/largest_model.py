"""The largest GPT that completes a training step under a cap on compute-side memory, per configuration.

CPU: rank 0 of ``--world-size`` ranks in torch's fake process group (collectives move no data, every
allocation is real). A probe builds a GPT of ``L`` blocks (width ``--d-model``), runs one bf16 step
(``MixedPrecision(param_dtype="bf16", reduce_dtype="bf16")``, fused AdamW, micro-batch 1, 1 MiB
gradient buckets) under
``zero.profile``, and takes the peak of the bytes the tracker attributes to the compute side:
everything live, less the buffers the optimizer names host-side (``... (host)``: offloaded master
weights, optimizer state, gradient and parameter shards). A binary search finds the largest ``L``
whose peak fits ``--cap-mib``. Contenders: stage 0 (DDP's memory), stages 1, 2 and 3, stage 2 with
the optimizer offloaded (ZeRO-Offload), stage 3 with optimizer and parameters offloaded.

Parameters per GB of the cap are printed next to ZeRO-Offload's 0.41 (13B on a 32 GB V100) and
ZeRO-3 Offload's 1.25 (40B on 32 GB); on a CPU, with a small cap, activations and the transient
buffers of one block weigh more, so compare the contenders with each other. Run::

    python benchmarks/largest_model.py [--cap-mib 16] [--world-size 8] [--d-model 256] [--bucket-mb 1] \\
        [--max-layers 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

CONTENDERS = {
    "stage 0 (DDP)": dict(stage=0),
    "stage 1": dict(stage=1),
    "stage 2": dict(stage=2),
    "stage 3": dict(stage=3),
    "stage 2 + optimizer offload": dict(stage=2, offload={"optimizer": "cpu"}),
    "stage 3 + optimizer & params offload": dict(stage=3, offload={"optimizer": "cpu", "params": "cpu"}),
}
PRECISION = {"param_dtype": "bf16", "reduce_dtype": "bf16"}


def probe(layers: int, d_model: int, settings: dict, bucket_mb: float) -> tuple[int, int]:
    """(compute-side peak bytes, parameters) of one step with a GPT of ``layers`` blocks."""
    import zero
    from zero.models import GPT, GPTConfig, init_gpt_weights, synthetic_batch

    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=d_model, num_layers=layers, num_heads=4)
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)  # noqa: E731
    if settings["stage"] == 3:
        model, opt = zero.init_sharded(lambda: GPT(cfg), make_opt, init_fn=init_gpt_weights, precision=PRECISION,
                                       bucket_size_mb=bucket_mb, **{k: v for k, v in settings.items() if k != "stage"})
    else:
        model = GPT(cfg)
        opt = zero.ZeroOptimizer(make_opt(model), model, precision=PRECISION, bucket_size_mb=bucket_mb, **settings)
    numel = opt.partition.numel
    x, y = synthetic_batch(0, 1, cfg)
    with zero.profile(model, opt, every_op=False) as prof:
        opt.backward(model.loss(x, y))
        opt.step()
    unrelated = prof.samples[0].labels.get("other/alive on entry", 0)  # not the model's (e.g. the batch)
    peak = max(s.total - sum(v for k, v in s.labels.items() if k.endswith("(host)")) for s in prof.samples)
    peak -= unrelated
    del model, opt, prof
    return peak, numel


def largest(cap: int, d_model: int, settings: dict, high: int, bucket_mb: float) -> tuple[int, int]:
    """Binary search on the number of blocks: (blocks, parameters) of the largest model that fits."""
    lo, hi, best = 0, high, (0, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        peak, numel = probe(mid, d_model, settings, bucket_mb)
        if peak <= cap:
            lo, best = mid, (mid, numel)
        else:
            hi = mid - 1
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mib", type=float, default=16)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--max-layers", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="stages 0-2: gradient bucket size")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=args.world_size, store=FakeStore())
    cap = int(args.cap_mib * 2**20)
    print(f"cap {args.cap_mib} MiB of compute-side memory, rank 0 of {args.world_size}, d_model {args.d_model}, "
          "bf16 with fp32 masters, micro-batch 1")
    results = {}
    for name, settings in CONTENDERS.items():
        start = time.perf_counter()
        layers, numel = largest(cap, args.d_model, settings, args.max_layers, args.bucket_mb)
        per_gb = numel / 1e9 / (cap / 1e9)
        results[name] = {"layers": layers, "parameters": numel, "params_per_gb": per_gb}
        print(f"  {name:38s} {layers:4d} blocks {numel / 1e6:8.1f}M parameters  {per_gb:6.2f}B per GB "
              f"({time.perf_counter() - start:.0f} s)")
    ddp = results["stage 0 (DDP)"]["parameters"]
    for name, r in results.items():
        r["times_ddp"] = r["parameters"] / ddp if ddp else None
    print("  (ZeRO-Offload on a 32 GB V100: 0.41B per GB; ZeRO-3 Offload: 1.25B per GB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cap_bytes": cap, "world_size": args.world_size, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
