"""The collective codec seam (``zero.comm.codec``) in real gloo worlds of 1 (forced collectives), 2 and 3 ranks; see
``codec_world`` for what each rank runs, and ``tests.codecs`` for the test double and its bound.

* The identity codec, the default, gives what ``communicator.py``'s raw calls gave before the seam, bit for bit, and the
  same counters (``numel`` the ZeRO paper's payload, ``bytes`` that payload's bytes).
* The double (every element as bfloat16 on the wire; the reduce-scatter an all-to-all summed in fp32 on the
  receiver) is within its stated bound of the exact results, keeps this rank's own chunk of an all-gather exact,
  saw every all-gather and reduce-scatter, and the counters show its bytes on the wire (half the payload's).
* End to end, a small GPT trained with SGD at stages 2 and 3 (2 ranks, and 3 for uneven shards) with the double
  swapped in after construction: per step the double counted exactly the all-gathers and reduce-scatters
  ``opt.comm_stats`` reports, the same payload as the identity run's, half its bytes. The losses and the final
  parameters (relative L2 distance) are within the double's bound, one bfloat16 rounding (``TRAIN_RTOL`` =
  2**-8 = 3.9e-3), of the identity run's: stage 2 reads the parameters as the last all-gather left them (other
  ranks' chunks rounded once), and what ``STEPS`` steps of rounded weights and gradients add stays far below it
  (observed, 2 and 3 ranks: losses within 2.0e-5, parameters 6.9e-5 at stage 3, 3.9e-4 to 5.9e-4 at stage 2);
  and the lossy wire really changed them.
* ZeRO++'s codecs (``QuantizedWeights``, ``QuantizedGradients``, block-wise int8): every element within the bound
  ``zero.comm.quantization`` states, this rank's own chunk exact, the int8 packets counted as the bytes on the wire; and
  trained through ``ZeroConfig.communication`` (qgZ at stage 2, qwZ and qgZ at stage 3): the same payload per
  step at about a quarter of the bytes, losses and parameters within 2% of the identity run's, and different.
  Also with int4 gradients (``gradient_bits=4``): within the int4 bound (and beyond the int8 one somewhere, so it is
  int4 on the wire), about an eighth of the bytes, losses and parameters within 1%.
* The estimator (``zero.estimate(..., communication=...).traffic``) prices every step of those runs, and of a GPT
  under both mixed precisions (``traffic_world.MIXED_CASES``), exactly: calls, elements and bytes on the wire of
  every collective kind equal ``opt.comm_stats``'.
* Codecs of the test's own, named by the policy (``codec_world.CODECS``: ``tests.codecs.Fp8Gather`` as
  ``gather_codec``, ``Bf16WireCodec`` as ``reduce_codec``), with no change to the runtime or the estimator: the fp8
  all-gather within its stated bound, this rank's chunk exact; a GPT trained at stage 3 through both stays within
  ``FP8_TRAIN_RTOL`` of the identity run; the estimate's traffic equals ``opt.comm_stats`` every step; and what each
  codec held in flight and while decoding, recorded as it ran, is what the estimator's codec memory prices for
  those buckets (``zero.estimator.codec_memory``).
"""

from __future__ import annotations

import pytest
import torch

from tests.codecs import FP32_REL, fp8_bound, fp8_packet, gather_bound, reduce_bound
from tests.distributed.codec_world import (
    BLOCK,
    BUCKET_MB,
    CFG,
    CODECS,
    INT4,
    KINDS,
    QUANTIZED,
    STAGES,
    N,
    codec_checks,
    inputs_of,
)
from tests.distributed.harness import run_world
from tests.distributed.traffic_world import MIXED_CASES, estimated_stats, gpt_workload, measured
from zero.comm import quantization
from zero.comm.policy import Communication
from zero.estimator.codec_memory import CodecMemory
from zero.estimator.traffic import Wire

TRAIN_RTOL = 2.0**-8  # the double's bound: one bfloat16 rounding
QUANTIZED_TRAIN_RTOL = 0.02  # int8 weights and gradients over STEPS steps of SGD
INT4_TRAIN_RTOL = 0.01  # ... with int4 gradients (measured: params 2.1-2.7e-3 apart, int8 1.2-8.1e-4)
FP8_TRAIN_RTOL = 0.01  # fp8 gathers, bfloat16 reductions (measured: params 7.3e-4 and 8.9e-4 apart, losses 3.2e-4)


@pytest.fixture(scope="module", params=(1, 2, 3), ids=lambda n: f"world{n}")
def codec_world(request):
    world_size = request.param
    return world_size, run_world(codec_checks, world_size, timeout_s=300)


def _exact(world_size: int) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """Every rank's inputs, the exact all-gather of ``gather`` and the exact (float64) sum of ``reduce``."""
    inputs = [inputs_of(r, world_size) for r in range(world_size)]
    gathered = torch.cat([i["gather"] for i in inputs])
    summed = torch.stack([i["reduce"].double() for i in inputs]).sum(0)
    return inputs, gathered, summed


def test_identity_codec_is_the_default_and_bit_identical_to_the_raw_collectives(codec_world):
    world_size, results = codec_world
    inputs, gathered, _ = _exact(world_size)
    for rank, result in enumerate(results):
        comm = result["comm"]
        assert comm["default_codec"] == "IdentityCodec"
        got, raw = comm["identity"], comm["raw"]
        for name in ("gather", "gather_in_place"):
            assert torch.equal(got[name], raw["gather"]) and torch.equal(got[name], gathered), name
        assert got["gather_bf16"].dtype == torch.bfloat16 and torch.equal(got["gather_bf16"], raw["gather_bf16"])
        for name in ("reduce", "reduce_in_place"):
            assert torch.equal(got[name], raw["reduce"]), name  # bit for bit: the same all-reduce


def test_identity_codec_counts_what_the_communicator_always_counted(codec_world):
    world_size, results = codec_world
    whole = world_size * N
    expected = {
        "all_gather": {"calls": 3, "numel": 3 * whole, "bytes": 2 * whole * 4 + whole * 2},
        "reduce_scatter": {"calls": 2, "numel": 2 * whole, "bytes": 2 * whole * 4},
    }
    for result in results:
        assert result["comm"]["identity_stats"] == expected


def test_double_is_within_its_bound_and_keeps_this_ranks_chunk_exact(codec_world):
    world_size, results = codec_world
    inputs, gathered, summed = _exact(world_size)
    for rank, result in enumerate(results):
        got = result["comm"]["double"]
        own = slice(rank * N, (rank + 1) * N)
        for name in ("gather", "gather_in_place"):
            assert got[name].dtype == torch.float32
            assert torch.equal(got[name][own], inputs[rank]["gather"]), name  # exact, never through the wire
            error = (got[name].double() - gathered.double()).abs()
            assert (error <= gather_bound(gathered)).all(), (name, (error / gather_bound(gathered)).max())
        bf16 = torch.cat([i["gather_bf16"] for i in inputs])
        assert torch.equal(got["gather_bf16"], bf16)  # bfloat16 on a bfloat16 wire: lossless
        chunks = [i["reduce"][own] for i in inputs]
        bound = reduce_bound(chunks)
        for name in ("reduce", "reduce_in_place"):
            assert got[name].dtype == torch.float32
            error = (got[name].double() - summed[own]).abs()
            assert (error <= bound).all(), (name, (error / bound).max())
    if world_size > 1:  # lossy indeed: the fp32 values of other ranks came through bfloat16
        assert not torch.equal(results[0]["comm"]["double"]["gather"], gathered)


def test_double_saw_every_all_gather_and_reduce_scatter_and_the_counters_show_its_wire_bytes(codec_world):
    world_size, results = codec_world
    whole = world_size * N
    for result in results:
        comm = result["comm"]
        assert comm["double_counts"] == {"all_gather": {"calls": 3, "numel": 3 * whole},
                                         "reduce_scatter": {"calls": 2, "numel": 2 * whole}}
        assert comm["double_stats"] == {
            "all_gather": {"calls": 3, "numel": 3 * whole, "bytes": 3 * whole * 2},  # bfloat16 on the wire
            "reduce_scatter": {"calls": 2, "numel": 2 * whole, "bytes": 2 * whole * 2},  # the all-to-all's input
        }


def _training(codec_world):
    world_size, results = codec_world
    if world_size == 1:
        pytest.skip("trained at 2 and 3 ranks")
    return results


@pytest.mark.parametrize("stage", STAGES)
def test_training_through_the_double_counts_what_comm_stats_reports(codec_world, stage):
    for result in _training(codec_world):
        identity, double = result["training"][stage]["identity"], result["training"][stage]["double"]
        assert identity["default"] == double["default"] == "IdentityCodec"
        assert all(counts == {} for counts in identity["counts"])  # the double was not in the identity run
        for step, (stats, counts, plain) in enumerate(zip(double["stats"], double["counts"], identity["stats"])):
            assert set(KINDS) <= set(stats), (step, stats)
            assert counts == {k: {"calls": stats[k]["calls"], "numel": stats[k]["numel"]} for k in KINDS}, step
            for kind in KINDS:
                assert stats[kind]["calls"] == plain[kind]["calls"] and stats[kind]["numel"] == plain[kind]["numel"]
                assert plain[kind]["bytes"] == 4 * plain[kind]["numel"]  # fp32 payload
                assert stats[kind]["bytes"] == 2 * stats[kind]["numel"], (step, kind)  # bfloat16 on the wire
            others = {k: v for k, v in stats.items() if k not in KINDS}
            assert others == {k: v for k, v in plain.items() if k not in KINDS}  # all-reduces untouched


@pytest.mark.parametrize("stage", STAGES)
def test_training_through_the_double_is_within_its_bound_of_the_identity_run(codec_world, stage):
    for result in _training(codec_world):
        identity, double = result["training"][stage]["identity"], result["training"][stage]["double"]
        for step, (a, b) in enumerate(zip(identity["losses"], double["losses"])):
            assert abs(a - b) <= TRAIN_RTOL * abs(a), (step, a, b)
        distance = (double["params"] - identity["params"]).norm() / identity["params"].norm()
        assert 0 < distance <= TRAIN_RTOL, distance
        assert identity["losses"] != double["losses"]


# ----- the real codecs: ZeRO++'s qwZ and qgZ (zero.comm.codec.QuantizedWeights, QuantizedGradients) ------------------


def test_quantized_gathers_are_within_their_stated_bound_and_keep_this_ranks_chunk_exact(codec_world):
    world_size, results = codec_world
    inputs, gathered, _ = _exact(world_size)
    for rank, result in enumerate(results):
        got = result["comm"]["quantized"]
        own = slice(rank * N, (rank + 1) * N)
        for name in ("gather", "gather_in_place"):
            assert got[name].dtype == torch.float32 and torch.equal(got[name][own], inputs[rank]["gather"]), name
            for r in range(world_size):
                theirs = slice(r * N, (r + 1) * N)
                error = (got[name][theirs].double() - gathered[theirs].double()).abs()
                assert (error <= quantization.error_bound(inputs[r]["gather"], BLOCK)).all(), (name, r)
        assert got["gather_bf16"].dtype == torch.bfloat16  # decoded into the output's dtype
    if world_size > 1:
        assert not torch.equal(results[0]["comm"]["quantized"]["gather"], gathered)


@pytest.mark.parametrize("codec,bits", [("quantized", 8), ("int4", 4)])
def test_the_quantized_reduce_scatter_is_within_its_bound_with_this_ranks_chunk_exact(codec_world, codec, bits):
    world_size, results = codec_world
    inputs, _, summed = _exact(world_size)
    for rank, result in enumerate(results):
        got = result["comm"][codec]
        own = slice(rank * N, (rank + 1) * N)
        bound = sum(quantization.error_bound(inputs[r]["reduce"][own], BLOCK, bits) for r in range(world_size)
                    if r != rank)
        bound = bound + world_size * FP32_REL * torch.stack([i["reduce"][own].double().abs() for i in inputs]).sum(0)
        for name in ("reduce", "reduce_in_place"):
            error = (got[name].double() - summed[own]).abs()
            assert (error <= bound).all(), (name, float((error - bound).max()))
            if world_size > 1 and bits == 4:  # int4 errs more than int8 would allow: it is int4 on the wire
                assert (error > sum(quantization.error_bound(inputs[r]["reduce"][own], BLOCK, 8)
                                    for r in range(world_size) if r != rank) * 1.5).any()


@pytest.mark.parametrize("codec,bits", [("quantized", 8), ("int4", 4)])
def test_the_quantized_all_reduce_leaves_every_rank_the_same_values_within_its_bound(codec_world, codec, bits):
    """HSDP's reduction across groups under qgZ: qgZ's reduce-scatter, then each chunk's sum shared as int8 (or
    int4) and decoded by every rank, its owner too."""
    world_size, results = codec_world
    inputs, _, summed = _exact(world_size)
    first = results[0]["comm"][codec]["all_reduce"]
    assert all(torch.equal(r["comm"][codec]["all_reduce"], first) for r in results)
    for owner in range(world_size):
        own = slice(owner * N, (owner + 1) * N)  # (chunks of the all-reduce: ceil(world_size * N / world_size) = N)
        reduced = sum(quantization.error_bound(inputs[r]["reduce"][own], BLOCK, bits) for r in range(world_size)
                      if r != owner)
        magnitude = torch.stack([i["reduce"][own].double().abs() for i in inputs]).sum(0)
        reduced = reduced + world_size * FP32_REL * magnitude
        bound = reduced + quantization.error_bound(summed[own].abs() + reduced, BLOCK, bits)
        error = (first[own].double() - summed[own]).abs()
        assert (error <= bound).all(), (owner, float((error - bound).max()))


def test_quantized_codecs_count_their_int8_packets_as_the_bytes_on_the_wire(codec_world):
    world_size, results = codec_world
    whole, packet = world_size * N, quantization.packet_bytes(N, BLOCK)  # 8 int8 values + 2 fp32 scales
    for result in results:
        assert result["comm"]["quantized_stats"] == {
            "all_gather": {"calls": 3, "numel": 3 * whole, "bytes": 3 * world_size * packet},
            "reduce_scatter": {"calls": 2, "numel": 2 * whole, "bytes": 2 * world_size * packet},
            "all_reduce": {"calls": 1, "numel": whole, "bytes": 2 * world_size * packet},  # all-to-all, all-gather
        }
        packet4 = quantization.packet_bytes(N, BLOCK, 4)  # 4 bytes of int4 values + 2 fp32 scales
        assert packet4 == 12 and result["comm"]["int4_stats"] == {
            "all_gather": {"calls": 3, "numel": 3 * whole, "bytes": 3 * whole * 4 - whole * 2},  # (identity; bf16)
            "reduce_scatter": {"calls": 2, "numel": 2 * whole, "bytes": 2 * world_size * packet4},
            "all_reduce": {"calls": 1, "numel": whole, "bytes": 2 * world_size * packet4},
        }


@pytest.mark.parametrize("stage", STAGES)
def test_training_with_the_quantized_codecs_stays_close_and_sends_about_a_quarter(codec_world, stage):
    for result in _training(codec_world):
        identity, quantized = result["training"][stage]["identity"], result["training"][stage]["quantized"]
        assert quantized["default"] == "PerCollective"
        for a, b in zip(identity["losses"], quantized["losses"], strict=True):
            assert abs(a - b) <= QUANTIZED_TRAIN_RTOL * abs(a), (a, b)
        distance = (quantized["params"] - identity["params"]).norm() / identity["params"].norm()
        assert 0 < distance <= QUANTIZED_TRAIN_RTOL, distance
        quantized_kinds = {"reduce_scatter"} | ({"all_gather"} if stage == 3 else set())
        for stats, plain in zip(quantized["stats"], identity["stats"], strict=True):
            for kind, entry in stats.items():
                assert entry["numel"] == plain[kind]["numel"], kind  # the same payload, fewer bytes
                ratio = entry["bytes"] / (4 * entry["numel"])
                assert 0.25 < ratio < 0.4 if kind in quantized_kinds else ratio == 1, (kind, ratio)


@pytest.mark.parametrize("stage", STAGES)
def test_training_with_int4_gradients_stays_close_and_sends_about_an_eighth(codec_world, stage):
    for result in _training(codec_world):
        identity, int4 = result["training"][stage]["identity"], result["training"][stage]["int4"]
        for a, b in zip(identity["losses"], int4["losses"], strict=True):
            assert abs(a - b) <= INT4_TRAIN_RTOL * abs(a), (a, b)
        distance = (int4["params"] - identity["params"]).norm() / identity["params"].norm()
        assert 0 < distance <= INT4_TRAIN_RTOL, distance
        for stats in int4["stats"]:
            ratio = stats["reduce_scatter"]["bytes"] / (4 * stats["reduce_scatter"]["numel"])
            assert 0.125 < ratio < 0.15, ratio  # half a byte per value and a 4-byte scale per 64


@pytest.mark.parametrize("stage", STAGES)
def test_the_estimator_prices_each_steps_traffic_exactly(codec_world, stage):
    world_size, results = codec_world[0], _training(codec_world)
    for run, communication in (("identity", {}), ("quantized", QUANTIZED[stage]), ("int4", INT4[stage])):
        expected = estimated_stats(gpt_workload(CFG), stage=stage, world_size=world_size, bucket_size_mb=BUCKET_MB,
                                   communication=communication)
        for result in results:
            for step, stats in enumerate(result["training"][stage][run]["stats"]):
                assert measured(stats) == expected, (run, step)


def test_the_estimator_prices_the_wire_dtype_under_mixed_precision(codec_world):
    world_size, results = codec_world[0], _training(codec_world)
    for case, (stage, precision, communication) in enumerate(MIXED_CASES):
        expected = estimated_stats(gpt_workload(CFG), stage=stage, world_size=world_size, precision=precision,
                                   bucket_size_mb=BUCKET_MB, communication=communication)
        for result in results:
            assert result["mixed"][case] == expected, MIXED_CASES[case]


# ----- codecs of the test's own, named by the policy (tests.codecs; codec_world.CODECS) ----------------------------


def test_the_fp8_test_codec_is_within_its_bound_and_counts_its_packets(codec_world):
    world_size, results = codec_world
    inputs, gathered, _ = _exact(world_size)
    for rank, result in enumerate(results):
        got = result["comm"]["fp8"]
        for name in ("gather", "gather_in_place"):
            for r in range(world_size):
                theirs = slice(r * N, (r + 1) * N)
                if r == rank:
                    assert torch.equal(got[name][theirs], inputs[rank]["gather"]), name  # never through the wire
                error = (got[name][theirs].double() - gathered[theirs].double()).abs()
                assert (error <= fp8_bound(inputs[r]["gather"])).all(), (name, r)
        whole = world_size * N
        assert result["comm"]["fp8_stats"] == {
            "all_gather": {"calls": 2, "numel": 2 * whole, "bytes": 2 * world_size * fp8_packet(N)}}
    if world_size > 1:  # lossy indeed
        assert not torch.equal(results[0]["comm"]["fp8"]["gather"], gathered)


def test_codecs_named_by_the_policy_train_and_the_estimate_prices_their_traffic(codec_world):
    world_size, results = codec_world[0], _training(codec_world)
    expected = estimated_stats(gpt_workload(CFG), stage=3, world_size=world_size, bucket_size_mb=BUCKET_MB,
                               communication=CODECS)
    for result in results:
        identity, run = result["training"][3]["identity"], result["training"][3]["codecs"]
        assert run["default"] == "PerCollective"
        for step, stats in enumerate(run["stats"]):
            assert measured(stats) == expected, step
            assert stats["all_gather"]["bytes"] < 0.3 * 4 * stats["all_gather"]["numel"]  # fp8 and a scale a chunk
            assert stats["reduce_scatter"]["bytes"] == 2 * stats["reduce_scatter"]["numel"]  # bfloat16
        for a, b in zip(identity["losses"], run["losses"], strict=True):
            assert abs(a - b) <= FP8_TRAIN_RTOL * abs(a), (a, b)
        distance = (run["params"] - identity["params"]).norm() / identity["params"].norm()
        assert 0 < distance <= FP8_TRAIN_RTOL, distance


def test_the_estimator_prices_what_codecs_named_by_the_policy_held(codec_world):
    world_size, results = codec_world[0], _training(codec_world)
    memory = CodecMemory.of(Communication(**CODECS), world_size, world_size)  # (flat: sharded over every rank)
    for result in results:
        held = result["training"][3]["codecs"]["held"]
        assert held["gather"] and held["reduce"]
        for n, group, dtype, in_flight, decoding in held["gather"]:
            wire = Wire(group * n, n, getattr(torch, dtype.removeprefix("torch.")), torch.float32, True, None)
            assert (memory.gathering(wire), memory.gather_decode(wire)) == (in_flight, decoding), (n, group, dtype)
        for n, group, dtype, in_flight, decoding in held["reduce"]:
            wire = Wire(group * n, n, torch.float32, getattr(torch, dtype.removeprefix("torch.")), True, None)
            assert (memory.reducing(wire), memory.reduce_decode(wire)) == (in_flight, decoding), (n, group, dtype)
