"""benchmarks/comm_modes.py at toy size: one real world of 4 gloo ranks (two groups of 2) trains every mode a few steps
on the repository's text, and the figures it derives are what the library's counters and the codecs' formulas say:
exact modes equal ``plain`` to rounding, quantized bytes are the int8 packets' (values and scales), no parameter
crosses the groups with hierarchy, the JSON, the plot and the README block come out (no full run)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

# --quick: the bounds it reports are checked once by tests/distributed/test_hierarchy_world.py and test_codec_world.py
pytestmark = pytest.mark.full_only

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
STEPS, FINAL, BLOCK = 10, 4, 64
TOY = ["--steps", str(STEPS), "--final-steps", str(FINAL), "--warmup", "2", "--warmup-lr", "3", "--d-model", "32",
       "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch", "8", "--block-size", str(BLOCK)]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the spawned ranks unpickle comm_modes.train_rank by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(BENCH))  # (spawned processes start with the parent's sys.path)
        yield _load("comm_modes")


@pytest.fixture(scope="module")
def toy(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("comm_modes")
    result = bench.main([*TOY, "--json", str(out / "r.json"), "--plot", str(out / "loss.png")])
    return result, out


def test_every_mode_trains_on_the_same_batches(bench, toy):
    result, _ = toy
    assert list(result["modes"]) == [*bench.MODES, bench.CONTROL]
    first = result["first_loss"]["plain"]
    assert abs(first - math.log(result["config"]["vocab_size"])) < 0.3  # a fresh model guesses uniformly
    for mode, losses in result["loss"].items():
        assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), mode
        assert abs(losses[0] / first - 1) < 1e-2, mode  # the same model and batch (quantized gathers differ a little)
        assert result["final_loss"][mode] < first - 0.1, mode  # it learns


def test_exact_modes_equal_plain_to_rounding_and_lossy_ones_stay_close(bench, toy):
    rows = toy[0]["modes"]
    assert rows["plain"]["max_step_rel_vs_plain"] == 0
    for mode in ("hierarchical", "plain (shares rotated)"):
        assert rows[mode]["max_step_rel_vs_plain"] <= 1e-5, mode
        assert abs(rows[mode]["eval_loss"] / rows["plain"]["eval_loss"] - 1) <= 1e-5, mode  # held out, after training
    assert all(math.isfinite(row["eval_loss"]) and row["eval_loss"] > 0 for row in rows.values())
    for mode in ("qwZ", "qgZ", "qwZ+qgZ", "hierarchical+qwZ+qgZ"):
        assert 0 < rows[mode]["max_step_rel_vs_plain"] < 0.02, mode  # lossy: not bit-equal, not far
    checks = {c["check"]: c for c in toy[0]["checks"]}
    assert checks["hierarchical: max per-step |loss / plain's - 1|"]["passed"]
    assert all(c["passed"] for name, c in checks.items() if "final loss" in name)
    assert all(row["largest_rise"] < 1 for row in rows.values())  # (toy steps: batch noise only)
    assert bench.largest_rise([4.0, 3.0, 3.9, 2.0, 2.5]) == pytest.approx(0.9)


def test_bytes_on_the_wire_are_the_codecs(toy):
    rows = toy[0]["modes"]
    for mode in ("plain", "hierarchical", "plain (shares rotated)"):
        assert rows[mode]["all_gather_x_fp32"] == 1.0 and rows[mode]["reduce_scatter_x_fp32"] == 1.0, mode
    for mode, kind, key in (("qwZ", "all_gather", "all_gather_x_fp32"), ("qgZ", "reduce_scatter",
                            "reduce_scatter_x_fp32"), ("hierarchical+qwZ+qgZ", "all_gather", "all_gather_x_fp32"),
                            ("hierarchical+qwZ+qgZ", "reduce_scatter", "reduce_scatter_x_fp32")):
        stats, group = rows[mode]["stats"][kind], rows[mode]["group_size"]
        # each rank's chunk of n elements is a packet (zero.comm.quantization.packet_bytes) of n int8 values and
        # n / BLOCK fp32 scales, and at most one padded block, 3 bytes of alignment and one more scale per call
        low = 1 / 4 + 1 / BLOCK
        high = low + stats["calls"] * group * (BLOCK + 3 + 4) / (4 * stats["numel"])
        assert low <= rows[mode][key] <= high, (mode, kind, rows[mode][key], low, high)
    for mode, flat in (("hierarchical", "plain"), ("hierarchical+qwZ+qgZ", "qwZ+qgZ")):
        row, ref = rows[mode], rows[flat]
        assert row["flat"] == flat and row["inter_param_bytes"] == 0 and row["inter_param_x_flat"] == 0
        assert ref["inter_param_bytes"] == ref["stats"]["all_gather"]["bytes"] > 0  # flat: every gather crosses
        assert "inter_all_gather" not in row["stats"]  # parameters are gathered inside the group only
    # across the groups, each group's reduced shard (its reduce-scatter's payload / 2) and the flags of which
    # parameters got gradients (a few hundred bytes): in fp32, or with qgZ an all-to-all and an all-gather of int8
    # packets of half the shard each (zero.comm.codec.QuantizedGradients.all_reduce)
    fp32 = rows["hierarchical"]["stats"]["reduce_scatter"]["numel"] * 4 / 2
    assert 0 <= rows["hierarchical"]["inter_grad_bytes"] - fp32 < 1024
    assert abs(rows["hierarchical"]["inter_grad_x_flat"] - 0.5) < 0.01
    row = rows["hierarchical+qwZ+qgZ"]
    shard = row["stats"]["reduce_scatter"]["numel"] / 2
    low = 2 * shard * (1 + 4 / BLOCK)
    high = low + row["stats"]["reduce_scatter"]["calls"] * 2 * 2 * (BLOCK + 7) + 1024
    assert low <= row["inter_grad_bytes"] <= high, (row["inter_grad_bytes"], low, high)


def test_step_times_and_exposure_are_ratios(toy):
    rows = toy[0]["modes"]
    assert rows["plain"]["step_x_plain"] == 1.0 and rows["plain"]["step_x_plain_iqr"] == 0.0
    for mode, row in rows.items():
        assert row["step_ms"] > 0 and row["step_x_plain"] > 0 and row["step_x_plain_iqr"] >= 0, mode
        assert 0 < row["exposed"] <= 1, mode  # waited in collectives, within the step
    assert all(len(times) == STEPS and min(times) > 0 for times in toy[0]["time_s"].values())


def test_outputs_json_plot_report_and_readme_block(bench, toy):
    result, out = toy
    data = json.loads((out / "r.json").read_text())
    assert data["modes"].keys() == result["modes"].keys() and data["spec"]["steps"] == STEPS
    assert data["spec"]["corpus"]["vocab"] == data["config"]["vocab_size"] and data["spec"]["corpus"]["bytes"] > 10**4
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = bench.report(data)
    assert all(f"{c['check']}: " in report for c in data["checks"])
    render = _load("render_results")
    block = render.comm_block(data)
    for mode, row in data["modes"].items():
        assert f"| `{mode}` | {row['final_loss']:.3f} |" in block
    assert "not measured in this run" in block  # no --compare here


def test_text_batches_and_schedule(bench):
    text = bench.corpus()
    assert text.startswith((ROOT / "README.md").read_bytes()) and text == bench.corpus()
    tokens, vocab = bench.encode(text)
    assert bytes(vocab[t] for t in tokens[:200].tolist()) == text[:200] and len(vocab) == len(set(text))
    x, y = bench.batch(tokens, 3, 4, 16, 0)
    x2, y2 = bench.batch(tokens, 3, 4, 16, 0)
    assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, bench.batch(tokens, 4, 4, 16, 0)[0])
    train, held_out = bench.split(tokens)
    assert torch.equal(torch.cat([train, held_out]), tokens) and abs(held_out.numel() / tokens.numel() - 0.1) < 1e-3
    spec = {"lr": 1.0, "warmup_lr": 10, "steps": 100}
    assert bench.lr_at(0, spec) == pytest.approx(0.1)  # warm-up: a tenth of the way, at the peak after 10 steps
    assert bench.lr_at(9, spec) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 9 / 100)))  # the cosine's
    assert bench.lr_at(99, spec) == pytest.approx(0.1, abs=1e-3)  # down to a tenth at the last step
    args = bench.parse_args(["--quick", "--compare"])
    assert args.steps == 60 and not args.compare
