"""The end of a script, in a real gloo world of 2 ranks (see ``exit_world``): gloo's worker thread never frees a
tensor of ours (after ``wait()`` it holds none of the tensor objects it was given: freeing one would take the GIL,
which aborts the process if the interpreter is exiting), and ``destroy_process_group()`` frees a group that a live
optimizer communicates over, joining its worker threads, after which the optimizer says so if it is used."""

from __future__ import annotations

import pytest

from tests.distributed.exit_world import ROUNDS, exit_checks
from tests.distributed.harness import run_world


@pytest.fixture(scope="module")
def exit_world():
    return run_world(exit_checks, 2, timeout_s=300)


def test_wait_returns_once_gloo_has_let_go_of_every_tensor_it_was_given(exit_world):
    for result in exit_world:
        released = result["released"]
        assert set(released["started"]) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
        assert all(count >= ROUNDS for count in released["started"].values()), released["started"]
        assert released["still_held"] == dict.fromkeys(released["started"], 0)


def test_metadata_gathers_go_through_the_same_path(exit_world):
    for result in exit_world:
        assert result["released"]["json"] == [0, 1]
        assert result["released"]["objects"] == [("rank", 0), ("rank", 1)]


def test_destroying_the_group_frees_it_and_its_threads_while_the_optimizer_lives(exit_world):
    for result in exit_world:
        destroyed = result["destroyed"]
        assert destroyed["with_group"] > destroyed["before"]  # (the group's own workers)
        assert not destroyed["group_outlived_destroy"]
        assert destroyed["after"] == destroyed["before"]
        assert "the process group was destroyed" in destroyed["error"]
        assert "destroy_process_group" in destroyed["error"]


def test_an_optimizer_dropped_after_its_group_was_destroyed_raises_nothing_in_its_finalizer(exit_world):
    """Scripts that destroy the group before the optimizer is collected printed "Exception ignored ... the process
    group was destroyed" (issue 34): the finalizer leaves the parameters sharded, and using them says why."""
    for result in exit_world:
        destroyed = result["destroyed"]
        assert destroyed["dropped_raised"] == []
        assert "dropped without close()" in destroyed["use_after_drop"], destroyed["use_after_drop"]
