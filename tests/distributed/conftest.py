"""The shared worlds: one real gloo world per world size (1, 2, 3) runs every check once per session
(``worlds.world_checks``); the test modules compare what it returned."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_world
from tests.distributed.worlds import world_checks

WORLD_SIZES = (1, 2, 3)


@pytest.fixture(scope="session", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def world(request):
    world_size = request.param
    return world_size, run_world(world_checks, world_size)
