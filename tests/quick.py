"""What ``python -m pytest --quick`` keeps of a test matrix (``tests/conftest.py`` says what the option leaves out).

A quick run still touches every feature once, not every combination: a world that runs a matrix (scenarios x stages,
plans x stages, ...) takes the part to run as an argument (``harness.world_fixture(..., quick_args=...)``, or
:func:`is_quick` in a fixture of its own), says in its results what it ran, and its tests check what it says it ran.
A test parametrized over the full matrix marks the cases a quick world does not run with :func:`full_only_beyond`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import pytest


def is_quick(request: pytest.FixtureRequest) -> bool:
    """Whether this is a ``--quick`` run."""
    return bool(request.config.getoption("--quick", default=False))


def full_only_beyond(values: Iterable[Any], kept: Collection[Any],
                     case_id: Callable[[Any], str] | None = None) -> list[Any]:
    """``values`` for ``pytest.mark.parametrize``, each not in ``kept`` marked ``full_only`` (a tuple stays one case
    of several arguments); ``case_id``: each case's id (default: its values joined by "-")."""
    def case(value: Any) -> Any:
        args = value if isinstance(value, tuple) else (value,)
        if value in kept and case_id is None:
            return value  # (its id is parametrize's own)
        marks = () if value in kept else pytest.mark.full_only
        return pytest.param(*args, marks=marks, id=case_id(value) if case_id else "-".join(map(str, args)))

    return [case(value) for value in values]
