"""Stage 3 in one process: bit-identical to PyTorch, gathering behaviour, and clear errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero
from tests.readouts import flat_params
from tests.toy import Blocks
from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig, init_gpt_weights, synthetic_batch
from zero.runtime.gathering.gatherer import UnitState

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=4, num_heads=2)


class CheckpointedGPT(GPT):
    """GPT whose blocks recompute their activations in backward (non-reentrant checkpointing)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.positions[: idx.shape[1]])
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def _train(build, run_step, stage3: bool, steps: int = 4, **overrides):
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stage3:
        opt = ZeroOptimizer(opt, model, stage=3, **overrides)
    losses = []
    for step in range(steps):
        loss = run_step(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, flat_params(model, opt)


def _gpt_step(model, step):
    x, y = synthetic_batch(step, 4, CFG)
    return model.loss(x, y)


def test_activation_checkpointing_is_bit_identical():
    build = lambda: CheckpointedGPT(CFG)  # noqa: E731
    ref = _train(build, _gpt_step, stage3=False)
    for overrides in ({}, {"reshard_after_forward": False}):
        ours = _train(build, _gpt_step, stage3=True, **overrides)
        assert ours[0] == ref[0]
        assert torch.equal(ours[1], ref[1])


def test_units_skipped_or_called_twice_are_bit_identical():
    orders = [[0, 1, 2], [0, 0, 2], [2], [1, 1, 1, 0]]  # block 1 unused on steps 1-2; units repeat
    run = lambda model, step: model(torch.linspace(-1, 1, 32).view(4, 8), orders[step])  # noqa: E731
    ref = _train(Blocks, run, stage3=False)
    with pytest.warns(UserWarning, match=r"ran unit 'blocks.0' as unit #2 .* first forward pass ran unit 'blocks.1'"):
        ours = _train(Blocks, run, stage3=True)  # (an order that changes on every rank alike is only a warning)
    assert ours[0] == ref[0]
    assert torch.equal(ours[1], ref[1])


def _gathered_while_blocks_run(prefetch: int) -> tuple[list[int], list[UnitState]]:
    """Train two steps; on the second, record how many units are gathered when each block starts,
    and the state of block 1 when block 0 starts."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=3, prefetch_units=prefetch)
    units = opt.runtime.gatherer.units
    block1 = next(u for u in units if u.name == "blocks.1")
    counts, next_state = [], []

    def watch(module, args):
        counts.append(sum(u.state is not UnitState.SHARDED for u in units))
        if module is model.blocks[0]:
            next_state.append(block1.state)

    for block in model.blocks:
        block.register_forward_pre_hook(watch)  # runs after ZeroOptimizer's own pre-hook
    for step in range(2):
        counts.clear()
        next_state.clear()
        _gpt_step(model, step).backward()
        opt.step()
        opt.zero_grad()
    return counts, next_state


def test_prefetch_gathers_the_next_unit_and_bounds_the_working_set():
    counts, next_state = _gathered_while_blocks_run(prefetch=1)
    assert next_state == [UnitState.GATHERING]  # launched while block 0 runs, waited for when block 1 starts
    assert max(counts) == 3  # the root unit, the running block and the prefetched one
    counts, next_state = _gathered_while_blocks_run(prefetch=0)
    assert next_state == [UnitState.SHARDED]
    assert max(counts) == 2


def gathered(opt) -> set[str]:
    return {b.unit.name for b in opt.buckets if b.param_buffer.is_allocated}


def test_stage3_releases_everything_between_steps():
    """After backward only the root unit is still gathered (a second pass may read it); step() releases it."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=3)
    _gpt_step(model, 0).backward()
    assert gathered(opt) == {""}
    opt.step()
    assert gathered(opt) == set()


# ----- errors ---------------------------------------------------------------------------------------


def test_wrap_policy_that_matches_nothing():
    model = GPT(CFG)
    with pytest.raises(ValueError, match=r"unit_classes=\['Blok'\] matches no module.*Block"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3, unit_classes=["Blok"])


def test_one_unit_policy_at_a_time():
    with pytest.raises(ValueError, match="either unit_classes or unit_size_mb"):
        zero.ZeroConfig(stage=3, unit_classes=["Block"], unit_size_mb=1.0)


def test_parameter_used_outside_forward_names_it_and_the_fix():
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)
    with pytest.raises(RuntimeError, match=r"'wte\.weight' is sharded.*gathered_parameters"):
        model.wte.weight.sum()
    with pytest.raises(RuntimeError, match=r"'wte\.weight' is sharded"):  # a submodule of the root unit, alone
        model.wte(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="is sharded"):
        model.state_dict()
    assert model.wte.weight.shape == (CFG.vocab_size, CFG.d_model)  # metadata stays readable
    assert "sharded" in repr(model.wte.weight)
    with opt.gathered_parameters(model.wte):
        assert torch.isfinite(model.wte.weight.sum())


def test_gathered_parameters_edits_are_written_back():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)
    with opt.gathered_parameters(model.ln_f), torch.no_grad():
        model.ln_f.weight.fill_(3.0)
    with opt.gathered_parameters():
        assert torch.all(model.ln_f.weight == 3.0)
    with pytest.raises(ValueError, match="not in the model"):
        with opt.gathered_parameters(nn.Linear(2, 2)):
            pass


def test_meta_models_need_stage3():
    with torch.device("meta"):
        model = GPT(CFG)
    with pytest.raises(ValueError, match="meta device; only stage 3"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=2)


def test_init_fn_only_for_meta_models():
    model = GPT(CFG)
    with pytest.raises(ValueError, match="init_fn is used only"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3, init_fn=init_gpt_weights)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))  # created in __init__, no reset_parameters()


def test_meta_parameter_without_an_initializer():
    with pytest.raises(ValueError, match=r"Scaled holds parameters \['gain'\] but has no reset_parameters"):
        zero.init_sharded(Scaled, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))


def test_meta_buffer_nobody_sets():
    untied = GPTConfig(**{**CFG.__dict__, "tie_embeddings": False})
    with pytest.raises(ValueError, match="buffer 'positions' was built on the meta device"):
        zero.init_sharded(lambda: GPT(untied), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))


def test_meta_tied_parameter_needs_init_fn():
    with pytest.raises(ValueError, match=r"'wte\.weight' is tied between modules \(Embedding and Linear\)"):
        zero.init_sharded(lambda: GPT(CFG), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))


class NormNoInit(nn.Module):
    """nanoGPT-style: a LayerNorm-like module with no reset_parameters(), left alone by init_fn."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.ones(4))


def test_meta_parameter_left_unset_by_init_fn():
    def init_fn(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    with pytest.raises(ValueError, match="parameter 'weight' was built on the meta device and neither"):
        zero.init_sharded(NormNoInit, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), init_fn=init_fn)


def test_meta_batchnorm_without_affine_is_initialized():
    build = lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False))  # noqa: E731
    torch.manual_seed(3)
    normal = build()
    torch.manual_seed(3)
    model, opt = zero.init_sharded(build, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    assert torch.equal(model[1].running_var, normal[1].running_var)
    assert torch.equal(flat_params(model, opt), flat_params(normal))


def test_guard_details():
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)
    p = model.wte.weight
    assert f"{p}".startswith("ZeroParameter('wte.weight'")  # never the placeholder's values
    assert p.nbytes == p.numel() * 4 and sum(q.numel() for q in model.parameters()) > 0
    with pytest.raises(RuntimeError, match="cannot deep-copy parameter '.*'.*gathered_parameters"):
        copy.deepcopy(model)
    with opt.gathered_parameters():
        state = model.state_dict()
    assert torch.isfinite(state["wte.weight"]).all()  # a snapshot that outlives the block
    expected = state["wte.weight"].clone()
    _gpt_step(model, 0).backward()
    opt.step()  # the next gathers go to new storage: the snapshot is not overwritten
    _gpt_step(model, 1)
    assert torch.equal(state["wte.weight"], expected)


def test_backward_interrupted_by_an_error_leaves_no_stale_state():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=3)
    x, y = synthetic_batch(0, 4, CFG)
    logits = model(x)
    logits.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("skip this batch")))
    with pytest.raises(RuntimeError, match="skip this batch"):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    opt.zero_grad()
    for _ in range(2):  # accumulation over two micro-batches, then a step
        with opt.no_sync():
            model.loss(x, y).backward()
        assert gathered(opt) <= {""}
    model.loss(x, y).backward()
    assert gathered(opt) <= {""}
    opt.step()
    assert gathered(opt) == set()


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return Out(torch.tanh(self.lin(x)))


class Opaque:
    def __init__(self, t):
        self.t = t


class OpaqueBlock(DataclassBlock):
    def forward(self, x):
        return Opaque(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("block", [DataclassBlock, OpaqueBlock])
def test_unit_outputs_in_dataclasses_or_opaque_objects(block):
    def build():
        m = nn.Module()
        m.blocks = nn.ModuleList(block() for _ in range(2))
        return m

    def run(model, step):
        x = torch.linspace(-1, 1, 16).view(2, 8) * (step + 1)
        for b in model.blocks:
            out = b(x)
            x = out.hidden if isinstance(out, Out) else out.t
        return x.pow(2).sum()

    ref = _train(build, run, stage3=False)
    ours = _train(build, run, stage3=True)
    assert ours[0] == ref[0] and torch.equal(ours[1], ref[1])


class AdaptedBlock(nn.Module):
    """A frozen linear layer and a trainable low-rank adapter beside it (LoRA's shape)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down = nn.Linear(width, 2, bias=False)
        self.up = nn.Linear(2, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.up(self.down(x)))


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AdaptedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_a_unit_is_released_after_its_input_gradients_not_its_last_parameter_gradient():
    """The frozen weight carries the gradient back to earlier adapters after the unit's own adapter
    gradients arrived: releasing the unit at its last parameter gradient trained NaN (issue 23)."""
    x = torch.linspace(-1, 1, 32).view(4, 8)
    build = lambda: Adapted()  # noqa: E731
    torch.manual_seed(0)
    reference = Adapted()
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(0)
    model = build()
    opt = ZeroOptimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), model, stage=3)
    for _ in range(6):
        for m, o in ((reference, ref_opt), (model, opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
    with opt.gathered_parameters():
        for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
            assert torch.equal(ours, theirs), name


def test_backward_reading_a_released_unit_raises_instead_of_reading_stale_memory():
    torch.manual_seed(0)
    model = Adapted()
    opt = ZeroOptimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), model, stage=3)
    unit = next(u for u in opt.runtime.gatherer.units if u.name == "blocks.1")

    def release_early(grad: torch.Tensor) -> None:  # as a bug in the release schedule would
        opt.runtime.gatherer.reshard(unit)

    def hook_output(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(release_early)  # runs before backward reads base.weight for the input gradient

    inner = model.blocks[1].base.register_forward_hook(hook_output)
    loss = model(torch.linspace(-1, 1, 32).view(4, 8))
    inner.remove()
    with pytest.raises(RuntimeError, match=r"backward needs the parameters of unit 'blocks.1', which were released"):
        loss.backward()


@pytest.mark.parametrize("stage", [1, 3])
def test_modifier_rank_must_be_a_rank_of_the_group(stage):
    model = Blocks()
    opt = zero.ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=stage)
    with pytest.raises(ValueError, match=r"modifier_rank=1 is not a rank of this ZeroOptimizer's group \(0..0\)"):
        with opt.gathered_parameters(modifier_rank=1):
            pass
    with opt.gathered_parameters(modifier_rank=0):  # (a world of one: its only rank)
        pass
