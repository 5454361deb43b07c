"""Hypothesis: a damaged checkpoint or export gives exactly the saved tensors or a clear error naming the file.

A small checkpoint (``tests.checkpoints.Tiny``: tied weights, a buffer, a frozen parameter, AdamW state, a
tensor in ``extra``) and its safetensors exports (one file; shards plus an index) are saved once. Each example
copies them and

* flips, truncates, appends to or deletes random bytes and files, then loads the checkpoint with an optimizer
  and into a plain model, exports it with ``zero.consolidate`` and with ``zero consolidate``, and reads the
  exports back with ``zero.load_consolidated``;
* or replaces one value anywhere in ``metadata.json`` by an arbitrary one and records the new checksum (a
  hand-crafted checkpoint: only the schema and the parts' own headers stand in the way).

Every outcome must be the saved tensors bit for bit (and the optimizer state, and ``extra``), or a ValueError /
FileNotFoundError whose message names a damaged file (the checkpoint for a hand-crafted one); the command line
returns 0 or 2 and never raises. Never other numbers.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zero
from tests.checkpoints import CHECKSUM, METADATA, PART, Tiny, rewrite_metadata, same, saved_tiny, step, tiny, weights
from zero.cli.main import main as cli

CHECKPOINT_FILES = [METADATA, CHECKSUM, PART]
EXTRA = {"epoch": 1, "rng": torch.arange(5, dtype=torch.int16)}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzz")
    model, opt = saved_tiny(root / "ckpt", extra=EXTRA)
    zero.consolidate(root / "ckpt", root / "model.safetensors", progress=False)
    zero.consolidate(root / "ckpt", root / "sharded", max_shard_size="1KB", progress=False)
    return {"root": root, "weights": weights(model, opt), "state": opt.inner.state_dict(),
            "shards": sorted(p.name for p in (root / "sharded").iterdir())}


mutation = st.tuples(st.integers(0, 99), st.sampled_from(["flip", "truncate", "append", "delete"]),
                     st.integers(0, 2**32), st.integers(1, 255))


def mutate(root: Path, names: list[str], mutations: list[tuple[int, str, int, int]]) -> set[str]:
    """Apply ``mutations`` to files of ``root``; return the names of those touched."""
    touched = set()
    for index, kind, where, value in mutations:
        name = names[index % len(names)]
        file = root / name
        if not file.exists():
            continue
        touched.add(name)
        data = bytearray(file.read_bytes())
        if kind == "delete":
            file.unlink()
            continue
        if kind == "flip" and data:
            data[where % len(data)] ^= value
        elif kind == "truncate":
            del data[where % (len(data) + 1) :]
        elif kind == "append":
            data.append(value)
        file.write_bytes(bytes(data))
    return touched


def exact_or_named(run: Callable[[], Any], named: list[str]) -> Any:
    """``run()``'s result, or None when it raised a ValueError or FileNotFoundError whose message names one of
    ``named``; any other exception fails the test."""
    try:
        return run()
    except (ValueError, FileNotFoundError) as err:
        assert any(name in str(err) for name in named), (str(err), named)
        return None


def same_state(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        a["state"][i].keys() == b["state"][i].keys() and all(torch.equal(a["state"][i][k], b["state"][i][k])
                                                             for k in a["state"][i])
        for i in a["state"])


def check_checkpoint(ckpt: Path, named: list[str], original: dict[str, Any]) -> None:
    """Load with an optimizer and into a plain model, export through Python and the command line: each exact or
    refused naming one of ``named``."""
    model, opt = tiny(seed=1)
    extra = exact_or_named(lambda: zero.load_checkpoint(ckpt, model, opt, progress=False), named)
    if extra is not None:
        assert same(weights(model, opt), original["weights"]) and same_state(opt.inner.state_dict(), original["state"])
        assert extra["epoch"] == 1 and torch.equal(extra["rng"], EXTRA["rng"])
    torch.manual_seed(2)
    plain = Tiny()
    if exact_or_named(lambda: zero.load_checkpoint(ckpt, plain, progress=False), named) is not None:
        assert same(weights(plain), original["weights"])
    out = ckpt.parent / "export.safetensors"
    if exact_or_named(lambda: zero.consolidate(ckpt, out, progress=False), named) is not None:
        assert same(zero.load_consolidated(out), original["weights"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli(["consolidate", str(ckpt), str(ckpt.parent / "cli")])
    if code == 0:
        assert same(zero.load_consolidated(ckpt.parent / "cli"), original["weights"])
    else:
        line = err.getvalue()
        assert code == 2 and line.count("\n") == 1 and any(name in line for name in named), line


@FUZZ
@given(mutations=st.lists(mutation, min_size=1, max_size=3))
def test_a_damaged_checkpoint_loads_exactly_or_is_refused_naming_the_file(original, mutations):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        shutil.copytree(original["root"] / "ckpt", ckpt)
        touched = mutate(ckpt, CHECKPOINT_FILES, mutations)
        check_checkpoint(ckpt, sorted(touched), original)


@FUZZ
@given(mutations=st.lists(mutation, min_size=1, max_size=3), sharded=st.booleans())
def test_a_damaged_export_loads_exactly_or_is_refused_naming_the_file(original, mutations, sharded):
    with tempfile.TemporaryDirectory() as tmp:
        if sharded:
            export = Path(tmp) / "sharded"
            shutil.copytree(original["root"] / "sharded", export)
            touched = mutate(export, original["shards"], mutations)
        else:
            export = Path(tmp) / "model.safetensors"
            shutil.copy(original["root"] / "model.safetensors", export)
            touched = mutate(Path(tmp), [export.name], mutations)
        state = exact_or_named(lambda: zero.load_consolidated(export), sorted(touched))
        if state is not None:
            assert same(state, original["weights"])


def leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """The path of every value inside ``value`` (containers included), depth first."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    found = [path] if path else []
    for key, child in children:
        found += leaves(child, (*path, key))
    return found


def replace(tree: Any, path: tuple, new: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = new


VALUES = st.one_of(
    st.integers(-2, 2**70), st.sampled_from([0, 1, 2, 7, 8, 31, 32, 255, 256, 2**28, 2**31, 2**34, 2**63, -1]),
    st.sampled_from(["F32", "I32", "F16", "BF16", "I64", "param", "buffer", "", "../outside.safetensors",
                     "/etc/passwd", "v/out.bias/0", "w/frozen", "x/0", "embed.weight", "zero.checkpoint/1"]),
    st.none(), st.booleans(), st.floats(allow_nan=False), st.lists(st.integers(-1, 64), max_size=3),
    st.dictionaries(st.sampled_from(["__tensor__", "__tuple__", "__items__", "a"]), st.integers(-1, 3), max_size=2),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.integers(0, 10**6), new=VALUES)
def test_hand_crafted_metadata_never_gives_other_numbers(original, where, new):
    """Any one value of ``metadata.json`` replaced, its checksum recomputed: loading into a plain model gives the
    saved tensors exactly or is refused naming the checkpoint; an export holds only saved tensors' values."""
    saved_bytes = {(v.dtype, v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                   for v in original["weights"].values()}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        shutil.copytree(original["root"] / "ckpt", ckpt)
        meta = json.loads((ckpt / METADATA).read_text())
        paths = leaves(meta)
        rewrite_metadata(ckpt, lambda m: replace(m, paths[where % len(paths)], new))
        torch.manual_seed(2)
        plain = Tiny()
        if exact_or_named(lambda: zero.load_checkpoint(ckpt, plain, progress=False), [str(ckpt)]) is not None:
            assert same(weights(plain), original["weights"])
        out = Path(tmp) / "export.safetensors"
        if exact_or_named(lambda: zero.consolidate(ckpt, out, progress=False), [str(ckpt)]) is not None:
            for value in zero.load_consolidated(out).values():
                assert (value.dtype, value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) in saved_bytes


@pytest.fixture(scope="module")
def original_whole(tmp_path_factory) -> dict[str, Any]:
    """``Tiny`` with Adafactor on its matrices (stepped whole) and AdamW on its biases (flat): a format-3 checkpoint."""
    if getattr(torch.optim, "Adafactor", None) is None:
        pytest.skip(f"torch {torch.__version__} has no torch.optim.Adafactor")
    root = tmp_path_factory.mktemp("fuzz_whole")
    model, opt = whole_tiny()
    step(model, opt)
    zero.save_checkpoint(root / "ckpt", model, opt, progress=False)
    return {"root": root, "weights": weights(model, opt), "state": [o.state_dict()["state"] for o in opt.optimizers]}


def whole_tiny(seed: int = 0) -> tuple[Tiny, zero.ZeroOptimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizers = [torch.optim.Adafactor([p for p in trained if p.dim() == 2], lr=1e-2),
                  torch.optim.AdamW([p for p in trained if p.dim() == 1], lr=1e-2)]
    return model, zero.ZeroOptimizer(optimizers, model, stage=2, bucket_size_mb=0.001)


def same_states(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(same_state({"state": x}, {"state": y}) for x, y in zip(a, b))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(where=st.integers(0, 10**6), new=VALUES)
def test_hand_crafted_metadata_of_whole_state_never_gives_other_numbers(original_whole, where, new):
    """Any one value of a format-3 ``metadata.json`` (several optimizers, one stepped whole) replaced, its checksum
    recomputed: loading with the optimizers gives the saved weights and every optimizer's state exactly, or is
    refused naming the checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        shutil.copytree(original_whole["root"] / "ckpt", ckpt)
        meta = json.loads((ckpt / METADATA).read_text())
        assert meta["format"] == "zero.checkpoint/3"
        paths = leaves(meta)
        rewrite_metadata(ckpt, lambda m: replace(m, paths[where % len(paths)], new))
        model, opt = whole_tiny(seed=1)
        if exact_or_named(lambda: zero.load_checkpoint(ckpt, model, opt, progress=False), [str(ckpt)]) is not None:
            assert same(weights(model, opt), original_whole["weights"])
            assert same_states([o.state_dict()["state"] for o in opt.optimizers], original_whole["state"])
