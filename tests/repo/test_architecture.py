"""The package's shape, checked from its source (nothing is imported): the dependencies between ``zero``'s modules
go one way (no import cycle, function-level imports included), no module is over 400 lines, ``zero/optimizer.py``
is a thin facade (at most 250 lines), and only ``zero/comm/communicator.py`` calls ``torch.distributed``'s
collectives (every other module, a collective codec included, goes through its ``Communicator``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zero"
MAX_LINES = 400
MAX_OPTIMIZER_LINES = 250
COMMUNICATOR = "zero/comm/communicator.py"  # the one module that calls torch.distributed's collectives
COMM = "zero.comm"  # the communication package: its modules import nothing else of zero
DISTRIBUTED = ("torch.distributed", "torch.distributed.distributed_c10d")
COLLECTIVE = re.compile(r"_?(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|barrier|monitored_barrier)\w*")
FUNCTIONAL_COLLECTIVES = "torch.distributed._functional_collectives"


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _where(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nodes(tree: ast.AST, type_checking: bool = False) -> list[ast.AST]:
    """Every node of ``tree`` (at any depth: in functions and classes too) except what an
    ``if TYPE_CHECKING:`` block holds (its ``else`` is kept: that runs), unless ``type_checking``."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def _under_type_checking(tree: ast.AST) -> set[int]:
    """The ids of the nodes only an ``if TYPE_CHECKING:`` block runs (type checkers, not Python)."""
    return {id(node) for node in _nodes(tree, type_checking=True)} - {id(node) for node in _nodes(tree)}


def _deepest_module(target: str, modules: set[str]) -> str:
    """``zero.a.b.name`` -> the deepest module it names (``zero.a.b``); ``""`` outside ``zero``."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def _ancestors(name: str) -> list[str]:
    """``zero.a.b`` -> ``["zero", "zero.a"]``: the packages Python imports before ``zero.a.b``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, package: str, modules: set[str]) -> list[str]:
    """The ``zero`` modules an import statement in ``module`` (of ``package``) runs or reads (outside modules are
    left out):

    * the module it names: ``import zero.a.b`` and ``from zero.a import b`` (``b`` a module) name ``zero.a.b``,
      ``from zero.a import name`` names ``zero.a``;
    * every package above it that is not above ``module`` too: importing ``zero.a.b`` runs ``zero/a/__init__.py``
      first, unless ``module`` is inside ``zero.a`` (then that ``__init__`` is already running: it is what
      imported ``module``, or Python imported it before ``module``);
    * the package ``P`` of ``from P import x`` even when ``x`` is a submodule: the name is read from ``P``'s
      namespace, i.e. from its ``__init__``, so a submodule of ``P`` importing ``from P import sibling`` depends
      on ``P/__init__.py`` (and is in a cycle with it where that ``__init__`` imports the submodule).
      ``import P.sub`` and ``from P.sub import x`` from inside ``P`` read nothing of ``P``'s ``__init__``."""
    above = set(_ancestors(module))
    named: list[str] = []
    if isinstance(node, ast.Import):
        named = [_deepest_module(alias.name, modules) for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: up from this module's package
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        base = _deepest_module(base, modules)
        if base:
            named.append(base)  # read from: its __init__ when it is a package
            named += [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    found: list[str] = []
    for target in filter(None, named):
        found += [p for p in _ancestors(target) if p in modules and p not in above] + [target]
    return list(dict.fromkeys(found))


def import_graph() -> dict[str, dict[str, str]]:
    """``{module: {module it imports: "file:line" of the first such import}}`` for every module of ``zero``; an
    import that only an ``if TYPE_CHECKING:`` block holds counts too (a cycle of types is still a cycle of the
    design), its place marked ``(TYPE_CHECKING)``."""
    paths = {_module_name(p): p for p in _files()}
    graph: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, str] = {}
        tree = ast.parse(path.read_text())
        typing_only = _under_type_checking(tree)
        imports = [n for n in _nodes(tree, type_checking=True) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in sorted(imports, key=lambda n: (id(n) in typing_only, n.lineno)):  # a running import first
            for target in _imported_modules(node, name, package, set(paths)):
                if target != name:
                    where = f"{_where(path)}:{node.lineno}"
                    edges.setdefault(target, where + (" (TYPE_CHECKING)" if id(node) in typing_only else ""))
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _targets(source: str, module: str, modules: set[str]) -> set[str]:
    """What ``import_graph`` draws from ``module`` (a package where it has submodules in ``modules``) for
    ``source``."""
    package = module if any(m.startswith(module + ".") for m in modules) else module.rpartition(".")[0]
    nodes = [n for n in _nodes(ast.parse(source), type_checking=True) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return {t for n in nodes for t in _imported_modules(n, module, package, modules) if t != module}


def test_the_import_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "zero.optimizer" in graph["zero"]  # from zero.optimizer import ZeroOptimizer (in zero/__init__.py)
    assert "zero.checkpoint.portable.tensorfile" in graph["zero.checkpoint.consolidate"]  # from P import module
    assert "zero.checkpoint.portable.directory" in graph["zero.checkpoint.portable.save"]  # import P.module as name
    assert "zero.profiler.sample" in graph["zero.profiler.report"]
    assert "zero.cli.main" in graph["zero.__main__"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    names = {alias.name for n in _nodes(tree) if isinstance(n, ast.Import) for alias in n.names}
    assert names == {"b", "c"}  # what runs: function-level imports count, TYPE_CHECKING-only ones do not
    every = {alias.name for n in _nodes(tree, type_checking=True) if isinstance(n, ast.Import) for alias in n.names}
    assert every == {"a", "b", "c"}  # what the import graph counts: a cycle of types is a cycle too
    assert cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [["a", "b", "c"]]


def test_the_import_graph_sees_packages_run_and_read():
    modules = {"z", "z.p", "z.p.a", "z.p.b", "z.q", "z.q.c"}
    # from P import sibling, inside P: the name is read from P's __init__ (the profiler's old cycle)
    assert _targets("from z.p import b", "z.p.a", modules) == {"z.p", "z.p.b"}
    assert _targets("from . import b", "z.p.a", modules) == {"z.p", "z.p.b"}
    assert _targets("from z.p import f", "z.p.a", modules) == {"z.p"}
    # straight to the submodule, inside P: P's __init__ is already running and nothing is read from it
    assert _targets("from z.p.b import f", "z.p.a", modules) == {"z.p.b"}
    assert _targets("import z.p.b", "z.p.a", modules) == {"z.p.b"}
    # from outside P: importing P.b runs P's __init__ first (zero.config reading zero.deepspeed.reader)
    assert _targets("from z.p.b import f", "z.q.c", modules) == {"z.p", "z.p.b"}
    assert _targets("import z.p.b", "z.q.c", modules) == {"z.p", "z.p.b"}
    assert _targets("def f():\n    from ..p import b", "z.q.c", modules) == {"z.p", "z.p.b"}
    # a package's own __init__ importing its submodules depends on them, not on itself
    assert _targets("from z.p import a\nfrom . import b", "z.p", modules) == {"z.p.a", "z.p.b"}
    # an import only type checkers run counts (zero.deepspeed_config's old `if TYPE_CHECKING:` import of ZeroConfig)
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from z.q.c import C\n"
    assert _targets(source, "z.p.a", modules) == {"z.q", "z.q.c"}
    assert cycles({"z.p": {"z.p.a": ""}, "z.p.a": {"z.p": "", "z.p.b": ""}, "z.p.b": {}}) == [["z.p", "z.p.a"]]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    described = []
    for component in found:
        edges = [f"  {a} -> {b} ({graph[a][b]})" for a in component for b in sorted(graph[a]) if b in component]
        described.append(" <-> ".join(component) + "\n" + "\n".join(edges))
    assert not found, "import cycles among zero's modules:\n" + "\n".join(described)


def test_the_communication_package_imports_nothing_else_of_zero():
    """``zero/comm/`` is the bottom of the stack (see its docstring): the runtime, checkpoints and the estimator
    import from it, never the reverse."""
    def inside(module: str) -> bool:
        return module == COMM or module.startswith(COMM + ".")

    outside = sorted(f"{m} -> {t} ({where})" for m, edges in import_graph().items() if inside(m)
                     for t, where in edges.items() if not inside(t))
    assert not outside, f"{COMM} imports other zero modules:\n" + "\n".join(outside)


LAYERS = (  # zero's top-level modules and packages, lowest first: each imports only from the layers before it
    ("comm", "kernels", "memory", "models", "outputs", "sizes", "version", "weak"),  # leaves: torch, pydantic
    ("activations", "offload", "precision"),  # the policies
    ("deepspeed",),  # DeepSpeed's JSON read into the policies' field values
    ("config",),  # ZeroConfig: every policy, validated once (and ZeroConfig.from_deepspeed)
    ("runtime",),  # what trains, built from the config
    ("checkpoint", "estimator", "profiler"),  # saving and loading the runtime's state; predicting; measuring
    ("auto_ratio",),  # offload.ratio="auto", chosen through the estimator
    ("optimizer",),  # the facade: ZeroOptimizer
    ("pipelining", "sharded_init"),  # built on the facade: torch's pipeline stage for it; building on meta into it
    ("cli", "integrations"),  # the zero command; the Trainer and Accelerate adapters
    ("__init__", "__main__"),  # zero/__init__.py's public names; python -m zero
)


def _top(module: str) -> str:
    """The top-level module or package of ``zero`` that ``module`` belongs to (``zero.a.b`` -> ``"a"``), as
    ``LAYERS`` names it (``zero`` itself, its ``__init__.py``: ``"__init__"``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, dict[str, str]], layers=LAYERS) -> list[str]:
    """Every import (at any level, function-level ones included; not those only an ``if TYPE_CHECKING:`` block runs)
    from a module to one of its own layer or a higher one, outside its own top-level module or package."""
    rank = {name: i for i, names in enumerate(layers) for name in names}
    found = []
    for module, edges in sorted(graph.items()):
        for target, where in sorted(edges.items()):
            low, high = _top(module), _top(target)
            if low != high and not where.endswith("(TYPE_CHECKING)") and rank[high] >= rank[low]:
                found.append(f"{module} (layer {rank[low]}: {low}) imports {target} (layer {rank[high]}: {high}) "
                             f"at {where}")
    return found


def test_every_top_level_module_has_one_layer():
    placed = [name for names in LAYERS for name in names]
    assert len(placed) == len(set(placed)), f"named in two layers: {sorted({n for n in placed if placed.count(n) > 1})}"
    tops = {_top(module) for module in import_graph()}
    assert tops == set(placed), (f"give each a layer in LAYERS: {sorted(tops - set(placed))}; "
                                 f"no longer in zero: {sorted(set(placed) - tops)}")


def test_the_layer_check_sees_an_upward_import():
    modules = {"zero", "zero.config", "zero.runtime", "zero.runtime.build", "zero.precision"}
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zero.runtime.build import a\n"
    typing_only = {t: "zero/config.py:3 (TYPE_CHECKING)" for t in _targets(source, "zero.config", modules)}
    assert upward_imports({"zero.config": typing_only}) == []  # types only: no layer is run from below
    function_level = "def f():\n    from zero.runtime.build import a\n"
    edges = {t: "zero/config.py:2" for t in _targets(function_level, "zero.config", modules)}
    assert upward_imports({"zero.config": edges}) == [
        "zero.config (layer 3: config) imports zero.runtime (layer 4: runtime) at zero/config.py:2",
        "zero.config (layer 3: config) imports zero.runtime.build (layer 4: runtime) at zero/config.py:2"]
    peers = {"zero.precision": {"zero.offload": "zero/precision.py:1"}, "zero.config": {"zero.precision": "x:1"}}
    assert upward_imports(peers) == [  # a layer's members are independent: the same layer counts as upward
        "zero.precision (layer 1: precision) imports zero.offload (layer 1: offload) at zero/precision.py:1"]


def test_the_imports_go_down_the_layers():
    """``zero``'s top-level modules and packages import only from the layers below theirs (``LAYERS``), so the
    policies never reach for the runtime, the runtime never for the estimator or the checkpoints, and nothing below
    the facade imports it (the checkpoints read it through ``zero.checkpoint.portable.model_tensors.Checkpointable``).
    """
    upward = upward_imports(import_graph())
    assert not upward, "imports from a lower layer to a higher one (or within a layer; see LAYERS):\n" + "\n".join(
        upward)


RUNTIME_LAYERS = ("guards", "precision", "activations", "buffers", "parallel", "stages", "offload", "step", "gathering",
                  "reduction")  # each imports only earlier ones


def test_the_runtime_packages_import_only_the_ones_before_them():
    """``zero/runtime/``'s sub-packages, in the order of ``RUNTIME_LAYERS`` (their docstrings say what each may
    import): none imports a later one, nor the assembly above them (``zero.runtime.build``, ``runtime``, ...)."""
    def layer(module: str) -> int | None:
        parts = module.split(".")
        if parts[:2] != ["zero", "runtime"] or len(parts) < 3:
            return None
        return RUNTIME_LAYERS.index(parts[2]) if parts[2] in RUNTIME_LAYERS else len(RUNTIME_LAYERS)

    graph = import_graph()
    assert all(f"zero.runtime.{name}" in graph for name in RUNTIME_LAYERS)
    upward = sorted(f"{m} -> {t} ({where})" for m, edges in graph.items() if (here := layer(m)) is not None
                    and here < len(RUNTIME_LAYERS) for t, where in edges.items()
                    if (there := layer(t)) is not None and there > here)
    assert not upward, "runtime packages importing later ones:\n" + "\n".join(upward)


def test_no_module_over_400_lines():
    long = {_where(p): n for p in _files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_optimizer_is_a_thin_facade():
    lines = len((PACKAGE / "optimizer.py").read_text().splitlines())
    assert lines <= MAX_OPTIMIZER_LINES, f"zero/optimizer.py has {lines} lines (at most {MAX_OPTIMIZER_LINES})"


def collective_calls(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each use of a ``torch.distributed`` collective in ``source``: through an alias of the
    module (``dist.all_reduce``), the full path (``torch.distributed.barrier``), a name imported from it (``from
    torch.distributed import broadcast``), or an import of the functional collectives."""
    tree = ast.parse(source)
    nodes = _nodes(tree)
    aliases = set()  # names bound to torch.distributed
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == FUNCTIONAL_COLLECTIVES:
                    found.append((node.lineno, alias.name))
                elif alias.name in DISTRIBUTED and alias.asname:
                    aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in DISTRIBUTED:
                    aliases.add(alias.asname or alias.name)
                elif full == FUNCTIONAL_COLLECTIVES or node.module == FUNCTIONAL_COLLECTIVES:
                    found.append((node.lineno, full))
                elif node.module in DISTRIBUTED and COLLECTIVE.fullmatch(alias.name):
                    found.append((node.lineno, full))
    for node in nodes:
        if isinstance(node, ast.Attribute) and COLLECTIVE.fullmatch(node.attr):
            owner = ast.unparse(node.value)
            if owner in aliases or owner in DISTRIBUTED:
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return sorted(found)


def test_the_collective_check_finds_each_spelling():
    source = ("import torch\nimport torch.distributed as dist\nfrom torch import distributed as d2\n"
              "from torch.distributed import broadcast, get_rank\n"
              "def f(t):\n    dist.all_reduce(t)\n    d2.all_gather_into_tensor(t, t)\n"
              "    torch.distributed.barrier()\n    op = dist.reduce_scatter_tensor\n    dist.get_rank()\n")
    assert [name for _, name in collective_calls(source)] == [
        "torch.distributed.broadcast", "dist.all_reduce", "d2.all_gather_into_tensor", "torch.distributed.barrier",
        "dist.reduce_scatter_tensor"]
    assert collective_calls("import torch.distributed as dist\nif dist.is_initialized():\n    dist.get_rank()\n") == []


def test_only_the_communicator_calls_collectives():
    assert collective_calls((ROOT / COMMUNICATOR).read_text()), f"the check finds {COMMUNICATOR}'s own collectives"
    elsewhere = {_where(p): calls for p in _files()
                 if _where(p) != COMMUNICATOR and (calls := collective_calls(p.read_text()))}
    assert not elsewhere, f"collectives called outside {COMMUNICATOR} (go through its Communicator): {elsewhere}"
