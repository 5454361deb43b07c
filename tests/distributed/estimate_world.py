"""The estimator against ``zero.profile`` on the same configuration: rank 0 of a world of N in torch's fake
process group (collectives return at once; every byte rank 0 holds is real).

Run in its own process (``python -m tests.distributed.estimate_world N [K/P [FILTER]]``: part K of P of the
cases): it initializes the default process group. Prints one JSON line: for each model, stage and micro-batch, the
measured peak (the allocator's, less what the process held before) and the estimate, with both breakdowns.

``python -m tests.distributed.estimate_world optimizers N RANK`` is rank RANK of a world of N instead (the fake
process group runs any rank), training with optimizers stepped on whole parameters (issue 42): Muon on the blocks'
matrices with AdamW on the rest, and Adafactor; each rank's peak against the estimate of that rank, and the rank the
estimator prices by default (the worst of the rank holding the most optimizer state and the one owning the most
whole-parameter elements).
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import zero
from tests.distributed.harness import init_fake_world
from tests.inplace import InplaceNet, ResNet18, TinyResNet, resnet_loss
from zero.estimator import Workload, estimate
from zero.estimator.traffic import stages_for, validated
from zero.models import GPT, GPTConfig

MICRO_BATCHES = (2, 4)
STAGES = (0, 1, 2, 3)
VOCAB, SEQ = 512, 64


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    ))


def _gpt2_first_block_frozen():
    """A frozen base: GPT-2's first block and position embedding get no gradient (still in the optimizer)."""
    model = _gpt2()
    for p in [*model.transformer.h[0].parameters(), model.transformer.wpe.weight]:
        p.requires_grad_(False)
    return model


def _gpt2_lora():
    """LoRA adapters (PEFT) on a frozen GPT-2: the base is built on ``meta`` by the estimator (PEFT moves modules)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_gpt2(), LoraConfig(r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))


def _tokens(micro: int) -> tuple:
    return (torch.randint(0, VOCAB, (micro, SEQ)),)


def _hf_loss(model, x):
    return model(input_ids=x, labels=x).loss


MODELS = {
    "gpt": (lambda: GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=64, num_layers=2, num_heads=4)),
            lambda m, x: m.loss(x, x), _tokens),
    # wide, short and six blocks deep: the parameters make the peak, so units, gathering and buckets show
    "gpt6": (lambda: GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=256, num_layers=6, num_heads=4)),
             lambda m, x: m.loss(x, x), lambda micro: (torch.randint(0, 64, (micro, 8)),)),
    "hf-gpt2": (_gpt2, _hf_loss, _tokens),
    "hf-llama": (_llama, _hf_loss, _tokens),
    "hf-gpt2-frozen": (_gpt2_first_block_frozen, _hf_loss, _tokens),
    "hf-gpt2-lora": (_gpt2_lora, _hf_loss, _tokens),
    # wide and short: the parameters, not the activations, make the peak (where the codecs' packets show)
    "gpt-wide": (lambda: GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=256, num_layers=4, num_heads=4)),
                 lambda m, x: m.loss(x, x), lambda micro: (torch.randint(0, 64, (micro, 8)),)),
    "cnn": (SmallCNN, lambda m, x, y: nn.functional.cross_entropy(m(x), y),
            lambda micro: (torch.randn(micro, 3, 32, 32), torch.randint(0, 10, (micro,)))),
    # in-place operations (issue 33): torchvision's ResNet layout (ReLU(inplace=True), out += identity) on 32 x 32
    # images, and blocks (stage 3's units) whose forward starts by modifying its input in place
    "resnet-inplace": (lambda: TinyResNet(width=16), resnet_loss,
                       lambda micro: (torch.randn(micro, 3, 32, 32), torch.randint(0, 10, (micro,)))),
    "inplace-blocks": (lambda: InplaceNet(width=256), lambda m, x: m(x), lambda micro: (torch.randn(micro * 64, 256),)),
    # torchvision's resnet18 layout at width 8 on 64 x 64 images (issue 43: its last stage is 2 x 2, where oneDNN's
    # weight gradient takes its GEMM kernel and holds 8 copies of the weight on 2 threads, inside the kernel)
    "resnet18": (lambda: ResNet18(width=8), resnet_loss,
                 lambda micro: (torch.randn(micro, 3, 64, 64), torch.randint(0, 10, (micro,)))),
}


# at the first micro-batch only
PARTIAL = ("hf-gpt2-frozen", "hf-gpt2-lora", "gpt-wide", "resnet-inplace", "inplace-blocks", "resnet18")

# variants priced on the project's GPT at the first micro-batch, besides fp32 (estimate()'s keyword arguments):
# both mixed-precision policies, activation checkpointing, and accumulation of a micro-batch under no_sync() (also
# under mixed precision with an fp32 reduction, where it accumulates in fp32)
VARIANTS = ({"precision": "mixed-fp32-reduce"}, {"precision": "mixed"}, {"checkpointing": True}, {"no_sync": True},
            {"precision": "mixed-fp32-reduce", "no_sync": True})  # (bf16 micro-batches accumulate in fp32)
# ZeRO++'s quantized collectives (ZeroConfig.communication), priced on the wide GPT at the stages they run at
COMMUNICATION = ({"quantized_gradients": True}, {"quantized_weights": True},
                 {"quantized_weights": True, "quantized_gradients": True},
                 {"quantized_gradients": True, "gradient_bits": 4})
# ... and with hierarchy, in a world of 4 (two groups of 2), the only runs there: HSDP with qgZ (its sum across the
# groups is qgZ's all-reduce, which a bucket starts when the next one launches: buckets of 4 MB, several; int8 and
# int4), and hpZ with both
HIERARCHICAL_WORLD = 4
HIERARCHICAL = ({"communication": {"shard_size": 2, "quantized_gradients": True}},
                {"communication": {"shard_size": 2, "quantized_gradients": True}, "bucket_size_mb": 4},
                {"communication": {"shard_size": 2, "quantized_gradients": True, "gradient_bits": 4},
                 "bucket_size_mb": 4},
                {"communication": {"shard_size": 2, "hierarchy": "hpz", "quantized_weights": True,
                                   "quantized_gradients": True}})
# ZeroConfig's memory-relevant fields away from their defaults (issue 43: the estimator once ignored the first three),
# priced on a wide 6-block GPT (its units and buckets, several of each) at the stages they act at. (Not offload.ratio:
# on CPU the host is the device, so the allocator cannot tell the device's part from the host's; a CUDA run can.)
CONFIG_FIELDS = ({"reshard_after_forward": False}, {"unit_classes": ["CausalSelfAttention"]}, {"unit_size_mb": 1},
                 {"prefetch_units": 2}, {"max_in_flight_buckets": 1, "bucket_size_mb": 2},
                 {"activation_checkpointing": {"every": 2}})
CONFIG_WORLD = 2
STAGE_3_FIELDS = ("reshard_after_forward", "unit_classes", "unit_size_mb", "prefetch_units")
POLICIES = {"fp32": {}, "mixed": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
            "mixed-fp32-reduce": {"param_dtype": "bf16"}}


def key(name: str, stage: int, micro: int, variant: dict) -> str:
    return f"{name}/{stage}/{micro}" + "".join(f"/{k}={v}" for k, v in variant.items())


def measured(prof) -> dict:
    """The allocator's peak over what the process held on entry (collectives' own buffers left out), its breakdown
    by category and where it fell."""
    peak = prof.peak
    return {
        "measured": prof.allocator.peak_without_collectives - prof.samples[0].labels.get("other/alive on entry", 0),
        "categories": {k: v for k, v in peak.categories.items() if v},
        "where": f"{peak.phase} {peak.module} {peak.event}",
    }


def estimated(e) -> dict:
    """The estimator's peak, its breakdown by category and where it falls (the keys of :func:`measured`, named
    ``estimated...``)."""
    return {"estimated": e.peak, "estimated_categories": {k: v for k, v in e.categories.items() if v},
            "estimated_where": f"{e.phase} {e.module} {e.event}", "estimated_host": e.host}


def measure(build, loss_fn, batch, stage: int, *, precision: str = "fp32", checkpointing: bool = False,
            no_sync: bool = False, communication: dict | None = None, bucket_size_mb: float = 25,
            every_op: bool = False, optimizers=None, inspect=None, **fields) -> dict:
    """The measured peak of two steps (:func:`measured`); ``optimizers(model)``: what ``ZeroOptimizer`` wraps (default
    AdamW); ``inspect(prof, opt)``: more of the run to return, under ``"inspected"``; ``fields``: more of
    ``ZeroConfig``'s."""
    gc.collect()
    torch.manual_seed(0)
    model = build()
    extra = {"activation_checkpointing": {}} if checkpointing else {}
    wrapped = optimizers(model) if optimizers is not None else torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = zero.ZeroOptimizer(wrapped, model, stage=stage,
                             precision=POLICIES[precision], communication=communication or {},
                             bucket_size_mb=bucket_size_mb, **extra, **fields)
    with zero.profile(model, opt, every_op=every_op) as prof:
        for _ in range(2):
            if no_sync:  # a micro-batch accumulated locally first, as the Trainer does
                with opt.no_sync():
                    loss_fn(model, *batch).backward()
            loss_fn(model, *batch).backward()
            opt.step()
            opt.zero_grad()
    result = measured(prof)
    if inspect is not None:
        result["inspected"] = inspect(prof, opt)
    del prof, opt, model
    gc.collect()
    return result


def stages(variant: dict) -> tuple[int, ...]:
    """The stages a variant runs at (ZeroConfig's rules: quantized weights at stage 3, gradients at 1-3; stage 3's
    unit and gathering fields at stage 3, offload at stages 1-3)."""
    if set(variant) & set(STAGE_3_FIELDS):
        return (3,)
    return stages_for(validated(variant.get("communication")), STAGES)


def jobs(world_size: int) -> list[tuple[str, int, dict, int, bool]]:
    """The world's cases, as (model, micro-batch, variant, stage, every_op); ``every_op``: the GPT sampled after every
    operator too, for the breakdown at the peak (the other runs sample at module boundaries)."""
    micros = MICRO_BATCHES if world_size == CONFIG_WORLD else MICRO_BATCHES[:1]  # (4 is extrapolated: once is enough)
    runs = [(name, micro, {}) for name in MODELS for micro in micros if name not in (*PARTIAL, "gpt6")]
    runs += [(name, MICRO_BATCHES[0], {}) for name in PARTIAL if name != "resnet18" or world_size == CONFIG_WORLD]
    if world_size == CONFIG_WORLD:  # (precision, checkpointing, codecs and the fields act alike at any world size)
        runs += [("gpt", MICRO_BATCHES[0], variant) for variant in VARIANTS]
        runs += [("gpt-wide", MICRO_BATCHES[0], {"communication": policy}) for policy in COMMUNICATION]
        runs += [("gpt6", MICRO_BATCHES[0], variant) for variant in ({}, *CONFIG_FIELDS)]
    if world_size == HIERARCHICAL_WORLD:
        runs = [("gpt-wide", MICRO_BATCHES[0], variant) for variant in HIERARCHICAL]
    cases = [(name, micro, variant, stage, False) for name, micro, variant in runs for stage in stages(variant)]
    every_op = [("gpt", MICRO_BATCHES[-1], {}, stage, True) for stage in STAGES]
    return cases + (every_op if world_size == CONFIG_WORLD else [])


def main(world_size: int, part: str = "0/1", only: str = "") -> None:
    """Part ``K/P`` of the world's cases (every P-th from the K-th: the test runs the parts side by side, a process
    each); ``only``: the cases whose key has it (a filter, to look at one case)."""
    init_fake_world(world_size)
    index, parts = map(int, part.split("/"))
    workloads = {name: Workload(*MODELS[name]) for name in MODELS}
    out = {}
    for name, micro, variant, stage, every_op in jobs(world_size)[index::parts]:
        case = f"every-op/{name}/{stage}" if every_op else key(name, stage, micro, variant)
        if only not in case:
            continue
        build, loss_fn, make_batch = MODELS[name]
        torch.manual_seed(micro)
        run = measure(build, loss_fn, make_batch(micro), stage, every_op=every_op, **variant)
        e = estimate(workloads[name], stage=stage, world_size=world_size, micro_batch=micro, **variant)
        out[case] = {**run, **estimated(e)}
    print(json.dumps(out))
    dist.destroy_process_group()


def _muon_adamw(model: nn.Module) -> list:
    """torch's recipe: Muon on the hidden matrices (the blocks' 2-D weights), AdamW on embeddings, norms and biases."""
    hidden = [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")]
    rest = [p for name, p in model.named_parameters() if not (p.ndim == 2 and name.startswith("blocks."))]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]


# optimizers stepped on whole parameters, on the wide GPT (its parameters, and so the owner step's whole tensors and
# exchange buffers, make the peak) at every stage, and under mixed precision and on the small GPT (activations make
# the peak) at stage 2
WHOLE_OPTIMIZERS = {"muon+adamw": _muon_adamw, "adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2)}
WHOLE_RUNS = [("gpt-wide", stage, {}) for stage in STAGES] + [("gpt-wide", 2, {"precision": "mixed-fp32-reduce"}),
                                                                ("gpt", 2, {})]


def _attribution(prof, opt) -> dict:
    """What the profiler attributes to optimizer state after the last step, against every wrapped optimizer's state
    (unique storages), its labels there, and the largest gap to the allocator's figure over the run."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for inner in opt.optimizers
                for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)}
    last = prof.samples[-1]
    return {"profiled": last.categories["optimizer_state"], "held": sum(storages.values()),
            "labels": sorted(label for label in last.labels if label.startswith("optimizer_state/")),
            "unexplained": max(abs(s.unexplained) for s in prof.samples)}


def whole_optimizers_main(world_size: int, rank: int) -> None:
    """Rank ``rank`` of a world of ``world_size`` (torch's fake process group): one JSON line, for each optimizer set
    and run of :data:`WHOLE_RUNS` at the first micro-batch, the measured peak, the estimate of this rank and the rank
    the estimator prices by default, the owner step's all-to-alls (calls and elements sent, counted and estimated);
    with Muon and AdamW at stage 2, the profiler's attribution (:func:`_attribution`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    out = {}
    for name, optimizers in WHOLE_OPTIMIZERS.items():
        for model, stage, variant in WHOLE_RUNS:
            if stage == 0 and (rank, world_size) != (0, 2):  # (one shard: every rank of every world holds the same)
                continue
            build, loss_fn, make_batch = MODELS[model]
            workload = Workload(build, loss_fn, make_batch, optimizers=optimizers)
            torch.manual_seed(MICRO_BATCHES[0])
            attribution = (name, stage, variant) == ("muon+adamw", 2, {})

            def inspect(prof, opt, attribution=attribution) -> dict:
                exchanged = opt.comm_stats.get("all_to_all", {})
                return {"all_to_all": [exchanged.get("calls", 0), exchanged.get("numel", 0)],
                        **(_attribution(prof, opt) if attribution else {})}

            run = measure(build, loss_fn, make_batch(MICRO_BATCHES[0]), stage, optimizers=optimizers, inspect=inspect,
                          **variant)
            e = estimate(workload, stage=stage, world_size=world_size, micro_batch=MICRO_BATCHES[0], rank=rank,
                         **variant)
            chosen = estimate(workload, stage=stage, world_size=world_size, micro_batch=MICRO_BATCHES[0], **variant)
            exchanged = e.traffic.comm_stats().get("all_to_all", {})
            out[f"{name}/{key(model, stage, MICRO_BATCHES[0], variant)}"] = {
                **run, **estimated(e), "rank": e.rank, "chosen": chosen.rank, "chosen_peak": chosen.peak,
                "estimated_all_to_all": [exchanged.get("calls", 0), exchanged.get("numel", 0)]}
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    # The imports' objects out of every collection and live-tensor walk (each measured run makes several): measured
    # peaks read the same (the allocator's figure and what was alive on entry both leave the frozen storages out)
    gc.freeze()
    if sys.argv[1] == "optimizers":
        whole_optimizers_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(int(sys.argv[1]), *sys.argv[2:])
