"""Offload to disk at world size 1: the same numbers as CPU offload and as no offload (bit for bit), the optimizer
state in the file, checkpoints across placements, and the file's robustness (free space, run identity, removal).
The multi-rank comparison is in ``tests/distributed/offload_world.py``."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from pydantic import ValidationError

import zero
from tests.readouts import flat_params
from tests.toy import Net, batch, train_net
from zero import ZeroConfig, ZeroOptimizer
from zero.runtime.buffers.placement import Where
from zero.runtime.offload.disk import HEADER_BYTES, check_disk_space, planned_disk_bytes

PRECISIONS = {"fp32": {}, "bf16": {"param_dtype": "bf16"}, "fp16": {"param_dtype": "fp16"}}
CASES = [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")]


def build(stage: int, offload: dict, precision: dict | None = None, make=None, **kwargs) -> tuple[Net, ZeroOptimizer]:
    torch.manual_seed(0)
    model = Net()
    make = make or (lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True))
    opt = ZeroOptimizer(make(model.parameters()), model, stage=stage, offload=offload, precision=precision or {},
                        bucket_size_mb=1e-4, **kwargs)
    return model, opt


def train(model: Net, opt: ZeroOptimizer, steps: int = 4, first: int = 0) -> torch.Tensor:
    """``no_sync`` accumulation of two micro-batches and clipping (``train_net``); the whole parameters (fp32)."""
    train_net(model, opt, steps, first)
    return flat_params(model, opt).float()


def disk(what: str, path, **more) -> dict:
    return {what: "disk", "path": str(path), **more}


def offload_files(path) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.startswith("zero-offload-"))


@pytest.mark.parametrize("stage,what", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_disk_offload_changes_no_number(tmp_path, stage, what, precision):
    expected = train(*build(stage, {}, PRECISIONS[precision]))
    on_host = train(*build(stage, {what: "cpu"}, PRECISIONS[precision]))
    model, opt = build(stage, disk(what, tmp_path), PRECISIONS[precision])
    got = train(model, opt)
    assert torch.equal(got, expected) and torch.equal(got, on_host)
    file = opt.runtime.placements.disk.file
    assert file.stats.prefetched > 0 and file.stats.evicted > 0  # the step walked the buckets through the window
    labels = {item.label for b in opt.partition.trainable_buckets for _, item in b.roles()}
    assert "master weights (disk)" in labels
    params = {i.label for b in opt.partition.buckets for k, i in b.roles() if k == "parameters"}
    assert ("shard (disk)" in params) == (what == "params")
    opt.close()
    assert offload_files(tmp_path) == []


def _in_file(opt: ZeroOptimizer, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes lie in one of the offload file's regions."""
    regions = [b for per_bucket in opt.runtime.paging.state.regions.values() for b in per_bucket.values()]
    regions += [b.buffers["master"] for b in opt.partition.trainable_buckets]
    start = tensor.data_ptr()
    for buffer in regions:
        base = buffer.storage_tensor.data_ptr()
        if base <= start and start + tensor.numel() * tensor.element_size() <= base + buffer.nbytes:
            return buffer.placement.where is Where.DISK
    return False


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_the_optimizer_state_lives_in_the_file(tmp_path, name):
    """Every per-element state tensor the wrapped optimizer holds (Adam's moments, SGD's momentum) is a view of the
    offload file, after the first step and after a load; the scalar step count stays in memory."""
    make = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, fused=True),
        "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    }[name]
    model, opt = build(2, disk("optimizer", tmp_path), make=make)
    expected = train(*build(2, {}, make=make))
    assert torch.equal(train(model, opt), expected)
    per_element = [(k, v) for s in opt.inner.state.values() for k, v in s.items() if v.dim()]
    assert per_element and all(_in_file(opt, v) for _, v in per_element)
    assert {k for k, _ in per_element} == set(opt.runtime.paging.state.layout)
    saved = opt.state_dict()
    opt.load_state_dict(saved)
    assert all(_in_file(opt, v) for s in opt.inner.state.values() for v in s.values() if v.dim())
    assert all(not _in_file(opt, v) for s in opt.inner.state.values() for v in s.values() if not v.dim())


@pytest.mark.parametrize("stage,what", [(2, "optimizer"), (3, "params")], ids=str)
def test_checkpoints_move_between_disk_cpu_and_no_offload(tmp_path, stage, what):
    """Saved under one placement, loaded under another, the run goes on as if uninterrupted."""
    expected = train(*build(stage, {}), steps=4)
    for saver, loader in [(disk(what, tmp_path / "a"), {}), ({what: "cpu"}, disk(what, tmp_path / "b"))]:
        model, opt = build(stage, saver)
        train(model, opt, steps=2)
        zero.save_checkpoint(tmp_path / "ckpt", model, opt)
        opt.close()
        model, opt = build(stage, loader)
        zero.load_checkpoint(tmp_path / "ckpt", model, opt)
        if "path" in loader:  # the loaded state lives in the file
            assert all(_in_file(opt, v) for s in opt.inner.state.values() for v in s.values() if v.dim())
        assert torch.equal(train(model, opt, steps=2, first=2), expected)
        opt.close()


def test_the_file_is_removed_when_the_optimizer_is_dropped_and_only_ours(tmp_path):
    theirs = tmp_path / "zero-offload-0000000000000000-rank00000-of-00001.bin"
    theirs.write_bytes(b"a file of someone else's, with our naming pattern")
    model, opt = build(3, disk("params", tmp_path))
    train(model, opt, steps=1)
    ours = opt.runtime.placements.disk.file.path
    other_model, other = build(3, disk("params", tmp_path))  # a second run in the same directory: its own file
    assert len(offload_files(tmp_path)) == 3 and ours.exists()
    del opt
    gc.collect()
    assert not ours.exists() and theirs.exists() and len(offload_files(tmp_path)) == 2
    other.close()
    assert offload_files(tmp_path) == [theirs.name]


def test_a_file_replaced_under_the_run_is_never_read(tmp_path):
    """The header names this run; another run's header, or a file replaced under us, fails the next read-ahead."""
    model, opt = build(2, disk("optimizer", tmp_path))
    train(model, opt, steps=1)
    path = opt.runtime.placements.disk.file.path
    with open(path, "r+b") as f:
        header = f.read(HEADER_BYTES)
        f.seek(0)
        f.write(header.replace(b'"run": "', b'"run": "x'))
    with pytest.raises(RuntimeError, match="is not this run's any more"):
        train(model, opt, steps=1, first=1)
    with open(path, "r+b") as f:
        f.write(header)
    train(model, opt, steps=1, first=1)  # its own header back: reads go on
    path.rename(path.with_suffix(".moved"))
    path.with_suffix(".moved").rename(path)  # the same inode again
    os.unlink(path)
    path.write_bytes(header)  # a new file with the same header and name, not the one mapped
    with pytest.raises(RuntimeError, match="is not this run's any more"):
        train(model, opt, steps=1, first=2)
    path.unlink()


def test_free_space_is_checked_before_anything_is_allocated(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"needs 1,000,000,000,000,000,000 bytes .* free"):
        check_disk_space(tmp_path / "not" / "yet", 10**18)
    stat = os.statvfs(tmp_path)
    full = type(stat)((4096, 4096, 0, 0, 1) + stat[5:])
    monkeypatch.setattr(zero.runtime.offload.disk.os, "statvfs", lambda path: full)
    with pytest.raises(ValueError, match="offload to disk needs .* bytes"):
        build(2, disk("optimizer", tmp_path))
    assert offload_files(tmp_path) == []


def test_the_free_space_check_counts_the_file_exactly(tmp_path):
    """What the check asks for (the plan's bytes on disk, before anything is allocated) is the file's size."""
    model, opt = build(3, disk("params", tmp_path), PRECISIONS["bf16"])
    file = opt.runtime.placements.disk.file
    assert planned_disk_bytes(opt.partition.plan, opt.runtime.paging.state.layout) == file.size
    assert os.stat(file.path).st_blocks * 512 >= file.size  # allocated on disk, not sparse
    train(model, opt, steps=1)
    assert planned_disk_bytes(opt.partition.plan, opt.runtime.paging.state.layout) == file.size
    exact = HEADER_BYTES + sum(
        b.nbytes for bucket in opt.partition.buckets
        for b in bucket.offloaded_buffers() if b.placement.where is Where.DISK
    ) + sum(b.nbytes for regions in opt.runtime.paging.state.regions.values() for b in regions.values())
    assert exact <= file.size < exact + 4096 * 5 * len(opt.partition.buckets)  # (tiny buckets: a page each)


class LateState(torch.optim.SGD):
    """Makes a per-element state tensor only from its second step: the probe at construction cannot see it."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["calls"] = state.get("calls", 0) + 1
                if state["calls"] == 2:
                    state["late"] = torch.zeros_like(p)


def test_an_optimizer_whose_state_the_probe_cannot_see_is_refused_by_name(tmp_path):
    model, opt = build(2, disk("optimizer", tmp_path), make=lambda params: LateState(params, lr=0.1),
                       elementwise_optimizers=["LateState"])  # (a subclass: stepped whole unless declared)
    with pytest.raises(ValueError, match="made per-element state 'late'.*offload.optimizer='cpu'"):
        train(model, opt, steps=2)


def test_bad_disk_offload_input_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValidationError, match="needs offload.path"):
        ZeroConfig(stage=2, offload={"optimizer": "disk"})
    with pytest.raises(ValidationError, match="offload.path is used only with 'disk'"):
        ZeroConfig(stage=2, offload={"optimizer": "cpu", "path": str(tmp_path)})
    with pytest.raises(ValidationError, match="set offload.optimizer='disk' or leave it unset"):
        ZeroConfig(stage=3, offload={"params": "disk", "optimizer": "cpu", "path": str(tmp_path)})
    with pytest.raises(ValidationError, match="use it with optimizer='cpu', not 'disk'"):
        ZeroConfig(stage=2, offload={"optimizer": "disk", "path": str(tmp_path), "delayed_step": True})
    with pytest.raises(ValidationError, match="offload.params='disk' needs stage 3"):
        ZeroConfig(stage=2, offload={"params": "disk", "path": str(tmp_path)})
    with pytest.raises(ValidationError, match="offload.optimizer='disk' needs stage 1, 2 or 3"):
        ZeroConfig(stage=0, offload={"optimizer": "disk", "path": str(tmp_path)})
    with pytest.raises(ValidationError, match="buffer_count"):
        ZeroConfig(stage=2, offload={"optimizer": "disk", "path": str(tmp_path), "buffer_count": 0})
    assert offload_files(tmp_path) == []


@pytest.mark.parametrize("buffer_count", [1, 3])
def test_any_window_gives_the_same_numbers(tmp_path, buffer_count):
    expected = train(*build(3, {}))
    model, opt = build(3, disk("params", tmp_path, buffer_count=buffer_count))
    assert torch.equal(train(model, opt), expected)


def user_loop(model: Net, opt: ZeroOptimizer) -> torch.Tensor:
    """The Trainer's way: three backward passes without no_sync(), model.zero_grad(), a step of whatever has a
    gradient, in fp32."""
    for step in range(3):
        for k in range(3):
            model(batch(step + 10 * k), k == 2).div(3).backward()
        opt.clip_grad_norm_(0.1)
        opt.step()
        model.zero_grad()
    return flat_params(model, opt).float()


@pytest.mark.parametrize("stage,what", [(2, "optimizer"), (3, "params")], ids=str)
def test_the_trainers_path_is_exact_and_torchs_own_clip_refused(tmp_path, stage, what):
    expected = user_loop(*build(stage, {}))
    model, opt = build(stage, disk(what, tmp_path))
    assert torch.equal(user_loop(model, opt), expected)
    model(batch(0)).backward()
    with pytest.raises(RuntimeError, match=r"sharded across ranks.*opt\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="changed dtype or device after ZeroOptimizer wrapped"):
        model.to(torch.float64)  # a cast after wrapping: refused by name, on disk as in memory
