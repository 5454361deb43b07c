"""benchmarks/disk_offload.py's helpers on a tiny model: the theory's bytes per element are the buffers' dtype sizes,
the /proc readers read what they say, the bandwidth test cleans up, and a toy run writes its JSON (no large run)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from zero.models import GPTConfig

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("disk_offload", ROOT / "benchmarks" / "disk_offload.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="reads Linux's /proc/self")


@pytest.fixture
def built(request, tmp_path):
    model, opt = bench.build(TINY, request.param, bench.OFFLOADS["disk"](str(tmp_path), 2))
    yield model, opt
    opt.close()
    bench.KEEP.clear()


@pytest.mark.parametrize("built", ["fp32", "bf16"], indirect=True)
def test_theory_counts_each_buffer_at_its_dtype_size(built):
    model, opt = built
    t = bench.theory(opt, model.blocks[-1])
    buckets = opt.runtime.partition.trainable_buckets
    state = opt.runtime.paging.state.regions
    for bucket in buckets:  # every role, at its own buffer's dtype size
        size = {**{k: bucket.buffers[k].dtype.itemsize for k in ("shard", "grad_shard", "master")},
                **{k: b.dtype.itemsize for k, b in state[bucket.index].items()}}
        assert "master_grad" not in bucket.buffers  # (fp32 reduce: the gradient shard is the optimizer's)
        assert size in t["per_element"]
    low = opt.runtime.config.precision.enabled
    assert t["per_element"] == [{"shard": 2 if low else 4, "grad_shard": 4, "master": 4, "exp_avg": 4, "exp_avg_sq": 4}]
    n = t["elements"]
    assert n == sum(b.layout.chunk_numel for b in buckets)  # world size 1: the chunk is the bucket
    s = 2 if low else 4
    assert t["step"] == {"read": n * (4 + 4 + s + 8), "write": n * (4 + s + 8)}
    assert t["forward_backward"]["write"] == n * 4
    # blocks.0 is gathered twice; blocks.1 (last in forward) and the root once
    twice = sum(b.layout.chunk_numel for b in buckets if b.unit.module is model.blocks[0])
    assert t["forward_backward"]["read"] == (n + twice) * s
    assert t["gathers"] == len(buckets) + sum(b.unit.module is model.blocks[0] for b in buckets)
    assert t["window_bytes"] == sum(sorted(b.layout.chunk_numel * (s + 16) for b in buckets)[-2:])
    units = {id(b.unit): b.unit for b in buckets}.values()
    assert t["largest_unit_bytes"] == max(sum(b.param_buffer.nbytes for b in buckets if b.unit is u) for u in units)


def test_readers_and_sampler():
    io = bench.proc_io()
    assert {"read_bytes", "write_bytes", "cancelled_write_bytes"} <= io.keys()
    assert abs(bench.rss() - bench.status_bytes("VmRSS")) < 16 * 2**20
    assert bench.status_bytes("VmHWM") >= bench.status_bytes("VmRSS") - 2**20
    reset = bench.reset_peak_rss()
    assert isinstance(reset, bool)
    with bench.sample_rss(1e-3) as seen:
        block = torch.ones(8 * 2**20, dtype=torch.uint8)  # 8 MiB, touched
        block.add_(1)
        del block
    assert seen["samples"] >= 1 and seen["peak"] > 0


def test_bandwidth_and_drop_cache_leave_nothing(tmp_path):
    result = bench.disk_bandwidth(tmp_path, 2**20, 2**18)
    assert result["write_MBps"] > 0 and result["read_MBps"] > 0
    assert list(tmp_path.iterdir()) == []
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4096))
    bench.drop_cache(path)
    assert path.read_bytes() != b""


def test_toy_run_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "out.json"
    bench.main(["--path", str(tmp_path / "d"), "--json", str(out), "--bandwidth-gib", "0.001", "--block-mib", "1",
                "--vocab", "64", "--seq-len", "8", "--d-model", "32", "--layers", "2", "--heads", "2",
                "--warmup", "1", "--steps", "1", "--skip-search"])
    data = json.loads(out.read_text())
    bench.KEEP.clear()
    assert set(data["traffic"]) == {"fp32", "bf16"}
    for r in data["traffic"].values():
        for key in ("fb_read_x", "fb_write_x", "step_read_x", "step_write_x", "step_x_disk"):
            assert r[key] > 0, key
        assert r["peak_x_window"] >= 0  # (0 when the step needs no memory beyond what the process already holds)
        assert r["gathers_x"] == 1.0
    assert "step / disk time" in capsys.readouterr().out
    assert bench.verdict(1.0, "step_x_disk").endswith("PASS)") and bench.verdict(0.5, "largest_x_cpu").endswith("FAIL)")
