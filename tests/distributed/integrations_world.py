"""What each rank runs in the Hugging Face integration tests (``test_integrations_world.py``): the Trainer and
an Accelerate loop, with ZeroOptimizer at stages 0-3 and with DDP (the baseline), on a GPT-2 from a config; and both
with hierarchical sharding at 4 ranks (``HIERARCHICAL``). ``--quick`` runs ``QUICK_STAGES`` and ``QUICK_HIERARCHICAL``
(the checkpoints, saved at stage 2 and resumed at stage 3, either way), and each world returns what it ran."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.toy import tiny_hf

GLOBAL_ROWS, SEQ, VOCAB = 32, 16, 64
STEPS = 4  # optimizer steps: 2 ranks x 2 rows x 2 micro-batches = 8 rows each
STAGES = (0, 1, 2, 3)
QUICK_STAGES = {  # --quick: each integration against DDP at one stage (stage 3: the hierarchical world's Trainer)
    "trainer": (1,),  # whole local gradients of which only a chunk is reduced: torch's clip would read them
    "accelerate": (2,),  # accelerator.accumulate's no_sync() over the reduce-scatter hooks
}
HIERARCHICAL = ("trainer", "accelerate", "trainer_hpz", "accelerate_hpz")  # the paths at 4 ranks in 2 groups
# --quick: HSDP through the Trainer (its export heard in every group), hpZ through Accelerate
QUICK_HIERARCHICAL = ("trainer", "accelerate_hpz")
# the Trainer's arguments in these tests and in lora_world's (each adds its steps and hyperparameters)
TRAINER_SETTINGS = dict(
    per_device_train_batch_size=2, gradient_accumulation_steps=2, lr_scheduler_type="linear", warmup_steps=1,
    logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, data_seed=0, ddp_backend="gloo",
    disable_tqdm=True, dataloader_num_workers=0)


def torchrun_env(rank: int, world_size: int) -> None:
    """What torchrun would set: Accelerate reads it (the process group already exists)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "ACCELERATE_USE_CPU": "true"})


def gpt2(seed: int = 0):
    return tiny_hf("gpt2", seed, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class Tokens(torch.utils.data.Dataset):
    """``rows`` random sequences of token ids (seeded), each its own labels."""

    def __init__(self, rows: int = GLOBAL_ROWS, vocab: int = VOCAB, seq: int = SEQ) -> None:
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out: str, **over):
    """``transformers.TrainingArguments`` writing to ``out``: ``TRAINER_SETTINGS`` and ``over``."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, **{**TRAINER_SETTINGS, **over})


def logs(trainer) -> dict:
    """The loss and gradient norm the Trainer logged at each step."""
    rows = [r for r in trainer.state.log_history if "loss" in r]
    return {"loss": [r["loss"] for r in rows], "grad_norm": [float(r["grad_norm"]) for r in rows]}


def trainer_runs(rank: int, world_size: int, root: str, stages: tuple[int, ...] = STAGES) -> dict:
    """DDP Trainer, then ZeroTrainer at ``stages``: per-step loss and grad norm; stage 2 and 3 resume from a
    checkpoint; the exported model of stage 3."""
    torchrun_env(rank, world_size)
    from transformers import Trainer

    from zero import ZeroConfig
    from zero.integrations.transformers import ZeroTrainer

    def args(out: str, **over):
        return training_args(out, max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5, **over)

    out = {"stages": stages}
    base = Trainer(model=gpt2(), args=args(f"{root}/ddp"), train_dataset=Tokens())
    base.train()
    out["ddp"] = logs(base)
    out["ddp_eval"] = base.evaluate(eval_dataset=Tokens())["eval_loss"]
    out["ddp_wrapped"] = type(base.model_wrapped).__name__
    for stage in stages:
        trainer = ZeroTrainer(model=gpt2(), args=args(f"{root}/stage{stage}"), train_dataset=Tokens(),
                              zero_config=ZeroConfig(stage=stage))
        trainer.train()
        out[f"stage{stage}"] = logs(trainer)
        out[f"stage{stage}_eval"] = trainer.evaluate(eval_dataset=Tokens())["eval_loss"]
        out[f"stage{stage}_wrapped"] = type(trainer.model_wrapped).__name__
    # a checkpoint after step 2, resumed by a new trainer at another stage
    trainer = ZeroTrainer(model=gpt2(), args=args(f"{root}/ckpt", save_strategy="steps", save_steps=2),
                          train_dataset=Tokens(), zero_config=ZeroConfig(stage=2))
    trainer.train()
    out["saving"] = logs(trainer)
    resumed = ZeroTrainer(model=gpt2(seed=1), args=args(f"{root}/ckpt"), train_dataset=Tokens(),
                          zero_config=ZeroConfig(stage=3))
    resumed.train(resume_from_checkpoint=f"{root}/ckpt/checkpoint-2")
    out["resumed"] = logs(resumed)
    resumed.save_model(f"{root}/final")
    with resumed.zero_optimizer.gathered_parameters():
        out["gathered"] = {k: v.clone() for k, v in resumed.model.state_dict().items()}
    return out


def _accelerate_run(stage: int | None, steps=range(STEPS), state_in: str | None = None,
                    state_out: str | None = None, **zero_config) -> dict:
    """One Accelerate loop with accumulation: DDP (``stage`` None) or the helper at ``stage`` with ``zero_config``;
    save_state after step 2 to ``state_out``, or load_state from ``state_in`` first."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import zero.integrations.accelerate as zacc

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = gpt2(seed=0 if state_in is None else 1)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)
    if stage is None:
        model, opt, loader = accelerator.prepare(model, inner, loader)
    else:
        model, opt, loader = zacc.prepare(accelerator, model, inner, loader, stage=stage, bucket_size_mb=0.01,
                                          **zero_config)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    if state_in is not None:
        accelerator.load_state(state_in)  # the helper's hook loads the model and optimizer
        loader = accelerator.skip_first_batches(loader, 2 * (STEPS - len(steps)))
    losses, norms, done = [], [], 0
    for batch in loader:
        if done == len(steps):
            break
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = (accelerator.clip_grad_norm_(model.parameters(), 0.5) if stage is None
                        else opt.clip_grad_norm_(0.5))
                norms.append(float(norm))
            opt.step()
            scheduler.step()
            opt.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        if accelerator.sync_gradients:
            done += 1
            if state_out is not None and done == 2:
                accelerator.save_state(state_out)
    return {"losses": losses, "norms": norms, "wrapped": type(model).__name__}


def accelerate_runs(rank: int, world_size: int, root: str, stages: tuple[int, ...] = STAGES) -> dict:
    """An Accelerate loop with accumulation: DDP (accelerator.prepare) and the helper at ``stages``; then
    save_state / load_state through the helper's hooks."""
    torchrun_env(rank, world_size)
    out = {"stages": stages, "ddp": _accelerate_run(None)}
    for stage in stages:
        out[f"stage{stage}"] = _accelerate_run(stage)
    out["saving"] = _accelerate_run(2, state_out=f"{root}/accel")
    out["resumed"] = _accelerate_run(3, steps=range(2, STEPS), state_in=f"{root}/accel")
    return out


def hierarchical_runs(rank: int, world_size: int, root: str, paths: tuple[str, ...] = HIERARCHICAL) -> dict:
    """4 ranks as 2 groups of 2 (``communication={"shard_size": 2}``, stage 3): the DDP Trainer and ZeroTrainer,
    whose model is then exported (rank 0, heard by every group); the Accelerate loop with DDP and with the helper;
    both again with ZeRO++'s hpZ (``hierarchy="hpz"``: shards over the 4 ranks, backward's gathers from the group's
    secondary copies). ``paths``: which of them (``HIERARCHICAL``) run, beside the DDP baselines they need."""
    torchrun_env(rank, world_size)
    from transformers import Trainer

    from zero import ZeroConfig
    from zero.integrations.transformers import ZeroTrainer

    def args(out: str):
        return training_args(out, max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1, max_grad_norm=0.5)

    out: dict = {"paths": paths}
    hpz = {"shard_size": 2, "hierarchy": "hpz"}
    if "trainer" in paths or "trainer_hpz" in paths:
        base = Trainer(model=gpt2(), args=args(f"{root}/ddp"), train_dataset=Tokens())
        base.train()
        out["trainer_ddp"] = logs(base)
    if "trainer" in paths:
        trainer = ZeroTrainer(model=gpt2(), args=args(f"{root}/hsdp"), train_dataset=Tokens(),
                              zero_config=ZeroConfig(stage=3, communication={"shard_size": 2}))
        trainer.train()
        trainer.save_model(f"{root}/final")
        with trainer.zero_optimizer.gathered_parameters():
            out["gathered"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        out["trainer"] = logs(trainer)
        out["shard_group"] = dist.get_process_group_ranks(trainer.zero_optimizer.comm.group)
    if "trainer_hpz" in paths:
        with_copies = ZeroTrainer(model=gpt2(), args=args(f"{root}/hpz"), train_dataset=Tokens(),
                                  zero_config=ZeroConfig(stage=3, communication=hpz))
        with_copies.train()
        out["trainer_hpz"] = logs(with_copies)
        out["hpz_gathers_inside"] = with_copies.zero_optimizer.comm_stats.get("intra_all_gather", {}).get("calls", 0)
    if "accelerate" in paths or "accelerate_hpz" in paths:
        out["accelerate_ddp"] = _accelerate_run(None)
    if "accelerate" in paths:
        out["accelerate"] = _accelerate_run(3, communication={"shard_size": 2})
    if "accelerate_hpz" in paths:
        out["accelerate_hpz"] = _accelerate_run(3, communication=hpz)
    return out
