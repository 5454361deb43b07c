"""Quantized and hierarchical communication (ZeRO++ qwZ and qgZ, HSDP) at stage 3: loss, bytes on the wire, step time.

A world of ``--world`` (4) gloo ranks on 127.0.0.1, read as two machines of two ranks (``shard_size=2``: the shard
groups are ranks 0-1 and 2-3). Every mode trains its own copy of the same character-level GPT (``zero.models.GPT``,
same seed, same batches, stage 3) on real text, this repository's ``README.md`` and ``docs/*.md`` concatenated
(read once, before the ranks start; vocabulary: the bytes that occur in it; the first 90% for training, the last 10%
held out): AdamW with betas (0.9, ``--beta2``: 0.95), a linear warm-up over ``--warmup-lr`` (100) steps, then a
cosine down to a tenth of ``--lr`` (3e-3), ``opt.clip_grad_norm_(--clip)`` (1.0). The long warm-up is what makes
the comparison one of the codecs: with 30 steps, an update near step 16 (learning rate 1.7e-3, the loss leaving its
3.4 plateau) sometimes threw the model off (the next batch's loss 6.4, every window's), and whether it did, and how
far, depended on the runs' small differences: final losses of a run and of the same run with its weights quantized
as qwZ's (single process) differed by up to 3.9% (1 seed in 3), and ``qwZ``'s and ``plain``'s by 1.9% and 3.4% in
this script's two runs with 30 steps; with 100, within 0.13% for all 3 seeds. The modes (``communication=`` of
``ZeroOptimizer``):

* ``plain``: one flat group, the identity codec (the baseline every ratio is to);
* ``qwZ``: ``quantized_weights`` (int8 blocks of ``block_size`` with an fp32 scale each, parameter all-gathers);
* ``qgZ``: ``quantized_gradients`` (one all-to-all of int8 blocks per gradient reduce-scatter, fp32 sum on receipt);
* ``qwZ+qgZ``: both;
* ``qgZ int4``: ``quantized_gradients`` with ``gradient_bits=4`` (int4 blocks, two values a byte);
* ``hierarchical``: ``shard_size=2`` (shard inside each machine, replicate across: exact);
* ``hierarchical+qwZ+qgZ``: ``shard_size=2`` with both codecs;
* ``plain (shares rotated)``, a control: ``plain``, with rank ``r`` training on rank ``r+1``'s share of the batch.
  The same sums in another order: how far rounding alone moves the losses (the yardstick for ``hierarchical``).

The modes run in one world, interleaved step by step (each step runs every mode once, the order rotating), so that
they share the machine's noise. Measured:

1. **Convergence**: every step's loss, the mean over ranks (each rank's mean over its share of the global batch);
   the final loss of a mode is the mean of its last ``--final-steps`` (20), compared with ``plain``'s. Targets: qwZ and
   hierarchical within 1%, qgZ (int8 and int4) within 2% (and the two combined modes within 2%); ``hierarchical``
   equals ``plain`` to rounding (its largest per-step relative loss difference at most 1e-5: gradients are summed in
   another order, and Adam carries that rounding on). Also reported: each mode's loss on ``EVAL_WINDOWS`` fixed
   windows of the held-out text after the last step, and its largest rise of a step's loss over the lowest of the 5
   steps before (batch noise: a few tenths).
2. **Bytes on the wire / theory**, from ``opt.comm_stats`` (one step, rank 0; every rank moves the same): all-gather
   bytes / (its payload in elements x 4, fp32) and the same for reduce-scatters (qwZ and qgZ: ``1/4 + 1/block``
   and a little padding, 0.254 at ``block_size`` 256; target <= 0.27; int4: ``1/8 + 1/block``, 0.129, target
   <= 0.14). Across machines: a flat layout's every
   collective spans both machines, so all its all-gather (and broadcast) bytes count as inter-group; with
   hierarchy only the ``inter_*`` counters cross. Inter-group parameter bytes of a hierarchical mode / those of
   the same mode without hierarchy (target <= 1/shard_size; 0 expected: parameters are gathered inside the
   machine); inter-group gradient bytes (``inter_all_reduce``, the reduced shard all-reduced across machines, with
   the few bytes of the all-reduce of which parameters got gradients) / the flat mode's (its reduce-scatter and
   all-reduce bytes), reported (with qgZ the shard crosses as int8 too: an all-to-all and an all-gather of packets).
3. **Step time**: forward + backward + ``clip_grad_norm_`` + ``step()`` + ``zero_grad()`` after a barrier, the
   largest over the ranks; after ``--warmup`` steps, the median over steps of each step's time / ``plain``'s in the
   same step, with the interquartile range of that ratio. **Exposed communication**: the seconds a rank waited in
   the step's collectives (``wait_s`` summed over every kind in ``comm_stats``, the mean over ranks) / the step
   time; the median over steps. With 4 ranks on a 2-core machine a wait also covers a peer that is not scheduled,
   so it is an upper bound on what the wire costs. Also, with ``--compare``: ``benchmarks/compare.py --only
   zero-3`` under ``torchrun`` at 2 ranks (its 3.3M GPT), its stage 3 / DDP step time and exposed communication.

Results: a report with PASS/FAIL per target, ``--json`` (every step's loss and time per mode, the counters, the
figures) and ``--plot`` (every mode's loss curve). The README's and docs/benchmarks.md's block is rendered from the
JSON by ``benchmarks/render_results.py``; to refresh it::

    python benchmarks/comm_modes.py --compare --json benchmarks/results/comm_modes.json \\
        --plot benchmarks/results/comm_modes_loss.png && python benchmarks/render_results.py --write

``--quick``: 60 steps, no compare.py run (about a minute). The default run takes about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import zero  # noqa: E402
from tests.distributed.harness import run_world  # noqa: E402
from zero.models import GPT, GPTConfig, local_slice  # noqa: E402

MODES = {
    "plain": {},
    "qwZ": {"quantized_weights": True},
    "qgZ": {"quantized_gradients": True},
    "qwZ+qgZ": {"quantized_weights": True, "quantized_gradients": True},
    "qgZ int4": {"quantized_gradients": True, "gradient_bits": 4},
    "hierarchical": {"shard_size": 2},
    "hierarchical+qwZ+qgZ": {"shard_size": 2, "quantized_weights": True, "quantized_gradients": True},
}
ROTATED = " (shares rotated)"  # a control: rank r trains on rank r+1's share (the sums' order differs, nothing else)
CONTROL = "plain" + ROTATED
FLAT = {"hierarchical": "plain", "hierarchical+qwZ+qgZ": "qwZ+qgZ"}  # a hierarchical mode's flat counterpart
LOSS_TARGETS = {"qwZ": 0.01, "qgZ": 0.02, "qwZ+qgZ": 0.02, "qgZ int4": 0.02, "hierarchical": 0.01,
                "hierarchical+qwZ+qgZ": 0.02}
TARGETS = {"loss_rel": LOSS_TARGETS, "exact_step_rel": 1e-5, "quantized_bytes_x_fp32": 0.27,
           "int4_bytes_x_fp32": 0.14}
RISE_WINDOW = 5  # a step's loss over the lowest of the steps before it in this window
HELD_OUT = 0.1  # the corpus's last tenth: never trained on
EVAL_WINDOWS = 64  # windows of the held-out text every mode is evaluated on after its last step
FINAL_STEPS = 20
CORPUS = ("README.md", "docs/*.md")


def corpus(root: Path = ROOT) -> bytes:
    """README.md, then docs/*.md in name order, as bytes."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return b"".join(path.read_bytes() for path in files)


def encode(text: bytes) -> tuple[torch.Tensor, list[int]]:
    """The text as token ids (the index of each byte among the sorted distinct bytes) and that vocabulary."""
    vocab = sorted(set(text))
    lookup = torch.zeros(256, dtype=torch.long)
    lookup[torch.tensor(vocab)] = torch.arange(len(vocab))
    return lookup[torch.frombuffer(bytearray(text), dtype=torch.uint8).long()], vocab


def split(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training text (the first 90%) and the held-out text (the rest)."""
    cut = round(tokens.numel() * (1 - HELD_OUT))
    return tokens[:cut], tokens[cut:]


def batch(tokens: torch.Tensor, step: int, size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``size`` windows at random offsets (the same for every mode and rank); step -1:
    the evaluation windows."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (size,), generator=g)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def policy(mode: str) -> dict:
    """The ``communication=`` of a mode (the control trains with ``plain``'s)."""
    return MODES[mode.removesuffix(ROTATED)]


def lr_at(step: int, spec: dict) -> float:
    """Linear warm-up over ``warmup_lr`` steps, then a cosine from ``lr`` down to a tenth of it at the last step."""
    warm = min(1.0, (step + 1) / spec["warmup_lr"])
    return spec["lr"] * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / spec["steps"])))


def build(spec: dict, mode: str) -> tuple[GPT, zero.ZeroOptimizer]:
    torch.manual_seed(spec["seed"])
    model = GPT(GPTConfig(**spec["config"]))
    inner = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, spec["beta2"]), weight_decay=0.01)
    communication = {**policy(mode), "block_size": spec["block_size"]}
    return model, zero.ZeroOptimizer(inner, model, stage=3, communication=communication)


def train_rank(rank: int, world: int, spec: dict, text: bytes) -> dict:
    """One rank: every mode, interleaved step by step, on ``text``; this rank's losses, step times and counters."""
    tokens, vocab = encode(text)
    assert len(vocab) == spec["config"]["vocab_size"]
    train, held_out = split(tokens)
    modes = list(spec["modes"])
    runs = {mode: build(spec, mode) for mode in modes}
    out = {m: {"loss": [], "time_s": [], "stats": []} for m in modes}
    seq_len = spec["config"]["seq_len"]
    for step in range(spec["steps"]):
        x, y = batch(train, step, spec["batch"], seq_len, spec["seed"])
        mine = local_slice(x, rank, world), local_slice(y, rank, world)
        rotated = local_slice(x, (rank + 1) % world, world), local_slice(y, (rank + 1) % world, world)
        for i in range(len(modes)):
            mode = modes[(step + i) % len(modes)]  # the order rotates
            model, opt = runs[mode]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, spec)
            dist.barrier()
            start = time.perf_counter()
            loss = model.loss(*(rotated if mode.endswith(ROTATED) else mine))
            loss.backward()
            opt.clip_grad_norm_(spec["clip"])
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - start
            out[mode]["loss"].append(loss.item())
            out[mode]["time_s"].append(elapsed)
            out[mode]["stats"].append(opt.comm_stats)
    x, y = batch(held_out, -1, EVAL_WINDOWS, seq_len, spec["seed"])
    for mode, (model, opt) in runs.items():
        with torch.no_grad():  # (every rank evaluates its share: stage 3 gathers the units for everyone)
            out[mode]["eval_loss"] = model.loss(local_slice(x, rank, world), local_slice(y, rank, world)).item()
        out[mode]["params"] = sum(p.numel() for p in model.parameters())
        out[mode]["group_size"] = opt.comm.world_size
    return out


def largest_rise(losses: list[float], window: int = RISE_WINDOW) -> float:
    """The largest rise of a step's loss over the lowest of the ``window`` steps before it (batch noise: a few
    tenths; a spike, a unit or more: the run diverged for a while, and comparisons with it mean little)."""
    return max((losses[s] - min(losses[max(0, s - window) : s]) for s in range(1, len(losses))), default=0.0)


def _iqr(values: list[float]) -> float:
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def summarize(ranks: list[dict], spec: dict) -> dict:
    """The figures of the module docstring from every rank's records."""
    modes, world, warmup = list(spec["modes"]), len(ranks), spec["warmup"]
    steps = len(ranks[0][modes[0]]["loss"])
    loss = {m: [sum(r[m]["loss"][s] for r in ranks) / world for s in range(steps)] for m in modes}
    time_s = {m: [max(r[m]["time_s"][s] for r in ranks) for s in range(steps)] for m in modes}
    waited = {m: [sum(sum(k["wait_s"] for k in r[m]["stats"][s].values()) for r in ranks) / world
                  for s in range(steps)] for m in modes}
    final = {m: statistics.fmean(loss[m][-spec["final_steps"]:]) for m in modes}
    timed = range(min(warmup, steps - 1), steps)
    base = "plain"
    out = {"loss": loss, "time_s": time_s, "wait_s": waited, "final_loss": final,
           "first_loss": {m: loss[m][0] for m in modes}, "modes": {}}
    for m in modes:
        stats = ranks[0][m]["stats"][-1]  # the last step's, rank 0
        kind = lambda name: stats.get(name, {"calls": 0, "numel": 0, "bytes": 0, "wait_s": 0.0})  # noqa: E731
        ag, rs = kind("all_gather"), kind("reduce_scatter")
        row = {
            "params": ranks[0][m]["params"], "group_size": ranks[0][m]["group_size"],
            "final_loss": final[m], "loss_rel_vs_plain": (final[m] - final[base]) / final[base],
            "max_step_rel_vs_plain": max(abs(a - b) / abs(b) for a, b in zip(loss[m], loss[base])),
            "largest_rise": largest_rise(loss[m]),
            "eval_loss": sum(r[m]["eval_loss"] for r in ranks) / world,
            "all_gather_x_fp32": ag["bytes"] / (ag["numel"] * 4) if ag["numel"] else None,
            "reduce_scatter_x_fp32": rs["bytes"] / (rs["numel"] * 4) if rs["numel"] else None,
            "step_ms": 1e3 * statistics.median(time_s[m][s] for s in timed),
            "step_iqr_ms": 1e3 * _iqr([time_s[m][s] for s in timed]),
            "step_x_plain": statistics.median(time_s[m][s] / time_s[base][s] for s in timed),
            "step_x_plain_iqr": _iqr([time_s[m][s] / time_s[base][s] for s in timed]),
            "exposed": statistics.median(waited[m][s] / time_s[m][s] for s in timed),
            "stats": stats,
        }
        if policy(m).get("shard_size"):  # only the inter_* counters cross the machines
            row["inter_param_bytes"] = kind("inter_all_gather")["bytes"] + kind("inter_broadcast")["bytes"]
            row["inter_grad_bytes"] = kind("inter_all_reduce")["bytes"]
        else:  # a flat layout: every collective spans both machines
            row["inter_param_bytes"] = ag["bytes"] + kind("broadcast")["bytes"]
            row["inter_grad_bytes"] = rs["bytes"] + kind("all_reduce")["bytes"]
        out["modes"][m] = row
    for m, flat in FLAT.items():
        if m in out["modes"] and flat in out["modes"]:
            row, ref = out["modes"][m], out["modes"][flat]
            row["flat"] = flat
            row["inter_param_x_flat"] = row["inter_param_bytes"] / ref["inter_param_bytes"]
            row["inter_grad_x_flat"] = row["inter_grad_bytes"] / ref["inter_grad_bytes"]
    out["checks"] = checks(out["modes"], spec)
    return out


def checks(rows: dict, spec: dict) -> list[dict]:
    """Every target of the module docstring that the modes run allow, with its value and PASS or FAIL."""
    out = []

    def check(name: str, value: float, limit: float) -> None:
        out.append({"check": name, "value": value, "limit": limit, "passed": bool(value <= limit)})

    for m, limit in LOSS_TARGETS.items():
        if m in rows and "plain" in rows:
            check(f"{m}: |final loss / plain's - 1|", abs(rows[m]["loss_rel_vs_plain"]), limit)
    if "hierarchical" in rows:
        check("hierarchical: max per-step |loss / plain's - 1|", rows["hierarchical"]["max_step_rel_vs_plain"],
              TARGETS["exact_step_rel"])
    for m, row in rows.items():
        if policy(m).get("quantized_weights"):
            check(f"{m}: all-gather bytes / fp32", row["all_gather_x_fp32"], TARGETS["quantized_bytes_x_fp32"])
        if policy(m).get("quantized_gradients"):
            limit = TARGETS["int4_bytes_x_fp32" if policy(m).get("gradient_bits") == 4 else "quantized_bytes_x_fp32"]
            check(f"{m}: reduce-scatter bytes / fp32", row["reduce_scatter_x_fp32"], limit)
        if "inter_param_x_flat" in row:
            check(f"{m}: inter-group parameter bytes / {row['flat']}'s", row["inter_param_x_flat"],
                  1 / spec["shard_size"])
    return out


def run_compare(timeout_s: float) -> dict:
    """``compare.py --only zero-3`` at 2 ranks under torchrun: stage 3 and DDP, its rows and checks."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "compare.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "benchmarks" / "compare.py"), "--only", "zero-3", "--json", str(path)]
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"skipped": f"compare.py ran past {timeout_s:g} s"}
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not path.exists():
            return {"skipped": "compare.py failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
        data = json.loads(path.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    keep = ("median_ms", "iqr_ms", "time_x_ddp", "exposed", "sent_x_theory", "loss_deviation")
    return {"world": data["world"], "params": data["params"], "config": data["config"], "seconds": seconds,
            "command": " ".join(["torchrun", *cmd[3:]]).replace(str(ROOT) + "/", ""),
            "rows": {n: {k: rows[n][k] for k in keep} for n in ("ddp", "zero-3")},
            "zero3_x_ddp": rows["zero-3"]["time_x_ddp"], "zero3_exposed": rows["zero-3"]["exposed"],
            "ddp_exposed": rows["ddp"]["exposed"]}


def plot(result: dict, path: str, smooth: int = 10) -> None:
    """Every mode's loss curve (a running mean over ``smooth`` steps) and its relative difference to ``plain``'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def running(values: list[float]) -> list[float]:
        return [statistics.fmean(values[max(0, i - smooth + 1) : i + 1]) for i in range(len(values))]

    loss = result["loss"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1))]
    base = running(loss["plain"])
    for i, (mode, values) in enumerate(loss.items()):
        smoothed = running(values)
        style = {"linestyle": styles[i % len(styles)], "color": f"C{i}", "label": mode}
        top.plot(smoothed, **style)
        if mode != "plain":
            bottom.plot([100 * (a / b - 1) for a, b in zip(smoothed, base)], **style)
    cfg, spec = result["config"], result["spec"]
    top.set_title(f"Stage 3, {spec['world']} gloo ranks (2 groups of {spec['shard_size']}), char-level GPT "
                  f"{result['params'] / 1e6:.2f}M ({cfg['d_model']} x {cfg['num_layers']}), this repo's docs")
    top.set_ylabel(f"training loss (running mean of {smooth} steps)")
    top.legend()
    top.grid(alpha=0.3)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel("vs plain, % (same smoothing)")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdicts(result: dict) -> list[str]:
    return [f"{c['check']}: {c['value']:.3g} (<= {c['limit']:.3g}: {'PASS' if c['passed'] else 'FAIL'})"
            for c in result["checks"]]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(result: dict) -> str:
    rows = result["modes"]
    head = (f"{'mode':<22}{'final loss':>11}{'vs plain':>10}{'max step':>10}{'rise':>6}{'AG B/fp32':>10}"
            f"{'RS B/fp32':>10}{'inter P':>10}{'inter G':>10}{'step ms':>9}{'x plain':>9}{'IQR':>7}{'exposed':>9}")
    lines = [head]
    for m, r in rows.items():
        lines.append(f"{m:<22}{r['final_loss']:>11.4f}{r['loss_rel_vs_plain']:>+10.2%}"
                     f"{r['max_step_rel_vs_plain']:>10.1e}{r['largest_rise']:>6.2f}"
                     f"{_fmt(r['all_gather_x_fp32'], '.3f'):>10}{_fmt(r['reduce_scatter_x_fp32'], '.3f'):>10}"
                     f"{_fmt(r.get('inter_param_x_flat'), '.3f'):>10}{_fmt(r.get('inter_grad_x_flat'), '.3f'):>10}"
                     f"{r['step_ms']:>9.1f}{r['step_x_plain']:>9.2f}{r['step_x_plain_iqr']:>7.2f}{r['exposed']:>9.1%}")
    lines.append(f"(first loss {result['first_loss']['plain']:.3f}; final: mean of the last {result['final_steps']} "
                 "steps; inter P / G: inter-group parameter / gradient bytes over the flat counterpart's)")
    compare = result.get("compare")
    if compare and "skipped" not in compare:
        lines.append(f"N=2 flat, compare.py's {compare['params'] / 1e6:.2f}M GPT: zero-3 step / DDP "
                     f"{compare['zero3_x_ddp']:.2f}, exposed communication zero-3 {compare['zero3_exposed']:.1%}, "
                     f"DDP {compare['ddp_exposed']:.1%}")
    elif compare:
        lines.append(f"N=2 compare.py: skipped ({compare['skipped']})")
    return "\n".join(lines + verdicts(result))


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine() -> dict:
    """The machine, the software, and the library's commit (with whether ``zero/`` differed from it)."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    status = _git("status", "--porcelain", "--", "zero")
    return {"device": names[0] if names else platform.machine(), "cpu_count": os.cpu_count(), "backend": "gloo",
            "torch": torch.__version__, "python": platform.python_version(), "commit": _git("rev-parse", "HEAD"),
            "zero_modified": None if status is None else bool(status)}


def make_spec(args: argparse.Namespace, text: bytes) -> dict:
    vocab = encode(text)[1]
    config = {"vocab_size": len(vocab), "seq_len": args.seq_len, "d_model": args.d_model,
              "num_layers": args.layers, "num_heads": args.heads, "tie_embeddings": True}
    return {"modes": args.modes.split(","), "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
            "lr": args.lr, "beta2": args.beta2, "warmup_lr": args.warmup_lr, "clip": args.clip, "seed": args.seed,
            "block_size": args.block_size, "world": args.world, "shard_size": 2, "config": config,
            "final_steps": args.final_steps,
            "corpus": {"files": list(CORPUS), "bytes": len(text), "vocab": len(vocab),
                       "sha256": hashlib.sha256(text).hexdigest()}}


def run(args: argparse.Namespace) -> dict:
    """Train every mode in one world, summarize, and (``--compare``) run compare.py at 2 ranks."""
    text = corpus()  # read once: every rank trains on these bytes
    spec = make_spec(args, text)
    unknown = {m.removesuffix(ROTATED) for m in spec["modes"]} - set(MODES)
    if unknown or "plain" not in spec["modes"]:
        raise SystemExit(f"--modes: 'plain' and some of {', '.join(MODES)} (got {args.modes})")
    print(f"{len(spec['modes'])} modes x {args.steps} steps, {args.world} ranks (groups of 2), GPT {spec['config']}, "
          f"corpus {spec['corpus']['bytes']} bytes", flush=True)
    start = time.perf_counter()
    ranks = run_world(train_rank, args.world, spec, text, timeout_s=args.timeout)
    result = {"spec": spec, "config": spec["config"], "run": machine(), "seconds": time.perf_counter() - start,
              "params": ranks[0][spec["modes"][0]]["params"], "targets": TARGETS,
              "final_steps": spec["final_steps"], "eval_windows": EVAL_WINDOWS, **summarize(ranks, spec)}
    if args.compare:
        result["compare"] = run_compare(args.compare_timeout)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps per mode (default 300)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the step times (default 10)")
    p.add_argument("--final-steps", type=int, default=FINAL_STEPS,
                   help=f"the final loss is the mean of this many last steps (default {FINAL_STEPS})")
    p.add_argument("--quick", action="store_true", help="60 steps, no --compare")
    p.add_argument("--world", type=int, default=4, help="ranks: two groups of shard_size 2 (default 4)")
    p.add_argument("--modes", default=",".join([*MODES, CONTROL]),
                   help="comma-separated, 'plain' included (default: all, and the control)")
    p.add_argument("--batch", type=int, default=32, help="global batch, split over the ranks (default 32)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak (default 3e-3)")
    p.add_argument("--beta2", type=float, default=0.95, help="AdamW's second beta (default 0.95)")
    p.add_argument("--warmup-lr", type=int, default=100, help="steps of linear warm-up (default 100)")
    p.add_argument("--clip", type=float, default=1.0, help="opt.clip_grad_norm_'s max norm (default 1.0)")
    p.add_argument("--block-size", type=int, default=256, help="communication.block_size (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the world (default 1800)")
    p.add_argument("--compare", action="store_true", help="also run compare.py --only zero-3 at 2 ranks")
    p.add_argument("--compare-timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--plot", default=None, help="write the loss curves (PNG) here")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.compare = 60, False
    if args.world % 2 or args.batch % args.world:
        p.error("--world must be even (groups of 2) and divide --batch")
    if not 0 < args.final_steps < args.steps or args.warmup >= args.steps:
        p.error("--final-steps and --warmup must be fewer than --steps (and --final-steps at least 1)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
