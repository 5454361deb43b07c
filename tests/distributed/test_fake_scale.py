"""A 153M-parameter GPT at stage 3 as rank 0 of 64 (torch's fake process group), on CPU in seconds."""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_module
from zero import zero_model_state_bytes

pytestmark = pytest.mark.full_only  # --quick: covered once by tests/unit's memory checks


def _run(*args: str) -> dict:
    return run_module("tests.distributed.fake_scale", *args, timeout=300)


@pytest.fixture(scope="module")
def scale() -> dict:
    return _run()


def test_model_state_of_one_rank_of_64_is_16_psi_over_n(scale):
    psi, n = scale["numel"], scale["world_size"]
    assert psi >= 150_000_000  # (the 1.1B GPT: benchmarks/estimate_scale.py)
    # Everything alive after a step is model state (plus the model's one small buffer) ...
    assert scale["measured"] == scale["held"] + scale["buffers"]
    # ... and that is the ZeRO-3 formula, 16Ψ/N, within 1% (padding and placeholders included).
    assert scale["measured"] == pytest.approx(zero_model_state_bytes(psi, n, 3), rel=0.01)
    # Built on meta: after initialization a rank holds only its parameter shard (4Ψ/N).
    assert scale["after_init"] == pytest.approx(4 * psi / n, rel=0.01)


def test_stage3_traffic_is_three_psi(scale):
    """Forward and backward gathers plus the reduce-scatter; the root unit (embeddings, final norm)
    and the last block stay gathered from forward into backward, which starts with them."""
    stats, padded, units = scale["comm_stats"], scale["padded_numel"], scale["unit_numel"]
    last_block = units[f"blocks.{scale['num_layers'] - 1}"]
    assert stats["all_gather"]["numel"] == 2 * padded - units[""] - last_block
    assert stats["reduce_scatter"]["numel"] == padded


def test_mixed_precision_model_state_of_one_rank_of_64_is_the_papers():
    """bf16 parameters, gradients and reduction over fp32 master shards: 2Ψ/N + 2Ψ/N + 12Ψ/N."""
    bf16 = _run("bf16")
    psi, n = bf16["numel"], bf16["world_size"]
    assert bf16["measured"] == bf16["held"] + bf16["buffers"]
    assert bf16["measured"] == pytest.approx(zero_model_state_bytes(psi, n, 3), rel=0.01)
    parameters, gradients, optimizer_state = bf16["model_state"]
    assert parameters == pytest.approx(2 * psi / n, rel=0.01)
    assert gradients == pytest.approx(2 * psi / n, rel=0.01)
    assert optimizer_state == pytest.approx(12 * psi / n, rel=0.01)  # fp32 master, m and v
    # Built on meta: after initialization a rank holds its bf16 shard and its fp32 master (6Ψ/N).
    assert bf16["after_init"] == pytest.approx(6 * psi / n, rel=0.01)
    assert bf16["comm_stats"]["all_gather"]["bytes"] == 2 * bf16["comm_stats"]["all_gather"]["numel"]
