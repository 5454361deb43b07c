"""The estimator: the ZeRO paper's model-state numbers, exact activation tracing, the planner, errors."""

from __future__ import annotations

import resource
import time

import pytest
import torch

from zero import zero_model_state_bytes
from zero.cli import main as cli_main
from zero.models import GPT, GPTConfig, synthetic_batch
from zero.profiler import estimate, model_states, parse_size, plan, trace

SMALL = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)


def _gpt_loss(model, x, y):
    return model.loss(x, y)


def _saved_bytes_of_a_real_forward(model, x, y) -> int:
    """Bytes autograd saves for backward in a real forward (parameters excluded, storages counted once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(x, y)
    return sum(saved.values())


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
    real = _saved_bytes_of_a_real_forward(GPT(SMALL), x, y)
    traced = trace(lambda: GPT(SMALL), _gpt_loss, (x, y))
    assert traced.activation_bytes == real
    assert traced.numel == sum(p.numel() for p in GPT(SMALL).parameters())
    assert sum(traced.unit_numels.values()) == traced.numel and set(traced.unit_numels) == {"", "blocks.0", "blocks.1"}
    assert traced.output_bytes == batch * SMALL.seq_len * SMALL.vocab_size * 4  # the logits


def test_a_billion_parameter_model_is_estimated_in_seconds_without_allocating_it():
    cfg = GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, num_layers=24, num_heads=16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    tokens = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    traced = trace(lambda: GPT(cfg), _gpt_loss, (tokens, tokens))
    result = plan(traced, gpu_memory=parse_size("24GiB"), world_size=8, micro_batches=[1, 2], traced_micro_batch=1)
    assert time.perf_counter() - start < 60
    assert traced.numel > 1_000_000_000
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 0.5 * 4 * traced.numel  # the fp32 weights alone would be 5 GB
    assert result.fits and result.rejected


def test_estimates_move_the_right_way():
    x, y = synthetic_batch(0, 2, SMALL)
    traced = trace(lambda: GPT(SMALL), _gpt_loss, (x, y))

    def peak(**kw):
        args = dict(stage=2, world_size=4, micro_batch=16, traced_micro_batch=2)
        return estimate(traced, **{**args, **kw}).peak

    assert peak(stage=1) < peak(stage=0) and peak(stage=2) < peak(stage=1)
    assert peak(world_size=8) < peak(world_size=2)
    assert peak(micro_batch=32) > peak(micro_batch=16)
    assert peak(checkpointing=True) < peak()
    assert peak(offload=True) < peak()
    e = estimate(traced, stage=3, world_size=4, micro_batch=16, traced_micro_batch=2)
    assert e.moment == "start of backward" and e.gathered_parameters > 0 and e.gradients == 0
    # with little activation memory, stages 2-3 peak while a bucket's gradients are reduced instead
    small = estimate(traced, stage=2, world_size=4, micro_batch=1, traced_micro_batch=2)
    assert small.moment == "gradient reduction" and small.activations == 0
    assert small.gradients == 2 * 4 * traced.numel  # one bucket holds the whole model: grads + staging


def test_planner_says_why_nothing_fits():
    x, y = synthetic_batch(0, 2, SMALL)
    traced = trace(lambda: GPT(SMALL), _gpt_loss, (x, y))
    result = plan(traced, gpu_memory=1024, world_size=2, micro_batches=[1], traced_micro_batch=2)
    assert not result.fits
    assert all("needs" in why and "largest part" in why for _, why in result.rejected)
    roomy = plan(traced, gpu_memory=2**30, world_size=2, micro_batches=[1, 2], traced_micro_batch=2)
    assert roomy.fits[0].micro_batch == 2 and not roomy.fits[0].checkpointing  # best first


def test_bad_input():
    with pytest.raises(ValueError, match="GPU memory must be positive"):
        plan(trace(lambda: GPT(SMALL), _gpt_loss, synthetic_batch(0, 2, SMALL)), gpu_memory=0, world_size=2,
             micro_batches=[1], traced_micro_batch=1)
    for text in ("lots", "-3GiB", "24 parsecs"):
        with pytest.raises(ValueError, match="memory size"):
            parse_size(text)
    with pytest.raises(ValueError, match="precision must be one of"):
        model_states(10, 2, 1, "fp8")

    def data_dependent(model, x, y):  # cannot run without data
        return model.loss(x[:, : int(x.max().item()) + 1], y)

    with pytest.raises(ValueError, match="could not trace the model on fake tensors"):
        trace(lambda: GPT(SMALL), data_dependent, synthetic_batch(0, 2, SMALL))


def test_cli(capsys):
    small = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "2"]
    assert cli_main(["estimate", "--gpu-memory", "64MiB", "--world-size", "2", *small]) == 0
    out = capsys.readouterr().out
    assert "fits, best first" in out and "stage 0, micro-batch 8" in out
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--gpu-memory", "24 parsecs", *small])
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--gpu-memory", "24GiB", "--no-such-flag"])
