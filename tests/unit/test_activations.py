"""Activation checkpointing by policy (``zero.activations``) at world size 1: exact with dropout at every
stage, really recomputing, the policies choosing the blocks they say, and clear errors for bad input
(two ranks: ``tests/distributed/activations_world.py``)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import zero
from tests.readouts import flat_params
from tests.toy import DropoutNet, batch
from zero import ActivationCheckpointing, ZeroConfig, ZeroOptimizer, blocks_within_budget, checkpoint_activations
from zero.estimator.activation_budget import saved_activation_bytes
from zero.estimator.estimator import trace
from zero.models import GPT, GPTConfig
from zero.runtime.activations.checkpointing import chosen_blocks

POLICIES = [{}, {"every": 2}, {"selective": True}, {"offload_inputs": True}, {"classes": ["DropoutBlock"]}]


def train(stage: int, policy: dict | None) -> tuple[list[float], torch.Tensor, ZeroOptimizer, list[int]]:
    """AdamW, 3 steps, dropout drawing from the global RNG; losses, final parameters and per-block forwards."""
    model = DropoutNet()
    calls = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        block.fc.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, stage=stage, bucket_size_mb=1e-4,
                        activation_checkpointing=policy)
    losses = []
    for step in range(3):
        torch.manual_seed(100 + step)
        loss = model(batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, flat_params(model, opt), opt, calls


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointing_changes_no_number_and_recomputes(stage):
    losses, params, _, calls = train(stage, None)
    assert calls == [3] * 4
    for policy in POLICIES:
        got_losses, got_params, opt, got_calls = train(stage, policy)
        assert got_losses == losses and torch.equal(got_params, params), policy  # the same dropout masks
        checkpointed = [0, 1, 2, 3] if policy.get("every") is None else [1, 3]
        assert got_calls == [6 if i in checkpointed else 3 for i in range(4)], policy  # forward ran again
        if policy.get("offload_inputs"):  # each block's 6x6 fp32 input, every step
            assert opt.checkpointed.offload.bytes_offloaded == 3 * 4 * 6 * 6 * 4


def test_policies_choose_blocks_and_bad_input_is_refused():
    model = GPT(GPTConfig(num_layers=4))
    assert chosen_blocks(model, ActivationCheckpointing()) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert chosen_blocks(model, ActivationCheckpointing(every=2)) == ["blocks.1", "blocks.3"]
    assert chosen_blocks(model, ActivationCheckpointing(modules=("blocks.2",))) == ["blocks.2"]
    with pytest.raises(ValueError, match=r"no module of the model has: \['GPT2Block'\]"):
        checkpoint_activations(model, {"classes": ["GPT2Block"]})
    with pytest.raises(ValueError, match="not in the model"):
        checkpoint_activations(model, {"modules": ["blocks.9"]})
    with pytest.raises(ValidationError, match="reentrant"):
        ZeroConfig(activation_checkpointing={"use_reentrant": True})
    with pytest.raises(ValidationError, match="every"):
        ActivationCheckpointing(every=0)
    checkpoint_activations(model, {"every": 2})
    with pytest.raises(ValueError, match="checkpointed already"):
        checkpoint_activations(model, {})


def test_budget_picks_the_fewest_blocks_or_names_the_minimum():
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, num_layers=4, num_heads=2)
    x = torch.zeros(4, cfg.seq_len, dtype=torch.long)
    traced = trace(lambda: GPT(cfg), lambda m, a, b: m.loss(a, b), (x, x))
    full = traced.activation_bytes
    assert blocks_within_budget(traced, full) == ()
    for budget in (full - 1, 0.8 * full, 0.6 * full):
        chosen = blocks_within_budget(traced, budget)
        assert saved_activation_bytes(traced, chosen) <= budget
        fewer = [chosen[:i] + chosen[i + 1:] for i in range(len(chosen))]
        assert all(saved_activation_bytes(traced, f) > budget for f in fewer)  # none can be left out
    minimum = saved_activation_bytes(traced, [f"blocks.{i}" for i in range(4)])
    with pytest.raises(ValueError, match=f"about {minimum / 2**20:.2f} MiB"):
        blocks_within_budget(traced, minimum - 1)


@pytest.mark.parametrize("policy", [None, {}])
def test_the_profiler_shows_recomputation_as_its_own_phase(policy):
    model = DropoutNet()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=2, activation_checkpointing=policy)
    with zero.profile(model, opt) as prof:
        model(batch(0)).backward()
        opt.step()
    recomputed = {s.module for s in prof.samples if s.phase == "recompute"}
    blocks = {f"blocks.{i}{child}" for i in range(4) for child in ("", ".fc", ".drop")}
    assert recomputed == (set() if policy is None else blocks)


def test_the_estimator_prices_a_policy_by_its_blocks():
    """zero.estimate traces the step with the policy applied: fewer checkpointed blocks, more memory at the peak;
    its activations at the peak never exceed what the forward census says the policy keeps."""
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, num_layers=4, num_heads=2)
    x = torch.zeros(4, cfg.seq_len, dtype=torch.long)
    work = zero.estimator.Workload(lambda: GPT(cfg), lambda m, a, b: m.loss(a, b), lambda micro: (x[:micro], x[:micro]))
    peak = lambda policy: zero.estimate(work, stage=2, world_size=1, micro_batch=4, checkpointing=policy)  # noqa: E731
    every, half, none = peak(True), peak(ActivationCheckpointing(every=2)), peak(False)
    assert peak({}).peak == every.peak < half.peak < none.peak
    assert every.checkpointing and half.checkpointing and not none.checkpointing
    selective = peak({"selective": True})
    assert every.peak < selective.peak < none.peak
    traced = trace(lambda: GPT(cfg), lambda m, a, b: m.loss(a, b), (x, x))
    assert none.activations <= traced.activation_bytes


def test_selective_is_priced_between_none_and_full_recompute():
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, num_layers=4, num_heads=2)
    x = torch.zeros(4, cfg.seq_len, dtype=torch.long)
    traced = trace(lambda: GPT(cfg), lambda m, a, b: m.loss(a, b), (x, x))
    blocks = [f"blocks.{i}" for i in range(4)]
    assert all(traced.unit_matmul_bytes[b] > 0 for b in blocks)  # the four projections and attention, per block
    full, selective = saved_activation_bytes(traced, blocks), saved_activation_bytes(traced, blocks, selective=True)
    assert full < selective < traced.activation_bytes
