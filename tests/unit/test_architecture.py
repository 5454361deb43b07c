"""The package's shape, checked from its source (nothing is imported): the dependencies between ``zero``'s modules
go one way (no import cycle, function-level imports included), no module is over 400 lines, ``zero/optimizer.py``
is a thin facade (at most 250 lines), and only ``zero/comm.py`` calls ``torch.distributed``'s collectives (every
other module, a collective codec included, goes through its ``Communicator``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zero"
MAX_LINES = 400
MAX_OPTIMIZER_LINES = 250
COMMUNICATOR = "zero/comm.py"  # the one module that calls torch.distributed's collectives
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


def _nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` (at any depth: in functions and classes too) except what an
    ``if TYPE_CHECKING:`` block holds (its ``else`` is kept: that runs)."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def _imported_modules(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> list[str]:
    """The ``zero`` modules an import statement runs (outside modules are left out): ``import zero.a.b`` and
    ``from zero.a import b`` (``b`` a module) name ``zero.a.b``; ``from zero.a import name`` names ``zero.a``."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: up from this module's package
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = []
    for target in targets:
        while target and target not in modules:  # zero.a.b.name: the deepest module it names
            target = target.rpartition(".")[0]
        if target:
            found.append(target)
    return found


def import_graph() -> dict[str, dict[str, str]]:
    """``{module: {module it imports: "file:line" of the first such import}}`` for every module of ``zero``."""
    paths = {_module_name(p): p for p in _files()}
    graph: dict[str, dict[str, str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, str] = {}
        imports = [n for n in _nodes(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in sorted(imports, key=lambda n: n.lineno):
            for target in _imported_modules(node, package, set(paths)):
                if target != name:
                    edges.setdefault(target, f"{_where(path)}:{node.lineno}")
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


def test_the_import_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "zero.optimizer" in graph["zero"]  # from zero.optimizer import ZeroOptimizer (in zero/__init__.py)
    assert "zero.checkpoint.directory" in graph["zero.checkpoint.save"]  # from zero.checkpoint import directory
    assert "zero.profiler.sample" in graph["zero.profiler.report"]
    assert "zero.cli.main" in graph["zero.__main__"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    names = {alias.name for n in _nodes(tree) if isinstance(n, ast.Import) for alias in n.names}
    assert names == {"b", "c"}  # function-level imports count, TYPE_CHECKING-only ones do not
    assert cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    described = []
    for component in found:
        edges = [f"  {a} -> {b} ({graph[a][b]})" for a in component for b in sorted(graph[a]) if b in component]
        described.append(" <-> ".join(component) + "\n" + "\n".join(edges))
    assert not found, "import cycles among zero's modules:\n" + "\n".join(described)


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
    assert collective_calls((ROOT / COMMUNICATOR).read_text()), "the check finds zero/comm.py's own collectives"
    elsewhere = {_where(p): calls for p in _files()
                 if _where(p) != COMMUNICATOR and (calls := collective_calls(p.read_text()))}
    assert not elsewhere, f"collectives called outside {COMMUNICATOR} (go through its Communicator): {elsewhere}"
