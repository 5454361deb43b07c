"""``python -m pytest --quick``: a local run of a few minutes that still touches every feature once.

The full run (``python -m pytest``, what CI runs) checks every world size (1, 2 and 3 ranks) and every matrix.
``--quick`` keeps one multi-rank world size, 2 (the real gloo worlds are the expensive part), and leaves out the tests
marked ``full_only``: a larger copy of a check that a quick run makes once elsewhere (every combination of a matrix,
``tests/quick.py``), and the benchmark scripts' toy runs and the notebook (the repository's tools, whose library paths
the worlds check).
"""

from __future__ import annotations

import os
import re

import pytest

# OpenMP's idle threads sleep rather than spin, in the workers and every process they start (before any test imports
# torch): a worker per core, each with torch's threads and its worlds' ranks, spinning threads took the cores from
# the others (the estimate world's two processes side by side: 4x the time); the threads and every number unchanged
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

OTHER_WORLDS = re.compile(r"(^|[-\[_])world[13]($|[-\]_])")  # the parameter ids of worlds of 1 and 3 ranks


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true", help="one world size (2), no full_only tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The modules marked heavy (a minute or more each) first, the rest as collected: the worker processes take test
    # modules in this order (pyproject's --no-loadscope-reorder), so no worker is left with a long one at the end
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
    if not config.getoption("--quick"):
        return
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        other_world = callspec is not None and OTHER_WORLDS.search(callspec.id) is not None
        heavy = item.get_closest_marker("full_only") is not None
        (dropped if other_world or heavy else kept).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
