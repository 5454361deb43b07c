"""Partial offload's step against full offload and the resident model, under device-memory caps, in one run.

For each GPT and cap: ``zero.init_sharded`` at stage 3, bf16 parameters over fp32 masters, activation checkpointing,
fused AdamW, one rank; three configurations, each trained ``--steps`` steps after one warm-up step:

* ``resident``: nothing offloaded (recorded as not fitting where it runs out of memory under the cap);
* ``full``: ``offload={"optimizer": "cpu", "params": "cpu"}``;
* ``auto``: the same with ``ratio="auto"`` and ``gpu_memory`` the cap (``zero.auto_ratio``: the least offload whose
  estimated peak fits 0.9 of it).

Each row gives the median step, its forward and backward, the host step (the offloaded buckets' updates, timed where
the runtime steps them), the transfers (bytes this configuration moves between host and device per step over the
copy bandwidths measured in the same run: gradients down and bf16 parameters up for each offloaded element, and each
offloaded parameter shard copied up for its two gathers), the ratio, and the peak. The overlap limit of ``auto`` is
the slowest of three measured alone: the device's compute (the resident step where it fits, else ``auto``'s forward
and backward), ``auto``'s host step and its transfers. Targets (issue 35): ``auto``'s step within 1.3x of that limit,
and at least 3x faster than ``full`` where at least half the optimizer side is on the device (ratio <= 0.5).

On a GPU (the caps set with ``torch.cuda.set_per_process_memory_fraction``)::

    python benchmarks/offload_speed.py --models 1.28B,2.6B --caps 4,8,16 --json $OUT/offload_speed.json

On the CPU at toy size (``--caps mid``: halfway between the estimated peaks of the resident and the fully offloaded
step; the device and the host are one memory, so this checks the machinery and the host step, not the overlap)::

    python benchmarks/offload_speed.py --device cpu --models toy --caps mid --steps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import zero  # noqa: E402
from zero.estimator import Workload, estimate  # noqa: E402
from zero.models import GPT, GPTConfig, init_gpt_weights, synthetic_batch  # noqa: E402

MODELS = {  # (d_model, blocks, heads, vocabulary, tokens per sequence, sequences)
    "1.28B": (2048, 24, 16, 32768, 1024, 4),
    "2.6B": (2560, 32, 20, 32768, 1024, 4),
    "toy": (64, 4, 2, 128, 16, 2),
}
SETTINGS = {"precision": {"param_dtype": "bf16"}, "activation_checkpointing": {}, "bucket_size_mb": 25}
FULL = {"optimizer": "cpu", "params": "cpu"}


def model_config(name: str) -> tuple[GPTConfig, int]:
    d, layers, heads, vocab, seq, batch = MODELS[name]
    return GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d, num_layers=layers, num_heads=heads), batch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidths(device: torch.device, nbytes: int = 256 * 2**20) -> dict[str, float]:
    """Bytes per second of a pinned host buffer copied to the device and back (median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (dst, src) in {"up": (dev, host), "down": (host, dev)}.items():
        times = []
        for _ in range(5):
            sync(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - start)
        out[name] = nbytes / statistics.median(times)
    return out


def build(cfg: GPTConfig, batch: tuple, device: torch.device, offload: dict) -> tuple:
    auto = offload.get("ratio") == "auto"
    example = zero.StepExample(loss=lambda m, x, y: m.loss(x, y), batch=batch) if auto else None
    return zero.init_sharded(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True),
                             init_fn=init_gpt_weights, device=device, offload=offload, example=example, **SETTINGS)


def measure(cfg: GPTConfig, batch: tuple, device: torch.device, offload: dict, steps: int,
            bandwidth: dict[str, float]) -> dict:
    """One configuration's figures (see the module docstring)."""
    model, opt = build(cfg, batch, device, offload)
    stepper = opt.runtime.update.stepper
    host_s = [0.0]

    def timed_step(bucket, step_kwargs, step=stepper.step):  # the host's part: the offloaded buckets' updates
        start = time.perf_counter()
        step(bucket, step_kwargs)
        if bucket.offloaded:
            host_s[0] += time.perf_counter() - start

    stepper.step = timed_step  # (this instance only: the figures' instrument)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows = []
    for _ in range(steps + 1):
        host_s[0] = 0.0
        sync(device)
        start = time.perf_counter()
        model.loss(*batch).backward()
        sync(device)
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync(device)
        rows.append((time.perf_counter() - start, backward - start, host_s[0]))
    rows = rows[1:]
    held = [b for b in opt.partition.trainable_buckets if b.offloaded]
    offloaded = sum(b.layout.chunk_numel for b in held)
    down = sum(b.layout.chunk_numel * b.dtypes.reduce.itemsize for b in held)
    gathers = 2 * opt.config.offload.params_on_host  # each offloaded parameter shard goes up for two gathers
    up = sum(b.layout.chunk_numel * b.dtypes.compute.itemsize for b in held) * (1 + gathers)
    result = {
        "ratio": opt.config.offload.ratio if opt.config.offload.optimizer_on_host else 0.0,
        "offloaded_elements": offloaded,
        "step_s": statistics.median(r[0] for r in rows),
        "forward_backward_s": statistics.median(r[1] for r in rows),
        "host_step_s": statistics.median(r[2] for r in rows),
        "transfers_s": down / bandwidth["down"] + up / bandwidth["up"],
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    opt.close()
    return result


def midpoint_budget(cfg: GPTConfig, batch_size: int) -> float:
    """Halfway between the estimated peaks of the resident and the fully offloaded step (the toy's cap), in bytes."""
    workload = Workload(lambda: GPT(cfg), lambda m, x, y: m.loss(x, y), lambda n: synthetic_batch(0, n, cfg))
    kw = dict(stage=3, world_size=1, micro_batch=batch_size, precision="mixed-fp32-reduce", checkpointing=True)
    peaks = [estimate(workload, **kw).peak, estimate(workload, offload="cpu", params_offload="cpu", **kw).peak]
    return sum(peaks) / 2


def run_cap(name: str, cap: str, device: torch.device, steps: int, bandwidth: dict[str, float]) -> dict:
    cfg, batch_size = model_config(name)
    batch = tuple(t.to(device) for t in synthetic_batch(0, batch_size, cfg))
    budget = midpoint_budget(cfg, batch_size) if cap == "mid" else float(cap) * 2**30
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(device)
                                                       .total_memory), device)
    row: dict = {"model": name, "cap_bytes": budget}
    for label, offload in (("resident", {}), ("full", FULL), ("auto", {**FULL, "ratio": "auto",
                                                                        "gpu_memory": budget})):
        try:
            row[label] = measure(cfg, batch, device, offload, steps, bandwidth)
        except torch.OutOfMemoryError:
            row[label] = {"error": "out of memory under the cap"}
        except ValueError as err:  # auto: even full offload does not fit
            row[label] = {"error": str(err)}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{name} cap {budget / 2**30:.3g} GiB {label}: {row[label]}", flush=True)
    row["targets"] = targets(row)
    return row


def targets(row: dict) -> dict:
    auto, full, resident = row["auto"], row["full"], row["resident"]
    if "error" in auto:
        return {}
    compute = resident["step_s"] if "error" not in resident else auto["forward_backward_s"]
    limit = max(compute, auto["host_step_s"], auto["transfers_s"])
    out = {"overlap_limit_s": limit, "auto_x_limit": auto["step_s"] / limit, "auto_within_1.3x": None}
    out["auto_within_1.3x"] = out["auto_x_limit"] <= 1.3
    if "error" not in full:
        out["full_x_auto"] = full["step_s"] / auto["step_s"]
        if auto["ratio"] <= 0.5:
            out["auto_3x_faster_than_full"] = out["full_x_auto"] >= 3
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1.28B,2.6B", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--caps", default="4,8,16", help="GiB, comma-separated, or 'mid'")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    bandwidth = copy_bandwidths(device)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "copy_bandwidth": bandwidth, "rows": []}
    for name in args.models.split(","):
        for cap in args.caps.split(","):
            result["rows"].append(run_cap(name, cap, device, args.steps, bandwidth))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
