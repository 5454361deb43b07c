"""Checkpoints and exports that cannot be silently corrupted, and a save that never deletes what it did not write
(issue 24, items 1-7). One process, a model of a few KB (``tests.checkpoints.Tiny``).

Each test damages or hand-crafts files the way the issue found them to give wrong numbers or lose data, and
checks that every outcome is the saved tensors exactly or a ValueError naming the file. The crash tests stop a
save at each of its file-system steps (a ``BaseException`` raised from ``os.rename``/``unlink``/``rmdir``, so no
handler runs: what a killed process leaves) and check what loading and the next save make of it.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import zero
from tests.checkpoints import (
    CHECKSUM,
    METADATA,
    PART,
    loaded,
    rewrite_header,
    rewrite_metadata,
    same,
    saved_tiny,
    step,
    tiny,
    weights,
)
from zero.cli.main import main as cli


@pytest.fixture
def saved(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of a trained ``Tiny`` and its weights."""
    model, opt = saved_tiny(tmp_path / "ckpt", extra={"epoch": 1, "rng": torch.arange(3)})
    return tmp_path / "ckpt", weights(model, opt)


def refused_everywhere(path: Path, match: str, capsys) -> None:
    """Loading with an optimizer, into a plain model, exporting, and ``zero consolidate``: each refuses with
    ``match``; the command line with one line and exit code 2."""
    model, opt = tiny(seed=1)
    before = weights(model, opt)
    with pytest.raises(ValueError, match=match):
        zero.load_checkpoint(path, model, opt, progress=False)
    assert same(weights(model, opt), before)
    with pytest.raises(ValueError, match=match):
        loaded(path)
    with pytest.raises(ValueError, match=match):
        zero.consolidate(path, path.parent / "export", progress=False)
    capsys.readouterr()
    assert cli(["consolidate", str(path), str(path.parent / "export")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zero consolidate: ") and "Traceback" not in err, err
    assert not (path.parent / "export" / "model.safetensors").exists()


def flip_text(file: Path, old: str, new: str) -> None:
    """Replace the first ``old`` by ``new`` in ``file``'s bytes (the same length: a flipped byte or two)."""
    data = file.read_bytes()
    assert len(old) == len(new) and old.encode() in data
    file.write_bytes(data.replace(old.encode(), new.encode(), 1))


# ----- item 1: the metadata is checksummed and self-consistent --------------------------------------------------


@pytest.mark.parametrize("code", ["I32", "F16"])
def test_a_flipped_dtype_in_the_metadata_is_refused(saved, capsys, code):
    """``F32`` → ``I32``/``F16`` in metadata.json loaded garbage with exit code 0; its SHA-256 is in another file."""
    path, _ = saved
    flip_text(path / METADATA, '"F32"', f'"{code}"')
    refused_everywhere(path, rf"metadata.json does not match the SHA-256 recorded in .*{CHECKSUM}", capsys)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["tensors"]["hidden.weight"].update(dtype="I32"),
     r"the piece of 'hidden.weight' at element 0 is 256 elements of I32, but its entry 'v/hidden.weight/0' is F32"),
    (lambda m: m["files"][0]["entries"]["v/hidden.weight/0"].__setitem__(0, "F16"),
     r"entry 'v/hidden.weight/0' of part-00000-of-00001.safetensors is F16 of shape \(256,\), 512 bytes, but 1024"),
    (lambda m: [m["tensors"]["hidden.weight"].update(dtype="I32"),
                m["files"][0]["entries"]["v/hidden.weight/0"].__setitem__(0, "I32")],
     r"part-00000-of-00001.safetensors does not match .*metadata.json: entries \['v/hidden.weight/0'\] differ"),
])
def test_a_hand_edited_dtype_with_its_checksum_recomputed_is_refused(saved, capsys, edit, match):
    """Even with the checksum fixed up, a dtype must agree with the piece's entry, an entry's bytes with
    ``numel × itemsize``, and the metadata's entries with the part's own header."""
    path, _ = saved
    rewrite_metadata(path, edit)
    refused_everywhere(path, match, capsys)


def test_the_checksum_file_is_required_and_checked(saved, capsys):
    path, expected = saved
    (path / CHECKSUM).write_text("0" * 64 + f"  {METADATA}\n")
    refused_everywhere(path, "metadata.json does not match the SHA-256 recorded in", capsys)
    (path / CHECKSUM).unlink()
    refused_everywhere(path, r"metadata.json.sha256 is missing: without it .*metadata.json cannot be verified", capsys)


def test_the_old_format_is_refused_with_the_way_out(saved, capsys):
    path, _ = saved
    meta = json.loads((path / METADATA).read_text())
    (path / METADATA).write_text(json.dumps({**meta, "format": "zero.checkpoint/1"}))
    (path / CHECKSUM).unlink()
    refused_everywhere(path, r"format 'zero.checkpoint/1', saved by an earlier zero without a checksum of its "
                       r"metadata.*save it again with this one", capsys)


# ----- item 2: pieces cover each tensor exactly; sizes bounded by the files ------------------------------------


@pytest.mark.parametrize("edit", [
    lambda m: m["tensors"]["hidden.bias"].update(pieces=[]),
    lambda m: m["tensors"]["hidden.bias"].update(shape=[2**28]),
    lambda m: m["tensors"]["hidden.bias"].update(shape=[2**34]),
], ids=["gap", "1-GiB-shape", "64-GiB-shape"])
def test_a_gap_or_an_absurd_shape_is_refused_before_allocating(saved, capsys, edit):
    """``consolidate`` exported uninitialised memory for a gap (exit 0), 1 GiB of garbage for 2^28 elements
    and an allocator traceback for 64 GiB."""
    path, _ = saved
    rewrite_metadata(path, edit)
    refused_everywhere(path, r"metadata.json is damaged or was edited: .*the pieces of 'hidden.bias' do not cover its "
                       r"\d+ elements exactly", capsys)


@pytest.mark.parametrize("edit,match", [
    (lambda m: m["files"][0]["entries"]["v/hidden.bias/0"].__setitem__(1, [2**40]),
     r"entry 'v/hidden.bias/0' of part-00000-of-00001.safetensors is F32 of shape \(1099511627776,\)"),
    (lambda m: m["files"][0]["entries"]["v/hidden.bias/0"].__setitem__(2, 2**62),
     r"entry 'v/hidden.bias/0' of part-00000-of-00001.safetensors lies at bytes \[4611686018427387904, "),
    (lambda m: m["tensors"]["hidden.bias"]["pieces"][0].__setitem__(3, "v/out.bias/0"),
     r"the piece of 'hidden.bias' at element 0 names entries \['v/out.bias/0'\], not its own"),
    (lambda m: m["tensors"]["out.bias"]["pieces"].append(m["tensors"]["out.bias"]["pieces"][0]),
     r"entry 'v/out.bias/0' of part-00000-of-00001.safetensors is read by more than one piece"),
    (lambda m: m.update(aliases={"head.weight": "nothing"}),
     r"alias 'head.weight' -> 'nothing' must name a stored tensor"),
    (lambda m: m.update(world_size=10**400), r"world_size"),
    (lambda m: m["state"].update(extra={"__tensor__": 7}), r"state refers to tensor 7, which is not one stored entry"),
    (lambda m: m.pop("tensors"), r"tensors: Field required"),
])
def test_entries_pieces_and_names_must_agree(saved, capsys, edit, match):
    """Hand-crafted metadata (checksum recomputed) that would read bytes from elsewhere, beyond a file, twice,
    or through a name that is not there: refused with the field named, before any tensor is allocated."""
    path, _ = saved
    rewrite_metadata(path, edit)
    refused_everywhere(path, match, capsys)


# ----- item 3: load_consolidated checks what it reads ---------------------------------------------------------


@pytest.fixture
def exported(saved, tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    path, expected = saved
    out = zero.consolidate(path, tmp_path / "model.safetensors", progress=False)[0]
    assert same(zero.load_consolidated(out), expected)
    return out, expected


def test_a_truncated_export_is_refused(exported):
    out, _ = exported
    out.write_bytes(out.read_bytes()[:-1024])
    with pytest.raises(ValueError,
                       match=r"model.safetensors has \d+ bytes but its header describes \d+: it is truncated"):
        zero.load_consolidated(out)


@pytest.mark.parametrize("old,new", [('"F32"', '"I32"'), ('"shape":[32]', '"shape":[16]')])
def test_a_flipped_header_byte_of_an_export_is_refused(exported, old, new):
    out, _ = exported
    flip_text(out, old, new)
    with pytest.raises(ValueError, match=r"model.safetensors is damaged"):
        zero.load_consolidated(out)


@pytest.mark.parametrize("edit,match", [
    (lambda h: h["out.bias"].update(data_offsets=[h["out.bias"]["data_offsets"][0], 10**6]),
     r"is damaged: tensor 'out.bias' is F32 of shape \(8,\), 32 bytes, but its data_offsets \[\d+, 1000000\] hold"),
    (lambda h: h["out.bias"].update(shape=[2**34], data_offsets=[h["out.bias"]["data_offsets"][0],
                                                                 h["out.bias"]["data_offsets"][0] + 2**36]),
     r"model.safetensors (is damaged: tensor '.*' starts at data byte|has \d+ bytes but its header describes)"),
    (lambda h: h["out.bias"].update(dtype="F64"), r"is damaged: tensor 'out.bias' is F64 of shape \(8,\), 64 bytes"),
    (lambda h: h["__metadata__"].pop("zero.checksums"), r"carries no zero.checksums in its header"),
])
def test_an_export_header_beyond_its_file_is_refused(exported, edit, match):
    out, _ = exported
    rewrite_header(out, edit)
    with pytest.raises(ValueError, match=match):
        zero.load_consolidated(out)


def test_an_absurd_header_length_is_refused(exported):
    out, _ = exported
    out.write_bytes((2**40).to_bytes(8, "little") + out.read_bytes()[8:])
    with pytest.raises(ValueError, match=r"model.safetensors is truncated or damaged: its header claims 1099511627776"):
        zero.load_consolidated(out)


def test_an_index_naming_a_file_outside_the_export_is_refused(saved, tmp_path):
    path, expected = saved
    files = zero.consolidate(path, tmp_path / "hf", max_shard_size="1KB", progress=False)
    assert len(files) > 2 and same(zero.load_consolidated(tmp_path / "hf"), expected)
    index = json.loads(files[-1].read_text())
    first = files[0].name
    shutil.copy(files[0], tmp_path / "outside.safetensors")
    index["weight_map"] = {k: "../outside.safetensors" if v == first else v for k, v in index["weight_map"].items()}
    files[-1].write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"maps '.*' to '../outside.safetensors', which is not a file name inside"):
        zero.load_consolidated(tmp_path / "hf")
    shutil.copy(tmp_path / "outside.safetensors", files[1])  # a shard swapped for another
    index["weight_map"] = {k: first if v == "../outside.safetensors" else v for k, v in index["weight_map"].items()}
    files[-1].write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{files[1].name} is not the shard that .* lists"):
        zero.load_consolidated(tmp_path / "hf")


def test_a_stale_export_of_the_other_layout_is_replaced_or_refused(saved, tmp_path):
    """An export into a directory holding the other layout: zero's own stale one is removed (``from_pretrained``
    would read a stale ``model.safetensors`` first); someone else's is refused; both at once is refused."""
    path, expected = saved
    out = tmp_path / "hf"
    zero.consolidate(path, out, progress=False)
    zero.consolidate(path, out, max_shard_size="1KB", progress=False)
    assert not (out / "model.safetensors").exists() and same(zero.load_consolidated(out), expected)
    zero.consolidate(path, out, progress=False)
    assert not (out / "model.safetensors.index.json").exists() and same(zero.load_consolidated(out), expected)
    (out / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        zero.load_consolidated(out)
    with pytest.raises(ValueError, match="index.json exists and zero did not write it"):
        zero.consolidate(path, out, progress=False)


# ----- item 4: names stay inside the checkpoint ----------------------------------------------------------------


@pytest.mark.parametrize("absolute", [False, True])
def test_a_part_name_leading_outside_is_refused(saved, capsys, absolute):
    """A part named ``../x`` or by an absolute path was read; here a valid copy lies there, so the old code
    loaded it without a word."""
    path, _ = saved
    name = str(path.parent / "outside.safetensors") if absolute else "../outside.safetensors"
    shutil.copy(path / PART, path.parent / "outside.safetensors")
    rewrite_metadata(path, lambda m: m["files"][0].update(name=name))
    refused_everywhere(path, rf"the files must be \['{PART}'\] \(one per saving rank\), not \['{name}'\]", capsys)


def test_a_part_that_is_a_symlink_is_followed_and_verified(saved, tmp_path):
    """Decided: a part may be a symlink (a deduplicating store); its bytes are checked all the same."""
    path, expected = saved
    elsewhere = tmp_path / "store" / PART
    elsewhere.parent.mkdir()
    (path / PART).rename(elsewhere)
    (path / PART).symlink_to(elsewhere)
    assert same(loaded(path), expected)
    data = bytearray(elsewhere.read_bytes())
    data[-1] ^= 0x40
    elsewhere.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{PART} is corrupted: the bytes of"):
        loaded(path)


# ----- item 5: a save deletes only what zero wrote -------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".partial", ".replaced"])
def test_a_users_directory_beside_the_checkpoint_is_never_deleted(saved, suffix):
    path, expected = saved
    mine = path.with_name(path.name + suffix)
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "todo.txt").write_text("keep me")
    model, opt = tiny(seed=2)
    with pytest.raises(FileExistsError, match=rf"{mine} exists and .* not ours to delete"):
        zero.save_checkpoint(path, model, opt, progress=False)
    assert (mine / "notes" / "todo.txt").read_text() == "keep me"
    assert same(loaded(path), expected)  # the checkpoint is untouched too


def test_a_dangling_symlink_or_a_file_at_path_is_refused(tmp_path):
    model, opt = tiny()
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match=r"link \(a symlink to .*nowhere\) exists and is not a zero checkpoint"):
        zero.save_checkpoint(tmp_path / "link", model, opt, progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="file exists and is not a zero checkpoint"):
        zero.save_checkpoint(tmp_path / "file", model, opt, progress=False)
    assert (tmp_path / "file").read_text() == "x" and (tmp_path / "link").is_symlink()


# ----- items 6 and 7: crashes at every step, PATH a symlink ----------------------------------------------------


class Crash(BaseException):
    """A process killed here: no ``except Exception`` handler runs."""


@contextmanager
def crash_at(monkeypatch, k: int, error: type[BaseException] = Crash, only: tuple[str, ...] = ()):
    """Raise ``error`` instead of the ``k``-th file-system change (rename, unlink, rmdir; or only those named in
    ``only``) from here on; yields a list whose length says how many changes ran."""
    done: list[str] = []

    def wrap(name):
        real = getattr(os, name)

        def change(*args, **kwargs):
            if only and name not in only:
                return real(*args, **kwargs)
            if len(done) == k:
                raise error(f"{name}{args}")
            done.append(name)
            return real(*args, **kwargs)
        return change

    with monkeypatch.context() as patch:
        for name in ("rename", "replace", "unlink", "rmdir"):
            patch.setattr(os, name, wrap(name))
        yield done


def save_crashing_at(monkeypatch, k: int, path: Path, model, opt) -> bool:
    """Save ``model`` and ``opt`` to ``path`` with a crash at the ``k``-th file-system change (``crash_at``):
    whether the save finished before it."""
    with crash_at(monkeypatch, k):
        try:
            zero.save_checkpoint(path, model, opt, progress=False)
        except Crash:
            return False
    return True


def state_after_crash(root: Path, k: int, monkeypatch, link: bool) -> tuple[Path, dict, dict, bool]:
    """A checkpoint ``A`` at ``root/ckpt`` (a symlink to ``root/target`` with ``link``), then a save of ``B`` over
    it stopped at the ``k``-th change. Returns the path, A's and B's weights, and whether the save finished."""
    model, opt = tiny()
    step(model, opt)
    path = root / "ckpt"
    zero.save_checkpoint(root / "target" if link else path, model, opt, progress=False)
    if link:
        path.symlink_to(root / "target")
    a = weights(model, opt)
    step(model, opt, seed=1)
    b = weights(model, opt)
    return path, a, b, save_crashing_at(monkeypatch, k, path, model, opt)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name not in ("ckpt", "target"))


@pytest.mark.parametrize("link", [False, True], ids=["directory", "symlink"])
def test_a_crash_at_any_step_leaves_the_previous_or_the_new_checkpoint(tmp_path, monkeypatch, link):
    """At every step of a save over ``A``: loading gives ``A`` exactly until the old checkpoint is set aside, ``B``
    exactly from then on (from ``PATH.partial`` between the two renames); the next save finishes or clears what
    the crash left and leaves nothing beside the checkpoint; a symlink's target is never touched."""
    outcomes = []
    for k in range(100):
        root = tmp_path / f"k{k}"
        root.mkdir()
        path, a, b, finished = state_after_crash(root, k, monkeypatch, link)
        got = loaded(path)
        assert same(got, b) if not path.exists() else same(got, a) or same(got, b), k  # the newest complete save
        outcomes.append("B" if same(got, b) else "A")
        model, opt = tiny(seed=3)
        zero.save_checkpoint(path, model, opt, progress=False)
        assert same(loaded(path), weights(model, opt)) and leftovers(root) == [], (k, leftovers(root))
        assert not path.is_symlink()
        if link:
            assert same(loaded(root / "target"), a)  # the link's target, as it was
        if finished:
            break
    assert finished and outcomes == sorted(outcomes) and outcomes[0] == "A", outcomes  # A... then B...
    print(f"{len(outcomes)} crash points: {''.join(outcomes)}")


def test_a_crash_in_the_first_save_leaves_nothing_or_the_complete_save(tmp_path, monkeypatch):
    """No checkpoint before: until the metadata is written loading is refused naming the unfinished save, then it
    reads the complete save (from ``PATH.partial`` until the rename); the next save clears or publishes it."""
    outcomes = []
    for k in range(100):
        path = tmp_path / f"k{k}" / "ckpt"
        model, opt = tiny()
        finished = save_crashing_at(monkeypatch, k, path, model, opt)
        try:
            outcomes.append("B" if same(loaded(path), weights(model, opt)) else "?")
        except ValueError as err:
            assert "ckpt.partial holds a save of it that was never finished" in str(err), str(err)
            outcomes.append("-")
        except FileNotFoundError:
            outcomes.append("-")
        complete = path.exists() or (path.with_name("ckpt.partial") / METADATA).is_file()
        assert (outcomes[-1] == "B") == complete, (k, outcomes)
        zero.save_checkpoint(path, *tiny(seed=7), progress=False)
        assert leftovers(path.parent) == []
        if finished:
            break
    assert finished and outcomes == sorted(outcomes, key="-B".index) and "?" not in outcomes, outcomes


def test_a_second_crash_after_a_crash_between_the_renames_loses_nothing(tmp_path, monkeypatch):
    """Item 6: a save stopped between its renames (``PATH`` missing, the complete save in ``PATH.partial``), then
    another save stopped at each step: loading always gives the first save's or the second's tensors."""
    between = None
    for k in range(100):
        root = tmp_path / f"probe{k}"
        root.mkdir()
        path, _, b, finished = state_after_crash(root, k, monkeypatch, link=False)
        assert not finished
        if not path.exists() and path.with_name("ckpt.partial").exists():
            between = k
            assert same(loaded(path), b)  # read from PATH.partial, and said so
            break
    assert between is not None
    for k in range(100):
        root = tmp_path / f"second{k}"
        root.mkdir()
        path, _, b, _ = state_after_crash(root, between, monkeypatch, link=False)
        model, opt = tiny(seed=4)
        c = weights(model, opt)
        finished = save_crashing_at(monkeypatch, k, path, model, opt)
        got = loaded(path)
        assert same(got, b) or same(got, c), k
        if finished:
            assert same(got, c)
            break
    assert finished


def test_a_failure_after_publishing_is_a_warning_and_the_next_save_tidies_up(saved, monkeypatch):
    """Once the new checkpoint is renamed into place the save has succeeded: failing to remove the old one is a
    warning, not an error; the next save removes it (zero's marker claims it)."""
    path, _ = saved
    model, opt = tiny(seed=6)
    with crash_at(monkeypatch, 0, error=PermissionError, only=("rmdir",)):
        with pytest.warns(UserWarning, match=rf"saved {path}, but could not remove {path}.replaced"):
            zero.save_checkpoint(path, model, opt, progress=False)
    assert same(loaded(path), weights(model, opt)) and path.with_name("ckpt.replaced").exists()
    zero.save_checkpoint(path, model, opt, progress=False)
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]


def test_saving_through_a_symlink_replaces_the_link_and_says_so(saved, capsys):
    """Item 7: the save published the checkpoint and then raised ``OSError: Cannot call rmtree on a symbolic link``.
    Decided: PATH is replaced, not followed; the directory it pointed to stays as it was."""
    path, expected = saved
    link = path.with_name("latest")
    link.symlink_to(path)
    assert same(loaded(link), expected)  # loading follows it
    model, opt = tiny(seed=5)
    capsys.readouterr()
    assert zero.save_checkpoint(link, model, opt) == link
    err = capsys.readouterr().err
    assert f"saved {link} (1 part; {link} was a symlink to {path}, which is left as it was)" in err, err
    assert not link.is_symlink() and same(loaded(link), weights(model, opt))
    assert same(loaded(path), expected)
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt", "latest"]
