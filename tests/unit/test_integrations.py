"""The Hugging Face integrations in one process: their refusals, and the Trainer's step against the hand-built
recipe (the training paths in worlds: tests/distributed/test_integrations_world.py)."""

from __future__ import annotations

import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import zero  # noqa: E402
from tests.distributed.integrations_world import gpt2  # noqa: E402
from tests.readouts import master_weights  # noqa: E402
from tests.recipes import MasterRecipe  # noqa: E402
from tests.toy import FreshTensors, batch  # noqa: E402
from zero import ZeroConfig, ZeroOptimizer  # noqa: E402
from zero.integrations import accelerate as zacc  # noqa: E402
from zero.integrations.transformers import ZeroTrainer  # noqa: E402


def _args(tmp_path, **over):
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **over)


def test_trainer_refuses_autocast_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"bf16=True/fp16=True.*precision=\{'param_dtype': 'bf16'\}"):
        ZeroTrainer(model=gpt2(), args=_args(tmp_path, bf16=True), zero_config=ZeroConfig(stage=2))


def test_trainer_refuses_a_scheduler_on_the_plain_optimizer(tmp_path):
    model = gpt2()
    plain = torch.optim.AdamW(model.parameters())
    trainer = ZeroTrainer(model=model, args=_args(tmp_path),
                          optimizers=(plain, torch.optim.lr_scheduler.StepLR(plain, 1)))
    with pytest.raises(ValueError, match="scheduler was built on the plain optimizer"):
        trainer.create_optimizer()


def test_trainer_wraps_the_trainers_optimizer_with_its_groups(tmp_path):
    model = gpt2()
    trainer = ZeroTrainer(model=model, args=_args(tmp_path, learning_rate=3e-3, weight_decay=0.05),
                          zero_config=ZeroConfig(stage=3))
    opt = trainer.create_optimizer()
    assert isinstance(opt, ZeroOptimizer) and opt is trainer.zero_optimizer
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]  # the Trainer's decay groups
    assert all(g["lr"] == 3e-3 for g in opt.param_groups)
    with model.no_sync():  # Accelerate's accumulation calls it: no reduction inside
        assert not opt.runtime.reducer.sync_enabled
    assert opt.runtime.reducer.sync_enabled
    copy = pickle.loads(pickle.dumps(model.no_sync))  # torch.save(model) still works
    with copy():
        pass


def test_accelerate_helper_refusals():
    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(ValueError, match="mixed_precision='bf16'.*precision=\\{'param_dtype': 'bf16'\\}"):
        zacc.prepare(accelerator, gpt2(), torch.optim.AdamW(gpt2().parameters()))
    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True)
    model = gpt2()
    plain = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="built on the plain optimizer"):
        zacc.prepare(accelerator, model, plain, torch.optim.lr_scheduler.StepLR(plain, 1))
    model, opt = zacc.prepare(accelerator, model, plain, stage=2)
    assert isinstance(opt.optimizer, ZeroOptimizer) and opt.comm_stats == {}  # ZeroOptimizer's own API passes through
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):  # torch's clip, which Accelerate calls: loud
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert float(opt.clip_grad_norm_(1.0)) > 0  # the optimizer's own clip: the global norm
    accelerate.state.AcceleratorState._reset_state(True)


def test_accelerate_helper_refuses_an_accelerator_that_sees_another_world():
    """Accelerate built without cpu=True under torchrun on CPU sees one process while the process group has more:
    refused, naming the fix (a stand-in accelerator plays the mismatch in one process)."""

    class TwoProcessAccelerator:
        mixed_precision, device, num_processes = "no", torch.device("cpu"), 2

    model = gpt2()
    with pytest.raises(ValueError, match=r"Accelerate sees 2 process\(es\).*Accelerator\(cpu=True\)"):
        zacc.prepare(TwoProcessAccelerator(), model, torch.optim.AdamW(model.parameters()))


class _FreshTensorsLM(torch.nn.Module):
    """``tests.toy.FreshTensors`` the Trainer's way: ``forward(x)`` returns ``{"loss": ...}``; keeps the batches it
    was given, in the order the Trainer gave them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = FreshTensors()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> dict:
        self.seen.append(x.detach().clone())
        return {"loss": self.net(x)}


def _trainer_step_by_hand(batches: list[torch.Tensor], lr: float, max_norm: float) -> dict:
    """The Trainer's steps on ``FreshTensors``' hand-built bf16 recipe (fp32 masters, each fp32 tensor cast to bf16
    where it enters a module): its default optimizer (fused AdamW, no weight decay), clipping to ``max_norm``, the
    linear schedule to 0 over the steps; the losses, the norms before clipping and the masters at the end."""
    torch.manual_seed(0)
    r = MasterRecipe(FreshTensors(recipe=True), torch.bfloat16,
                     lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True))
    losses, norms = [], []
    for step, x in enumerate(batches):
        for group in r.opt.param_groups:
            group["lr"] = lr * (float(len(batches) - step) / float(len(batches)))  # (transformers' linear schedule)
        loss = r.low(x.bfloat16())
        loss.backward()
        r.grads_to_master()
        norms.append(torch.nn.utils.clip_grad_norm_(r.master, max_norm).item())
        r.step()
        losses.append(loss.item())
    return {"loss": losses, "grad_norm": norms, "masters": r.flat()}


@pytest.mark.parametrize("stage", [0, 3])
def test_trainer_trains_a_model_that_makes_fp32_tensors_inside_forward_under_bf16(tmp_path, stage):
    """Issue 37 on the Trainer's path: fp32 tensors made inside forward reach bf16 modules (without the casts at their
    entry: "mat1 and mat2 must have the same dtype"), and it trains as the hand-built bf16 recipe does on the batches
    the Trainer gave, with the Trainer's optimizer, clipping (acting on the first two steps: norms 0.84, 0.70, 0.53)
    and schedule: the same masters bit for bit, the same logged losses and norms."""
    data = [{"x": row} for row in torch.cat([batch(step) for step in range(2)])]
    model = _FreshTensorsLM()
    trainer = ZeroTrainer(model=model, train_dataset=data,
                          args=_args(tmp_path, per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
                                     max_grad_norm=0.6, logging_steps=1, save_strategy="no"),
                          zero_config=ZeroConfig(stage=stage, precision={"param_dtype": "bf16"}))
    trainer.train()
    assert trainer.zero_optimizer.runtime.config.precision.param_dtype == "bf16"
    assert [len(x) for x in model.seen] == [4, 4, 4]
    expected = _trainer_step_by_hand(model.seen, lr=1e-2, max_norm=0.6)
    assert (expected["masters"] - _initial_fresh_tensors()).abs().max() > 1e-3  # (3 steps moved the parameters)
    torch.testing.assert_close(master_weights(trainer.zero_optimizer), expected["masters"], rtol=0, atol=0)
    for key in ("loss", "grad_norm"):
        logged = [entry[key] for entry in trainer.state.log_history if key in entry]
        assert logged == pytest.approx(expected[key], rel=1e-6), key


def _initial_fresh_tensors() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.cat([p.detach().flatten() for p in FreshTensors().parameters()])


def test_trainer_and_accelerate_pass_the_example_of_an_automatic_offload_ratio(tmp_path):
    """``offload.ratio="auto"`` through the Trainer (``zero_example``) and Accelerate's ``prepare`` (``example``): it
    reaches the optimizer, which prices the step (a budget everything fits: nothing offloaded); without it the error
    names what to pass."""
    model = gpt2()
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    example = zero.StepExample(loss=lambda m, inputs: m(**inputs).loss, batch=({"input_ids": ids, "labels": ids},))
    auto = ZeroConfig(stage=2, offload={"optimizer": "cpu", "ratio": "auto", "gpu_memory": 2**40})
    opt = ZeroTrainer(model=model, args=_args(tmp_path), zero_config=auto, zero_example=example).create_optimizer()
    assert opt.config.offload.ratio == 0.0
    with pytest.raises(ValueError, match="needs the loss and one micro-batch"):
        ZeroTrainer(model=gpt2(), args=_args(tmp_path), zero_config=auto).create_optimizer()
    accelerate.state.AcceleratorState._reset_state(True)
    model = gpt2()
    _, prepared = zacc.prepare(accelerate.Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters()),
                               config=auto, example=example)
    assert prepared.optimizer.config.offload.ratio == 0.0
    accelerate.state.AcceleratorState._reset_state(True)


def _muon_and_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch's documented recipe: Muon on the hidden 2-D matrices, AdamW on the rest (embeddings, norms, biases)."""
    hidden = [p for name, p in model.named_parameters() if p.ndim == 2 and ".h." in name]
    rest = [p for name, p in model.named_parameters() if not (p.ndim == 2 and ".h." in name)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
def test_trainer_and_accelerate_step_muon_and_adamw_in_one_zero_optimizer(tmp_path):
    """The Trainer takes one optimizer: a ``ZeroOptimizer`` over ``[muon, adamw]`` passed as ``optimizers=(opt, None)``
    trains, each Muon matrix is updated once per step (as a whole), and the Trainer's schedule reaches both optimizers'
    groups; Accelerate's ``prepare`` takes the list itself."""
    model = gpt2()
    opt = ZeroOptimizer(_muon_and_adamw(model), model, stage=2)
    matrices = sum(1 for g in opt.optimizers[0].param_groups for _ in g["params"])  # this rank owns them all (world 1)
    before = [p.detach().clone() for p in model.parameters()]
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, 64, (8, 16), generator=torch.Generator())]
    trainer = ZeroTrainer(model=model, train_dataset=data, optimizers=(opt, None),
                          args=_args(tmp_path, per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                                     save_strategy="no", lr_scheduler_type="linear"))
    trainer.train()
    assert trainer.zero_optimizer is opt and opt.runtime.whole_parameter_step.updates == 3 * matrices > 0
    assert all(not torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]  # the linear schedule's end, in Muon's and AdamW's group
    accelerate.state.AcceleratorState._reset_state(True)
    model = gpt2()
    model, prepared = zacc.prepare(accelerate.Accelerator(cpu=True), model, _muon_and_adamw(model), stage=3)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    prepared.backward(model(input_ids=ids, labels=ids).loss)
    prepared.step()
    assert [type(o).__name__ for o in prepared.optimizers] == ["Muon", "AdamW"]
    assert prepared.runtime.whole_parameter_step.updates == matrices
    accelerate.state.AcceleratorState._reset_state(True)
