"""The README stays what a newcomer reads first: short, with both set-up commands, and every link it gives leads
somewhere (docs pages, examples, the notebook)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_short_and_has_both_set_up_commands():
    assert len(README.splitlines()) <= 175
    assert 'pip install torch==2.13.0 -e . && zero demo' in README
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest' in README


def test_every_relative_link_in_the_readme_exists():
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README) if "://" not in t]
    assert targets, "the README links its guides"
    missing = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not missing, f"README.md links to files that do not exist: {missing}"
