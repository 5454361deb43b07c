"""What each rank runs in ``test_codec_world.py`` (the collective codec seam, ``zero.comm.codec``).

One world per world size runs both parts and returns plain data; the test compares it with exact values:

* ``comm_checks``: all-gathers (out of place, in place, bfloat16) and reduce-scatters (out of place, in place), all
  launched before any is waited for, through a forced communicator with the default (identity) codec, through
  today's raw ``torch.distributed`` calls (``communicator.py``'s gloo path: one broadcast per rank, an all-reduce of the
  input), through one with the test double (``tests.codecs.Bf16WireCodec``) and through the quantized codecs (int8,
  and int4 gradients); and all-gathers through the test fp8 codec (``tests.codecs.Fp8Gather``);
* ``training`` (world sizes 2 and 3): a small GPT trained with SGD at stages 2 and 3, once with the identity codec
  and once with the double swapped in after construction, recording losses, the final parameters, and per step
  ``opt.comm_stats`` and what the double counted; and the runs of ``traffic_world.MIXED_CASES`` (the estimator's
  traffic under mixed precision). At stage 3 also with the test codecs named by the policy (``CODECS``: fp8
  all-gathers, bfloat16 reductions), recording what each held.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.codecs import Bf16WireCodec, Fp8Gather
from tests.distributed.traffic_world import MIXED_CASES, steady_step_stats
from zero import ZeroOptimizer
from zero.comm.codec import PerCollective, QuantizedGradients, QuantizedWeights
from zero.comm.communicator import Communicator
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

N = 7  # elements per rank's chunk
CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
STEPS = 4
BUCKET_MB = 0.01  # ~2.6k fp32 elements: several buckets, shards padded unevenly at 3 ranks
LR, MOMENTUM = 0.05, 0.9
STAGES = (2, 3)
KINDS = ("all_gather", "reduce_scatter")
BLOCK = 4  # quantization block of the collective checks: two blocks per chunk of N, the second one padded
QUANTIZED = {  # ZeroConfig.communication of the quantized training runs, by stage
    2: {"quantized_gradients": True, "block_size": 64},
    3: {"quantized_weights": True, "quantized_gradients": True, "block_size": 64},
}
INT4 = {stage: {**policy, "gradient_bits": 4} for stage, policy in QUANTIZED.items()}  # ... with int4 gradients
CODECS = {"gather_codec": "tests.codecs:Fp8Gather", "reduce_codec": "tests.codecs:Bf16WireCodec"}  # stage 3's run


def _values(gen: torch.Generator, k: int) -> torch.Tensor:
    """Normal values over six orders of magnitude, so that a bound relative to each element is tested."""
    return torch.randn(k, generator=gen) * 10.0 ** torch.randint(-3, 4, (k,), generator=gen)


def inputs_of(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return {
        "gather": _values(gen, N),
        "gather_bf16": _values(gen, N).to(torch.bfloat16),
        "reduce": _values(gen, world_size * N),
    }


def _run(comm: Communicator, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every all-gather and reduce-scatter case, launched first, then waited for in launch order."""
    world, rank = comm.world_size, comm.rank
    out = {
        "gather": torch.full((world * N,), float("nan")),
        "gather_in_place": torch.full((world * N,), float("nan")),
        "gather_bf16": torch.full((world * N,), float("nan"), dtype=torch.bfloat16),
        "reduce": torch.full((N,), float("nan")),
        "reduce_in_place": inputs["reduce"].clone(),
    }
    own = out["gather_in_place"].narrow(0, rank * N, N)
    own.copy_(inputs["gather"])
    in_place_chunk = out["reduce_in_place"].narrow(0, rank * N, N)
    handles = [
        comm.all_gather(out["gather"], inputs["gather"]),
        comm.all_gather(out["gather_in_place"], own),
        comm.all_gather(out["gather_bf16"], inputs["gather_bf16"]),
        comm.reduce_scatter(out["reduce"], inputs["reduce"].clone()),
        comm.reduce_scatter(in_place_chunk, out["reduce_in_place"]),
    ]
    for handle in handles:
        handle.wait()
    out["reduce_in_place"] = in_place_chunk.clone()
    return out


def _raw(rank: int, world_size: int, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same collectives as ``communicator.py`` issued them before the codec seam (its gloo path)."""
    out = {}
    for name in ("gather", "gather_bf16"):
        chunks = [inputs[name].clone() if r == rank else torch.empty_like(inputs[name]) for r in range(world_size)]
        for r, chunk in enumerate(chunks):
            dist.broadcast(chunk, r)
        out[name] = torch.cat(chunks)
    summed = inputs["reduce"].clone()
    dist.all_reduce(summed)
    out["reduce"] = summed.narrow(0, rank * N, N).clone()
    return out


def _stats(comm: Communicator) -> dict:
    stats = comm.stats.as_dict("current")
    for entry in stats.values():
        entry.pop("wait_s")
    return stats


def comm_checks(rank: int, world_size: int) -> dict:
    inputs = inputs_of(rank, world_size)
    identity = Communicator(force_collectives=True, timeout_s=60)
    double = Bf16WireCodec()
    lossy = Communicator(force_collectives=True, timeout_s=60, codec=double)
    quantized = Communicator(force_collectives=True, timeout_s=60,
                             codec=PerCollective(QuantizedWeights(BLOCK), QuantizedGradients(BLOCK)))
    int4 = Communicator(force_collectives=True, timeout_s=60, codec=QuantizedGradients(BLOCK, bits=4))
    summed, summed4 = inputs["reduce"].clone(), inputs["reduce"].clone()
    quantized.reduce_gradients(summed, what="all-reduce of gradients").wait()
    int4.reduce_gradients(summed4, what="all-reduce of gradients").wait()
    fp8 = Communicator(force_collectives=True, timeout_s=60, codec=Fp8Gather())
    fp8_out = {"gather": torch.full((world_size * N,), float("nan")), "gather_in_place": torch.zeros(world_size * N)}
    own = fp8_out["gather_in_place"].narrow(0, rank * N, N)
    own.copy_(inputs["gather"])
    handles = [fp8.all_gather(fp8_out["gather"], inputs["gather"]), fp8.all_gather(fp8_out["gather_in_place"], own)]
    for handle in handles:
        handle.wait()
    return {
        "fp8": fp8_out,
        "fp8_stats": _stats(fp8),
        "quantized": {**_run(quantized, inputs), "all_reduce": summed},
        "quantized_stats": _stats(quantized),
        "int4": {**_run(int4, inputs), "all_reduce": summed4},
        "int4_stats": _stats(int4),
        "default_codec": type(identity.codec).__name__,
        "identity": _run(identity, inputs),
        "identity_stats": _stats(identity),
        "raw": _raw(rank, world_size, inputs),
        "double": _run(lossy, inputs),
        "double_stats": _stats(lossy),
        "double_counts": double.counts(),
    }


def _train(rank: int, world_size: int, stage: int, swap: bool, communication: dict | None = None) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), model, stage=stage,
                        bucket_size_mb=BUCKET_MB, communication=communication or {})
    default = type(opt.comm.codec).__name__
    double = Bf16WireCodec()
    if swap:
        opt.comm.codec = double
    losses, stats, counts = [], [], []
    for step in range(STEPS):
        x, y = synthetic_batch(step % 2, GLOBAL_BATCH, CFG)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats.append({kind: {k: v for k, v in entry.items() if k != "wait_s"}
                      for kind, entry in opt.comm_stats.items()})
        counts.append(double.counts())
        double.reset()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    with opt.gathered_parameters():  # (exact whatever the codec)
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    held = {name: sorted(getattr(getattr(opt.comm.codec, name, None), "held", ())) for name in ("gather", "reduce")}
    return {"default": default, "losses": losses, "params": params, "stats": stats, "counts": counts, "held": held}


def codec_checks(rank: int, world_size: int) -> dict:
    result = {"comm": comm_checks(rank, world_size)}
    if world_size > 1:
        result["training"] = {stage: {"identity": _train(rank, world_size, stage, swap=False),
                                      "double": _train(rank, world_size, stage, swap=True),
                                      "quantized": _train(rank, world_size, stage, False, QUANTIZED[stage]),
                                      "int4": _train(rank, world_size, stage, False, INT4[stage])}
                              for stage in STAGES}
        result["training"][3]["codecs"] = _train(rank, world_size, 3, False, CODECS)
        result["mixed"] = [steady_step_stats(rank, world_size, CFG, GLOBAL_BATCH, BUCKET_MB, *case)
                           for case in MIXED_CASES]  # for the estimator (traffic_world)
    return result
