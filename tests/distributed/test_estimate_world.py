"""The estimator against ``zero.profile`` on the same configuration, rank 0 of worlds of 1, 2 and 3 in torch's
fake process group (``estimate_world``), with the breakdown by category at the peak for the GPT: the project's
GPT, Hugging Face GPT-2 and Llama with the loss inside ``forward`` (GPT-2 also with its first block frozen, and
with PEFT LoRA adapters on a frozen base), a CNN with batch norm, and models that modify tensors in place
(torchvision's ResNet layout, blocks that modify their input in place first), at stages 0-3 and two micro-batches; the
GPT also with activation checkpointing, under both mixed-precision policies and with a micro-batch accumulated
under ``no_sync()`` first; a wide, short GPT (its parameters make the peak) also with ZeRO++'s quantized weights,
gradients and both (the codecs' packets and slices; at world size 1 no codec runs). (A 1.1B GPT at stage 3 on 64
ranks is ``benchmarks/estimate_scale.py``.)

World sizes 1, 2 and 3 run by default (a minute or two each on 2 cores), and 4 for hierarchy (seconds);
``pytest --quick`` runs none (``full_only``). Worlds of 1 and 3 price the models at one micro-batch, every stage (the
shards' arithmetic); the rest runs at 2 ranks only, since it acts alike at any world size: the second micro-batch (4,
extrapolated from the traces of 2 and 3), the GPT's precision, checkpointing and ``no_sync`` variants, the codecs,
the breakdown after every operator, resnet18, and ZeroConfig's fields away from their defaults (a wide 6-block GPT:
units by class and by size, ``reshard_after_forward=False``, prefetch, one reduction in flight, checkpointing every
second block; within 2%).

Optimizers stepped on whole parameters (issue 42: Muon on the hidden matrices with AdamW on the rest, and
Adafactor), on every rank of a world of 2 (``estimate_world optimizers N RANK``, a process per rank, about a minute
and a half each; 3 ranks measured 0.9999-1.0000 when written): each rank's estimate within 2% of its measured peak
(measured: 0.99996-1.00000), the rank priced by default has the world's largest measured peak within 2%, and its
estimate is that peak within 2%, and the profiler attributes every byte of the wrapped optimizers' state, Muon's
momentum matrices included, to ``optimizer_state``.

Measured means the allocator's peak (PyTorch's CPU allocator, read through the profiler) over what the
process held when the run started. The estimate must be within 5% of it, at every point of the matrix, and within
1% with the quantized codecs (whose packets are 3-5% of the wide GPT's peak: leaving them out fails).
Under mixed precision on CPU, PyTorch's bf16 matmuls allocate inside the kernel (oneDNN's scratchpad), which
fake tensors cannot see: priced from the operator's shapes for the kernels measured
(``zero.estimator.matmul_workspaces``), the GPT's mixed cases read 1.0000 at stages 0-3 on an AVX512_BF16 CPU
(0.954-0.986 unpriced, world of 2). Where the CPU's kernel is not priced (oneDNN's AMX ones) the estimate may fall
up to 7% short (measured when written: 0.3 MB in a 2.2 MB step of the small GPT, at ``aten::mm`` in backward); on
a GPU cuBLAS keeps its workspace outside the tensors. The CPU convolution's
own allocations inside the kernel (oneDNN's blocked copies, GEMM workspaces, slow_conv2d's columns) are priced
(``zero.estimator.workspaces``): the CNNs, the in-place ResNet and torchvision's resnet18 layout are within 2%
(measured when written, world of 2: 0.9997-1.0000; before the pricing 0.958-0.964 for the ResNet, 0.73-0.90 for
resnet18).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.estimate_world import (
    COMMUNICATION,
    CONFIG_FIELDS,
    CONFIG_WORLD,
    HIERARCHICAL,
    HIERARCHICAL_WORLD,
    MICRO_BATCHES,
    MODELS,
    PARTIAL,
    STAGES,
    VARIANTS,
    WHOLE_OPTIMIZERS,
    WHOLE_RUNS,
    key,
    stages,
)
from tests.distributed.harness import run_modules

pytestmark = [pytest.mark.heavy, pytest.mark.full_only]  # --quick: covered once by the estimator's unit tests


@pytest.fixture(scope="module")
def worlds() -> dict[int, dict]:
    return {}  # world size -> its runs, filled on first use


def _world(worlds: dict[int, dict], world_size: int) -> dict:
    """The world's cases, in two halves measured side by side (a process each)."""
    if world_size not in worlds:
        halves = run_modules([("tests.distributed.estimate_world", str(world_size), f"{k}/2") for k in range(2)],
                             timeout=900)
        worlds[world_size] = {case: run for half in halves for case, run in half.items()}
    return worlds[world_size]


@pytest.mark.parametrize("world_size", [2, 1, 3], ids=lambda n: f"world{n}")
def test_every_estimate_is_within_five_percent_of_the_measured_peak(worlds, world_size):
    runs = _world(worlds, world_size)
    micros = MICRO_BATCHES if world_size == CONFIG_WORLD else MICRO_BATCHES[:1]  # (both at 2 ranks)
    at_two = ("gpt6", "resnet18") if world_size != CONFIG_WORLD else ("gpt6",)  # (gpt6: its own cases below)
    expected = {key(name, stage, micro, {}) for name in MODELS for stage in STAGES for micro in micros
                if (name not in PARTIAL or micro == MICRO_BATCHES[0]) and name not in at_two}
    if world_size == CONFIG_WORLD:
        expected |= {key("gpt", stage, MICRO_BATCHES[0], variant) for stage in STAGES for variant in VARIANTS}
        quantized = [{"communication": policy} for policy in COMMUNICATION]
        expected |= {key("gpt-wide", stage, MICRO_BATCHES[0], v) for v in quantized for stage in stages(v)}
        expected |= {key("gpt6", stage, MICRO_BATCHES[0], v) for v in ({}, *CONFIG_FIELDS) for stage in stages(v)}
    every_op = {f"every-op/gpt/{stage}" for stage in STAGES} if world_size == CONFIG_WORLD else set()
    assert set(runs) == expected | every_op
    for case, run in runs.items():
        if case.startswith("every-op/"):  # the breakdown, category by category, against the peak sample's
            assert run["estimated"] == pytest.approx(run["measured"], rel=0.05), case
            for category, measured in run["categories"].items():
                assert run["estimated_categories"][category] == pytest.approx(measured, abs=0.02 * run["measured"])
            continue
        ratio = run["estimated"] / run["measured"]
        if case.split("/")[0] in UNCALIBRATED:  # (test_uncalibrated_convolutions_are_overestimated)
            continue
        low, high = (0.93 if "mixed" in case else 0.95), 1.05
        if "quantized" in case:
            low, high = 0.99, 1.01
        if case.startswith("gpt6/"):  # ZeroConfig's fields away from their defaults, read from the one config
            low, high = 0.98, 1.02
        assert low <= ratio <= high, (world_size, case, ratio, run)
        # the breakdown adds up, and names the phase
        assert sum(run["estimated_categories"].values()) == pytest.approx(run["estimated"]), case
        assert run["estimated_where"].split()[0] in ("forward", "backward", "step"), case


def test_hierarchical_quantized_estimates_are_within_one_percent(worlds):
    """HSDP with qgZ (its sum across the groups: qgZ's all-reduce, started as the next bucket launches) and hpZ with
    both codecs, in a world of 4 in two groups of 2, every stage they run at."""
    runs = _world(worlds, HIERARCHICAL_WORLD)
    assert set(runs) == {key("gpt-wide", stage, MICRO_BATCHES[0], v) for v in HIERARCHICAL for stage in stages(v)}
    for case, run in runs.items():
        assert 0.99 <= run["estimated"] / run["measured"] <= 1.01, (case, run)


WHOLE_WORLDS = (2,)  # (3 ranks measured 0.9999-1.0000 too; a process per rank of 1.5 minutes: left out of the run)
needs_whole_optimizers = pytest.mark.skipif(
    getattr(torch.optim, "Muon", None) is None or getattr(torch.optim, "Adafactor", None) is None,
    reason="torch.optim.Muon and Adafactor need torch >= 2.9")


@pytest.fixture(scope="module")
def whole_ranks() -> dict[tuple[int, int], dict]:
    """(world size, rank) -> that rank's runs with whole-parameter optimizers."""
    ranks = [(n, rank) for n in WHOLE_WORLDS for rank in range(n)]
    runs = run_modules([("tests.distributed.estimate_world", "optimizers", str(n), str(rank)) for n, rank in ranks],
                       timeout=900)
    return dict(zip(ranks, runs))


def _whole_cases(world_size: int, rank: int) -> set[str]:
    return {f"{name}/{key(model, stage, MICRO_BATCHES[0], variant)}" for name in WHOLE_OPTIMIZERS
            for model, stage, variant in WHOLE_RUNS if stage or (rank, world_size) == (0, 2)}


@needs_whole_optimizers
def test_whole_parameter_optimizers_are_estimated_within_two_percent_on_every_rank(whole_ranks):
    """Muon with AdamW, and Adafactor: each rank's state where it lives (Muon's momentum matrices and Adafactor's row
    and column statistics on the owner), and the owner step's whole tensors and exchange buffers; the estimate's
    traffic counts the owner step's all-to-alls as ``opt.comm_stats`` does (none with one shard)."""
    for (world_size, rank), runs in whole_ranks.items():
        assert set(runs) == _whole_cases(world_size, rank)
        for case, run in runs.items():
            assert run["rank"] == rank, case
            assert 0.98 <= run["estimated"] / run["measured"] <= 1.02, (world_size, rank, case, run)
            assert run["estimated_categories"]["optimizer_state"] == pytest.approx(
                run["categories"]["optimizer_state"], abs=64), (world_size, rank, case)
            assert run["estimated_all_to_all"] == run["inspected"]["all_to_all"], (world_size, rank, case)
            assert run["estimated_all_to_all"][0] == (2 if "/0/" not in case else 0), case


@needs_whole_optimizers
def test_the_rank_priced_by_default_has_the_largest_peak(whole_ranks):
    """The worse of the rank holding the most optimizer state and the one owning the most whole-parameter elements:
    its measured peak is the world's largest, and so is its estimate, within 2%; the ranks differ (the choice means
    something)."""
    differ = 0  # cases whose ranks' peaks differ by more than 2%
    for world_size in WHOLE_WORLDS:
        ranks = [whole_ranks[world_size, rank] for rank in range(world_size)]
        for case in _whole_cases(world_size, world_size - 1):  # (stages 1-3)
            runs = [runs[case] for runs in ranks]
            (chosen,) = {run["chosen"] for run in runs}
            peaks = [run["measured"] for run in runs]
            assert runs[chosen]["measured"] >= 0.98 * max(peaks), (world_size, case, peaks, chosen)
            assert 0.98 <= runs[0]["chosen_peak"] / max(peaks) <= 1.02, (world_size, case, peaks)
            differ += max(peaks) > 1.02 * min(peaks)
    assert differ >= 1  # (at 2 ranks: Adafactor's stage-1 state sits mostly on one rank)


@needs_whole_optimizers
def test_the_profiler_attributes_whole_parameter_state_to_the_optimizer(whole_ranks):
    """Muon with AdamW at stage 2: the memory report's optimizer state after the last step is every wrapped
    optimizer's state (momentum matrices, exp_avg and exp_avg_sq, step counts), and the report adds up."""
    for (world_size, rank), runs in whole_ranks.items():
        for case, run in runs.items():
            if not case.startswith("muon+adamw/") or "/2/" not in case or "precision" in case:
                continue
            seen = run["inspected"]
            assert seen["profiled"] == seen["held"] > 0, (world_size, rank, case, seen)
            assert {"optimizer_state/momentum_buffer", "optimizer_state/exp_avg"} <= set(seen["labels"]), seen
            assert seen["unexplained"] <= 1024, (world_size, rank, case, seen)


# ----- issue 43: the CPU convolution's workspaces priced (zero.estimator.workspaces) ----------------------------------
CONVOLUTIONAL = ("cnn", "resnet-inplace", "resnet18")


# the workspaces were measured on AVX2 with oneDNN (zero.estimator.workspaces); on another CPU oneDNN picks other
# kernels, and the estimate keeps the matrix's general 5%
MEASURED_CPU = torch.backends.cpu.get_cpu_capability() == "AVX2" and torch.backends.mkldnn.is_available()
# ... where resnet18's estimate is not within 5% either: on an AVX-512 (AVX512_BF16) EPYC its 2 x 2 last stage's
# convolutions take oneDNN kernels that hold less than the AVX2 ones priced, and the estimate reads 1.21-1.37 of the
# measured peak (an over-estimate: a plan stays safe); pricing those kernels is open work
UNCALIBRATED = () if MEASURED_CPU else ("resnet18",)


@pytest.mark.parametrize("world_size", [2, 1, 3], ids=lambda n: f"world{n}")
def test_convolutional_estimates_are_within_two_percent(worlds, world_size):
    """The CNNs within 0.98-1.02 of the measured peak at every stage (fp32: oneDNN's blocked copies and, for
    resnet18's 2 x 2 last stage, its GEMM weight gradient's per-thread copies, all inside the kernels; resnet18 at 2
    ranks)."""
    runs = _world(worlds, world_size)
    cases = {case: run for case, run in runs.items() if case.split("/")[0] in CONVOLUTIONAL}
    expected = set(CONVOLUTIONAL) if world_size == CONFIG_WORLD else set(CONVOLUTIONAL) - {"resnet18"}
    assert {case.split("/")[0] for case in cases} == expected
    assert {int(case.split("/")[1]) for case in cases} == set(STAGES)
    low, high = (0.98, 1.02) if MEASURED_CPU else (0.95, 1.05)
    for case, run in cases.items():
        if case.split("/")[0] not in UNCALIBRATED:
            assert low <= run["estimated"] / run["measured"] <= high, (world_size, case, run)


def test_uncalibrated_convolutions_are_overestimated(worlds):
    """On a CPU whose convolution kernels were not measured, resnet18's estimate errs on the safe side: never under
    the measured peak, and within 1.5x (measured 1.21-1.37 on an AVX512_BF16 EPYC)."""
    if not UNCALIBRATED:
        pytest.skip("this CPU's convolution kernels are the ones priced (AVX2): held to 2% above")
    runs = _world(worlds, CONFIG_WORLD)
    cases = {case: run for case, run in runs.items() if case.split("/")[0] in UNCALIBRATED}
    assert cases
    for case, run in cases.items():
        assert 1.0 <= run["estimated"] / run["measured"] <= 1.5, (case, run)
