"""Portable checkpoint throughput next to ``torch.save``/``torch.load`` of the same bytes, and the memory
``consolidate`` needs, on a GPT of over 300M parameters.

One process (world size 1; each rank writes its own part in parallel, so N ranks on N disks scale
this). The model takes one AdamW step so that the optimizer state exists, then, interleaved for
``--repeats`` rounds (the ratios printed are medians of each round's ratio, since this machine's disk
and page cache are noisy): ``zero.save_checkpoint`` (every file fsynced, CRC-32 computed), ``torch.save`` of
the model's and the optimizer's state dicts with and without an fsync, ``zero.load_checkpoint`` into a
second model and optimizer (CRCs verified first, then the ranges read), and ``torch.load``. Reads come
from the page cache on a machine with enough memory (the files were just written), for both.

``consolidate`` runs in a child process that samples its own anonymous memory (``RssAnon``, what the
process itself holds; the page cache is not counted) every 5 ms: printed is its peak growth over the
child's baseline after imports, as a multiple of the largest parameter. The exported file is then
compared with the model's parameters, which must be equal bit for bit.

Run::

    python benchmarks/checkpoint_io.py [--d-model 1024 --layers 24 --vocab 50257] [--dir /tmp/ckpt-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import zero
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import GPT, synthetic_batch

CHILD = r"""
import json, sys, threading, time
import zero

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

base, peak, running = anon(), [0], [True]

def sample():
    while running[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)

thread = threading.Thread(target=sample)
thread.start()
start = time.perf_counter()
zero.consolidate(sys.argv[1], sys.argv[2], progress=False)
seconds = time.perf_counter() - start
running[0] = False
thread.join()
print(json.dumps({"baseline": base, "peak_growth": max(peak[0], anon()) - base, "seconds": seconds}))
"""


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build(cfg) -> tuple[GPT, zero.ZeroOptimizer]:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), model, stage=0)
    return model, opt


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def torch_save(obj, path: Path, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def export(checkpoint: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), str(out)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    add_gpt_arguments(parser, vocab=50257, seq_len=16, d_model=1024, layers=24, heads=16)
    args = parser.parse_args()
    cfg = gpt_config(args)
    root = Path(args.dir or tempfile.mkdtemp(prefix="zero-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    model, opt = build(cfg)
    x, y = synthetic_batch(0, 1, cfg)
    model.loss(x, y).backward()
    opt.step()
    opt.zero_grad()
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    print(f"GPT: {numel / 1e6:.0f}M parameters; largest {largest / 1e6:.0f} MB", flush=True)
    model2, opt2 = build(cfg)
    times: dict[str, list[float]] = {
        k: [] for k in ("zero save", "torch.save", "torch.save + fsync", "zero load", "torch.load")
    }
    ckpt, plain = root / "ckpt", root / "plain.pt"
    for _ in range(args.repeats):
        times["zero save"].append(timed(lambda: zero.save_checkpoint(ckpt, model, opt, progress=False)))
        state = {"model": model.state_dict(), "optimizer": opt.inner.state_dict()}
        # state bound as a default: the lambdas must not read the loop's name, which is deleted below
        times["torch.save"].append(timed(lambda state=state: torch_save(state, plain, fsync=False)))
        times["torch.save + fsync"].append(timed(lambda state=state: torch_save(state, plain, fsync=True)))
        del state  # frees the state_dict copies before the loads are timed
        times["zero load"].append(timed(lambda: zero.load_checkpoint(ckpt, model2, opt2, progress=False)))
        times["torch.load"].append(timed(lambda: torch.load(plain, weights_only=True)))
    sizes = {"zero": dir_bytes(ckpt), "torch": plain.stat().st_size}
    rows = {}
    for name, samples in times.items():
        nbytes = sizes["zero" if name.startswith("zero") else "torch"]
        rows[name] = {"seconds": statistics.median(samples), "GB/s": nbytes / statistics.median(samples) / 1e9}
        print(f"{name:>20}: {rows[name]['seconds']:6.2f} s  {rows[name]['GB/s']:5.2f} GB/s  ({nbytes / 1e9:.2f} GB)")
    for ours, theirs in (("zero save", "torch.save"), ("zero save", "torch.save + fsync"), ("zero load", "torch.load")):
        ratios = sorted((sizes["zero"] / a) / (sizes["torch"] / b) for a, b in zip(times[ours], times[theirs]))
        rows[f"{ours} / {theirs}"] = {"median": statistics.median(ratios), "range": [ratios[0], ratios[-1]]}
        print(f"{ours} throughput / {theirs}: median {statistics.median(ratios):.2f} of {len(ratios)} rounds "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    assert torch.equal(torch.cat([p.flatten() for p in model2.parameters()]),
                       torch.cat([p.flatten() for p in model.parameters()]))
    exports = {}
    for out in ("hf", "model.pt"):
        result = export(ckpt, root / out)
        result["peak_growth_x_largest"] = result["peak_growth"] / largest
        exports[out] = result
        print(f"consolidate -> {out}: {result['seconds']:.1f} s, "
              f"peak memory growth {result['peak_growth'] / 1e6:.0f} MB "
              f"= {result['peak_growth_x_largest']:.2f} x the largest parameter "
              f"(baseline {result['baseline'] / 1e6:.0f} MB)")
    exported = zero.load_consolidated(root / "hf")
    same = all(torch.equal(exported[name], value) for name, value in model.state_dict().items())
    print(f"exported safetensors equal the parameters bit for bit: {same}")
    assert same
    result = {"params": numel, "largest_param_bytes": largest, "bytes": sizes, "io": rows, "consolidate": exports}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
