"""The prepared GPU check: every figure and test that needs a GPU, in one call of under 9 minutes on one H100 or
H200, written to ``benchmarks/results/gpu.json`` (``--out``; ``docs/benchmarks.md`` renders it).

Parts, in this order, each in a process of its own under a time limit (one that fails or runs out of time is
recorded as such and the next one still runs; the JSON is rewritten after each part, so a cut-off call keeps what
was measured):

1. ``tests``: ``pytest -m gpu tests/gpu``: how many passed, failed and were skipped, and each failure's first line;
2. ``syncs``: host synchronizations (``torch.cuda.set_sync_debug_mode("warn")``, with the lines that made them) and
   kernel launches (``torch.profiler``) in one training step, the step time (median of 10) and the peak, of the
   186M GPT (d_model 1024, 12 blocks, vocabulary 32768, 8 x 1024 tokens) for plain PyTorch, FSDP2 bf16 and
   ``zero`` stages 2-3 (bf16 and fp32);
3. ``compare``: ``benchmarks/compare.py`` on this GPU with the same GPT: every contender's step time and peak;
4. ``triton``: ``benchmarks/triton_step.py`` (the step against the copy bandwidth);
5. ``memory``: the profiler's reconciliation on CUDA (largest unexplained bytes over the peak, and what ``other``
   holds) and the estimator against the measured peak: the GPT of ``tests/gpu/test_cuda_memory.py`` at stages 0 and
   2, Hugging Face Llama (hidden 1024, 8 layers, 16 heads, 8 KV heads) at stage 3 fp32, 4 x 512 tokens;
6. ``cap``: under a 4 GiB cap (``torch.cuda.set_per_process_memory_fraction``), the largest GPT of width 2560 that
   plain PyTorch trains and the largest that stage 3 with optimizer and parameters offloaded trains (bf16,
   activation checkpointing, ``zero.init_sharded``), with the latter's step time against the same model resident;
7. ``offload``: ``benchmarks/offload_speed.py`` (issue 35): the 1.28B and 2.6B GPTs under caps of 4 and 16 GiB,
   resident, fully offloaded and at ``offload.ratio="auto"``, with the step split into compute, host step and
   transfers (run it alone with ``--parts offload`` when the budget does not reach it).

Targets (issue 34), each PASS or FAIL in the JSON: stage 3 bf16 <= 1.0x FSDP2 bf16 and stage 2 bf16 <= 0.95x, fp32
stages <= 1.02x plain PyTorch, kernel launches per step <= FSDP2's, stage 3 bf16's peak <= FSDP2's, at most one
host synchronization per step.

Run (the GPU image has no pydantic: carry its wheels, see the device notes)::

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [--parts tests,syncs,compare,triton,memory,cap,offload] \\
        [--budget 540] [--out benchmarks/results/gpu.json]

On a lent machine, write it under ``$OUT`` (``--out $OUT/gpu.json``), copy what comes back to
``benchmarks/results/gpu.json`` and run ``python benchmarks/render_results.py --write``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu.json"
PARTS = {"tests": 170, "syncs": 90, "compare": 170, "triton": 40, "memory": 90, "cap": 150,
         "offload": 200}  # seconds at most
GPT_186M = {"vocab": 32768, "seq_len": 1024, "d_model": 1024, "layers": 12, "heads": 16}
BATCH = 8
CONTENDERS = ("plain", "ddp", "fsdp2", "zero-0", "zero-1", "zero-2", "zero-3", "fsdp2-bf16", "zero-2-bf16",
              "zero-3-bf16", "zero-3-bf16-offload")
STEP_CONTENDERS = ("plain", "fsdp2-bf16", "zero-2-bf16", "zero-3-bf16", "zero-3")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


# ----- the parts (each runs in a process of its own: ``--part NAME``) -----------------------------------------


def part_tests(out: Path) -> dict:
    import xml.etree.ElementTree as ET

    report = out.with_suffix(".xml")
    # in this process, one GPU: without pyproject's worker processes (the GPU image has no pytest-xdist)
    done = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-m", "gpu", "tests/gpu", "-q", "-p",
                           "no:cacheprovider", f"--junitxml={report}"], cwd=ROOT, capture_output=True, text=True)
    cases = ET.parse(report).getroot().iter("testcase")
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for case in cases:
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            first = (problem.get("message") or "").strip().splitlines()
            failures.append(f"{case.get('classname')}::{case.get('name')}: {first[0] if first else ''}"[:400])
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "exit_code": done.returncode, "tail": done.stdout[-1500:]}


def _world_of_one() -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))


def _gpt_186m():
    from zero.models import GPTConfig

    g = GPT_186M
    return GPTConfig(vocab_size=g["vocab"], seq_len=g["seq_len"], d_model=g["d_model"], num_layers=g["layers"],
                     num_heads=g["heads"])


def part_syncs(out: Path) -> dict:
    import statistics
    import warnings

    import torch

    from zero.models import GPT, synthetic_batch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare  # noqa: E402 - benchmarks/compare.py: the contenders, built as it builds them

    _world_of_one()
    cfg = _gpt_186m()
    torch.manual_seed(0)
    base = GPT(cfg).cuda()
    x, y = (t.cuda() for t in synthetic_batch(0, BATCH, cfg))
    specs = {s.name: s for s in compare.specs(1)}
    results = {}
    for name in STEP_CONTENDERS:
        step = partial(_train_step, specs[name].build(base), x, y)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where: dict[str, int] = {}
        for w in caught:
            if "synchroniz" in str(w.message):
                key = f"{Path(w.filename).name}:{w.lineno}"
                where[key] = where.get(key, 0) + 1
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = {e.key: e.count for e in prof.key_averages()}
        times = []
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        results[name] = {
            "syncs_per_step": sum(where.values()), "sync_lines": dict(sorted(where.items(), key=lambda kv: -kv[1])[:8]),
            "launches_per_step": sum(events.get(k, 0) for k in LAUNCHES),
            "device_syncs_per_step": max(0, sum(events.get(k, 0) for k in SYNCS) - 1),  # (less our own wait)
            "step_ms": statistics.median(times), "peak_gib": (torch.cuda.max_memory_allocated() - before) / 2**30,
        }
        print(name, results[name], flush=True)
        del step
        torch.cuda.empty_cache()
    return {"model": GPT_186M, "batch": BATCH, "contenders": results}


def _train_step(contender, x, y) -> None:
    """compare.py's ``Contender.train_step`` without its ``loss.item()`` (a synchronization of the harness's own)."""
    import torch

    loss = torch.nn.functional.cross_entropy(contender.module(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    contender.optimizer.step()
    contender.optimizer.zero_grad()


def part_compare(out: Path) -> dict:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in GPT_186M.items()]
    report = out.with_suffix(".compare.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "benchmarks/compare.py", *flags, f"--batch={BATCH}", "--steps=10", "--warmup=3",
           f"--only={','.join(CONTENDERS)}", f"--json={report}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compare.py failed ({done.returncode}): {done.stderr[-3000:]}")
    print(done.stdout[-4000:], flush=True)
    return json.loads(report.read_text())


def part_triton(out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import triton_step  # noqa: E402

    return triton_step.measure(200_000_000, 20)


def part_memory(out: Path) -> dict:
    import torch

    import zero
    from zero.estimator import Workload, estimate
    from zero.models import GPT, GPTConfig, synthetic_batch

    _world_of_one()
    results = {}
    gpt = GPTConfig(vocab_size=8192, seq_len=512, d_model=512, num_layers=6, num_heads=8)

    def gpt_loss(m, a, b):
        return m.loss(a, b)

    def gpt_batch(micro):
        return tuple(t.cuda() for t in synthetic_batch(0, micro, gpt))

    def llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                            num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                                            max_position_embeddings=512)).cuda()

    def llama_loss(m, ids):
        return m(input_ids=ids, labels=ids).loss

    def llama_batch(micro):
        return (torch.randint(0, 32000, (micro, 512), generator=torch.Generator().manual_seed(0)).cuda(),)

    cases = {"gpt/stage0": (lambda: GPT(gpt).cuda(), gpt_loss, gpt_batch, 8, 0),
             "gpt/stage2": (lambda: GPT(gpt).cuda(), gpt_loss, gpt_batch, 8, 2),
             "llama/stage3": (llama, llama_loss, llama_batch, 4, 3)}
    for name, (build, loss_fn, make_batch, micro, stage) in cases.items():
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        model = build()
        opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), model, stage=stage)
        batch = make_batch(micro)
        with zero.profile(model, opt) as prof:
            for _ in range(2):
                loss_fn(model, *batch).backward()
                opt.step()
                opt.zero_grad()
        peak = prof.allocator.peak
        unrelated = prof.samples[0].labels.get("other/alive on entry", 0)
        worst = max(prof.samples, key=lambda s: abs(s.unexplained))
        e = estimate(Workload(build, loss_fn, make_batch), stage=stage, world_size=1, micro_batch=micro)
        results[name] = {
            "peak": peak, "largest_unexplained": worst.unexplained, "unexplained_x_peak": abs(worst.unexplained) / peak,
            "other_at_peak": {k: v for k, v in prof.peak.labels.items() if k.startswith("other/")},
            "estimated": e.peak, "estimate_x_measured": e.peak / (peak - unrelated),
        }
        print(name, results[name], flush=True)
        del model, opt, prof
    return results


def part_offload(out: Path) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import offload_speed

    return offload_speed.main(["--models", "1.28B,2.6B", "--caps", "4,16", "--steps", "2"])


def part_cap(out: Path, cap_gib: float = 4.0) -> dict:
    import statistics

    import torch

    import zero
    from zero.models import GPT, GPTConfig, init_gpt_weights, synthetic_batch

    _world_of_one()
    total = torch.cuda.get_device_properties(0).total_memory

    def config(layers: int) -> GPTConfig:
        return GPTConfig(vocab_size=32768, seq_len=1024, d_model=2560, num_layers=layers, num_heads=20)

    def timed_steps(model, opt, cfg, steps: int = 3) -> float:
        x, y = (t.cuda() for t in synthetic_batch(0, 4, cfg))
        times = []
        for _ in range(steps + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    def plain(layers: int) -> float:
        model = GPT(config(layers)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return timed_steps(model, opt, config(layers), steps=1)

    def offloaded(layers: int, offload: bool) -> tuple[float, int]:
        settings = {"offload": {"optimizer": "cpu", "params": "cpu"}} if offload else {}
        model, opt = zero.init_sharded(lambda: GPT(config(layers)),
                                       lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True),
                                       init_fn=init_gpt_weights, device="cuda", precision={"param_dtype": "bf16"},
                                       activation_checkpointing={}, **settings)
        return timed_steps(model, opt, config(layers)), opt.partition.numel

    def fits(fn) -> bool:
        torch.cuda.empty_cache()
        try:
            fn()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total)
    plain_layers = 0
    for layers in (1, 2, 4, 8, 16):
        if not fits(lambda: plain(layers)):
            break
        plain_layers = layers
    result = {"cap_gib": cap_gib, "d_model": 2560, "plain_layers": plain_layers}
    for layers in (32, 16, 8):
        torch.cuda.reset_peak_memory_stats()
        try:
            seconds, numel = offloaded(layers, offload=True)
        except torch.OutOfMemoryError:
            continue
        result.update(offload_layers=layers, offload_params=numel, offload_step_s=seconds,
                      offload_peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        break
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    if "offload_layers" in result:
        seconds, _ = offloaded(result["offload_layers"], offload=False)
        result.update(resident_step_s=seconds, offload_x_resident=result["offload_step_s"] / seconds)
    print(result, flush=True)
    return result


# ----- the targets and the run ---------------------------------------------------------------------------------


def targets(parts: dict) -> list[dict]:
    """Issues 34's and 35's targets from what was measured (those whose figures are missing are left out)."""
    out = []
    rows = {r["name"]: r for r in (parts.get("compare", {}).get("result") or {}).get("rows", [])}

    def ratio(check: str, a: float, b: float, limit: float) -> None:
        out.append({"check": check, "ratio": a / b, "limit": limit, "passed": a / b <= limit})

    if "fsdp2-bf16" in rows:
        for name, limit in (("zero-3-bf16", 1.0), ("zero-2-bf16", 0.95)):
            if name in rows:
                ratio(f"{name} step vs fsdp2-bf16", rows[name]["median_ms"], rows["fsdp2-bf16"]["median_ms"], limit)
        if "zero-3-bf16" in rows:
            ratio("zero-3-bf16 peak vs fsdp2-bf16", rows["zero-3-bf16"]["peak"], rows["fsdp2-bf16"]["peak"], 1.0)
    if "plain" in rows:
        for stage in range(4):
            if f"zero-{stage}" in rows:
                ratio(f"zero-{stage} step vs plain", rows[f"zero-{stage}"]["median_ms"], rows["plain"]["median_ms"],
                      1.02)
    steps = (parts.get("syncs", {}).get("result") or {}).get("contenders", {})
    if "fsdp2-bf16" in steps and "zero-3-bf16" in steps:
        ratio("zero-3-bf16 launches vs fsdp2-bf16", steps["zero-3-bf16"]["launches_per_step"],
              steps["fsdp2-bf16"]["launches_per_step"], 1.0)
    for name in ("zero-2-bf16", "zero-3-bf16", "zero-3"):
        if name in steps:
            syncs = steps[name]["syncs_per_step"]
            out.append({"check": f"{name} host syncs per step", "ratio": syncs, "limit": 1, "passed": syncs <= 1})
    for row in (parts.get("offload", {}).get("result") or {}).get("rows", []):  # issue 35's
        where = f"{row['model']} under {row['cap_bytes'] / 2**30:.3g} GiB"
        found = row.get("targets") or {}
        if "auto_x_limit" in found:
            ratio(f"offload auto step vs overlap limit, {where}", found["auto_x_limit"], 1.0, 1.3)
        if "auto_3x_faster_than_full" in found:
            out.append({"check": f"full offload vs auto, {where}", "ratio": found["full_x_auto"], "limit": 3,
                        "passed": found["auto_3x_faster_than_full"]})
    return out


def run_record() -> dict:
    import torch

    record = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record["commit"] = commit.stdout.strip() or None
    return record


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)  # atomic


def run_part(name: str, limit: float) -> dict:
    """``name`` in a process of its own, at most ``limit`` seconds: its status, seconds and result (or error)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{name}.json"
        try:
            done = subprocess.run([sys.executable, __file__, "--part", name, "--part-out", str(out)], cwd=ROOT,
                                  capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as err:
            tail = (err.stdout or b"")[-1500:]
            return {"status": "timed out", "seconds": limit,
                    "output": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
        seconds = time.monotonic() - start
        if done.returncode != 0 or not out.exists():
            return {"status": "failed", "seconds": seconds, "error": (done.stderr or done.stdout)[-3000:]}
        return {"status": "ok", "seconds": seconds, "result": json.loads(out.read_text()),
                "output": done.stdout[-1500:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--budget", type=float, default=540, help="seconds for every part together")
    p.add_argument("--out", type=Path, default=OUT, help="the JSON (default: benchmarks/results/gpu.json)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part is not None:
        result = globals()[f"part_{args.part}"](args.part_out)
        write(args.part_out, result)
        return 0
    deadline = time.monotonic() + args.budget
    data = {"run": run_record(), "parts": {}, "targets": []}
    for name in args.parts.split(","):
        left = deadline - time.monotonic()
        if left < 10:
            data["parts"][name] = {"status": "not run: the budget was spent"}
            continue
        print(f"== {name} (at most {min(PARTS[name], left):.0f} s)", flush=True)
        data["parts"][name] = run_part(name, min(PARTS[name], left))
        data["targets"] = targets(data["parts"])
        write(args.out, data)
        part = data["parts"][name]
        print(f"   {part['status']} in {part['seconds']:.0f} s" + (f": {part.get('error', '')[-800:]}"
                                                                    if part["status"] == "failed" else ""), flush=True)
    for t in data["targets"]:
        print(f"{t['check']:<40} {t['ratio']:.3f} (<= {t['limit']}) {'PASS' if t['passed'] else 'FAIL'}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
