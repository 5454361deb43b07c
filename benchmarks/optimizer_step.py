"""The host (CPU) AdamW step against the memory-bandwidth limit, measured in one run.

An AdamW step over fp32 tensors reads the parameter, gradient, m and v and writes the
parameter, m and v: 28 bytes per element at the least. The limit is ``28 * numel / bandwidth``,
where the bandwidth is measured here, in the same run, by a large in-place ``a += b`` (12 bytes per
element: two reads, one write). Contenders, each on its own copy of the same data, interleaved
(every round runs each once, the order rotating):

* ``adamw``        -- ``torch.optim.AdamW`` with its defaults (foreach on CPU when available)
* ``adamw-single`` -- ``foreach=False``: one tensor at a time
* ``adamw-fused``  -- ``fused=True`` (CPU fused kernel, torch >= 2.4)
* ``zero-host-step`` -- what an offloaded bucket of ``ZeroOptimizer`` runs under bf16 mixed precision:
  the fused step, then the master cast into the bf16 parameter copy that goes back up (``zero.runtime.step.stepper``);
  6 more bytes per element (34 in all), shown against both limits
* ``zero-host-step-1-thread`` -- the same on one thread: what the host step ran at under torchrun (which sets
  ``OMP_NUM_THREADS=1``) before ``offload.host_threads`` (``"auto"``: the cores of the process's CPU affinity,
  ``zero.runtime.step.host_threads.host_step_threads``)
* ``ds-cpu-adam``  -- DeepSpeed's ``DeepSpeedCPUAdam``, if installed (its op builds on first use)

The threads default to what ``offload.host_threads="auto"`` gives one rank here.

The offloaded step of ``ZeroOptimizer`` runs the wrapped ``torch.optim`` optimizer on the host
master shard (``zero.offload``), so these are its figures: pick ``fused=True`` when it is
the fastest here. Run::

    python benchmarks/optimizer_step.py [--numel 50_000_000] [--rounds 7] [--threads N] \
        [--json benchmarks/results/optimizer_step.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from zero.runtime.step.host_threads import host_step_threads


def bandwidth(numel: int, rounds: int) -> float:
    """Bytes per second of a large in-place add (2 reads + 1 write of fp32)."""
    a, b = torch.rand(numel), torch.rand(numel)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        a += b
        times.append(time.perf_counter() - start)
    return 12 * numel / statistics.median(times)


def contenders(numel: int) -> dict:
    """Name -> a function running one step."""
    kinds = {
        "adamw": {},
        "adamw-single": {"foreach": False},
        "adamw-fused": {"fused": True},
    }
    out = {}
    for name, kwargs in kinds.items():
        p = torch.zeros(numel, requires_grad=True)
        p.grad = torch.rand(numel)
        try:
            out[name] = torch.optim.AdamW([p], lr=1e-3, **kwargs).step
        except (RuntimeError, ValueError) as err:  # e.g. no fused CPU kernel in this torch
            print(f"{name}: unavailable ({err})")
    if "adamw-fused" in out:
        p = torch.zeros(numel, requires_grad=True)
        p.grad = torch.rand(numel)
        fused, low = torch.optim.AdamW([p], lr=1e-3, fused=True), torch.empty(numel, dtype=torch.bfloat16)

        def host_step(fused=fused, p=p, low=low):
            fused.step()
            low.copy_(p.detach())

        out["zero-host-step"] = host_step

        def one_thread(host_step=host_step):
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                host_step()
            finally:
                torch.set_num_threads(threads)

        out["zero-host-step-1-thread"] = one_thread
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.zeros(numel, requires_grad=True)
        p.grad = torch.rand(numel)
        out["ds-cpu-adam"] = DeepSpeedCPUAdam([p], lr=1e-3).step
    except Exception as err:  # not installed, or its op does not build here
        print(f"ds-cpu-adam: unavailable ({type(err).__name__})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads or host_step_threads("auto", 1))
    steps = contenders(args.numel)
    for step in steps.values():  # first step allocates m and v
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    bws = []
    names = list(steps)
    for r in range(args.rounds):
        bws.append(bandwidth(args.numel, 1))
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    bw = statistics.median(bws)
    limit = 28 * args.numel / bw
    print(f"{args.numel:,} fp32 elements, {torch.get_num_threads()} threads; bandwidth {bw / 1e9:.2f} GB/s "
          f"(in-place add), limit {limit * 1e3:.1f} ms per step")
    result = {"numel": args.numel, "threads": torch.get_num_threads(), "bandwidth": bw, "limit_s": limit, "steps": {}}
    for name, ts in times.items():
        t = statistics.median(ts)
        result["steps"][name] = {"median_s": t, "ratio_to_limit": t / limit}
        own = t / (limit * 34 / 28)
        if name.startswith("zero-host-step"):
            result["steps"][name]["ratio_to_own_limit"] = own
        extra = f"   ({own:.2f} x its own 34-byte limit)" if name.startswith("zero-host-step") else ""
        print(f"  {name:23s} {t * 1e3:8.1f} ms   {t / limit:5.2f} x limit{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
