"""The published benchmark figures are what compare.py wrote: docs/benchmarks.md and the README's block equal what
``benchmarks/render_results.py`` renders from the committed ``benchmarks/results/compare.json`` (no benchmark runs).

A hand-edited figure, a JSON refreshed without re-rendering, or a method changed in compare.py's docstring without
re-rendering fails here; the fix is ``python benchmarks/render_results.py --write``.
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIX = "run `python benchmarks/render_results.py --write`"


def _render():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "benchmarks" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _render()


@pytest.fixture(scope="module")
def data():
    return render.load(render.JSON)


def test_benchmarks_page_matches_the_json(data):
    assert render.PAGE.exists(), f"docs/benchmarks.md is missing; {FIX}"
    assert render.PAGE.read_text() == render.page(data), f"docs/benchmarks.md is out of date; {FIX}"


def test_readme_block_matches_the_json(data):
    readme = render.README.read_text()
    if render.START not in readme and render.END not in readme:
        pytest.skip("README.md has no benchmarks markers")
    spliced = render.splice(readme, render.readme_block(data))
    assert spliced is not None, f"README.md needs exactly one {render.START} ... {render.END} pair, in order"
    assert spliced == readme, f"README.md's benchmarks block is out of date; {FIX}"


def test_every_figure_in_the_json_is_rendered(data):
    """Each contender and each step-time target appears on the page, and the README rows are the headline ones."""
    page = render.page(data)
    for row in data["rows"]:
        assert f"| `{row['name']}` | {row['median_ms']:.1f} |" in page
    for check in data["checks"]:
        assert f"| `{check['check']}` | {check['ratio']:.3f} |" in page
    block = render.readme_block(data)
    shown = {r["name"] for r in data["rows"]} & set(render.HEADLINE)
    assert shown and all(f"| `{name}` |" in block for name in shown)


def test_check_mode_flags_a_stale_page(data, tmp_path, monkeypatch):
    stale = tmp_path / "benchmarks.md"
    stale.write_text(render.page(data).replace("| `ddp` |", "| `ddp` (edited) |"))
    monkeypatch.setattr(render, "PAGE", stale)
    monkeypatch.setattr(render, "README", tmp_path / "README.md")  # absent: no block to check
    assert render.main(["--check"]) == 1
    stale.write_text(render.page(data))
    assert render.main(["--check"]) == 0


def test_splice_touches_only_the_block():
    readme = f"head\n{render.START}\nold\n{render.END}\ntail\n"
    assert render.splice(readme, "\nnew\n") == f"head\n{render.START}\nnew\n{render.END}\ntail\n"
    assert render.splice("no markers\n", "\nnew\n") is None


def test_readme_disk_offload_block_matches_the_json():
    """The offload-to-disk figures in the README are what benchmarks/disk_offload.py wrote."""
    readme = render.README.read_text()
    spliced = render.splice(readme, render.disk_block(render.load(render.DISK_JSON)), render.DISK_MARKERS)
    assert spliced is not None, f"README.md needs exactly one {' ... '.join(render.DISK_MARKERS)} pair"
    assert spliced == readme, f"README.md's disk-offload block is out of date; {FIX}"


def test_readme_comm_modes_block_matches_the_json():
    """The communication modes' figures in the README (and docs/benchmarks.md's last section, checked with the page)
    are what benchmarks/comm_modes.py wrote."""
    assert render.COMM_JSON.exists(), "benchmarks/results/comm_modes.json is missing (benchmarks/comm_modes.py --json)"
    data = render.load(render.COMM_JSON)
    readme = render.README.read_text()
    spliced = render.splice(readme, render.comm_readme_block(data), render.COMM_MARKERS)
    assert spliced is not None, f"README.md needs exactly one {' ... '.join(render.COMM_MARKERS)} pair"
    assert spliced == readme, f"README.md's comm-modes block is out of date; {FIX}"
    page = render.page(render.load(render.JSON))
    assert render.COMM_MARKERS[0] + render.comm_block(data) + render.COMM_MARKERS[1] in page
    for mode in data["modes"]:
        assert f"| `{mode}` |" in page
