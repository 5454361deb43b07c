"""What each rank runs in the LoRA tests (``test_lora_world.py``, issue 23), and the single-process references.

Hugging Face PEFT's LoRA (``get_peft_model(model, LoraConfig(r=4, target_modules=[...]))``) on a tiny GPT-2 and a
tiny Llama built from configs: a frozen base (embeddings, norms, head and every base weight) with small trainable
adapters beside its linear layers, trained with ``ZeroOptimizer(AdamW(trainable parameters), model, stage=s)`` and
``opt.clip_grad_norm_(1.0)`` for ``STEPS`` steps on this rank's share of the global batch. Composed with bf16 mixed
precision, CPU offload, activation checkpointing (the PEFT way, ``model.gradient_checkpointing_enable()``: reentrant
with ``enable_input_require_grads()``, and non-reentrant; and zero's own, by ``ZeroConfig`` and by
``zero.checkpoint_activations``), gradient accumulation under ``opt.no_sync()``, and ``ZeroTrainer`` against the
Trainer with DDP.

One world runs every case (``lora_checks``); the references run in one process (``reference``, ``bf16_recipe``).
Each case gets its own process group, so a case that fails (issue 23: stage 3) is recorded as an error and the next
one starts clean; its collectives time out after ``TIMEOUT_S`` instead of hanging.
"""

from __future__ import annotations

import datetime
import gc
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.toy import tiny_hf
from zero.models import local_slice

GLOBAL_ROWS, SEQ, VOCAB = 12, 16, 64  # 12 rows: 1, 2 or 3 ranks, each with 2 micro-batches when accumulating
STEPS = 6
NUM_BATCHES = 3  # batches are revisited, so the loss visibly falls
LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.01, 1.0
# A base initialized wider than Hugging Face's 0.02 and LoRA scaling 32/4: gradient norms 1.0-1.5, so clipping at 1.0
# is active on most steps (not on the last); with the defaults the norms stay near 0.1 and clipping never acts.
INIT_STD, LORA_ALPHA = 0.1, 32
TIMEOUT_S = 60
MODELS = ("gpt2", "llama")
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama": ["q_proj", "v_proj", "o_proj", "down_proj"]}
BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}


def models_at(world_size: int) -> tuple[str, ...]:
    """Both models at 2 ranks; GPT-2 alone at 1 and 3. What Llama adds (``nn.Linear`` targets, its decoder layer
    checkpointed) does not depend on the world size, and the shards' arithmetic at 1 and 3 ranks (uneven at 3) does
    not depend on the model: GPT-2's adapters are split unevenly at 3 ranks too."""
    return MODELS if world_size == 2 else MODELS[:1]


# ----- the model, the data, the step ----------------------------------------------------------------------------


def build(kind: str, seed: int = 0):
    """A tiny GPT-2 or Llama from a config with LoRA adapters of rank 4 (PEFT's defaults otherwise: A random,
    B zero, no dropout), in training mode. The same weights on every call with the same seed."""
    from peft import LoraConfig, get_peft_model

    if kind == "gpt2":  # lm_head tied to wte: frozen together
        base = tiny_hf("gpt2", seed, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       initializer_range=INIT_STD)
    else:
        base = tiny_hf(kind, seed, vocab_size=VOCAB, max_position_embeddings=SEQ, num_key_value_heads=2,
                       initializer_range=INIT_STD)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGETS[kind],
                      fan_in_fan_out=kind == "gpt2")
    model = get_peft_model(base, lora)
    model.train()
    return model


def batch(step: int) -> torch.Tensor:
    """The global batch of token ids at ``step`` (labels are the ids: the model shifts them)."""
    return torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ), generator=torch.Generator().manual_seed(step % NUM_BATCHES))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # mean over tokens; every row has SEQ - 1 of them


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def split_state(model) -> tuple[dict, dict]:
    """(adapters, frozen base): clones of the trainable and the frozen parameters by name (whole: call it inside
    ``gathered_parameters()`` at stage 3)."""
    adapters, frozen = {}, {}
    for name, p in model.named_parameters():
        (adapters if p.requires_grad else frozen)[name] = p.detach().clone()
    return adapters, frozen


# ----- single-process references (also run in the pytest process) -------------------------------------------------


def reference(kind: str) -> dict:
    """Plain PyTorch in one process on the whole global batch: AdamW on the adapters, torch's clipping."""
    model = build(kind)
    _, initial = split_state(model)
    opt = adamw(trainable(model))
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_of(model, batch(step))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable(model), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapters, frozen = split_state(model)
    return {"losses": losses, "norms": norms, "adapters": adapters, "frozen": frozen, "initial": initial}


def bf16_recipe(kind: str, rank: int = 0, world_size: int = 1, group=None) -> dict:
    """The hand-built bf16 recipe (``tests.recipes.MasterRecipe``'s pattern, for the adapters only): fp32 masters of
    the adapters' initial values, a bf16 copy of the model for forward and backward, its adapters' gradients cast to
    fp32 onto the masters, clipped there and stepped by AdamW, cast back. Buffers keep their dtype, as under
    ZeroOptimizer (Llama's rotary ``inv_freq`` stays fp32). In one process on the whole batch, or with ``group`` under
    DDP on this rank's share (DDP reduces the bf16 gradients in bf16): the noise floor at 2 and 3 ranks."""
    model = build(kind)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().clone().requires_grad_() for p in trainable(model)]  # the fp32 initial values
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    low = trainable(model)
    opt = adamw(masters)
    forward = DistributedDataParallel(model, process_group=group) if group is not None else model
    losses = []
    for step in range(STEPS):
        loss = loss_of(forward, batch(step) if group is None else local_slice(batch(step), rank, world_size))
        loss.backward()
        for m, p in zip(masters, low):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, MAX_NORM)
        opt.step()
        opt.zero_grad()
        model.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, low):
                p.copy_(m)
        losses.append(loss.detach().float())
    return {"losses": _global_mean(losses, group, world_size) if group is not None else [float(v) for v in losses],
            "masters": {n: m.detach().clone() for n, m in zip(names, masters)}}


# ----- one distributed case --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One ZeroOptimizer run: ``name`` says what it composes (see ``CASES``)."""

    name: str
    stage: int
    precision: str | None = None  # "bf16"
    offload: dict = field(default_factory=dict)
    checkpointing: str | None = None  # "peft-reentrant", "peft", "zero-config", "zero-fn"
    accumulate: int = 1  # micro-batches per step, all but the last under opt.no_sync()

    @property
    def key(self) -> str:
        return f"{self.name}-stage{self.stage}"


def _cases() -> list[Case]:
    cases = [Case("fp32", s) for s in range(4)]
    cases += [Case("accumulate", s, accumulate=2) for s in range(4)]
    cases += [Case("offload-optimizer", s, offload={"optimizer": "cpu"}) for s in (1, 2, 3)]
    cases += [Case("offload-params", 3, offload={"params": "cpu"})]
    cases += [Case("ckpt-peft-reentrant", s, checkpointing="peft-reentrant") for s in range(4)]
    cases += [Case("ckpt-peft", s, checkpointing="peft") for s in range(4)]
    cases += [Case("ckpt-zero-config", s, checkpointing="zero-config") for s in range(4)]
    cases += [Case("ckpt-zero-fn", s, checkpointing="zero-fn") for s in (0, 3)]
    cases += [Case("bf16", s, precision="bf16") for s in range(4)]
    cases += [Case("bf16-offload-optimizer", s, precision="bf16", offload={"optimizer": "cpu"}) for s in (2, 3)]
    cases += [Case("bf16-offload-params", 3, precision="bf16", offload={"params": "cpu"})]
    return cases


CASES = {c.key: c for c in _cases()}
TRAINER_STAGES = (0, 1, 2, 3)


def _global_mean(values: list[torch.Tensor], group, world_size: int) -> list[float]:
    stacked = torch.stack([v.detach().float() for v in values])
    dist.all_reduce(stacked, group=group)
    return (stacked / world_size).tolist()


def _masters(opt, model, group) -> dict:
    """The fp32 master weights of the adapters, whole, by name (every rank's pieces, gathered)."""
    mine = [(p.slot.name, p.piece.param_start, p.tensor.detach().clone().cpu())
            for b in opt.buckets if b.trainable for p in b.pieces]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for rank_pieces in everyone:
        for name, start, tensor in rank_pieces:
            pieces.setdefault(name, {})[start] = tensor
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return {n: torch.cat([t for _, t in sorted(by_start.items())]).view(shapes[n]) for n, by_start in pieces.items()}


def run_case(rank: int, world_size: int, kind: str, case: Case, group) -> dict:
    import zero
    from zero import ZeroOptimizer

    model = build(kind)
    if case.checkpointing == "peft-reentrant":  # PEFT's documented way: inputs must require grad for reentrant
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model.enable_input_require_grads()
    elif case.checkpointing == "peft":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif case.checkpointing == "zero-fn":
        zero.checkpoint_activations(model, {"classes": [BLOCKS[kind]]})
    options = dict(stage=case.stage, process_group=group, timeout_s=TIMEOUT_S)
    if case.precision is not None:
        options["precision"] = {"param_dtype": case.precision}
    if case.offload:
        options["offload"] = case.offload
    if case.checkpointing == "zero-config":
        options["activation_checkpointing"] = {}
    opt = ZeroOptimizer(adamw(trainable(model)), model, **options)
    losses, norms = [], []
    for step in range(STEPS):
        micro = local_slice(batch(step), rank, world_size).chunk(case.accumulate)
        total = torch.zeros(())
        for i, ids in enumerate(micro):
            with opt.no_sync() if i < len(micro) - 1 else nullcontext():
                loss = loss_of(model, ids) / len(micro)
                loss.backward()
            total += loss.detach().float()
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if not torch.isfinite(total):
            raise FloatingPointError(f"loss {float(total)} at step {step}")
    out = {"losses": _global_mean(losses, group, world_size), "norms": norms}
    with opt.gathered_parameters():
        out["adapters"], out["frozen"] = split_state(model)
    if case.precision is not None:
        out["masters"] = _masters(opt, model, group)
    return out


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or ``{"error": ...}``: the exception's type and message, and the traceback's end."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded, and the test names it
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    finally:
        gc.collect()


def _group():
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S + 30))


# ----- the Trainer --------------------------------------------------------------------------------------------------

TRAINER_BATCH = 2  # rows per rank per micro-batch, 2 micro-batches per step


def trainer_run(rank: int, world_size: int, root: str, stage: int | None) -> dict:
    """``ZeroTrainer`` at ``stage`` (None: the plain Trainer, which wraps the model in DDP) on LoRA GPT-2, 2
    micro-batches per step: per-step loss and grad norm, and the adapters and frozen base after training."""
    from transformers import Trainer

    from tests.distributed.integrations_world import Tokens, logs, torchrun_env, training_args
    from zero import ZeroConfig
    from zero.integrations.transformers import ZeroTrainer

    torchrun_env(rank, world_size)
    args = training_args(f"{root}/stage{stage}", per_device_train_batch_size=TRAINER_BATCH, max_steps=STEPS,
                         learning_rate=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM)
    data = Tokens(STEPS * 2 * TRAINER_BATCH * world_size, VOCAB, SEQ)
    if stage is None:
        trainer = Trainer(model=build("gpt2"), args=args, train_dataset=data)
    else:
        trainer = ZeroTrainer(model=build("gpt2"), args=args, train_dataset=data,
                              zero_config=ZeroConfig(stage=stage, timeout_s=TIMEOUT_S))
    trainer.train()
    out = {**logs(trainer), "wrapped": type(trainer.model_wrapped).__name__}
    with trainer.zero_optimizer.gathered_parameters() if stage is not None else nullcontext():
        out["adapters"], out["frozen"] = split_state(trainer.model)
    return out


# ----- the world ----------------------------------------------------------------------------------------------------


def lora_checks(rank: int, world_size: int, root: str) -> dict:
    """Every case for the models of this world size (``models_at``), the bf16 recipe under DDP at 2 and 3 ranks, and
    the Trainer (DDP and stages 0-3); keyed by (model, case key), ("ddp-bf16", model) and ("trainer", stage or
    "ddp"). Each value is the run's result or ``{"error": ...}``; ``"seconds"`` holds each run's time."""
    import time

    warnings.filterwarnings("ignore", category=FutureWarning)  # gradient_checkpointing_enable's rename
    warnings.filterwarnings("ignore", message=".*fused=True.*")  # offload's advice; the kernel changes no check
    keys = list(CASES)
    out: dict = {"seconds": {}}

    def timed(key, fn, *args):
        start = time.perf_counter()
        out[key] = _guarded(fn, *args)
        out["seconds"][key] = time.perf_counter() - start

    for kind in models_at(world_size):
        for key in keys:
            timed((kind, key), run_case, rank, world_size, kind, CASES[key], _group())
        if world_size > 1 and any(CASES[key].precision for key in keys):
            timed(("ddp-bf16", kind), bf16_recipe, kind, rank, world_size, _group())
    timed(("trainer", "ddp"), trainer_run, rank, world_size, root, None)
    for stage in TRAINER_STAGES:
        timed(("trainer", stage), trainer_run, rank, world_size, root, stage)
    return out
