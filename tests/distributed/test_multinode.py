"""Two machines as users launch them: two torchrun agents (``--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d``)
on this machine stand in for two, running ``examples/multinode.py`` (hierarchical sharding with
``shard_size="local"``). The shard groups follow the agents (torchrun's ``GROUP_RANK``), no parameter is gathered
across them, every rank trains to the same losses, and those are single-process PyTorch's (exact; with int8
weights and gradients within 2%)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import ROOT, free_port

# --quick: the example's launch is left out; the library's side of it runs there once: shard_size="local" read from
# torchrun's variables (tests/unit/test_quantization.py) and 2 shard groups of 2 trained (test_hierarchy_world.py)
pytestmark = pytest.mark.full_only

AGENTS, RANKS_PER_AGENT = 2, 2


def launch(*args: str) -> list[dict]:
    """Both agents at once, rendezvousing through c10d on 127.0.0.1; every rank's JSON line, by rank."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={AGENTS}",
               f"--nproc-per-node={RANKS_PER_AGENT}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=zero-multinode-test", str(ROOT / "examples" / "multinode.py"), "--check", *args]
    agents = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(AGENTS)]
    outputs = [agent.communicate(timeout=240) for agent in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-4000:]
    reports = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    return sorted(reports, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def hierarchical():
    return launch()


def test_the_shard_groups_follow_the_machines(hierarchical):
    assert [r["rank"] for r in hierarchical] == list(range(AGENTS * RANKS_PER_AGENT))
    for report in hierarchical:
        machine = [r["rank"] for r in hierarchical if r["machine"] == report["machine"]]
        assert report["local_world_size"] == RANKS_PER_AGENT
        assert report["shard_group"] == machine


def test_parameters_stay_inside_a_machine_and_gradient_shards_cross_once(hierarchical):
    for report in hierarchical:
        kinds = set(report["comm_stats"])
        assert {"all_gather", "reduce_scatter", "inter_all_reduce"} <= kinds
        assert not any(k.startswith("inter_") and k != "inter_all_reduce" for k in kinds), kinds
        assert 0 < report["bytes_across"] < report["bytes_inside"]


def test_every_rank_trains_exactly_as_one_process(hierarchical):
    assert all(r["losses"] == hierarchical[0]["losses"] for r in hierarchical)
    assert hierarchical[0]["reference_gap"] <= 1e-5


def test_with_int8_weights_and_gradients_the_losses_stay_within_two_percent():
    reports = launch("--quantized")
    assert [r["shard_group"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert 0 < reports[0]["reference_gap"] <= 0.02
    gather = reports[0]["comm_stats"]["all_gather"]
    assert gather["bytes"] < 0.3 * 4 * gather["numel"]  # int8 on the wire
