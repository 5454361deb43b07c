"""The repository is lint-clean: ``ruff check .`` (every Python file and notebook, under pyproject.toml's
``[tool.ruff]`` settings)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean():
    pytest.importorskip("ruff")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff check .:\n{done.stdout}{done.stderr}"
