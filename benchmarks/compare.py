"""One run against every peer: step time, peak memory, model state, traffic and exposed communication.

This docstring, after this paragraph, is the method (in Markdown): ``benchmarks/render_results.py`` renders it
with the figures of ``--json`` into docs/benchmarks.md and the README's table, which a test keeps in step. To
refresh the published figures: ``--json benchmarks/results/compare.json`` (every contender, default options),
then ``python benchmarks/render_results.py --write``.

Every contender trains its own copy of the same GPT (same seed, same batches, AdamW):

* ``ddp``                    ``DistributedDataParallel`` (the baseline every ratio is to)
* ``plain``                  the model and AdamW alone, no wrapper (in a world of one only: the same training)
* ``zro``                    ``torch.distributed.optim.ZeroRedundancyOptimizer`` over DDP (ZeRO-1)
* ``fsdp2``, ``fsdp2-keep``  ``fully_shard`` on each block and the root, resharding after forward or not
* ``ds-1``, ``ds-2``, ``ds-3``, ``ds-offload``  DeepSpeed ZeRO 1/2/3 and ZeRO-Offload (stage 2, optimizer on
  the host), when ``deepspeed`` is installed (on CPU: ``DS_ACCELERATOR=cpu``, gloo), with reduce, all-gather
  and prefetch buckets of our bucket size (25 MB; DeepSpeed's defaults, 5e8 elements, take 1.9 GB here)
* ``zero-0`` .. ``zero-3``, ``zero-2-offload``, ``zero-2-bf16``  ``ZeroOptimizer``, also with optimizer offload
  and with bf16 mixed precision (fp32 masters)
* ``zero-3-keep``            stage 3 with ``reshard_after_forward=False``: units stay gathered from forward to
  backward (2Ψ traffic instead of 3Ψ, more memory)
* ``fsdp2-bf16``, ``zero-3-bf16``, ``zero-3-bf16-offload``  on a GPU only: FSDP2 with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, stage 3 with bf16 parameters (fp32 masters and
  reduction), and the same with the optimizer and the parameters offloaded to the host
* ``zero-3-qwz``, ``zero-3-qgz``, ``zero-3-zpp``  stage 3 with ZeRO++'s quantized collectives
  (``ZeroConfig.communication``, docs/communication.md): int8 parameter gathers (qwZ), int8 gradient reduction
  through one all-to-all (qgZ), and both; blocks of 256 elements, ``1 + 4/256`` bytes per element on the wire.
  Lossy, so held to the low-precision loss tolerance below
* ``zero-3-hsdp``, ``zero-3-hpz``  stage 3 with hierarchical sharding over groups of ``g = N/2`` consecutive
  ranks, as HSDP and as ZeRO++'s hpZ (``shard_size=g``; only at an even world size ``N >= 4``)
* ``ds-3-zpp``               DeepSpeed's ZeRO++ at stage 3 (``zero_quantized_weights``,
  ``zero_quantized_gradients``, and ``zero_hpz_partition_size = N/2`` at an even ``N >= 4``), when ``deepspeed``
  is installed. It is built and takes one step on a throwaway copy first, and is skipped, with the error printed,
  if that fails on any rank: on CPU it does (DeepSpeed 0.19.8: ``ValueError: This op had not been implemented
  on CPU backend.``, raised in ``deepspeed.initialize`` when ``zero.Init`` loads ``QuantizerBuilder``, a CUDA
  op, for the quantized weights; qgZ's all-to-all loads the same op)

Measured, per contender:

* **step time**: forward + backward + step + zero_grad after a barrier (on a GPU between two
  ``torch.cuda.synchronize()``: the device's time, not the host's launches), max over ranks; the median of the
  timed steps, interleaved (each step runs every contender once, the order rotating), and their interquartile
  range (how noisy the median is);
* **peak memory** per rank (max over ranks): on CPU the C allocator's bytes in use (glibc ``mallinfo2``)
  read after every operator (collectives included) and around the step, over what was in use before the
  contender was built (reading only at module hooks misses peaks inside a module: FSDP2's all-gather
  and gradient buffers live between them); on CUDA ``torch.cuda.max_memory_allocated``; contenders are
  built and measured one at a time for this, each twice in turn (the lower figure is kept: the first one
  measured in a process also carries one-time allocations);
* **model state** = bytes in use after a step and ``zero_grad()`` over the same baseline, divided by the
  ZeRO paper's formula for that stage and precision (``zero.zero_model_state_bytes``; quantization changes
  only the wire, so its contenders keep fp32's 4 bytes; HSDP shards over its group, so the formula's world is
  ``g``; hpZ's is ``N`` plus its secondary copy of the parameters, ``4Ψ/g``);
* **traffic**: bytes this rank wrote to its sockets per step (``/proc/self/io`` ``wchar``: gloo's sends),
  divided by the bandwidth-optimal volume: ``(n-1)/n Ψ`` per collective over ``n`` ranks, times its bytes per
  element on the wire (2 fp32 collectives over the ``N`` ranks at stages 0-2, 3 at stage 3: the paper's 2Ψ and
  3Ψ; quantized ones ``1 + 4/256``, DeepSpeed's int8 weights 1 and int4 gradients 0.5, scales not counted).
  With ``R = N/g`` groups, HSDP reduce-scatters in the group and all-reduces each rank's shard (``Ψ/g``) across
  the ``R`` groups, and gathers in the group: ``4Ψ (3 (g-1)/g + 2 (R-1)/(R g))``; hpZ reduce-scatters over
  the world, gathers for forward over the world and for backward in the group, from the secondary copies:
  ``4Ψ (2 (N-1)/N + (g-1)/g)``. On gloo ``zero``'s reduce-scatter is an all-reduce
  (``zero/comm/communicator.py``), which sends twice the optimum (hence about 1.5 at stages 1-2); qgZ's
  all-to-all is not. Stage 3 keeps the root unit and the last one forward ran gathered into backward, so it
  sends less than its 3Ψ;
* **exposed communication** = (step time - the same step on PyTorch's fake process group, where every
  collective returns at once) / step time. The fake run is a separate process per rank, started by the
  rank after the real run, both ranks at once (the same contention for the cores).

Before any time is reported the script checks that every contender's losses agree with DDP's at every
step (fp32: 1e-3 relative, since Adam turns rounding differences into diverging updates over the run;
bf16 parameters or quantized collectives: 3e-2); the table shows each contender's largest gap. Results: a table
of ratios to DDP, ``--json`` and ``--plot``.

Below the table, the step-time targets, each PASS or FAIL: stages 1 and 2 <= 1.05x DDP and stage 1 no slower than
``ZeroRedundancyOptimizer``; stage 3 <= 1.15x DDP and no slower than FSDP2 (the same units, resharding after
forward). On a 2-core machine step times are noisy (see the IQR column): compare ratios across a few runs before
trusting a single PASS or FAIL near a limit.

With CUDA it runs on each rank's GPU with NCCL, every contender's AdamW fused (peak memory from the CUDA allocator;
the traffic column is n/a, as NCCL does not write to sockets on one machine, and so it is in a world of one, which
sends nothing). ``benchmarks/gpu_check.py`` runs it on one GPU with a GPU-sized GPT and records the figures in
``benchmarks/results/gpu.json``.

Run (CPU, gloo)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 benchmarks/compare.py [--d-model 256 --layers 4]
        [--steps 20] [--only zero-3,fsdp2] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import functools
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from zero import ZeroOptimizer, zero_model_state_bytes
from zero.cli.gpt_options import add_gpt_arguments, gpt_config
from zero.models import GPT, local_slice, synthetic_batch

LR, WD = 3e-4, 0.1
LOSS_RTOL, LOSS_RTOL_LOW = 1e-3, 3e-2  # largest relative loss gap to DDP over the run (fp32; lossy: bf16, quantized)
BUCKET_MB = 25.0  # ZeroConfig's default bucket; DeepSpeed gets buckets of the same size
BLOCK_SIZE = 256  # elements per quantization block (Communication's default)
QUANTIZED_WIRE_BYTES = 1 + 4 / BLOCK_SIZE  # int8 values and one fp32 scale per block (zero.comm.quantization)
TIME_LIMITS = {"zero-1": 1.05, "zero-2": 1.05, "zero-3": 1.15}  # step-time targets: largest ratio to DDP
TIME_PEERS = (("zero-1", "zro"), ("zero-3", "fsdp2"))  # step-time targets: ours no slower than the peer
DEVICE = (
    torch.device("cuda", int(os.environ.get("LOCAL_RANK") or 0)) if torch.cuda.is_available() else torch.device("cpu")
)


@dataclass
class Spec:
    """A contender: how to build it, the ZeRO stage whose formulas it follows, and its bytes per element."""

    name: str
    build: Callable[[GPT], "Contender"]
    stage: int
    param_bytes: int = 4  # parameters as stored (and all-gathered)
    grad_bytes: int = 4  # gradients as reduced
    optimizer_bytes: int = 8  # m and v (+ a 4-byte master under mixed precision)
    gathers: int = 1  # parameter all-gathers per step (stage 3 resharding after forward: 2)
    low_precision: bool = False  # lossy (bf16 parameters, quantized collectives): LOSS_RTOL_LOW
    gather_wire_bytes: float | None = None  # bytes per element a parameter gather sends (None: param_bytes; qwZ)
    reduce_wire_bytes: float | None = None  # bytes per element a gradient reduction sends (None: grad_bytes; qgZ)
    shard_size: int | None = None  # hierarchical sharding: ranks per shard group (None: one group of every rank)
    hierarchy: str = "hsdp"  # with shard_size: "hsdp" or "hpz" (zero.comm.policy)
    probe: bool = False  # may not run here (DeepSpeed's ZeRO++ on CPU): one step on a copy first, skipped if it fails


@dataclass
class Contender:
    module: torch.nn.Module  # what forward runs through
    optimizer: object  # has step() and zero_grad(), or a DeepSpeed engine
    engine: object = None  # DeepSpeed: backward and step go through it
    losses: list[float] = field(default_factory=list)
    times_ms: list[float] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        logits = self.module(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if self.engine is not None:
            self.engine.backward(loss)
            self.engine.step()
        else:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss.item()


def adamw(params, fused: bool | None = None) -> torch.optim.AdamW:
    """Every contender's AdamW; on a GPU torch's fused kernel (its fastest), on the CPU its default."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True if DEVICE.type == "cuda" else fused)


def _plain(base: GPT) -> Contender:
    model = copy.deepcopy(base)
    return Contender(model, adamw(model.parameters()))


def _wrap_ddp(model: torch.nn.Module) -> DistributedDataParallel:
    """DDP; on the fake process group with a no-op communication hook (the fake all-reduce returns nothing, which
    DDP's reducer refuses), so that the step computes without communicating."""
    ddp = DistributedDataParallel(model)
    if dist.get_backend() == "fake":
        def no_op(_, bucket):
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        ddp.register_comm_hook(None, no_op)
    return ddp


def _ddp(base: GPT) -> Contender:
    model = copy.deepcopy(base)
    return Contender(_wrap_ddp(model), adamw(model.parameters()))


def _zro(base: GPT) -> Contender:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = copy.deepcopy(base)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WD)
    return Contender(_wrap_ddp(model), opt)


def _fsdp2(reshard: bool, bf16: bool = False) -> Callable[[GPT], Contender]:
    def build(base: GPT) -> Contender:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = copy.deepcopy(base)
        mesh = init_device_mesh(DEVICE.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        extra = {"mp_policy": policy} if policy is not None else {}
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **extra)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **extra)
        return Contender(model, adamw(model.parameters()))

    return build


def _deepspeed(stage: int, offload: bool = False, zpp: dict | None = None) -> Callable[[GPT], Contender]:
    """DeepSpeed's engine at ``stage``; ``zpp``: ZeRO++'s flags (``zero_quantized_weights``, ...) added."""
    def build(base: GPT) -> Contender:
        import deepspeed

        model = copy.deepcopy(base)
        bucket = int(BUCKET_MB * 2**20 / 4)  # fp32 elements in one of our buckets (DeepSpeed's default: 5e8)
        zero_opt = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                    "stage3_prefetch_bucket_size": bucket,
                    **({"offload_optimizer": {"device": "cpu"}} if offload else {}), **(zpp or {})}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "zero_optimization": zero_opt, "zero_allow_untested_optimizer": True,
                  "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
        return Contender(engine, None, engine=engine)

    return build


def _zero(stage: int, **config) -> Callable[[GPT], Contender]:
    def build(base: GPT) -> Contender:
        model = copy.deepcopy(base)
        fused = "offload" in config  # the host step: torch's fused CPU AdamW, as ZeroOptimizer advises
        inner = adamw(model.parameters(), fused=fused or None)
        return Contender(model, ZeroOptimizer(inner, model, stage=stage, **config))

    return build


def specs(world: int | None = None) -> list[Spec]:
    """Every contender at this world size (default: the process group's; the hierarchical ones need an even world
    of at least 4 ranks)."""
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    out = [Spec("ddp", _ddp, 0), Spec("zro", _zro, 1),
           Spec("fsdp2", _fsdp2(True), 3, gathers=2), Spec("fsdp2-keep", _fsdp2(False), 3)]
    if world == 1:  # one process: plain PyTorch is the same training
        out.insert(0, Spec("plain", _plain, 0))
    if DEVICE.type == "cuda":  # bf16 peers and ours (on the CPU bf16 matmuls are slower than fp32 ones)
        bf16 = {"param_dtype": "bf16"}
        out += [Spec("fsdp2-bf16", _fsdp2(True, bf16=True), 3, gathers=2, param_bytes=2, low_precision=True),
                Spec("zero-3-bf16", _zero(3, precision=bf16), 3, gathers=2, param_bytes=2, optimizer_bytes=12,
                     low_precision=True),
                Spec("zero-3-bf16-offload", _zero(3, precision=bf16, offload={"optimizer": "cpu", "params": "cpu"}),
                     3, gathers=2, param_bytes=2, optimizer_bytes=12, low_precision=True)]
    if importlib.util.find_spec("deepspeed") is not None:
        out += [Spec("ds-1", _deepspeed(1), 1), Spec("ds-2", _deepspeed(2), 2),
                Spec("ds-3", _deepspeed(3), 3, gathers=2), Spec("ds-offload", _deepspeed(2, offload=True), 2)]
        zpp = {"zero_quantized_weights": True, "zero_quantized_gradients": True,
               **({"zero_hpz_partition_size": world // 2} if world >= 4 and world % 2 == 0 else {})}
        out += [Spec("ds-3-zpp", _deepspeed(3, zpp=zpp), 3, gathers=2, low_precision=True, probe=True,
                     gather_wire_bytes=1.0, reduce_wire_bytes=0.5,  # int8 weights, int4 gradients (scales not counted)
                     **({"shard_size": world // 2, "hierarchy": "hpz"} if "zero_hpz_partition_size" in zpp else {}))]
    out += [Spec(f"zero-{s}", _zero(s), s, gathers=2 if s == 3 else 1) for s in range(4)]
    out += [Spec("zero-3-keep", _zero(3, reshard_after_forward=False), 3)]
    out += [Spec("zero-2-offload", _zero(2, offload={"optimizer": "cpu"}), 2),
            Spec("zero-2-bf16", _zero(2, precision={"param_dtype": "bf16"}), 2, param_bytes=2, grad_bytes=4,
                 optimizer_bytes=12, low_precision=True)]
    wire = QUANTIZED_WIRE_BYTES
    for suffix, policy, wire_bytes in (("qwz", {"quantized_weights": True}, {"gather_wire_bytes": wire}),
                                       ("qgz", {"quantized_gradients": True}, {"reduce_wire_bytes": wire}),
                                       ("zpp", {"quantized_weights": True, "quantized_gradients": True},
                                        {"gather_wire_bytes": wire, "reduce_wire_bytes": wire})):
        out.append(Spec(f"zero-3-{suffix}", _zero(3, communication={**policy, "block_size": BLOCK_SIZE}), 3,
                        gathers=2, low_precision=True, **wire_bytes))
    if world >= 4 and world % 2 == 0:
        shard = world // 2
        out += [Spec(f"zero-3-{h}", _zero(3, communication={"shard_size": shard, "hierarchy": h}), 3, gathers=2,
                     shard_size=shard, hierarchy=h) for h in ("hsdp", "hpz")]
    return out


# ----- measuring --------------------------------------------------------------------------------------------


def _synchronize() -> None:
    """On a GPU, wait for everything queued: a step's time is the device's, not only the host's launches."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _bytes_written() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                              "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc() -> ctypes.CDLL:
    """glibc, loaded once (loading it on every read took 25 times as long as the read: 170 us a call, after every
    operator)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc


def in_use() -> int:
    """Bytes in use: the CUDA allocator's, or glibc's heap plus mmap'd chunks on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    info = _libc().mallinfo2()
    return info.uordblks + info.hblkhd


class EveryOp(TorchDispatchMode):
    """Calls ``sample(func)`` after every operator (also the collectives, which dispatch as ``c10d`` operators)."""

    def __init__(self, sample: Callable[[object], None]):
        super().__init__()
        self.sample = sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sample(func)
        return out


def parse_zero(name: str) -> tuple[int, dict[str, int]]:
    """``zero-3`` or ``zero-3/prefetch_units=0/...`` (ZeroConfig integer overrides): the stage and the overrides."""
    stage, *overrides = name.removeprefix("zero-").split("/")
    return int(stage), {k: int(v) for k, v in (o.split("=") for o in overrides)}


def _reason(err: Exception) -> str:
    """An error in a line: its type, its message's first line, and where it was raised and called from."""
    first = (str(err).strip().splitlines() or [""])[0]
    frames = traceback.extract_tb(err.__traceback__)[-2:]
    where = ["/".join(Path(f.filename).parts[-3:]) + f":{f.lineno} ({f.name}"
             + (f": {f.line})" if f.line and i else ")") for i, f in enumerate(reversed(frames))]
    return f"{type(err).__name__}: {first}" + (f"; raised in {where[0]}" if where else "") + \
        (f", called from {where[1]}" if len(where) > 1 else "")


def probed(chosen_specs: list[Spec], base: GPT, cfg, batch: int) -> tuple[list[Spec], dict[str, str]]:
    """The contenders that run here, and why each other failed: one flagged ``probe`` is built and takes one
    step on a throwaway copy first (every rank hears every rank's outcome), and is skipped if that failed on any."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kept, skipped = [], {}
    for spec in chosen_specs:
        if not spec.probe:
            kept.append(spec)
            continue
        error = ""
        try:
            c = spec.build(base)
            x, y = (local_slice(t, rank, world).to(DEVICE) for t in synthetic_batch(0, batch, cfg))
            c.train_step(x, y)
            del c
        except Exception as err:  # noqa: BLE001 - the contender is skipped with the reason
            error = _reason(err)
        errors: list[str] = [""] * world
        dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            skipped[spec.name] = failed[0][1] if len({e for _, e in failed}) == 1 else "; ".join(
                f"rank {r}: {e}" for r, e in failed)
        else:
            kept.append(spec)
        gc.collect()
    return kept, skipped


def run_steps(contenders: dict[str, Contender], cfg, batch: int, steps: int, warmup: int, real: bool,
              dp: tuple[int, int] | None = None) -> None:
    """Interleaved steps; records losses, times (max over ranks on a real group) and bytes sent. ``dp``: this rank's
    data-parallel (rank, size) when not every rank takes its own share of the batch (tensor parallelism:
    ``compare_tp.py``); default (rank, world size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = dp or (rank, world)
    names = list(contenders)
    for step in range(warmup + steps):
        x, y = (local_slice(t, dp_rank, dp_size).to(DEVICE) for t in synthetic_batch(step, batch, cfg))
        k = step % len(names)
        for name in names[k:] + names[:k]:
            c = contenders[name]
            if real:
                dist.barrier()
            _synchronize()
            sent, start = _bytes_written(), time.perf_counter()
            loss = c.train_step(x, y)
            _synchronize()
            elapsed, sent = (time.perf_counter() - start) * 1e3, _bytes_written() - sent
            if real:
                t = torch.tensor([elapsed, loss], dtype=torch.float64, device=DEVICE)
                dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
                dist.all_reduce(t[1:])
                elapsed, loss = float(t[0]), float(t[1]) / world
            c.losses.append(loss)
            if step >= warmup:
                c.times_ms.append(elapsed)
                c.sent.append(sent)


def memory(spec: Spec, base: GPT, cfg, batch: int, dp: tuple[int, int] | None = None) -> dict:
    """Peak and model state of one contender, built alone (bytes over what was in use before it); ``dp`` as in
    :func:`run_steps`."""
    rank, world = dp or (dist.get_rank(), dist.get_world_size())
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = in_use()
    c = spec.build(base)
    peak = [0]

    def sample(_func: object = None) -> None:
        peak[0] = max(peak[0], in_use())

    for step in range(2):
        x, y = (local_slice(t, rank, world).to(DEVICE) for t in synthetic_batch(step, batch, cfg))
        sample()
        with EveryOp(sample):
            c.train_step(x, y)
        sample()
    gc.collect()
    rest = in_use() - before
    if torch.cuda.is_available():
        peak[0] = max(peak[0], torch.cuda.max_memory_allocated())
    result = torch.tensor([peak[0] - before, rest], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    del c
    gc.collect()
    return {"peak": float(result[0]), "model_state": float(result[1])}


def fake_times(args: argparse.Namespace, names: list[str]) -> dict[str, float | None]:
    """This rank's median step times with every collective a no-op: the same script in a child process on
    PyTorch's fake process group (same rank and world size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, __file__, "--fake-rank", str(rank), "--fake-world", str(world), "--fake-out", out.name,
               "--only", ",".join(names)] + args.passthrough
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        mine = json.load(open(out.name))
    t = torch.tensor([[mine[n] or 0.0, mine[n] is None] for n in names], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a contender that failed on any rank has no fake time
    return {n: (None if failed else ms) for n, (ms, failed) in zip(names, t.tolist())}


def fake_main(args: argparse.Namespace) -> None:
    """The child process of :func:`fake_times`: each contender's steps on the fake group, one contender at a time
    (without communication there is nothing to interleave); ``null`` for one that cannot run there (DeepSpeed
    stage 3 checks that ranks agree, which a group that sends nothing cannot satisfy)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=args.fake_rank, world_size=args.fake_world)
    torch.set_num_threads(args.threads)
    cfg = gpt_config(args)
    torch.manual_seed(0)
    base = GPT(cfg).to(DEVICE)
    medians: dict[str, float | None] = {}
    for spec in chosen(args):
        try:
            contender = {spec.name: spec.build(base)}
            run_steps(contender, cfg, args.batch, args.steps, args.warmup, real=False)
            medians[spec.name] = statistics.median(contender[spec.name].times_ms)
        except Exception as err:  # noqa: BLE001 - reported as "n/a" with the reason
            print(f"{spec.name} cannot run on the fake process group: {err}", file=sys.stderr)
            medians[spec.name] = None
        gc.collect()
    json.dump(medians, open(args.fake_out, "w"))


# ----- report -----------------------------------------------------------------------------------------------


def theory_sent(spec: Spec, numel: int, world: int) -> float:
    """Bandwidth-optimal bytes one rank sends per step: reduce the gradients, gather the parameters (in the
    docstring's terms: ``(n-1)/n Ψ`` per collective over ``n`` ranks, times its wire bytes per element)."""
    def share(n: int) -> float:
        return (n - 1) / n * numel

    gather = spec.param_bytes if spec.gather_wire_bytes is None else spec.gather_wire_bytes
    reduce = spec.grad_bytes if spec.reduce_wire_bytes is None else spec.reduce_wire_bytes
    if spec.stage == 0:
        return 2 * share(world) * reduce  # all-reduce
    if spec.shard_size is None:
        return share(world) * (reduce + spec.gathers * gather)
    g, r = spec.shard_size, world // spec.shard_size
    if spec.hierarchy == "hpz":  # forward's gather over the world, backward's inside the group (exact: param_bytes)
        return share(world) * (reduce + gather) + (spec.gathers - 1) * share(g) * spec.param_bytes
    # HSDP: reduce-scatter and gathers inside the group; each rank's shard (Ψ/g) all-reduced across the r groups
    # (through the gradients' codec: quantized with qgZ)
    return share(g) * (reduce + spec.gathers * gather) + 2 * (r - 1) / r * numel / g * reduce


def sent_x_theory(spec: Spec, sent: float, numel: int, world: int) -> float | None:
    """Bytes sent over the bandwidth-optimal volume; ``None`` where nothing is to be sent (a world of one) or the
    sockets do not see it (NCCL on one machine)."""
    theory = theory_sent(spec, numel, world)
    return sent / theory if theory > 0 and DEVICE.type == "cpu" else None


def state_formula(spec: Spec, numel: int, world: int) -> float:
    """The ZeRO paper's model-state bytes per rank for the contender: HSDP shards over its group of ``shard_size``
    ranks; hpZ over every rank, plus the secondary copy of the parameters (``Ψ/shard_size``, as stored)."""
    formula = zero_model_state_bytes(numel, world if spec.shard_size is None or spec.hierarchy == "hpz"
                                     else spec.shard_size, spec.stage, param_bytes=spec.param_bytes,
                                     grad_bytes=spec.grad_bytes if spec.stage else spec.param_bytes,
                                     optimizer_bytes=spec.optimizer_bytes)
    if spec.shard_size is not None and spec.hierarchy == "hpz":
        formula += numel / spec.shard_size * spec.param_bytes
    return formula


def iqr(times: list[float]) -> float:
    """Interquartile range of the step times: how noisy their median is."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return q3 - q1


def time_checks(rows: list[dict]) -> list[dict]:
    """The step-time targets of the contenders in ``rows``: a ratio to DDP, or to a peer, against its limit."""
    by_name = {r["name"]: r for r in rows}
    checks = [{"check": f"{name} vs ddp", "ratio": by_name[name]["time_x_ddp"], "limit": limit}
              for name, limit in TIME_LIMITS.items() if name in by_name]
    checks += [{"check": f"{ours} vs {peer}", "ratio": by_name[ours]["median_ms"] / by_name[peer]["median_ms"],
                "limit": 1.0} for ours, peer in TIME_PEERS if ours in by_name and peer in by_name]
    return [{**c, "passed": c["ratio"] <= c["limit"]} for c in checks]


def table(rows: list[dict]) -> str:
    head = (f"{'contender':<15}{'step ms':>9}{'IQR':>7}{'x DDP':>7}{'peak MiB':>10}{'x DDP':>7}{'state/formula':>15}"
            f"{'sent/theory':>13}{'exposed':>9}{'loss gap':>10}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['name']:<15}{r['median_ms']:>9.1f}{r['iqr_ms']:>7.1f}{r['time_x_ddp']:>7.2f}"
                     f"{r['peak'] / 2**20:>10.1f}"
                     f"{r['peak_x_ddp']:>7.2f}{r['state_x_formula']:>15.2f}"
                     + (f"{r['sent_x_theory']:>13.2f}" if r["sent_x_theory"] is not None else f"{'n/a':>13}")
                     + (f"{r['exposed']:>9.1%}" if r["exposed"] is not None else f"{'n/a':>9}")
                     + f"{r['loss_deviation']:>10.1e}")
    return "\n".join(lines)


def checks_table(checks: list[dict]) -> str:
    return "\n".join(["step-time targets:"] + [
        f"  {c['check']:<15} {c['ratio']:.3f} (<= {c['limit']:.2f})  {'PASS' if c['passed'] else 'FAIL'}"
        for c in checks])


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.35 * len(rows) + 2), sharey=True)
    for ax, key, label in zip(axes, ("time_x_ddp", "peak_x_ddp", "exposed"),
                              ("step time / DDP", "peak memory / DDP", "exposed communication (share of the step)")):
        ax.barh(names, [r[key] or 0.0 for r in rows],
                color=["tab:blue" if n.startswith("zero") else "tab:gray" for n in names])
        ax.set_xlabel(label)
        if key != "exposed":
            ax.axvline(1.0, color="black", lw=0.8)
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----- main -------------------------------------------------------------------------------------------------


def run_record(args: argparse.Namespace) -> dict:
    """The machine and options of this run, for the JSON (docs/benchmarks.md states them)."""
    if DEVICE.type == "cuda":
        device = torch.cuda.get_device_name(DEVICE)
    else:
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")] \
            if os.path.exists("/proc/cpuinfo") else []
        device = names[0] if names else (platform.processor() or platform.machine())
    ds = importlib.util.find_spec("deepspeed")
    return {"device": device, "cpu_count": os.cpu_count(), "backend": dist.get_backend(),
            "torch": torch.__version__, "python": platform.python_version(),
            "deepspeed": importlib.metadata.version("deepspeed") if ds is not None else None,
            **{k: getattr(args, k) for k in ("steps", "warmup", "batch", "threads", "only")}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch", type=int, default=8, help="global batch (split over ranks)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--only", default=None, help="comma-separated contenders (ddp is always run)")
    p.add_argument("--json", default=None, help="write the rows, the checks and every step time here")
    p.add_argument("--plot", default=None, help="write a PNG of the table here")
    add_gpt_arguments(p, vocab=512, seq_len=128, d_model=256, layers=4, heads=4)
    p.add_argument("--fake-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fake-world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fake-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                        ("steps", "warmup", "batch", "threads", "vocab", "seq_len", "d_model", "layers", "heads")]
    return args


def chosen(args: argparse.Namespace) -> list[Spec]:
    """The contenders ``--only`` names (every one without it), at this process group's world size."""
    available = specs(dist.get_world_size())
    if args.only is None:
        return available
    wanted = {"ddp", *args.only.split(",")}
    missing = sorted(wanted - {s.name for s in available})
    if missing and dist.get_rank() == 0 and args.fake_rank is None:
        print(f"--only: no contender {', '.join(missing)} here (world size {dist.get_world_size()}; zero-3-hsdp and "
              f"zero-3-hpz need an even world of at least 4 ranks, ds-* needs deepspeed); available: "
              f"{', '.join(s.name for s in available)}", file=sys.stderr, flush=True)
    return [s for s in available if s.name in wanted]


def main() -> None:
    args = parse_args()
    if args.fake_rank is not None:
        return fake_main(args)
    torch.set_num_threads(args.threads)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo", timeout=timedelta(minutes=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    cfg = gpt_config(args)
    torch.manual_seed(0)
    base = GPT(cfg).to(DEVICE)
    numel = sum(p.numel() for p in base.parameters())
    chosen_specs, skipped = probed(chosen(args), base, cfg, args.batch)
    for name, reason in skipped.items():
        log(f"{name}: skipped, it does not run here ({reason})", flush=True)
    log(f"world {world}, GPT {numel / 1e6:.2f}M params, global batch {args.batch}, {args.threads} thread(s)/rank; "
        f"contenders: {', '.join(s.name for s in chosen_specs)}", flush=True)
    contenders = {s.name: s.build(base) for s in chosen_specs}
    run_steps(contenders, cfg, args.batch, args.steps, args.warmup, real=True)
    ddp_losses = contenders["ddp"].losses
    deviation = {n: max(abs(a / b - 1) for a, b in zip(c.losses, ddp_losses)) for n, c in contenders.items()}
    for spec in chosen_specs:  # the same training, before any time is reported
        tol = LOSS_RTOL_LOW if spec.low_precision else LOSS_RTOL
        if deviation[spec.name] > tol:
            raise SystemExit(f"{spec.name}: losses differ from DDP's by {deviation[spec.name]:.2e} (> {tol:.0e}); "
                             "not reporting times")
    log(f"losses agree with DDP's over {args.warmup + args.steps} steps", flush=True)
    results = {n: {"median_ms": statistics.median(c.times_ms), "iqr_ms": iqr(c.times_ms),
                   "sent": statistics.median(c.sent), "loss_deviation": deviation[n]} for n, c in contenders.items()}
    times_ms = {n: c.times_ms for n, c in contenders.items()}  # every timed step, for the JSON
    del contenders
    gc.collect()
    for _ in range(2):  # each contender twice, in turn, keeping its lower figures: the first one measured in
        for spec in chosen_specs:  # a process also carries one-time allocations (gloo's, thread pools)
            measured = memory(spec, base, cfg, args.batch)
            kept = results[spec.name]
            kept.update({k: min(v, kept.get(k, v)) for k, v in measured.items()})
    fake = fake_times(args, [s.name for s in chosen_specs])
    ddp = results["ddp"]
    rows = []
    for spec in chosen_specs:
        r = results[spec.name]
        formula = state_formula(spec, numel, world)
        rows.append({
            "name": spec.name, **r, "fake_ms": fake[spec.name],
            "time_x_ddp": r["median_ms"] / ddp["median_ms"], "peak_x_ddp": r["peak"] / ddp["peak"],
            "state_x_formula": r["model_state"] / formula,
            "sent_x_theory": sent_x_theory(spec, r["sent"], numel, world),
            "exposed": (None if fake[spec.name] is None
                        else max(0.0, (r["median_ms"] - fake[spec.name]) / r["median_ms"])),
        })
    checks = time_checks(rows)
    log("\n" + table(rows) + "\n\n" + checks_table(checks))
    if rank == 0 and args.json:
        json.dump({"world": world, "params": numel, "config": vars(cfg), "run": run_record(args), "rows": rows,
                   "skipped": skipped, "checks": checks, "times_ms": times_ms}, open(args.json, "w"), indent=2)
    if rank == 0 and args.plot:
        plot(rows, args.plot, f"GPT {numel / 1e6:.1f}M params, world size {world}: ratios to DDP")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
