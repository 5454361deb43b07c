"""The estimator prices ``ZeroConfig.communication``: one step's traffic by kind, level and wire dtype (ZeRO++'s
quantized weights and gradients at their packets' exact bytes, about 0.27x fp32's at blocks of 256), hierarchical
sharding's memory that of a ``shard_size``-rank world with its shards all-reduced across the groups, ZeRO++'s hpZ
as flat stage 3 plus its secondary copies (``P / shard_size`` per bucket) with backward's gathers inside the group,
the policy checked as ``ZeroConfig`` checks it, and ``zero estimate``'s flags and traffic table. (Against
``opt.comm_stats`` of real runs: ``tests/distributed/test_codec_world.py`` and ``test_hierarchy_world.py``.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from zero import Communication, ZeroOptimizer
from zero.cli.main import main as cli_main
from zero.comm.quantization import packet_bytes
from zero.estimator import Workload, estimate, plan
from zero.estimator.traffic import Collective, Traffic, step_traffic
from zero.models import GPT, GPTConfig, synthetic_batch

SMALL = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
TINY = ["--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "2"]  # SMALL
WIDTH = 512


class Wide(nn.Module):
    """Four square layers of ``WIDTH``: large chunks, so the packets' block padding is negligible."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _wide() -> Workload:
    return Workload(Wide, lambda m, x: m(x).square().mean(), lambda micro: (torch.zeros(micro, WIDTH),))


def _gpt() -> Workload:
    return Workload(lambda: GPT(SMALL), lambda m, x, y: m.loss(x, y), lambda micro: synthetic_batch(0, micro, SMALL))


def _kind(e, kind: str, level: str = "intra") -> list[Collective]:
    return [c for c in e.traffic.collectives if c.kind == kind and c.level == level]


# ----- bytes on the wire -----------------------------------------------------------------------------------------


def test_quantized_weights_send_int8_packets_about_a_quarter_of_fp32s_bytes():
    work, world = _wide(), 4
    plain = estimate(work, stage=3, world_size=world, micro_batch=2)
    quantized = estimate(work, stage=3, world_size=world, micro_batch=2, communication={"quantized_weights": True})
    (fp32,), (int8,) = _kind(plain, "all_gather"), _kind(quantized, "all_gather")
    assert (fp32.dtype, int8.dtype) == ("fp32", "int8")
    assert int8.calls == fp32.calls and int8.numel == fp32.numel and fp32.bytes == 4 * fp32.numel
    assert 0.25 < int8.bytes / fp32.bytes < 0.27  # 1 + 4/256 bytes per element instead of 4: 0.254, and padding
    # exactly: each gather of a bucket moves one packet per rank of its chunk (zero.comm.quantization.packet_bytes)
    layout = work.layout(3, world)
    gathers = {unit: 2 for unit in layout.units} | {"": 1, layout.units[-1]: 1}  # root and last unit: once
    assert int8.bytes == sum(gathers[b.unit or ""] * world * packet_bytes(b.wire.chunk, 256) for b in layout.buckets)
    assert _kind(quantized, "reduce_scatter") == _kind(plain, "reduce_scatter")  # gradients stay exact


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_quantized_gradients_are_one_all_to_all_of_packets_per_bucket(stage):
    work, world = _wide(), 4
    plain = estimate(work, stage=stage, world_size=world, micro_batch=2)
    quantized = estimate(work, stage=stage, world_size=world, micro_batch=2,
                         communication={"quantized_gradients": True, "block_size": 128})
    (fp32,), (int8,) = _kind(plain, "reduce_scatter"), _kind(quantized, "reduce_scatter")
    assert int8.numel == fp32.numel and int8.calls == fp32.calls and int8.dtype == "int8"
    assert 0.25 < int8.bytes / fp32.bytes < 0.27  # (1 + 4/128) / 4 = 0.258
    chunks = [b.wire.chunk for b in work.layout(stage, world).buckets if b.wire.trainable]
    assert int8.bytes == sum(world * packet_bytes(c, 128) for c in chunks)
    assert _kind(quantized, "all_gather") == _kind(plain, "all_gather")


def test_the_wire_dtype_follows_the_precision():
    e = estimate(_gpt(), stage=2, world_size=2, micro_batch=1, precision="mixed-fp32-reduce")
    (gather,), (reduce,) = _kind(e, "all_gather"), _kind(e, "reduce_scatter")
    assert (gather.dtype, gather.bytes) == ("bf16", 2 * gather.numel)  # the parameters, after the step
    assert (reduce.dtype, reduce.bytes) == ("fp32", 4 * reduce.numel)  # gradients reduced in fp32
    flags = [c for c in e.traffic.collectives if c.dtype == "int32"]
    assert [(c.kind, c.calls, c.bytes) for c in flags] == [("all_reduce", 1, 4 * c.numel) for c in flags]


def test_a_flat_world_is_one_level_and_a_world_of_one_sends_nothing():
    e = estimate(_gpt(), stage=2, world_size=4, micro_batch=1)
    assert {c.level for c in e.traffic.collectives} == {"intra"} and e.traffic.level_bytes("inter") == 0
    assert e.traffic.bytes == e.traffic.level_bytes("intra") > 0
    assert estimate(_gpt(), stage=3, world_size=1, micro_batch=1).traffic.collectives == ()


def test_step_traffic_counts_a_group_of_one_only_across_groups():
    """``shard_size=1``: nothing is sent inside a group; each shard (the whole bucket) is all-reduced across."""
    e = estimate(_gpt(), stage=2, world_size=2, micro_batch=1, communication={"shard_size": 1})
    assert {c.level for c in e.traffic.collectives} == {"inter"}
    padded = sum(b.wire.padded for b in _gpt().layout(2, 1).buckets if b.wire.trainable)
    assert sum(c.numel for c in _kind(e, "all_reduce", "inter") if c.dtype == "fp32") == padded
    assert step_traffic(3, (), 0, {}, Communication(), 1, 1).collectives == ()


# ----- hierarchical sharding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hierarchical_memory_is_a_shard_size_worlds_and_its_shards_cross_the_groups(stage):
    work = _gpt()
    hierarchical = estimate(work, stage=stage, world_size=8, micro_batch=2, communication={"shard_size": 2})
    flat = estimate(work, stage=stage, world_size=2, micro_batch=2)
    assert hierarchical.categories == flat.categories and hierarchical.peak == flat.peak
    assert (hierarchical.phase, hierarchical.event, hierarchical.host) == (flat.phase, flat.event, flat.host)
    assert hierarchical.group_size == 2 and hierarchical.world_size == 8 and flat.group_size == 2
    assert estimate(work, stage=stage, world_size=8, micro_batch=2).peak < flat.peak  # 1/8 of the states, not 1/2
    # inside a group: the 2-rank world's collectives; across the 4 groups: each reduce-scatter's shard, and the flags
    inside = {c for c in hierarchical.traffic.collectives if c.level == "intra"}
    assert inside == set(flat.traffic.collectives)
    (shards,), (flags,) = ([c for c in _kind(hierarchical, "all_reduce", "inter") if c.dtype == dtype]
                           for dtype in ("fp32", "int32"))
    (reduce,) = _kind(flat, "reduce_scatter")
    assert (shards.calls, shards.numel, shards.bytes) == (reduce.calls, reduce.numel // 2, reduce.bytes // 2)
    assert flags.numel == [c for c in _kind(flat, "all_reduce") if c.dtype == "int32"][0].numel
    stats = hierarchical.traffic.comm_stats()  # named as opt.comm_stats names them
    assert stats["inter_all_reduce"]["calls"] == stats["reduce_scatter"]["calls"] + 1
    assert "inter_all_gather" not in stats  # parameters never cross the groups


def test_a_shard_size_of_the_whole_world_is_flat():
    work = _gpt()
    assert estimate(work, stage=3, world_size=4, micro_batch=1, communication={"shard_size": 4}).traffic == \
        estimate(work, stage=3, world_size=4, micro_batch=1).traffic


# ----- hierarchical partitioning (ZeRO++ hpZ) ----------------------------------------------------------------------

HPZ = {"shard_size": 2, "hierarchy": "hpz"}


@pytest.mark.parametrize("precision,itemsize", [("fp32", 4), ("mixed", 2)])
def test_hpz_memory_is_flat_stage_3_plus_a_secondary_copy_of_each_bucket(precision, itemsize):
    """Shards over every rank (as flat), and each bucket's secondary copy: ``P / shard_size`` elements of the
    parameters' dtype, always on the device, under ``parameters`` (as the profiler files it)."""
    work, world = _gpt(), 8
    planned = work.layout(3, world, precision, secondary_shards=2)
    for bucket in planned.buckets:
        assert bucket.secondary == bucket.wire.padded // 2 * itemsize
        assert bucket.wire.chunk * world == bucket.wire.padded  # (the primary shards: over every rank)
    assert all(b.secondary == 0 for b in work.layout(3, world, precision).buckets)
    copies = sum(b.secondary for b in planned.buckets)
    for offload in ("none", "cpu"):
        hpz = estimate(work, stage=3, world_size=world, micro_batch=2, precision=precision, offload=offload,
                       communication=HPZ)
        flat = estimate(work, stage=3, world_size=world, micro_batch=2, precision=precision, offload=offload)
        assert hpz.categories == {**flat.categories, "parameters": flat.parameters + copies}
        assert (hpz.phase, hpz.event, hpz.host) == (flat.phase, flat.event, flat.host)
        assert (hpz.group_size, hpz.secondary_size, flat.secondary_size) == (world, 2, 0)


def test_hpz_gathers_forward_over_every_rank_and_backward_inside_the_group():
    work, world = _gpt(), 4
    hpz = estimate(work, stage=3, world_size=world, micro_batch=2, communication=HPZ)
    flat = estimate(work, stage=3, world_size=world, micro_batch=2)
    assert {c.level for c in hpz.traffic.collectives} == {"intra", "hpz"} and hpz.traffic.level_bytes("inter") == 0
    (primary,), (every,) = _kind(hpz, "all_gather"), _kind(flat, "all_gather")
    (copies,) = _kind(hpz, "all_gather", "hpz")
    assert copies.dtype == "fp32" and copies.bytes == 4 * copies.numel
    assert (primary.calls + copies.calls, primary.numel + copies.numel) == (every.calls, every.numel)
    # forward gathers each unit once; backward regathers blocks.0 only (the root and blocks.1, forward's last unit,
    # are still gathered when backward starts)
    planned = work.layout(3, world)
    assert primary.numel == sum(b.wire.padded for b in planned.buckets)
    assert copies.numel == sum(b.wire.padded for b in planned.buckets if b.unit == "blocks.0")
    # gradients and the agreement's flags: over every rank, once, as flat
    assert [c for c in hpz.traffic.collectives if c.kind != "all_gather"] == \
        [c for c in flat.traffic.collectives if c.kind != "all_gather"]
    assert set(hpz.traffic.comm_stats()) == {"all_gather", "reduce_scatter", "all_reduce", "intra_all_gather"}
    assert hpz.traffic.as_dict()["hpz_bytes"] == copies.bytes
    checkpointed = estimate(work, stage=3, world_size=world, micro_batch=2, communication=HPZ, checkpointing=True)
    assert _kind(checkpointed, "all_gather", "hpz") == [copies]  # recomputation's gather is backward's


def test_hpz_backward_gathers_are_exact_under_quantized_weights():
    work, world = _gpt(), 4
    quantized = estimate(work, stage=3, world_size=world, micro_batch=2, precision="mixed",
                         communication={**HPZ, "quantized_weights": True})
    plain = estimate(work, stage=3, world_size=world, micro_batch=2, precision="mixed", communication=HPZ)
    (forward,), (backward,) = _kind(quantized, "all_gather"), _kind(quantized, "all_gather", "hpz")
    assert forward.dtype == "int8" and backward == _kind(plain, "all_gather", "hpz")[0]
    assert (backward.dtype, backward.bytes) == ("bf16", 2 * backward.numel)


def test_hpz_over_the_whole_world_is_flat():
    """A group of every rank keeps no copies (``zero.comm.hierarchy`` runs it flat)."""
    work = _gpt()
    hpz = estimate(work, stage=3, world_size=4, micro_batch=1, communication={"shard_size": 4, "hierarchy": "hpz"})
    flat = estimate(work, stage=3, world_size=4, micro_batch=1)
    assert (hpz.traffic, hpz.categories, hpz.secondary_size) == (flat.traffic, flat.categories, 0)


def test_comm_stats_names_each_level_as_opt_comm_stats_does():
    traffic = Traffic(tuple(Collective("all_gather", level, "fp32", 1, 2, 8) for level in ("intra", "inter", "hpz")))
    assert set(traffic.comm_stats()) == {"all_gather", "inter_all_gather", "intra_all_gather"}


def test_the_planner_prices_hpz_at_stage_3_only():
    fits = plan(_gpt(), gpu_memory=2**30, world_size=4, micro_batches=[1], communication=HPZ).fits
    assert {e.stage for e in fits} == {3} and {e.secondary_size for e in fits} == {2}


# ----- the policy, checked --------------------------------------------------------------------------------------


def test_a_shard_size_that_does_not_divide_the_world_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the world of 8 ranks"):
        estimate(_gpt(), stage=2, world_size=8, micro_batch=1, communication={"shard_size": 3})
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the world of 8 ranks"):
        plan(_gpt(), gpu_memory=2**30, world_size=8, micro_batches=[1], communication=Communication(shard_size=3))


@pytest.mark.parametrize("stage,communication,message", [
    (2, {"quantized_weights": True}, r"quantized_weights needs stage 3 \(got stage 2\)"),
    (0, {"quantized_gradients": True}, r"quantized_gradients needs stage 1, 2 or 3 \(got stage 0\)"),
    (0, {"shard_size": 2}, r"shard_size needs stage 1, 2 or 3 \(got stage 0\)"),
    (1, {"shard_size": 0}, r"shard_size must be at least 1"),
    (1, {"block_size": 8}, r"block_size"),
    (1, {"quantize": True}, r"quantize"),
    (2, {"shard_size": 2, "hierarchy": "hpz"}, r"hierarchy='hpz' needs stage 3 \(got stage 2\)"),
    (3, {"hierarchy": "hpz"}, r"hierarchy='hpz' needs shard_size"),
])
def test_a_policy_zero_config_refuses_is_refused_with_its_message(stage, communication, message):
    with pytest.raises(ValueError, match=message):
        estimate(_gpt(), stage=stage, world_size=4, micro_batch=1, communication=communication)


def test_the_planner_tries_only_the_stages_the_policy_runs_at():
    work = _gpt()
    weights = plan(work, gpu_memory=2**30, world_size=2, micro_batches=[1], communication={"quantized_weights": True})
    assert {e.stage for e in weights.fits} == {3}
    assert {e.communication_config["quantized_weights"] for e in weights.fits} == {True}
    sharded = plan(work, gpu_memory=2**30, world_size=4, micro_batches=[1], communication={"shard_size": 2})
    assert {e.stage for e in sharded.fits} == {1, 2, 3} and {e.group_size for e in sharded.fits} == {2}


def test_an_estimated_configuration_runs(tmp_path):
    """``zero_config_kwargs`` carries the policy: a world of one runs it (its own group: nothing is sent)."""
    from zero.cli.estimate import zero_config_kwargs

    e = estimate(_gpt(), stage=3, world_size=1, micro_batch=1,
                 communication={"quantized_weights": True, "quantized_gradients": True, "block_size": 64})
    kwargs = zero_config_kwargs(e)
    assert kwargs["communication"] == {"quantized_weights": True, "quantized_gradients": True, "block_size": 64}
    model = GPT(SMALL)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, **kwargs)
    model.loss(*synthetic_batch(0, 1, SMALL)).backward()
    opt.step()
    assert opt.comm_stats == {} and e.traffic.comm_stats() == {}


# ----- zero estimate ---------------------------------------------------------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli_main(["estimate", "--gpu-memory", "1GiB", "--micro-batch", "1", "--show", "2", *TINY, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_the_traffic_table_under_the_memory_figures(capsys, tmp_path):
    path = tmp_path / "estimates.json"
    code, out, _ = _cli(capsys, "--world-size", "8", "--shard-size", "2", "--quantized-weights",
                        "--quantized-gradients", "--block-size", "64", "--json", str(path))
    assert code == 0
    assert "8 ranks (4 shard groups of 2), int8 weights and gradients (blocks of 64)" in out
    assert "communication={'quantized_weights': True, 'quantized_gradients': True, 'block_size': 64, " \
           "'shard_size': 2}" in out
    table = out[out.index("traffic per step of the first (stage 3, micro-batch 1"):]
    assert out.index("fits, best first") < out.index("traffic per step")
    lines = table.splitlines()
    assert lines[1].split() == ["collective", "level", "dtype", "calls", "elements", "bytes"]
    end = next(i for i, line in enumerate(lines) if line.split()[:1] == ["total"])
    rows = [line.split()[:3] for line in lines[2:end]]
    assert rows == [["all_gather", "intra", "int8"], ["reduce_scatter", "intra", "int8"],
                    ["all_reduce", "intra", "int32"], ["all_reduce", "inter", "int32"],
                    ["all_reduce", "inter", "int8"]]  # (the shards across groups quantized too)
    assert "inside the shard groups" in table and "across them" in table
    first = json.loads(path.read_text())["fits"][0]
    assert first["zero_config"]["communication"]["shard_size"] == 2 and first["group_size"] == 2
    assert first["traffic"]["bytes"] == first["traffic"]["intra_bytes"] + first["traffic"]["inter_bytes"]
    assert {c["dtype"] for c in first["traffic"]["collectives"]} == {"int8", "int32"}


def test_cli_prices_int4_gradients(capsys):
    code, out, _ = _cli(capsys, "--world-size", "4", "--quantized-gradients", "--gradient-bits", "4")
    assert code == 0 and "4 ranks, int4 gradients (blocks of 256)" in out
    assert "'quantized_gradients': True, 'gradient_bits': 4" in out
    table = out[out.index("traffic per step of the first"):]
    assert ["reduce_scatter", "intra", "int4"] in [line.split()[:3] for line in table.splitlines()[2:]]


def test_cli_without_the_flags_prints_one_flat_level(capsys):
    code, out, _ = _cli(capsys, "--world-size", "2")
    table = out[out.index("traffic per step of the first (stage 0"):]
    assert code == 0 and " inter " not in table and "across them" not in table
    assert [line.split()[:3] for line in table.splitlines()[2:4]] == [["all_reduce", "intra", "fp32"],
                                                                      ["all_reduce", "intra", "int32"]]


def test_cli_prices_hpz_with_its_own_level(capsys):
    code, out, _ = _cli(capsys, "--world-size", "4", "--shard-size", "2", "--hierarchy", "hpz")
    assert code == 0 and "4 ranks (hpZ: secondary copies over 2 groups of 2)" in out
    assert "communication={'shard_size': 2, 'hierarchy': 'hpz'}" in out
    table = out[out.index("traffic per step of the first (stage 3"):]
    rows = [line.split()[:3] for line in table.splitlines()[2:6]]
    assert rows == [["all_gather", "intra", "fp32"], ["reduce_scatter", "intra", "fp32"],
                    ["all_reduce", "intra", "int32"], ["all_gather", "hpz", "fp32"]]
    assert "over every rank, hpz" in table and "inside hpZ's groups of 2" in table


def test_cli_refuses_hpz_without_a_shard_size_in_one_line(capsys):
    code, _, err = _cli(capsys, "--world-size", "4", "--hierarchy", "hpz")
    assert code == 2 and err.startswith("zero estimate: communication.hierarchy='hpz' needs shard_size")
    assert err.count("\n") == 1


def test_cli_refuses_a_shard_size_that_does_not_divide_the_world_in_one_line(capsys):
    code, out, err = _cli(capsys, "--world-size", "8", "--shard-size", "3")
    assert code == 2 and err.startswith("zero estimate: communication.shard_size=3 does not divide the world of 8 "
                                        "ranks") and err.count("\n") == 1


def test_hpz_over_groups_of_one_is_the_flat_layout():
    """As DeepSpeed's zero_hpz_partition_size=1 (off), and as zero.comm.hierarchy runs it."""
    hpz = estimate(_gpt(), stage=3, world_size=2, micro_batch=1, communication={"shard_size": 1, "hierarchy": "hpz"})
    flat = estimate(_gpt(), stage=3, world_size=2, micro_batch=1)
    assert hpz.secondary_size == 0 and hpz.peak == flat.peak
    assert hpz.traffic.comm_stats() == flat.traffic.comm_stats()
