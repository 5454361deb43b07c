"""The walk-through notebook runs from top to bottom (so it never rots), says what it should, and is
saved with its outputs (a reader who does not run it still sees the report and the plot)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.heavy  # a module of a minute or more: run first (tests/conftest.py)

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "memory_walkthrough.ipynb"


def _text(nb) -> str:
    return "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )


def _images(nb) -> list[str]:
    return [
        out["data"]["image/png"] for cell in nb.cells if cell.cell_type == "code"
        for out in cell.get("outputs", []) if "image/png" in out.get("data", {})
    ]


@pytest.mark.full_only  # --quick leaves it out (see tests/conftest.py)
def test_walkthrough_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _text(nb)
    # the torchrun script: 2 gloo ranks, accumulation, clipping, the profile's report, gathered parameters
    assert "2 ranks, stage 3" in text and "grad norm" in text and "peak per rank: rank 0" in text
    assert "largest unexplained" in text and "inside gathered_parameters()" in text
    assert (tmp_path / "train_zero.py").read_text().count("opt.no_sync()") == 1
    assert (tmp_path / "memory_rank0.png").stat().st_size > 10_000 and len(_images(nb)) == 1
    # the checkpoint, resumed on one rank at another stage and exported, equals what the two ranks had
    assert (tmp_path / "ckpt" / "last" / "metadata.json").is_file()
    assert (tmp_path / "export" / "model.safetensors").is_file()
    differences = [float(d) for d in re.findall(r"largest difference of a norm from the 2-rank run's: (\S+)", text)]
    assert len(differences) == 2 and max(differences) < 1e-5
    assert "resumed on 1 rank" in text
    # each stage against the formula and the estimate; zero estimate's plan
    assert "rank 0 of 4" in text and len(re.findall(r"measured +[\d.]+ MiB, ratio", text)) == 4
    assert text.count("(formula") == text.count("1.0000x)") == 4
    assert "fits, best first" in text


def test_saved_notebook_shows_its_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.get("outputs") for cell in code), "save the notebook executed (see notebooks/README.md)"
    assert not any(out.output_type == "error" for cell in code for out in cell.outputs)
    assert len(_images(nb)) == 1 and len(_images(nb)[0]) > 10_000  # the plot, embedded
    text = _text(nb)
    assert "largest unexplained" in text and "USDT" not in text
