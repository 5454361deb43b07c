"""``zero.estimate(..., tensor_parallel=tp)`` of a ``Workload(..., parallelize=fn)`` (issue 47 part 6), priced in a
forked child process as one rank of a fake dp x tp world (this process has no process group): the rank and mesh it
reports, the model states divided by tp, and what it refuses, with the runtime's causes. Against measured peaks:
``tests/distributed/test_estimate_tensor_parallel_world.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.estimate_tensor_parallel_world import MICRO, batch, build, loss, sequence_parallel, workload
from zero.estimator import Workload, estimate, plan


def test_prices_the_rank_asked_on_its_mesh():
    e = estimate(workload("plan2"), stage=2, world_size=4, tensor_parallel=2, micro_batch=MICRO, rank=3)
    assert (e.rank, e.world_size, e.tensor_parallel, e.group_size) == (3, 4, 2, 2)
    assert not dist.is_initialized()  # (the fake world was the child's)


def test_model_states_are_tp_local():
    """Stage 1's optimizer state at dp 2 x tp 2 is about half of dp 2's without TP (the norms' vectors and the
    biases of the row-wise layers stay whole on each tp rank), and the same workload written with lambdas is priced
    (the child is forked: the functions are this process's own)."""
    plain = estimate(Workload(build, loss, batch), stage=1, world_size=2, micro_batch=MICRO)
    split = estimate(Workload(lambda: build(), lambda m, x, y: loss(m, x, y), lambda n: batch(n),
                              parallelize=lambda m, mesh: sequence_parallel(m, mesh)),
                     stage=1, world_size=4, tensor_parallel=2, micro_batch=MICRO)
    ratio = split.categories["optimizer_state"] / plain.categories["optimizer_state"]
    assert 0.5 <= ratio <= 0.55, ratio


@pytest.mark.parametrize(("settings", "message"), [
    ({"tensor_parallel": 3}, "is not a multiple of tensor_parallel 3"),
    ({"tensor_parallel": 0}, "tensor_parallel must be a whole number >= 1"),
    ({"offload": "disk"}, "tensor parallelism with offload to disk; with a model split by parallelize_module"),
    ({"communication": {"shard_size": 1}}, "tensor parallelism with hierarchical communication"),
])
def test_refuses_what_the_runtime_refuses(settings, message):
    with pytest.raises(ValueError, match=message):
        estimate(workload("plan2"), **{"stage": 3, "world_size": 4, "tensor_parallel": 2, "micro_batch": MICRO,
                                       **settings})


def test_refuses_a_split_without_its_function_and_whole_parameter_optimizers():
    with pytest.raises(ValueError, match="needs the workload's parallelize function"):
        estimate(Workload(build, loss, batch), stage=1, world_size=4, tensor_parallel=2, micro_batch=MICRO)
    with pytest.raises(ValueError, match="does not search tensor-parallel workloads yet"):
        plan(workload("plan2"), gpu_memory=2**30, world_size=4, micro_batches=[MICRO])
    def hidden(name: str, p: torch.Tensor) -> bool:
        return name.startswith("layers.") and p.ndim == 2

    muon = Workload(build, loss, batch, parallelize=sequence_parallel, optimizers=lambda m: [
        torch.optim.Muon([p for n, p in m.named_parameters() if hidden(n, p)], lr=0.02),
        torch.optim.AdamW([p for n, p in m.named_parameters() if not hidden(n, p)], lr=1e-3)])
    with pytest.raises(ValueError, match="under tensor parallelism yet"):  # (raised in the child, raised here)
        estimate(muon, stage=1, world_size=4, tensor_parallel=2, micro_batch=MICRO)
