"""The estimator: the ZeRO paper's model-state numbers, exact activation tracing, the planner, errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import resource
from types import SimpleNamespace

import pytest
import torch

import zero
from tests.inplace import InplaceNet, TinyResNet, resnet_loss
from tests.quick import full_only_beyond
from tests.readouts import forward_saved_bytes
from tests.toy import FreshTensors, batch
from zero import zero_model_state_bytes
from zero.cli.main import build_parser
from zero.cli.main import main as cli_main
from zero.estimator import Workload, estimate, model_states, parse_size, plan, sources, trace
from zero.estimator.configuration import POLICIES, precision_name, priced_config
from zero.models import GPT, GPTConfig, synthetic_batch
from zero.precision import MixedPrecision
from zero.sizes import format_bytes, format_count

SMALL = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
TINY_GPT = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "2"]  # SMALL


def _gpt_loss(model, x, y):
    return model.loss(x, y)


def test_model_states_match_the_zero_paper():
    """Ψ = 7.5B, N = 64, mixed-precision Adam: 120 / 31.4 / 16.6 / 1.9 GB (Table 1 of the paper)."""
    got = [round(model_states(7_500_000_000, 64, stage, "mixed").total / 1e9, 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("stage", range(4))
def test_fp32_model_states_match_the_optimizer_formula(stage):
    assert model_states(1000, 3, stage).total == pytest.approx(zero_model_state_bytes(1000, 3, stage))


@pytest.mark.parametrize("batch", [2, 5])
def test_fake_trace_counts_exactly_what_a_real_forward_saves(batch):
    x, y = synthetic_batch(0, batch, SMALL)
    torch.manual_seed(0)
    real = forward_saved_bytes(GPT(SMALL), x, y)
    traced = trace(lambda: GPT(SMALL), _gpt_loss, (x, y))
    assert traced.activation_bytes == real
    assert traced.numel == sum(p.numel() for p in GPT(SMALL).parameters())
    assert set(traced.unit_activation_bytes) == {"", "blocks.0", "blocks.1"}  # stage 3's default units


def _gpt_workload(cfg: GPTConfig = SMALL) -> Workload:
    return Workload(lambda: GPT(cfg), _gpt_loss, lambda micro: synthetic_batch(0, micro, cfg))


def _real_step_peak(model, loss_fn, batch) -> tuple[int, int]:
    """zero.profile of a plain forward, loss and backward: the largest activations + temporaries + gradients at
    any operator, and the allocator's peak over what the run started with."""
    with zero.profile(model, every_op=True) as prof:
        loss_fn(model, *batch).backward()
    own = max(sum(s.categories[c] for c in ("activations", "temporaries", "gradients")) for s in prof.samples)
    return own, prof.allocator.peak - prof.samples[0].allocated


def test_the_fake_timeline_is_the_real_step_operator_by_operator():
    """Hugging Face GPT-2 computing its loss inside forward: the traced step's largest live bytes are what the
    tracker and the allocator measure in the real step (to within a few small tensors: 768 bytes of 1.2 MB)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    x = torch.randint(0, 256, (3, 32))
    torch.manual_seed(0)
    real, allocator = _real_step_peak(GPT2LMHeadModel(config), lambda m, ids: m(input_ids=ids, labels=ids).loss, (x,))
    workload = Workload(lambda: GPT2LMHeadModel(config), lambda m, ids: m(input_ids=ids, labels=ids).loss,
                        lambda micro: (torch.zeros(micro, 32, dtype=torch.long),))
    traced = max(p.total for p in workload.timeline(3).points)
    assert traced == pytest.approx(real, rel=1e-3) and traced == pytest.approx(allocator, rel=1e-3)


def test_large_micro_batches_are_extrapolated_exactly():
    workload = _gpt_workload()
    extrapolated = workload.timeline(7)
    assert extrapolated.points == workload._trace(7, "fp32", False).points
    assert sorted(key[0] for key in workload._timelines) == [2, 3, 7]  # 7 was not traced (one precision, policy)


def test_the_step_trace_prices_the_wrapped_optimizer():
    """AdamW keeps 8 bytes per element and a 4-byte step count per piece; SGD with momentum 4 per element; its
    temporaries (AdamW's per-tensor step: sqrt and division of the largest piece) are what the fake step made."""
    workload = _gpt_workload()
    layout = workload.layout(1, 2)
    buckets = [b for b in layout.buckets if b.params]
    adam = workload.step(layout)
    for b in buckets:
        assert adam.state([b]) == 8 * sum(b.pieces) + 4 * len(b.pieces)
    largest = max(p for b in buckets for p in b.pieces)
    assert 8 * largest <= adam.update < 9 * largest and adam.whole == 0
    sgd = Workload(lambda: GPT(SMALL), _gpt_loss, lambda m: synthetic_batch(0, m, SMALL),
                   optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)).step(layout)
    assert sgd.state(buckets) == 4 * sum(sum(b.pieces) for b in buckets) and sgd.adopt == 0


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_a_billion_parameter_model_is_planned_without_allocating_it():
    """Llama-7B's layer (width 4096) and vocabulary, four layers deep (the time a 7B plan takes is a benchmark's:
    docs/estimator.md)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_hidden_layers=4,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    workload = Workload(lambda: LlamaForCausalLM(config), sources.hf_loss,
                        lambda micro: (torch.zeros(micro, 512, dtype=torch.long),))
    result = plan(workload, gpu_memory=parse_size("16GB"), world_size=64, micro_batches=[1, 8], precision="mixed")
    numel = sum(p.numel() for p in workload.model().parameters())
    assert numel > 1_000_000_000
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 0.05 * 2 * numel  # the bf16 weights alone would be 13 GB
    assert result.fits and result.rejected
    stage3 = next(e for e in result.fits if e.stage == 3 and e.micro_batch == 8 and not e.checkpointing)
    # at its peak (the loss's backward) stage 3 holds its bf16 shards, the root unit (embeddings, head) and the last
    # layer, which forward left gathered for backward
    layout = workload.layout(3, 64, "mixed")
    gathered = sum(b.whole for b in layout.buckets if b.unit in ("", "model.layers.3"))
    assert stage3.event == "_log_softmax_backward_data operator"
    assert stage3.parameters == sum(b.shard for b in layout.buckets) + gathered


def test_estimates_move_the_right_way():
    workload = _gpt_workload()

    def peak(**kw):
        args = dict(stage=2, world_size=4, micro_batch=16)
        return estimate(workload, **{**args, **kw}).peak

    assert peak(stage=1) < peak(stage=0) and peak(stage=2) < peak(stage=1)
    assert peak(world_size=8) < peak(world_size=2)
    assert peak(micro_batch=32) > peak(micro_batch=16)
    assert peak(checkpointing=True) < peak()
    assert peak(offload=True) < peak()
    e = estimate(workload, stage=3, world_size=4, micro_batch=16)
    assert e.phase == "backward" and e.gradients < e.activations
    # with little activation memory, stage 2 peaks when its one bucket is reduced: gradients and staging, whole
    small = estimate(workload, stage=2, world_size=4, micro_batch=1)
    numel = sum(p.numel() for p in workload.model().parameters())
    assert small.event == "gradient reduction" and small.communication == 4 * numel


def test_accumulation_under_no_sync_keeps_whole_gradients_at_stages_2_and_3(capsys):
    workload = _gpt_workload()
    numel = sum(p.numel() for p in workload.model().parameters())
    for stage in (2, 3):
        plain = estimate(workload, stage=stage, world_size=4, micro_batch=16)  # peaks as backward starts
        accumulated = estimate(workload, stage=stage, world_size=4, micro_batch=16, no_sync=True)
        assert accumulated.gradients >= 4 * numel > plain.gradients  # whole, as at stage 1
        assert accumulated.peak > plain.peak
    assert estimate(workload, stage=1, world_size=4, micro_batch=2, no_sync=True).peak == estimate(
        workload, stage=1, world_size=4, micro_batch=2).peak  # stages 0-1 keep whole gradients anyway
    small = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "2"]
    args = ["estimate", "--gpu-memory", "64MiB", "--world-size", "4", "--micro-batch", "2", "--show", "100", *small]
    assert cli_main(args) == 0
    plain = capsys.readouterr().out
    assert cli_main([*args, "--no-sync-accumulation"]) == 0
    assert capsys.readouterr().out != plain


def test_planner_says_why_nothing_fits():
    workload = _gpt_workload()
    result = plan(workload, gpu_memory=1024, world_size=2, micro_batches=[1])
    assert not result.fits
    assert all("needs" in why and "largest part" in why and " at " in why for _, why in result.rejected)
    roomy = plan(workload, gpu_memory=2**30, world_size=2, micro_batches=[1, 2])
    assert roomy.fits[0].micro_batch == 2 and not roomy.fits[0].checkpointing  # best first


def test_bad_input():
    with pytest.raises(ValueError, match="GPU memory must be positive"):
        plan(_gpt_workload(), gpu_memory=0, world_size=2, micro_batches=[1])
    for text in ("lots", "-3GiB", "24 parsecs"):
        with pytest.raises(ValueError, match="memory size"):
            parse_size(text)
    with pytest.raises(ValueError, match="precision must be one of"):
        model_states(10, 2, 1, "fp8")
    with pytest.raises(ValueError, match="offload.optimizer='cpu' needs stage 1, 2 or 3"):  # ZeroConfig's own rule
        estimate(_gpt_workload(), stage=0, world_size=2, micro_batch=1, offload=True)
    with pytest.raises(ValueError, match="unknown setting 'unit_class'.*unit_classes"):  # a typo, named
        estimate(_gpt_workload(), stage=3, world_size=2, micro_batch=1, unit_class=["Block"])
    with pytest.raises(ValueError, match="config must be a zero.ZeroConfig, got dict"):
        estimate(_gpt_workload(), {"stage": 3}, world_size=2, micro_batch=1)

    def data_dependent(model, x, y):  # cannot run without data
        return model.loss(x[:, : int(x.max().item()) + 1], y)

    line = "`return model.loss(x[:, : int(x.max().item()) + 1], y)`"  # the failing line, named
    with pytest.raises(ValueError, match=f"failed while tracing the model on fake tensors at .*{re.escape(line)}"):
        trace(lambda: GPT(SMALL), data_dependent, synthetic_batch(0, 2, SMALL))
    branchy = Workload(lambda: GPT(SMALL), data_dependent, lambda m: synthetic_batch(0, m, SMALL))
    with pytest.raises(ValueError, match=f"tracing the step on fake tensors at .*{re.escape(line)}.*data-dependent"):
        estimate(branchy, stage=1, world_size=2, micro_batch=2)
    not_a_model = Workload(lambda: "GPT", _gpt_loss, lambda m: synthetic_batch(0, m, SMALL))
    with pytest.raises(ValueError, match="must return a torch.nn.Module, got str"):
        estimate(not_a_model, stage=1, world_size=2, micro_batch=2)
    not_a_loss = Workload(lambda: GPT(SMALL), lambda m, x, y: m(x), lambda m: synthetic_batch(0, m, SMALL))
    with pytest.raises(ValueError, match="must return the scalar loss tensor, got \\(2, 8, 64\\)"):
        estimate(not_a_loss, stage=1, world_size=2, micro_batch=2)


def test_a_loss_with_a_backward_of_its_own_is_refused_by_name():
    """A gradient penalty (``torch.autograd.grad(..., create_graph=True)`` inside the loss: double backward) is not
    priced (issue 41): the estimate says so rather than leave out the graph the penalty builds."""

    def penalized(model, x):
        x = x.requires_grad_(True)
        out = model(x)
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        return out + g.square().sum()

    workload = Workload(InplaceNet, penalized, lambda n: (torch.randn(n, 6),))
    for stage in (0, 3):
        with pytest.raises(ValueError, match="runs a backward pass of its own .* gradient penalty, double backward"):
            estimate(workload, stage=stage, world_size=2, micro_batch=2)
    plain = Workload(InplaceNet, lambda m, x: m(x), lambda n: (torch.randn(n, 6),))
    assert estimate(plain, stage=3, world_size=2, micro_batch=2).peak > 0


@pytest.mark.parametrize("stage", full_only_beyond(range(4), (3,)))  # --quick: 3 (units released in backward)
def test_models_with_in_place_operations_are_estimated(stage):
    """torchvision's ResNet layout (``ReLU(inplace=True)``, ``out += identity``) and blocks that modify their input in
    place first (issue 33: tracing failed at every stage). Backward's end of each block is still seen (the point
    stage 3 releases a unit at), and the estimates against measured peaks are in ``test_estimate_world``."""
    resnet = Workload(TinyResNet, resnet_loss, lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 10, (n,))))
    blocks = Workload(InplaceNet, lambda m, x: m(x), lambda n: (torch.randn(n, 6),))
    for workload in (resnet, blocks):
        assert estimate(workload, stage=stage, world_size=2, micro_batch=2).peak > 0
    done = {p.name for p in blocks.timeline(2).points if p.kind == "done"}
    assert {f"blocks.{i}" for i in range(4)} <= done


@pytest.mark.parametrize("stage", full_only_beyond(range(4), (3,)))  # --quick: 3 (bf16 units gathered); 0-2 in full
def test_fp32_tensors_made_inside_forward_are_estimated_under_mixed_precision(stage):
    """The estimator casts where ZeroOptimizer casts (issue 37: the inputs of each module computing in bf16), so a
    model that makes fp32 tensors inside forward is traced (it failed on a dtype mismatch), and its estimate is the
    measured peak's."""
    workload = Workload(lambda: FreshTensors(width=256), lambda m, x: m(x), lambda n: (batch(0, n, 256),))
    e = estimate(workload, stage=stage, world_size=1, micro_batch=64, precision="mixed-fp32-reduce")
    torch.manual_seed(0)
    model = FreshTensors(width=256)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=stage,
                             precision={"param_dtype": "bf16"})
    x = batch(0, 64, 256)
    with zero.profile(model, opt) as prof:
        for _ in range(2):
            model(x).backward()
            opt.step()
            opt.zero_grad()
    measured = prof.allocator.peak_without_collectives - prof.samples[0].labels.get("other/alive on entry", 0)
    assert e.peak == pytest.approx(measured, rel=0.01)  # (measured: 1.0000 at every stage)


@torch.library.custom_op("zero_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:  # an operator with no fake implementation
    return x.clone()


def test_an_operation_that_cannot_run_on_fake_tensors_is_named():
    """The error names the user's line, the torch call below it and the module, and blames data dependence only
    when the operation needed data."""

    class Opaque(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _opaque(self.fc(x)).sum()

    workload = Workload(Opaque, lambda m, x: m(x), lambda n: (torch.randn(n, 4),))
    with pytest.raises(ValueError) as caught:
        estimate(workload, stage=0, world_size=1, micro_batch=2)
    text = str(caught.value)
    assert "tracing the step on fake tensors at " in text and "`return _opaque(self.fc(x)).sum()`" in text
    assert "calling torch/library.py" in text and "in Opaque.forward" in text and "no fake impl" in text
    assert "data-dependent" not in text and "please report it" in text


def test_cli(capsys):
    small = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "2"]
    assert cli_main(["estimate", "--gpu-memory", "64MiB", "--world-size", "2", *small]) == 0
    out = capsys.readouterr().out
    assert "fits, best first" in out and "stage 0, micro-batch 8" in out and "peak at" in out
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["estimate", "--gpu-memory", "24 parsecs", *small])
    assert exit_info.value.code == 2
    assert "argument --gpu-memory: expected a size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["estimate", "--gpu-memory", "24GiB", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


# a model module for --model (imported by name from this test module)
def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def tiny_workload():
    return _gpt_workload()


def not_a_model():
    return 42


def unknown_inputs():
    return torch.nn.Linear(4, 4)


def base_model_without_loss():
    from transformers import GPT2Config, GPT2Model

    return GPT2Model(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2))


class NanoGPTStyle(torch.nn.Module):
    """nanoGPT's calling convention: a ``config.vocab_size``, and ``forward(idx, targets) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=SMALL.vocab_size)
        self.gpt = GPT(SMALL)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gpt(idx), self.gpt.loss(idx, targets)


class HuggingFaceStyleDataDependent(torch.nn.Module):
    """Called the Hugging Face way, but its forward branches on a value: a real tracing failure."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=SMALL.vocab_size)
        self.gpt = GPT(SMALL)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        kept = input_ids[:, : int(input_ids.max().item()) + 1]
        return {"loss": self.gpt.loss(kept, labels[:, : kept.shape[1]])}


def nano_gpt():
    return NanoGPTStyle()


def data_dependent_hf_style():
    return HuggingFaceStyleDataDependent()


def nano_gpt_workload():
    """What the error for :func:`nano_gpt` tells its author to return instead."""
    return Workload(NanoGPTStyle, lambda model, idx: model(idx, idx)[1],
                    lambda micro_batch: (torch.randint(0, SMALL.vocab_size, (micro_batch, SMALL.seq_len)),))


def _estimate_cli(capsys, *args) -> tuple[int, str, str]:
    code = cli_main(["estimate", "--gpu-memory", "1GiB", "--world-size", "2", "--micro-batch", "2", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plans_for_a_callable_or_a_hugging_face_config(capsys, tmp_path):
    code, out, _ = _estimate_cli(capsys, "--model", "tests.unit.test_estimator:tiny_gpt2", "--seq-len", "16")
    assert code == 0 and "tests.unit.test_estimator:tiny_gpt2 (16 tokens)" in out and "fits, best first" in out
    code, out, _ = _estimate_cli(capsys, "--model", "tests.unit.test_estimator:tiny_workload")
    assert code == 0 and "fits, best first" in out
    tiny_gpt2().config.save_pretrained(tmp_path)
    code, out, _ = _estimate_cli(capsys, "--hf-config", str(tmp_path), "--seq-len", "16")
    assert code == 0 and "fits, best first" in out
    direct = estimate(sources.from_hf_config(str(tmp_path / "config.json"), 16), stage=2, world_size=2, micro_batch=2)
    assert re.search(rf"^  stage 2, micro-batch 2 +{re.escape(format_bytes(direct.peak))} ", out, re.MULTILINE)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "tests.unit.test_estimator:not_a_model"], "returned a int, not a torch.nn.Module"),
        (["--model", "tests.unit.test_estimator:unknown_inputs"], "cannot tell this model's inputs and loss"),
        (["--model", "tests.unit.test_estimator:base_model_without_loss"], "holds no loss when given labels"),
        (["--model", "no_such_module_here:build"], "cannot import it"),
        (["--model", "tests.unit.test_estimator"], "wants module:function"),
        (["--hf-config", "/no/such/config"], "no such file or directory"),
    ],
)
def test_cli_refuses_bad_models_in_one_line(capsys, args, message):
    code, _, err = _estimate_cli(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and err.startswith("zero estimate: ")


def test_a_model_not_called_the_hugging_face_way_is_told_how_it_is_called(capsys):
    """nanoGPT's forward(idx, targets) once failed with "unexpected keyword argument 'input_ids'" under a hint about
    data-dependent control flow: the error says how the model is called and how to say otherwise (a Workload)."""
    code, _, err = _estimate_cli(capsys, "--model", "tests.unit.test_estimator:nano_gpt")
    assert code == 2 and err.count("\n") == 1 and err.startswith("zero estimate: NanoGPTStyle.forward(idx")
    assert "does not take input_ids= and labels=" in err and "model(input_ids=ids, labels=ids)" in err
    assert "zero.estimator.Workload(build, loss, batch)" in err and "data-dependent" not in err
    code, out, _ = _estimate_cli(capsys, "--model", "tests.unit.test_estimator:nano_gpt_workload")  # the fix it names
    assert code == 0 and "fits, best first" in out


def test_a_real_tracing_failure_keeps_the_data_dependence_hint(capsys):
    code, _, err = _estimate_cli(capsys, "--model", "tests.unit.test_estimator:data_dependent_hf_style")
    assert code == 2 and err.count("\n") == 1 and "data-dependent control flow" in err
    assert "does not take input_ids=" not in err


def _estimate_parser_option(flag: str) -> argparse.Action:
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (action,) = [a for a in subparsers.choices["estimate"]._actions if flag in a.option_strings]
    return action


def test_one_default_precision_stated_in_python_and_on_the_command_line():
    """estimate() once defaulted to fp32 and zero estimate to mixed precision."""
    option = _estimate_parser_option("--precision")  # (unset: --config's precision, else ZeroConfig's default)
    assert option.default is None and option.help.startswith("fp32 (the default without --config")
    assert priced_config().precision == POLICIES["fp32"] == MixedPrecision()  # estimate() and plan() take ZeroConfig's
    assert precision_name(priced_config().precision) == "fp32"


def test_the_estimate_table_chooses_units_by_magnitude_and_json_holds_whole_bytes(capsys, tmp_path):
    """A small model once showed 0.00 (GiB) in every column and "0.000B parameters"; the JSON held fractional bytes."""
    path = tmp_path / "estimates.json"
    code, out, _ = _estimate_cli(capsys, "--world-size", "3", "--precision", "mixed", "--show", "100", "--json",
                                 str(path), *TINY_GPT)
    assert code == 0 and "0.00" not in out and "0.000B" not in out
    numel = sum(p.numel() for p in GPT(SMALL).parameters())
    assert f"  {format_count(numel)} trainable parameters" in out and format_count(numel).endswith("K")
    header, *rows = out[out.index("fits, best first") : out.index("to run the first")].splitlines()[1:]
    assert len(rows) == 14
    units = set()
    for row in rows:
        figures = re.findall(r"\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b", row)
        assert len(figures) == 8, row
        assert row.index(figures[0]) + len(figures[0]) == header.index("peak") + len("peak"), row  # aligned
        units.update(f.split()[1] for f in figures)
    assert units == {"B", "KiB"}  # zeros in bytes, the rest in KiB: each figure's own magnitude
    data = json.loads(path.read_text())
    entries = data["fits"] + data["rejected"]
    assert entries
    for e in entries:
        assert all(type(v) is int for v in [*e["categories"].values(), e["host"], e["peak"]]), e
        assert e["peak"] == sum(e["categories"].values())
    exact = estimate(_gpt_workload(), stage=3, world_size=3, micro_batch=1, precision="mixed")
    assert exact.optimizer_state == int(exact.optimizer_state)  # per element and per piece: whole bytes now
    fractional = dataclasses.replace(exact, categories={**exact.categories, "optimizer_state": 1234.6})
    assert fractional.as_dict()["categories"]["optimizer_state"] == 1235  # (a fractional figure is rounded)
