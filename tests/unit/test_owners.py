"""Owners of whole parameters (``zero.runtime.buffers.owners``): who steps each one, which pieces travel to it and
back, the balance of the optimizer state on the benchmark GPT, and the rebuilt optimizer's rule (pure arithmetic and
single-process runs; the exchange itself runs in ``tests/distributed/test_optimizers_world.py``)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig
from zero.runtime.buffers.layout import plan_buckets
from zero.runtime.buffers.owners import Exchange, assign_owners
from zero.runtime.step.inner import same_kind

# The 32.6M benchmark GPT (benchmarks/compare.py --d-model 512 --layers 9 --heads 8 --vocab 8192)
BENCHMARK_GPT = GPTConfig(vocab_size=8192, d_model=512, num_layers=9, num_heads=8, seq_len=128)


def _loads(numels: list[int], owners: list[int], num_shards: int) -> list[int]:
    loads = [0] * num_shards
    for numel, owner in zip(numels, owners):
        loads[owner] += numel
    return loads


def test_largest_first_to_the_least_loaded_shard():
    assert assign_owners([5, 3, 3, 2, 1], 2) == [0, 1, 1, 0, 1]
    assert assign_owners([1, 2, 3], 1) == [0, 0, 0]  # one shard (stage 0): it owns everything
    assert assign_owners([4, 4, 4], 3) == [0, 1, 2]  # equal sizes in the given order, ties to the lowest shard
    assert assign_owners([1, 9], 5) == [1, 0]
    assert assign_owners([], 3) == []


@pytest.mark.parametrize("seed", range(20))
def test_owners_are_deterministic_and_balanced(seed):
    """The same owners for the same sizes (every rank computes them alone), every parameter owned by one shard, and
    greedy list scheduling's bound: no shard holds more than the mean plus the largest parameter."""
    rng = random.Random(seed)
    numels = [rng.randint(1, 10_000) for _ in range(rng.randint(1, 60))]
    num_shards = rng.choice([1, 2, 3, 5, 8])
    owners = assign_owners(numels, num_shards)
    assert owners == assign_owners(list(numels), num_shards)
    assert len(owners) == len(numels) and all(0 <= o < num_shards for o in owners)
    loads = _loads(numels, owners, num_shards)
    assert max(loads) <= sum(numels) / num_shards + max(numels)
    if len(numels) >= num_shards:
        assert min(loads) > 0  # (no shard idle while another holds two)


def _plan(seed: int):
    """Random buckets over random parameters (some larger than a bucket, so split over shards), some of them whole."""
    rng = random.Random(seed)
    num_shards = rng.choice([1, 2, 3, 4, 8])
    numels = [rng.choice([1, 2, 7, rng.randint(1, 300)]) for _ in range(rng.randint(1, 25))]
    layouts = plan_buckets(numels, [0] * len(numels), rng.randint(1, 200), num_shards)
    keys = [(b, span.param_index) for b, layout in enumerate(layouts) for span in layout.spans]
    whole = [key for key in keys if rng.random() < 0.6]
    numel_of = {(b, span.param_index): span.numel for b, layout in enumerate(layouts) for span in layout.spans}
    owners = dict(zip(whole, assign_owners([numel_of[k] for k in whole], num_shards)))
    return layouts, owners, numel_of, num_shards


@pytest.mark.parametrize("seed", range(40))
def test_every_piece_of_every_whole_parameter_travels_once(seed):
    layouts, owners, numel_of, num_shards = _plan(seed)
    exchanges = [Exchange(layouts, owners, num_shards, shard) for shard in range(num_shards)]
    arriving: dict[tuple[int, int], list[tuple[int, int]]] = {key: [] for key in owners}  # (param_start, numel)
    for shard, ex in enumerate(exchanges):
        for t in ex.own:
            assert t.holder == shard and owners[t.param] == shard
            arriving[t.param].append((t.piece.param_start, t.piece.numel))
        for owner, transfers in ex.outgoing.items():
            assert owner != shard
            # the owner expects exactly these pieces from this holder, in this order (nothing else is sent)
            assert exchanges[owner].incoming[shard] == transfers
            for t in transfers:
                assert t.holder == shard and owners[t.param] == owner and t.param in owners
                arriving[t.param].append((t.piece.param_start, t.piece.numel))
    for key, pieces in arriving.items():  # each whole parameter, reassembled on its owner: every element once
        at = 0
        for start, numel in sorted(pieces):
            assert start == at, f"parameter {key}: a gap or an overlap at element {at}"
            at += numel
        assert at == numel_of[key]
    travelling = {t.param for ex in exchanges for ts in ex.outgoing.values() for t in ts}
    assert travelling <= set(owners)  # the flat path's parameters never travel
    if num_shards == 1:
        assert travelling == set()


def test_select_keeps_the_pieces_of_parameters_with_a_gradient_in_order():
    layouts, owners, _, num_shards = _plan(3)
    ex = Exchange(layouts, owners, num_shards, 0)
    transfers = [t for ts in ex.incoming.values() for t in ts] + ex.own
    used = {t.param for t in transfers[::2]}
    chosen = Exchange.select(transfers, used)
    assert chosen == [t for t in transfers if t.param in used]


def _hidden_matrices(model: nn.Module) -> list[int]:
    """The sizes of the matrices Muon steps on the GPT (the blocks' 2-D weights), in model order."""
    return [p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name.startswith("blocks")]


@pytest.mark.parametrize("num_shards", [2, 3, 8])
def test_optimizer_state_is_balanced_on_the_benchmark_gpt(num_shards):
    """Muon on the hidden matrices (one fp32 momentum per element, on its owner), AdamW on the rest (two fp32 states
    per element, on flat shards, equal by construction): the largest rank's Muon state, and its whole optimizer
    state, within 1.15x the mean at 2, 3 and 8 ranks."""
    with torch.device("meta"):
        model = GPT(BENCHMARK_GPT)
    total = sum(p.numel() for p in model.parameters())
    assert 32_000_000 < total < 33_500_000
    hidden = _hidden_matrices(model)
    assert len(hidden) == 4 * BENCHMARK_GPT.num_layers
    muon = [4 * load for load in _loads(hidden, assign_owners(hidden, num_shards), num_shards)]
    adamw = 8 * -(-(total - sum(hidden)) // num_shards)
    mean = sum(muon) / num_shards
    assert max(muon) <= 1.15 * mean, f"Muon state per rank {muon}"
    assert max(muon) + adamw <= 1.15 * (mean + adamw)


class ScaledSGD(torch.optim.Optimizer):
    """A rule that keeps a constructor argument as an attribute, not in ``defaults`` (as pytorch_optimizer's LAMB
    keeps ``pre_norm``), and a per-tensor norm: ``p -= lr * scale * g / ||g||``."""

    def __init__(self, params, lr: float = 0.1, scale: float = 1.0):
        self.scale = scale
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=group["lr"] * self.scale / float(p.grad.norm()))


def test_the_rebuilt_optimizer_keeps_constructor_arguments_kept_as_attributes():
    rebuilt = same_kind(ScaledSGD([nn.Parameter(torch.ones(2))], lr=0.5, scale=3.0), [nn.Parameter(torch.ones(3))])
    assert (rebuilt.scale, rebuilt.defaults["lr"]) == (3.0, 0.5)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_rule_with_attribute_arguments_steps_as_in_one_process(stage):
    """Through ZeroOptimizer (one rank, whole-parameter path) the same numbers as the optimizer alone."""

    def run(zero: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = ScaledSGD(model.parameters(), lr=0.1, scale=3.0)
        opt = ZeroOptimizer(opt, model, stage=stage, bucket_size_mb=1e-4) if zero else opt
        for step in range(3):
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if zero:
            with opt.gathered_parameters():
                return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(True), run(False))
