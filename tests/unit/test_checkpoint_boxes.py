"""The geometry of format 4's boxes (``zero.checkpoint.portable.boxes``): any range of any target box, read from
saved boxes of another layout (uneven splits included, as torch's ``Shard`` makes them), gives the global tensor's
elements in the target box's row-major order."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from zero.checkpoint.portable.boxes import Box, contiguous_in, moves, runs, strides


def _grid(shape: tuple[int, ...], rng: random.Random) -> list[Box]:
    """A random grid of boxes tiling ``shape`` (each dimension cut at random points, some left whole)."""
    cuts = []
    for n in shape:
        points = sorted(rng.sample(range(1, n), rng.randint(0, min(3, n - 1)))) if n > 1 else []
        edges = [0, *points, n]
        cuts.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    return [Box(tuple(c[0] for c in combo), tuple(c[1] for c in combo)) for combo in itertools.product(*cuts)]


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offset, box.size))


def _read(whole: torch.Tensor, saved: list[Box], target: Box, start: int, numel: int) -> torch.Tensor:
    flats = [whole[_slices(b)].contiguous().view(-1) for b in saved]  # as a saved box is stored
    out = torch.full((numel,), float("nan"))
    for move in moves(saved, target, start, numel):
        span = flats[move.saved].narrow(0, move.start, move.numel)
        move.target(out).copy_(move.source(span, saved[move.saved]))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_any_range_of_any_box_from_any_layout(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(0, 4)))
    whole = torch.arange(float(max(1, torch.Size(shape).numel()))).reshape(shape)
    saved = _grid(shape, rng)
    for target in [*_grid(shape, rng), Box.whole(shape), *saved[:2]]:
        flat = whole[_slices(target)].reshape(-1)
        for _ in range(4):
            start = rng.randrange(flat.numel())
            numel = rng.randint(1, flat.numel() - start)
            assert torch.equal(_read(whole, saved, target, start, numel), flat[start : start + numel]), \
                (shape, saved, target, start, numel)


def test_the_same_layout_is_one_direct_move():
    saved = [Box((0, 0), (4, 6)), Box((4, 0), (4, 6))]
    (move,) = moves(saved, saved[1], 5, 10)
    assert (move.saved, move.start, move.numel, move.direct) == (1, 5, 10, True)


def test_runs_are_contiguous_blocks_in_order():
    size = (3, 4, 5)
    for start, numel in [(0, 60), (7, 41), (19, 1), (20, 20), (1, 58)]:
        blocks = runs(size, start, numel)
        assert len(blocks) <= 2 * len(size) - 1
        position = start
        for block, at in blocks:
            assert at == position - start and contiguous_in(block, Box.whole(size))
            assert sum(c * s for c, s in zip(block.offset, strides(size))) == position
            position += block.numel
        assert position == start + numel


def test_shard_columns_read_from_rows():
    """A Shard(1) box of tp 4 (columns 8-15) read from the Shard(0) boxes of tp 2: strided copies, no direct one."""
    whole = torch.arange(32.0 * 32).reshape(32, 32)
    saved = [Box((0, 0), (16, 32)), Box((16, 0), (16, 32))]
    target = Box((0, 8), (32, 8))
    found = moves(saved, target, 0, 256)
    assert [m.saved for m in found] == [0, 1] and not any(m.direct for m in found)
    assert torch.equal(_read(whole, saved, target, 0, 256), whole[:, 8:16].reshape(-1))
