"""``benchmarks/offload_speed.py`` at toy size on the CPU: the three configurations train, ``ratio="auto"`` keeps part
of the optimizer side on the device under a cap between the resident and the fully offloaded peaks, and each row
carries its time split and its targets (the figures themselves are the GPU's to give)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import offload_speed  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:offloaded AdamW")


def test_the_toy_run_splits_the_step_and_picks_a_partial_ratio(tmp_path, capsys):
    out = tmp_path / "speed.json"
    result = offload_speed.main(["--device", "cpu", "--models", "toy", "--caps", "mid", "--steps", "1",
                                 "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (row,) = result["rows"]
    resident, full, auto = row["resident"], row["full"], row["auto"]
    assert resident["ratio"] == 0 and resident["offloaded_elements"] == 0 and resident["host_step_s"] == 0
    assert full["ratio"] == 1 and full["offloaded_elements"] > 0
    assert 0 < auto["ratio"] < 1 and 0 < auto["offloaded_elements"] < full["offloaded_elements"]
    for figures in (full, auto):
        assert figures["step_s"] > figures["host_step_s"] > 0 and figures["transfers_s"] > 0
        assert figures["step_s"] >= figures["forward_backward_s"] > 0
    assert set(row["targets"]) >= {"overlap_limit_s", "auto_x_limit", "auto_within_1.3x", "full_x_auto"}
    assert "offload.ratio='auto' ->" in capsys.readouterr().err
