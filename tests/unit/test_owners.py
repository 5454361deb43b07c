"""Owners of whole parameters (``zero.runtime.buffers.owners``): who steps each one, which pieces travel to it and
back, the balance of the optimizer state on the benchmark GPT, the owner step's own memory (rank 0 of a world of 2 in
torch's fake process group, this module run as ``python -m tests.unit.test_owners``), and the rebuilt optimizer's
rule (pure arithmetic and single-process runs; the exchange itself runs in
``tests/distributed/test_optimizers_world.py``)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig
from zero.runtime.buffers.layout import plan_buckets
from zero.runtime.buffers.owners import Exchange, assign_owners
from zero.runtime.step.inner import same_kind
from zero.runtime.step.owner_step import OwnerStep

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


# The GPT benchmarks/optimizers.py times (d_model 256, 4 layers: 5.3M parameters, one 25 MB bucket at stages 1-2)
TIMED_GPT = GPTConfig(vocab_size=8192, d_model=256, num_layers=4, num_heads=4, seq_len=128)


def _state_and_work(cfg: GPTConfig, num_shards: int, folded: bool = False) -> tuple[float, float]:
    """Max over mean, over the ranks, of the optimizer state and of the whole path's elements owned (its work), with
    Muon on the hidden matrices (the blocks' 2-D weights: one fp32 momentum per element, on the owner) and AdamW on
    the rest (two fp32 states per element of the rank's chunks), laid out as the runtime lays them out at stages 1-2
    (trainable parameters in reverse model order, 25 MB fp32 buckets: ``zero.runtime.buffers.partition``) and owned
    as ``OwnerStep`` owns them (``assign_owners`` in model order). ``folded``: the alternative not taken, each shard
    starting the owners' balance at its flat state."""
    with torch.device("meta"):
        model = GPT(cfg)
    packed = list(model.named_parameters())[::-1]
    hidden = {i for i, (name, p) in enumerate(packed) if p.dim() == 2 and name.startswith("blocks")}
    layouts = plan_buckets([p.numel() for _, p in packed], [0] * len(packed), 25 * 2**20 // 4, num_shards)
    flat = [8 * sum(piece.numel for layout in layouts for piece in layout.pieces(shard)
                    if piece.param_index not in hidden) for shard in range(num_shards)]
    matrices = [p.numel() for i, (_, p) in reversed(list(enumerate(packed))) if i in hidden]  # (model order)
    if folded:
        work = [0] * num_shards
        for numel in sorted(matrices, reverse=True):
            shard = min(range(num_shards), key=lambda s: (flat[s] + 4 * work[s], s))
            work[shard] += numel
    else:
        work = _loads(matrices, assign_owners(matrices, num_shards), num_shards)
    state = [f + 4 * w for f, w in zip(flat, work)]
    return max(state) / (sum(state) / num_shards), max(work) / (sum(work) / num_shards)


@pytest.mark.parametrize("num_shards", [2, 3, 8])
def test_optimizer_state_and_work_are_balanced_on_the_benchmark_gpt(num_shards):
    """The 32.6M GPT at stages 1-2 (6 buckets, each chunked over the ranks): the largest rank's optimizer state and
    whole-path work within 1.15x the mean at 2, 3 and 8 ranks (computed when written: state 1.004, 1.007, 1.027; work
    1.000, 1.000, 1.037)."""
    with torch.device("meta"):
        assert 32_000_000 < sum(p.numel() for p in GPT(BENCHMARK_GPT).parameters()) < 33_500_000
    state, work = _state_and_work(BENCHMARK_GPT, num_shards)
    assert state <= 1.15 and work <= 1.15, (state, work)


def test_one_bucket_leaves_the_flat_state_where_the_layout_puts_it():
    """Why the owners balance work, not the whole state (docs/design.md): in one bucket the flat optimizer's state
    lives where its parameters fall in the chunks (the 5.3M GPT's embedding: in one rank's), which the owners cannot
    move; folding it into their balance evens the state only by moving the matrices, and so the step's work, to the
    other ranks."""
    assert _state_and_work(TIMED_GPT, 2) == (pytest.approx(1.570, abs=1e-3), 1.0)
    assert _state_and_work(TIMED_GPT, 3)[0] == pytest.approx(1.846, abs=1e-3)
    folded = [_state_and_work(TIMED_GPT, n, folded=True) for n in (2, 3)]
    assert folded[0] == (pytest.approx(1.147, abs=1e-3), 2.0)  # (every matrix on one rank: no step split at all)
    assert folded[1][1] > 1.8


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


# ----- the owner step's own memory -------------------------------------------------------------------------------
# wide enough that the owned tensors make the owner step's peak: the ratios and the exact estimates below are the
# same at every width measured from 96 to 256 (at 64 stage 1's estimate is 3% above; 128 steps Muon several times
# faster than 256)
WIDE_GPT = GPTConfig(vocab_size=64, seq_len=8, d_model=128, num_layers=4, num_heads=4)
OWNER_STEP_RUNS = {"stage1": (1, None), "stage3": (3, None), "stage2-mixed": (2, {"param_dtype": "bf16"})}


def test_the_owner_step_holds_the_whole_tensors_and_the_received_pieces():
    """Muon + AdamW on a wide GPT, 2 shards: what the owner step allocates at its peak, over the owned parameters'
    bytes, is 2.5 (2x for the whole gradients and masters, 0.5 for the pieces received), 3.0 where the master travels
    too (mixed precision) and 3.33 at stage 3 (its last bucket's pieces); it was 3.0, 4.0 and 4.67 with the send
    buffer held beside them (issue 49). The estimator's ``owner_step_bytes`` prices it to the byte."""
    proc = subprocess.run([sys.executable, "-m", "tests.unit.test_owners"], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    ratios = {case: run["peak"] / run["owned"] for case, run in runs.items()}
    assert ratios == pytest.approx({"stage1": 2.5, "stage3": 3.329, "stage2-mixed": 3.0}, abs=0.01), ratios
    assert all(run["peak"] == run["estimated"] for run in runs.values()), runs


class _Allocated(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak of the bytes of the storages operators create under it, while they live."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage()._cdata for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is None or storage._cdata in inputs or any(r() is storage for r, _ in self.refs):
                continue
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            self.refs.append((weakref.ref(storage, lambda _r, n=storage.nbytes(): self._freed(n)), storage.nbytes()))
        return out

    def _freed(self, nbytes: int) -> None:
        self.now -= nbytes


def _owner_step_memory() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zero.estimator import Workload

    def optimizers(model: nn.Module) -> list:
        named = list(model.named_parameters())
        hidden = [p for name, p in named if p.dim() == 2 and name.startswith("blocks.")]
        return [torch.optim.Muon(hidden, lr=0.02),
                torch.optim.AdamW([p for _, p in named if all(p is not h for h in hidden)], lr=1e-3)]

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    peaks: list[tuple[int, int]] = []  # (peak, owned bytes) of each owner step
    step = OwnerStep.step

    def measured(self, kwargs):
        mode = _Allocated()
        with mode:
            step(self, kwargs)
        peaks.append((mode.peak, sum(slot.param.numel() for slot, _ in self.owned()) * self.dtype.itemsize))

    OwnerStep.step = measured
    work = Workload(lambda: GPT(WIDE_GPT), lambda m, x: m.loss(x, x), lambda n: (torch.randint(0, 64, (n, 8)),),
                    optimizers=optimizers)
    runs = {}
    for case, (stage, precision) in OWNER_STEP_RUNS.items():
        torch.manual_seed(0)
        model = GPT(WIDE_GPT)
        opt = ZeroOptimizer(optimizers(model), model, stage=stage, **({"precision": precision} if precision else {}))
        x = torch.randint(0, 64, (2, 8))
        for _ in range(2):
            model.loss(x, x).backward()
            opt.step()
            opt.zero_grad()
        shorthand = "mixed-fp32-reduce" if precision else "fp32"
        estimated = work.step(work.layout(stage, 2, shorthand, rank=0), shorthand).whole
        runs[case] = {"peak": peaks[-1][0], "owned": peaks[-1][1], "estimated": estimated}
    print(json.dumps(runs))


if __name__ == "__main__":
    _owner_step_memory()
