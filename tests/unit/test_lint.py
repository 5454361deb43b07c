"""The tree is lint-clean: ``ruff check zero tests benchmarks`` under pyproject.toml's ``[tool.ruff]`` settings."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean():
    pytest.importorskip("ruff")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "zero", "tests", "benchmarks"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff check zero tests benchmarks:\n{done.stdout}{done.stderr}"
