"""Stage 3's units of gathering: which modules gather their parameters together (construction only).

A *unit* is a module whose parameters are all-gathered in one go just before its forward
(and again before its backward) and released afterwards. The root module is always a
unit; it owns every parameter that no nested unit claims.

Units are modules that run a forward of their own: a container that has none (``nn.ModuleList``,
``nn.ModuleDict``, whose layers the parent calls one by one) is never a unit; its children are
candidates in its place. A root that is such a container (a pipeline rank's parts in an ``nn.ModuleList``, each
called by its own stage) has its running children as units always: they own what no unit inside them claims.

Note: a parameter used by modules of different units (tied embeddings, a module shared
between blocks) belongs to the innermost unit that encloses *all* of its users. Units
nest, and a unit stays gathered for its whole forward, nested units' forwards included,
so the parameter is gathered whenever any of its users runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class UnitSpec:
    """One unit: the module whose forward hooks gather it, and the parameters it owns."""

    name: str  # module path ("" for the root)
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)


def plan_units(
    model: nn.Module,
    managed: list[nn.Parameter],
    *,
    unit_classes: tuple[str, ...] | None,
    unit_size_bytes: int | None,
) -> list[UnitSpec]:
    """Choose the unit modules and give each managed parameter to exactly one unit.

    Returns the units that own at least one managed parameter, root included, in module order.
    """
    if unit_classes is not None:
        names = _by_class(model, unit_classes)
    elif unit_size_bytes is not None:
        names = _by_size(model, set(managed), unit_size_bytes)
    else:
        names = _module_list_children(model)
    if not runs_forward(model):  # a container of parts: each part stands in for the root
        names = list(dict.fromkeys([*names, *_running("", model)]))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    names = [""] + sorted((n for n in names if n), key=order.__getitem__)
    modules = dict(model.named_modules())
    units = {name: UnitSpec(name, modules[name]) for name in names}
    owners = _direct_owners(model)
    for p in managed:
        units[_common_unit([_enclosing_unit(path, units) for path in owners[p]], units)].params.append(p)
    return [u for u in units.values() if u.params]


def runs_forward(module: nn.Module) -> bool:
    """Whether calling the module runs a forward of its own (containers such as ``nn.ModuleDict`` have none)."""
    return type(module).forward is not nn.Module.forward


def _by_class(model: nn.Module, classes: tuple[str, ...]) -> list[str]:
    wanted = set(classes)
    containers = sorted({type(m).__name__ for m in model.modules()
                         if type(m).__name__ in wanted and not runs_forward(m)})
    if containers:
        raise ValueError(
            f"unit_classes names {', '.join(containers)}, a container without a forward of its own: its layers "
            "are called one by one, so its hooks never run. Name the class of the layers inside it instead."
        )
    names = [name for name, m in model.named_modules() if type(m).__name__ in wanted]
    if not names:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"unit_classes={list(classes)} matches no module of this {type(model).__name__}; its module classes "
            f"are: {', '.join(present)}. Name the class of its repeated blocks (e.g. the transformer layer)."
        )
    return names


def _module_list_children(model: nn.Module) -> list[str]:
    """Default policy: each module held directly in an ``nn.ModuleList`` (transformer blocks); for a child
    that is a container without a forward (an ``nn.ModuleDict`` of layers), the modules inside it that run."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList):
            for child, module in m.named_children():
                names += _running(f"{name}.{child}" if name else child, module)
    return names


def _running(name: str, module: nn.Module) -> list[str]:
    """``name`` if the module runs a forward of its own, else the outermost modules inside it that do."""
    if runs_forward(module):
        return [name]
    return [found for child, sub in module.named_children()
            for found in _running(f"{name}.{child}" if name else child, sub)]


def _by_size(model: nn.Module, managed: set[nn.Parameter], threshold: int) -> list[str]:
    """Children first: a module whose not-yet-claimed parameters reach ``threshold`` bytes becomes a unit."""
    claimed: set[nn.Parameter] = set()
    names = []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        mine = [p for p in module.parameters() if p in managed and p not in claimed]
        if runs_forward(module) and sum(p.numel() * p.element_size() for p in mine) >= threshold:
            names.append(name)
            claimed.update(mine)

    visit("", model)
    return names


def _direct_owners(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every module path (shared modules under each of their paths) that holds each parameter directly."""
    owners: dict[nn.Parameter, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False):
            owners.setdefault(p, []).append(path)
    return owners


def _enclosing_unit(path: str, units: dict[str, UnitSpec]) -> str:
    parts = path.split(".") if path else []
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in units:
            return candidate
    return ""


def _common_unit(paths: list[str], units: dict[str, UnitSpec]) -> str:
    """The innermost unit enclosing every one of ``paths`` (units nest along module paths)."""
    split = [p.split(".") if p else [] for p in paths]
    common = []
    for parts in zip(*split):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return _enclosing_unit(".".join(common), units)


__all__ = ["UnitSpec", "plan_units"]
