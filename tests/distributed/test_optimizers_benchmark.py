"""``benchmarks/optimizers.py`` at toy size on 2 gloo ranks: Muon+AdamW and Adafactor train at stages 2-3, each
whole-parameter update is computed once in the world (the ranks' counts sum to the whole-path parameters), the
state is spread over the ranks, and the result carries the stage-2 speed ratio (the figures themselves:
``benchmarks/results``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import optimizers  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9"),
    pytest.mark.full_only,  # --quick: each whole update once per step is checked by test_optimizers_world.py
]


def test_the_toy_run_counts_each_whole_update_once(tmp_path):
    out = tmp_path / "optimizers.json"
    result = optimizers.main(["--vocab", "64", "--seq", "8", "--d-model", "32", "--layers", "2", "--heads", "2",
                              "--steps", "1", "--only", "muon+adamw,adafactor", "--stages", "2,3", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert set(rows) == {f"{k}@{s}" for k in ("muon+adamw", "adafactor") for s in (2, 3)}
    hidden = 2 * 4  # per block: attention's qkv and projection, the MLP's two matrices
    gpt = optimizers.GPT(optimizers.GPTConfig(**result["spec"]["gpt"]))
    for stage in (2, 3):
        assert sum(rows[f"muon+adamw@{stage}"]["updates_per_rank"]) == hidden
        assert sum(rows[f"adafactor@{stage}"]["updates_per_rank"]) == len(list(gpt.parameters()))
        assert all(u > 0 for u in rows[f"adafactor@{stage}"]["updates_per_rank"])  # spread over both ranks
        for key in (f"muon+adamw@{stage}", f"adafactor@{stage}"):
            assert rows[key]["step_s"] >= rows[key]["optimizer_s"] > 0 and rows[key]["peak_bytes"] > 0
            assert rows[key]["state_bytes_max"] < 2 * rows[key]["state_bytes_mean"]  # not all on one rank
    assert result["aligned_max_over_mean"] >= 1.0
    assert set(result["targets"]) == {"muon_stage2_over_single", "muon_stage2_pass"}
