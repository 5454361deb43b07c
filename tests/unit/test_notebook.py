"""The walk-through notebook runs from top to bottom (so it never rots), and says what it should."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "memory_walkthrough.ipynb"


def test_walkthrough_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    assert "rank 0 of 4" in text and "largest unexplained" in text
    assert text.count("ratio") == 4
    assert (tmp_path / "memory_stage3.png").stat().st_size > 10_000
