"""Build a model on the ``meta`` device and materialize only this rank's shards (stage 3).

No rank ever holds the whole model: parameters are created one module at a time,
initialized, and reduced to this rank's chunks at once.

Exactness: the values equal those of building the model normally with the same seed, for
models that draw their random numbers the way ``torch.nn`` layers do:

1. *construction*: each module's ``reset_parameters()`` runs once, in module
   (construction) order; a parameter tied to an earlier module's (``head.weight =
   wte.weight``) keeps the earlier value, as after ``__init__`` ties it;
2. *then* an optional ``init_fn`` applied as ``model.apply(init_fn)`` (children first),
   which may read and overwrite a module's own parameters and set its buffers.

Step 2 needs the values of step 1, which were already dropped: each module's values are
recomputed by restoring the random generator to the state it had when step 1 ran that
module's ``reset_parameters()``, so the generator's stream is exactly the normal one.
Buffers are not sharded; a buffer that neither ``reset_parameters()`` nor ``init_fn`` sets
(e.g. a ``torch.arange`` made in ``__init__``) raises an error naming it, and so does a
parameter that neither sets.

Limits: a parameter tied between modules that both initialize it needs an ``init_fn`` that
sets it (which module's value survives depends on how ``__init__`` ties them: nanoGPT's
``wte.weight = lm_head.weight`` keeps the later one), and a module whose ``__init__`` calls
its own ``reset_parameters()`` only after building its children is replayed before them.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator

import torch
from torch import nn

from zero.runtime.buffers.bucket import ParamSlot
from zero.runtime.buffers.sharded_param import ZeroParameter, placeholder, set_data

InitFn = Callable[[nn.Module], None]


def replace_meta_parameters(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> set:
    """Swap every meta parameter for a placeholder parameter on ``device`` (ties kept); returns the new ones.

    A meta tensor cannot be given real storage in place, so the parameter objects change:
    in every module that holds them and in the optimizer's groups.
    """
    new_of: dict[nn.Parameter, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if p not in new_of:
                    data = placeholder(p.shape, p.dtype, device)
                    new_of[p] = nn.Parameter(data, requires_grad=p.requires_grad)
                module._parameters[name] = new_of[p]
    for group in optimizer.param_groups:
        group["params"] = [new_of.get(p, p) for p in group["params"]]
    return set(new_of.values())


def materialize(
    model: nn.Module,
    targets: set,
    slots: dict[nn.Parameter, ParamSlot],
    init_fn: InitFn | None,
    device: torch.device,
) -> None:
    """Initialize the parameters in ``targets`` (see the module docstring) and keep this rank's shards.

    Parameters in ``slots`` are sharded (their chunks go into their bucket's shard); other
    targets (frozen parameters) are kept whole.
    """
    fresh_buffers = _materialize_buffers(model, device)
    first_owner = _first_owners(model, targets)
    names: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
    if init_fn is None:
        _refuse_ambiguous_ties(model, targets, names)
    states: dict[nn.Module, torch.Tensor] = {}
    store = partial(_store, slots=slots, names=names)
    with torch.no_grad():
        for module in _construction_order(model):
            own = _owned(module, first_owner)
            if not _direct(module, targets):
                if hasattr(module, "reset_parameters") and module in fresh_buffers:
                    module.reset_parameters()  # buffers only (BatchNorm without affine): no random draws
                continue
            if not hasattr(module, "reset_parameters"):
                if init_fn is None:
                    names = [n for n, p in module.named_parameters(recurse=False) if p in targets]
                    raise ValueError(
                        f"{type(module).__name__} holds parameters {names} but has no reset_parameters(), so "
                        "there is no way to initialize them from the meta device. Give it a reset_parameters() "
                        "or pass init_fn= that initializes them."
                    )
                continue
            states[module] = _rng_state(device)
            values = _reset(module, targets, first_owner, slots, device)
            if init_fn is None:
                for p in own:
                    store(p, values[p])
        if init_fn is not None:
            _apply_init(model, targets, first_owner, states, init_fn, slots, store, device)
    _check_buffers(model, fresh_buffers)


def _refuse_ambiguous_ties(model: nn.Module, targets: set, names: dict) -> None:
    for p in targets:
        owners = [
            m for m in _construction_order(model)
            if any(q is p for q in _direct(m, targets)) and hasattr(m, "reset_parameters")
        ]
        if len(owners) > 1:
            kinds = " and ".join(type(m).__name__ for m in owners)
            raise ValueError(
                f"parameter {names[p]!r} is tied between modules ({kinds}) that each initialize it in "
                "reset_parameters(); which value a normal build keeps depends on how __init__ ties them. "
                "Pass init_fn= that initializes it (as GPT-2-style _init_weights functions do)."
            )


def _apply_init(model, targets, first_owner, states, init_fn, slots, store, device) -> None:
    """Step 2: ``init_fn`` children first; values from step 1 recomputed per module."""
    order = list(_apply_order(model))
    visits: dict[nn.Parameter, int] = {}
    for module in order:
        for p in _direct(module, targets):
            visits[p] = visits.get(p, 0) + 1
    current: dict[nn.Parameter, torch.Tensor] = {}
    for module in order:
        direct = _direct(module, targets)
        for p in direct:
            if p not in current:
                current.update(_recompute(first_owner[p], targets, first_owner, states, slots, device))
        for p in direct:
            _point(p, current[p])
        init_fn(module)
        for p in direct:
            current[p] = p.detach()
            visits[p] -= 1
            if visits[p] == 0:
                store(p, current.pop(p))


def _recompute(owner, targets, first_owner, states, slots, device) -> dict[nn.Parameter, torch.Tensor]:
    """The values ``owner.reset_parameters()`` gave its parameters in step 1 (NaN if it has none)."""
    if owner not in states:
        return {p: _blank(p, device, slots) for p in _owned(owner, first_owner)}
    running = _rng_state(device)
    _set_rng_state(device, states[owner])
    values = _reset(owner, targets, first_owner, slots, device)
    _set_rng_state(device, running)
    return {p: values[p] for p in _owned(owner, first_owner)}


def _reset(module, targets, first_owner, slots, device) -> dict[nn.Parameter, torch.Tensor]:
    """Run ``module.reset_parameters()`` on fresh whole tensors; parameters owned by an earlier
    module get a scratch tensor (drawn, then dropped, as the tie in ``__init__`` drops them)."""
    values = {p: _blank(p, device, slots) for p in _direct(module, targets)}
    for p, value in values.items():
        _point(p, value)
    module.reset_parameters()
    for p in values:
        _release(p, slots)
    return {p: v for p, v in values.items() if first_owner[p] is module}


def _point(p: nn.Parameter, value: torch.Tensor) -> None:
    """Give ``p`` a whole value to initialize or read."""
    if isinstance(p, ZeroParameter):
        set_data(p, value, sharded=False)
    else:
        p.data = value


def _release(p: nn.Parameter, slots: dict[nn.Parameter, ParamSlot]) -> None:
    """Drop ``p``'s whole value (a sharded parameter goes back to its placeholder)."""
    if p in slots:
        set_data(p, slots[p].placeholder, sharded=True)


def _store(p: nn.Parameter, value: torch.Tensor, slots: dict[nn.Parameter, ParamSlot], names: dict) -> None:
    """``p``'s final value: this rank's pieces go into its shard; a frozen parameter is kept whole."""
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        raise ValueError(
            f"parameter {names[p]!r} was built on the meta device and neither its module's reset_parameters() "
            "nor init_fn set (all of) it. Initialize it in init_fn (or give its module a reset_parameters())."
        )
    slot = slots.get(p)
    if slot is None:
        p.data = value
        return
    slot.bucket.copy_to_shard(slot, value)
    slot.bucket.evict()  # offload to disk: written back, not kept in memory
    _release(p, slots)


def _blank(p: nn.Parameter, device: torch.device, slots: dict[nn.Parameter, ParamSlot]) -> torch.Tensor:
    """A NaN tensor for ``p``'s initial value, in the dtype the model was built in (under mixed precision
    the master's: initialized in full precision, then cast, as a normal build followed by wrapping is)."""
    dtype = slots[p].bucket.dtypes.master if p in slots else p.dtype
    return torch.full(p.shape, float("nan"), dtype=dtype, device=device)


def _direct(module: nn.Module, targets: set) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None and p in targets]


def _owned(module: nn.Module, first_owner: dict) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None and first_owner.get(p) is module]


def _first_owners(model: nn.Module, targets: set) -> dict[nn.Parameter, nn.Module]:
    owners: dict[nn.Parameter, nn.Module] = {}
    for module in _construction_order(model):
        for p in _direct(module, targets):
            owners.setdefault(p, module)
    return owners


def _construction_order(model: nn.Module) -> Iterator[nn.Module]:
    """Each module once, parents before children, in registration order (how ``__init__`` builds them)."""
    return (m for _, m in model.named_modules())


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """The order ``module.apply(fn)`` calls ``fn`` in: children first, shared modules once per parent."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _materialize_buffers(model: nn.Module, device: torch.device) -> dict[nn.Module, list[torch.Tensor]]:
    """Give meta buffers storage, filled with a marker that ``_check_buffers`` looks for."""
    fresh: dict[nn.Module, list[torch.Tensor]] = {}
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.full(b.shape, _marker(b.dtype), dtype=b.dtype, device=device)
                fresh.setdefault(module, []).append(module._buffers[name])
    return fresh


def _check_buffers(model: nn.Module, fresh: dict[nn.Module, list[torch.Tensor]]) -> None:
    ours = {id(b) for buffers in fresh.values() for b in buffers}
    for name, b in model.named_buffers():
        untouched = id(b) in ours and (b.dtype == torch.bool or (b.numel() > 0 and _is_marker(b)))
        if b.is_meta or untouched:
            raise ValueError(
                f"buffer {name!r} was built on the meta device and neither reset_parameters() nor init_fn set it "
                "(its value from __init__ cannot be recovered). Set it in init_fn, e.g. "
                "`module.<buffer> = torch.arange(...)` for that module."
            )


def _marker(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min


def _is_marker(b: torch.Tensor) -> bool:
    if b.dtype.is_floating_point or b.dtype.is_complex:
        return bool(torch.isnan(b).all())
    return bool((b == torch.iinfo(b.dtype).min).all())


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
