"""Offload to disk (ZeRO-Infinity) against the disk it runs on: bandwidth, traffic, step time, host memory, model size.

World size 1, CPU; stage 3 with ``offload={"params": "disk", "path": DIR, "buffer_count": B}``, fused AdamW, no
clipping, one micro-batch, ``zero_grad()`` after each step; GPTs built on meta by ``zero.init_sharded`` (materialized
shard by shard, never whole). Measured in one run:

1. **Sequential bandwidth** under ``--path``: a ``--bandwidth-gib`` file written in big blocks and fsync'ed, dropped
   from the page cache (``POSIX_FADV_DONTNEED``), read back, deleted.
2. **Disk traffic per step / theory**: ``/proc/self/io`` ``read_bytes`` and ``write_bytes`` (all threads; a page is
   counted written when dirtied, whenever write-back runs), for forward+backward and for the step, each started cold
   (the offload file, ``opt.runtime.placements.disk.file.path``, fsync'ed and dropped from the page cache), after
   ``--warmup`` steps (a never-written region reads without I/O). Theory per element of the rank's chunk of each
   bucket, from its buffers' dtypes: ``s`` parameter shard, ``g`` gradient shard (reduce dtype), ``m`` master, ``mg``
   the plan's ``master_grad`` (only when the reduce dtype is not the master's), ``st`` the optimizer's per-element
   state (Adam: ``exp_avg`` + ``exp_avg_sq``)::

       forward+backward  reads   k * s    k gathers: 2 (reshard_after_forward, the default), but 1 for the root unit
                                          (kept gathered until the step) and for the unit that runs last in forward
                                          (it goes straight into backward)
                         writes  g        the reduced gradient shard, once
       step              reads   g + mg + m + s + st    (mg written by make_master_grads, then read)
                         writes  mg + m + s + st        (the gradient shard is only read)

   fp32: 2*4 | 4 | 20 | 16 bytes; bf16 (fp32 reduce and master: no ``master_grad``): 2*2 | 4 | 18 | 14. No page
   rounding (the header page and each region's rounding are measured, negligible here). Ratios are reported as they
   come out; to locate a gap, reads inside ``Stage3.unshard`` (the all-gathers) and ``finish_reduce`` (the gradient
   write-out) are counted too, by wrapping those methods on the stage instance.
3. **Step time / disk time** = wall time of ``step()`` / (reads / read MB/s + writes / write MB/s) of its measured
   traffic. The step returns with writes queued; an fsync right after it is timed too (``+ flush``).
4. **Peak RSS during the step / (window + largest unit)**: the larger of RSS (``/proc/self/statm``, anonymous and
   mapped file pages) sampled by a thread every ``--sample-ms`` and ``VmHWM`` (reset before the step by
   ``clear_refs`` 5), less the RSS before the step (also: less the RSS after it); over the ``buffer_count`` largest
   buckets' on-disk bytes plus the largest unit's whole parameters.
5. **Largest GPT under ``--budget-mib``**, disk against ``{"params": "cpu"}``: a subprocess per candidate (imports; a
   1-block warm-up step, so that code pages and thread pools are not charged to the model, unless ``--cold-baseline``;
   baseline RSS; build, 2 steps) fits if it does not fail and its peak (``VmHWM``, or sampled) over the baseline is
   within the budget. Blocks are doubled until one does not fit, then bisected (``--max-layers``: a lower bound).

Targets: step <= 1.3x disk time; peak RSS <= 1.2x (window + largest unit); largest model >= 10x CPU offload's.

On CPU the model's "device" memory (gathered units, activations, gradients) is host memory too, allocated through
glibc, whose mmap threshold rises as large blocks are freed, so later blocks of that size come from its heap and stay
resident once freed. ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment fixes the threshold (large blocks are
mapped and given back when freed); the run records any ``MALLOC_*`` setting, and the figures are published both ways.

The README's figures: ``MALLOC_MMAP_THRESHOLD_=65536 ... --json benchmarks/results/disk_offload.json``, then
``python benchmarks/render_results.py --write``.

Run (the second line: toy size, about two minutes)::

    python benchmarks/disk_offload.py --path /local_nvme/zero-bench [--json out.json] [--bandwidth-gib 1] ...
    python benchmarks/disk_offload.py --path /tmp/zb --bandwidth-gib 0.25 --vocab 256 --seq-len 16 --d-model 256 \\
        --layers 4 --heads 4 --budget-mib 128 --search-d-model 128 --search-heads 4 --max-layers 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

import zero
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import GPT, GPTConfig, init_gpt_weights, synthetic_batch
from zero.runtime.buffers.placement import Where

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
PRECISIONS = {"fp32": {}, "bf16": {"param_dtype": "bf16"}}
OFFLOADS = {"disk": lambda path, count: {"params": "disk", "path": path, "buffer_count": count},
            "cpu": lambda path, count: {"params": "cpu"}}
TARGETS = {"step_x_disk": 1.3, "peak_x_window": 1.2, "largest_x_cpu": 10.0}
KEEP: list = []  # built models, kept until exit: dropping or closing a stage-3 optimizer gathers the whole model
on_disk = lambda buffer: buffer is not None and buffer.placement.where is Where.DISK  # noqa: E731


def proc_io() -> dict[str, int]:
    """This process's storage counters (``/proc/self/io``: ``read_bytes``, ``write_bytes``..., all threads)."""
    lines = Path("/proc/self/io").read_text().splitlines()
    return {key: int(value) for key, value in (line.split(":") for line in lines if ":" in line)}


def rss() -> int:
    """Resident bytes now (anonymous and mapped file pages)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE_SIZE


def status_bytes(field: str) -> int:
    """A size from ``/proc/self/status`` (``VmHWM``, ``VmRSS``, ``RssFile``...), in bytes."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5); False where that is not permitted."""
    try:
        return Path("/proc/self/clear_refs").write_text("5") == 1
    except OSError:
        return False


@contextmanager
def sample_rss(interval_s: float = 1e-3) -> Iterator[dict[str, int]]:
    """``{"peak", "samples"}``: the largest RSS a thread sees, sampling every ``interval_s`` while the block runs."""
    seen, stop = {"peak": rss(), "samples": 0}, threading.Event()

    def run() -> None:
        while not stop.is_set():
            seen["peak"], seen["samples"] = max(seen["peak"], rss()), seen["samples"] + 1
            stop.wait(interval_s)
    (thread := threading.Thread(target=run, daemon=True)).start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()
        seen["peak"] = max(seen["peak"], rss())


def drop_cache(path: str | os.PathLike) -> float:
    """Write the file's dirty pages, then drop its pages from the page cache (pages still mapped stay); seconds."""
    start, fd = time.perf_counter(), os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return time.perf_counter() - start


def disk_bandwidth(directory: str | os.PathLike, nbytes: int, block: int) -> dict:
    """Sequential write (fsync'ed) and cold read of an ``nbytes`` file in ``directory``; MB/s are 1e6 bytes/s."""
    path = Path(directory) / f"zero-bandwidth-{os.getpid()}.bin"
    data = torch.randint(0, 256, (block,), dtype=torch.uint8).numpy().tobytes()  # not compressible
    out, fd = memoryview(bytearray(block)), os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        start, done = time.perf_counter(), 0
        while done < nbytes:
            done += os.write(fd, data[: min(block, nbytes - done)])
        os.fsync(fd)
        write_s = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start, read = time.perf_counter(), 0
        while n := os.readv(fd, [out]):
            read += n
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return {"bytes": nbytes, "block": block, "write_s": write_s, "read_s": read_s,
            "write_MBps": nbytes / write_s / 1e6, "read_MBps": read / read_s / 1e6}


def theory(opt: zero.ZeroOptimizer, last_unit: torch.nn.Module | None) -> dict:
    """Disk bytes per step as the module docstring derives them from each bucket's buffers' dtypes (``last_unit``: the
    unit that runs last in forward); also gathers, bytes per element by role, the window's and largest unit's bytes."""
    reshard = opt.runtime.config.reshard_after_forward
    out = {"forward_backward": {"read": 0, "write": 0}, "step": {"read": 0, "write": 0}, "gathers": 0}
    per_element, bucket_bytes, unit_bytes = [], [], {}
    for bucket in opt.runtime.partition.trainable_buckets:
        states = opt.runtime.paging.state.regions.get(bucket.index, {})  # the optimizer's, by key
        roles = {k: bucket.buffers[k] for k in ("shard", "grad_shard", "master", "master_grad") if k in bucket.buffers}
        roles.update(states)
        n, size = bucket.layout.chunk_numel, {k: b.dtype.itemsize for k, b in roles.items() if on_disk(b)}
        state, mg = sum(size[k] for k in states), size.get("master_grad", 0)
        gathers = 1 if not reshard or bucket.unit.name == "" or bucket.unit.module is last_unit else 2
        out["gathers"] += gathers
        out["forward_backward"]["read"] += n * gathers * size["shard"]
        out["forward_backward"]["write"] += n * size["grad_shard"]
        out["step"]["read"] += n * (size["grad_shard"] + mg + size["master"] + size["shard"] + state)
        out["step"]["write"] += n * (mg + size["master"] + size["shard"] + state)
        per_element += [size] if size not in per_element else []
        bucket_bytes.append(n * sum(size.values()))
        unit_bytes[id(bucket.unit)] = unit_bytes.get(id(bucket.unit), 0) + bucket.param_buffer.nbytes
    count = opt.runtime.config.offload.buffer_count
    return {**out, "per_element": per_element, "elements": opt.runtime.partition.padded_numel, "buffer_count": count,
            "window_bytes": sum(sorted(bucket_bytes)[-count:]), "largest_unit_bytes": max(unit_bytes.values())}


def count_reads(stage, counts: dict[str, int]) -> None:
    """Add to ``counts`` the bytes read inside ``Stage3.unshard`` (the all-gathers), their number, and the bytes
    read inside ``finish_reduce`` (the gradient write-out), by wrapping the two methods on the stage instance."""
    def wrap(method, key):
        def wrapped(*args, **kwargs):
            before = proc_io()["read_bytes"]
            try:
                return method(*args, **kwargs)
            finally:
                counts[key] += proc_io()["read_bytes"] - before
                counts["gathers"] += key == "gather_reads"
        return wrapped
    counts.update(gather_reads=0, grad_write_reads=0, gathers=0)
    stage.unshard = wrap(stage.unshard, "gather_reads")
    stage.finish_reduce = wrap(stage.finish_reduce, "grad_write_reads")


def build(cfg: GPTConfig, precision: str, offload: dict) -> tuple[GPT, zero.ZeroOptimizer]:
    model, opt = zero.init_sharded(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), fused=True),
                                   init_fn=init_gpt_weights, precision=PRECISIONS[precision], offload=offload)
    KEEP.append((model, opt))
    return model, opt


def measure_steps(args: argparse.Namespace, cfg: GPTConfig, precision: str, bandwidth: dict) -> dict:
    model, opt = build(cfg, precision, OFFLOADS["disk"](args.path, args.buffer_count))
    path, expected, inside, rows = opt.runtime.placements.disk.file.path, theory(opt, model.blocks[-1]), {}, []
    count_reads(opt.runtime.stage, inside)
    for step in range(args.warmup + args.steps):
        drop_cache(path)
        a, start_counts = proc_io(), dict(inside)
        model.loss(*synthetic_batch(step, args.batch, cfg)).backward()
        b, fb_inside = proc_io(), {k: v - start_counts[k] for k, v in inside.items()}
        drop_cache(path)
        b2, before, file_before, hwm = proc_io(), rss(), status_bytes("RssFile"), reset_peak_rss()
        with sample_rss(args.sample_ms / 1e3) as sampler:
            start = time.perf_counter()
            opt.step()
            step_s = time.perf_counter() - start
        c, after, peak = proc_io(), rss(), max(sampler["peak"], status_bytes("VmHWM") if hwm else 0)
        file_after, flush_s = status_bytes("RssFile"), drop_cache(path)
        opt.zero_grad()
        if step >= args.warmup:
            rows.append({"fb_read": b["read_bytes"] - a["read_bytes"], "fb_write": b["write_bytes"] - a["write_bytes"],
                         "step_read": c["read_bytes"] - b2["read_bytes"],
                         "step_write": c["write_bytes"] - b2["write_bytes"], **fb_inside, "step_s": step_s,
                         "flush_s": flush_s, "peak_over_before": peak - before, "peak_over_after": peak - after,
                         "file_pages_unmapped_by_step": file_before - file_after, "rss_samples": sampler["samples"]})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    disk_s = med["step_read"] / (bandwidth["read_MBps"] * 1e6) + med["step_write"] / (bandwidth["write_MBps"] * 1e6)
    fb, st = expected["forward_backward"], expected["step"]
    window = expected["window_bytes"] + expected["largest_unit_bytes"]
    return {"precision": precision, "theory": expected, "measured": med, "steps": rows, "disk_s": disk_s,
            "fb_read_x": med["fb_read"] / fb["read"], "gather_read_x": med["gather_reads"] / fb["read"],
            "grad_write_read_mib": med["grad_write_reads"] / 2**20, "fb_write_x": med["fb_write"] / fb["write"],
            "gathers_x": med["gathers"] / expected["gathers"], "step_read_x": med["step_read"] / st["read"],
            "step_write_x": med["step_write"] / st["write"], "step_s": med["step_s"],
            "step_x_disk": med["step_s"] / disk_s, "step_flush_x_disk": (med["step_s"] + med["flush_s"]) / disk_s,
            "peak_mib": med["peak_over_before"] / 2**20, "window_mib": window / 2**20,
            "peak_x_window": med["peak_over_before"] / window, "peak_after_x_window": med["peak_over_after"] / window}


def probe_main(spec: dict) -> None:
    """The child: baseline, then the peak RSS of building ``spec``'s model and training 2 steps; one JSON line."""
    torch.set_num_threads(spec["threads"])

    def train(layers: int, steps: int) -> tuple[int, zero.ZeroOptimizer]:
        cfg = GPTConfig(spec["vocab"], spec["seq_len"], spec["d_model"], layers, spec["heads"])
        model, opt = build(cfg, spec["precision"], OFFLOADS[spec["kind"]](spec["path"], spec["buffer_count"]))
        built, _ = status_bytes("VmHWM"), reset_peak_rss()
        for step in range(steps):
            model.loss(*synthetic_batch(step, spec["batch"], cfg)).backward()
            opt.step()
            opt.zero_grad()
        return built, opt

    imports = rss()
    if not spec["cold"]:
        train(1, 1)[1].close()  # (gathers the 1-block model back and removes its file)
        KEEP.clear()
        gc.collect()
    baseline, _ = rss(), reset_peak_rss()
    with sample_rss(spec["sample_ms"] / 1e3) as sampler:
        built, opt = train(spec["layers"], 2)
        trained = status_bytes("VmHWM")
    peaks = {"build_peak": built, "train_peak": trained, "sampled_peak": sampler["peak"]}
    print(json.dumps({"params": opt.partition.numel, "rss_imports": imports, "baseline": baseline,
                      "peak": max(peaks.values()) - baseline, **{k: v - baseline for k, v in peaks.items()}}))


def run_probe(args: argparse.Namespace, kind: str, layers: int) -> dict:
    spec = {k: getattr(args, "search_" + k) for k in ("precision", "batch", "vocab", "seq_len", "d_model", "heads")}
    spec.update(kind=kind, layers=layers, path=args.path, buffer_count=args.buffer_count, threads=args.threads,
                sample_ms=args.sample_ms, cold=args.cold_baseline)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--probe", json.dumps(spec)], capture_output=True,
                              text=True, timeout=args.probe_timeout)
        lines = done.stdout.strip().splitlines()
        result = json.loads(lines[-1]) if done.returncode == 0 and lines else {
            "error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
    except subprocess.TimeoutExpired:
        result = {"error": f"ran past --probe-timeout {args.probe_timeout} s"}
    fits = "error" not in result and result["peak"] <= args.budget_mib * 2**20
    result.update(kind=kind, layers=layers, seconds=time.perf_counter() - start, fits=fits)
    shown = (f"{result['params'] / 1e6:9.2f}M params, peak {result['peak'] / 2**20:7.1f} MiB (building "
             f"{result['build_peak'] / 2**20:.1f}, training {result['train_peak'] / 2**20:.1f})"
             if "error" not in result else f"failed: {result['error'][:120]}")
    print(f"  {kind} {layers:4d} blocks: {shown}, {'fits' if fits else 'no'} ({result['seconds']:.0f} s)", flush=True)
    return result


def largest(args: argparse.Namespace, kind: str) -> dict:
    """Double the blocks until a candidate does not fit (or past ``--max-layers``), then bisect."""
    probes, best, layers, failed = [], None, 1, None
    while layers <= args.max_layers and failed is None:
        probes.append(run_probe(args, kind, layers))
        best, failed, layers = (probes[-1], None, layers * 2) if probes[-1]["fits"] else (best, layers, layers)
    low, high = (best["layers"] if best else 0), (failed or args.max_layers + 1)
    while high - low > 1:
        p = run_probe(args, kind, (low + high) // 2)
        probes.append(p)
        best, low, high = (p, p["layers"], high) if p["fits"] else (best, low, p["layers"])
    return {"layers": (best or {}).get("layers", 0), "params": (best or {}).get("params", 0), "capped": not failed,
            "probes": probes}


def machine(args: argparse.Namespace) -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    stat = os.statvfs(args.path)
    return {"device": names[0] if names else platform.machine(), "cpu_count": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PHYS_PAGES") * PAGE_SIZE, "path": str(Path(args.path).resolve()),
            "disk_free_bytes": stat.f_bavail * stat.f_frsize, "kernel": platform.release(),
            "torch": torch.__version__, "python": platform.python_version(),
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},  # glibc's knobs, if set
            "options": {k: v for k, v in vars(args).items() if k != "probe"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--path", required="--probe" not in (sys.argv if argv is None else argv),
                   help="a directory on the disk to measure (files are made and removed there)")
    p.add_argument("--json", default=None, help="write every figure, the machine and the options here")
    for flag, kind, default, what in (
        ("--bandwidth-gib", float, 1.0, "size of the bandwidth test file"), ("--block-mib", int, 64, "its blocks"),
        ("--buffer-count", int, 2, "offload.buffer_count"), ("--precisions", str, "fp32,bf16", "traffic runs"),
        ("--steps", int, 3, "measured steps per precision"), ("--warmup", int, 2, "steps before them"),
        ("--batch", int, 1, "micro-batch"), ("--threads", int, 1, "torch threads"),
        ("--sample-ms", float, 1.0, "RSS sampling interval"), ("--budget-mib", float, 512, "5.'s budget"),
        ("--search-precision", str, "fp32", "5.: fp32 or bf16"), ("--search-d-model", int, 512, "5.: width"),
        ("--search-heads", int, 8, "5."), ("--search-vocab", int, 1024, "5."), ("--search-seq-len", int, 16, "5."),
        ("--search-batch", int, 1, "5."), ("--max-layers", int, 128, "5.: largest candidate (bounds its time)"),
        ("--probe-timeout", float, 600, "5.: seconds per candidate"),
    ):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
    add_gpt_arguments(p, vocab=4096, seq_len=64, d_model=768, layers=8, heads=12)
    p.add_argument("--skip-search", action="store_true", help="skip 5.")
    p.add_argument("--cold-baseline", action="store_true", help="5.: baseline right after the imports")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.probe is not None:
        return probe_main(json.loads(args.probe))
    torch.set_num_threads(args.threads)
    Path(args.path).mkdir(parents=True, exist_ok=True)
    cfg = gpt_config(args)
    out = {"run": machine(args), "config": vars(cfg), "targets": TARGETS, "traffic": {}}
    print(f"1. bandwidth: writing and reading {args.bandwidth_gib} GiB under {out['run']['path']}", flush=True)
    bw = out["bandwidth"] = disk_bandwidth(args.path, int(args.bandwidth_gib * 2**30), args.block_mib * 2**20)
    for precision in args.precisions.split(","):
        print(f"2-4. {precision}: {cfg}, buffer_count {args.buffer_count}", flush=True)
        r = out["traffic"][precision] = measure_steps(args, cfg, precision, bw)
        print(f"  {r['theory']['elements'] / 1e6:.2f}M elements, bytes each: {r['theory']['per_element']}", flush=True)
    if not args.skip_search:
        print(f"5. largest GPT under {args.budget_mib} MiB, d_model {args.search_d_model}", flush=True)
        found = out["largest"] = {kind: largest(args, kind) for kind in ("cpu", "disk")}
        out["largest_x_cpu"] = found["disk"]["params"] / found["cpu"]["params"] if found["cpu"]["params"] else None
    print("\n" + report(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))


ROWS = (("fwd+bwd reads / theory", "fb_read_x"), ("  inside the all-gathers / theory", "gather_read_x"),
        ("  inside gradient write-out, MiB", "grad_write_read_mib"), ("fwd+bwd writes / theory", "fb_write_x"),
        ("gathers / theory", "gathers_x"), ("step reads / theory", "step_read_x"),
        ("step writes / theory", "step_write_x"), ("step time, s", "step_s"), ("step / disk time", "step_x_disk"),
        ("(step + flush) / disk time", "step_flush_x_disk"), ("peak RSS over before the step, MiB", "peak_mib"),
        ("window + largest unit, MiB", "window_mib"), ("peak over before / (window + unit)", "peak_x_window"),
        ("peak over after / (window + unit)", "peak_after_x_window"))


def verdict(value: float, key: str) -> str:
    """`` (<= limit PASS)`` for a figure with a target, else nothing."""
    if key not in TARGETS:
        return ""
    above, limit = key == "largest_x_cpu", TARGETS[key]
    return f" ({'>=' if above else '<='} {limit} {'PASS' if (value >= limit if above else value <= limit) else 'FAIL'})"


def report(out: dict) -> str:
    bw, traffic = out["bandwidth"], out["traffic"]
    lines = [f"1. disk: sequential write {bw['write_MBps']:.0f} MB/s, read {bw['read_MBps']:.0f} MB/s "
             f"({bw['bytes'] / 2**30:.2f} GiB, fsync'ed; cold read)", "", "2-4.".ljust(40) + "".join(
                 name.rjust(22) for name in traffic)]
    lines += [f"{label:<40}" + "".join(f"{r[key]:.3f}{verdict(r[key], key)}".rjust(22) for r in traffic.values())
              for label, key in ROWS]
    for kind, g in out.get("largest", {}).items():
        lines.append(f"5. largest under the budget, {kind:4s}: {g['layers']} blocks, {g['params'] / 1e6:.2f}M "
                     "parameters" + (" (reached --max-layers: a lower bound)" if g["capped"] else ""))
    if out.get("largest_x_cpu") is not None:
        lines.append(f"   disk / cpu: {out['largest_x_cpu']:.2f}x{verdict(out['largest_x_cpu'], 'largest_x_cpu')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
