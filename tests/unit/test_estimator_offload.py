"""The estimator prices offload: device, host memory and disk apart. The offload file it predicts is the one
``ZeroOptimizer(offload={"optimizer": "disk", ...})`` makes (world size 1, against the real buffers), host memory
with offload to disk is a window of ``buffer_count`` buckets, the planner keeps to a host budget and chooses disk
when only disk fits, and ``zero estimate --host-memory`` prints and writes host and disk bytes."""

from __future__ import annotations

import json
import re

import pytest
import torch

from zero import ZeroOptimizer
from zero.cli.main import main as cli_main
from zero.estimator import Workload, estimate, plan
from zero.models import GPT, GPTConfig, synthetic_batch
from zero.runtime.buffers.placement import Where
from zero.runtime.offload.disk import HEADER_BYTES, PAGE, round_up
from zero.sizes import format_bytes

pytestmark = pytest.mark.filterwarnings("ignore:offloaded AdamW steps on the host")

SMALL = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=2)
# big enough for sizes in MiB (the command line's smallest unit), with stage-3 units much smaller than the model
MEDIUM = ["--vocab", "4096", "--seq-len", "8", "--d-model", "128", "--layers", "8", "--heads", "2"]
PRECISIONS = {"fp32": {}, "mixed": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
              "mixed-fp32-reduce": {"param_dtype": "bf16"}}
BUCKET_MB = 0.01  # several buckets at stages 1-2 too


def _workload(cfg: GPTConfig = SMALL) -> Workload:
    return Workload(lambda: GPT(cfg), lambda m, x, y: m.loss(x, y), lambda micro: synthetic_batch(0, micro, cfg))


def _on_disk(opt: ZeroOptimizer) -> list[list[int]]:
    """Per bucket, the bytes of each buffer the runtime placed in the offload file (its optimizer-state regions too)."""
    regions = opt.runtime.paging.state.regions
    return [
        [b.nbytes for b in bucket.offloaded_buffers() if b.placement.where is Where.DISK]
        + [b.nbytes for b in regions.get(bucket.index, {}).values()]
        for bucket in opt.partition.buckets
    ]


@pytest.mark.parametrize(
    ("stage", "precision", "offload"),
    [(1, "fp32", {"optimizer": "disk"}), (2, "mixed", {"optimizer": "disk"}),
     (3, "mixed-fp32-reduce", {"optimizer": "disk"}), (3, "fp32", {"params": "disk"}),
     (3, "mixed", {"optimizer": "disk", "params": "cpu", "buffer_count": 1})],
    ids=str,
)
def test_the_disk_estimate_is_the_file_zero_optimizer_makes(tmp_path, stage, precision, offload):
    """disk: the header and every buffer the plans put on disk plus the optimizer's state regions, each rounded up to
    a page as the file allocates it; host: the largest buffer_count buckets of that file (plus what lives in host
    memory anyway: a parameter shard offloaded to the CPU, Adam's step counts)."""
    buffer_count = offload.get("buffer_count", 2)
    e = estimate(_workload(), stage=stage, world_size=1, micro_batch=2, precision=precision, bucket_size_mb=BUCKET_MB,
                 offload=offload.get("optimizer", "none"), params_offload=offload.get("params", "none"),
                 buffer_count=buffer_count)
    assert e.optimizer_offload == "disk" and e.offload
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, bucket_size_mb=BUCKET_MB,
                        precision=PRECISIONS[precision], offload={**offload, "path": str(tmp_path)})
    x, y = synthetic_batch(0, 2, SMALL)
    model.loss(x, y).backward()
    opt.step()  # the optimizer's state exists
    file = opt.runtime.placements.disk.file
    buckets = _on_disk(opt)
    assert len(buckets) > 1
    exact = HEADER_BYTES + sum(map(sum, buckets))
    assert e.disk == file.size == HEADER_BYTES + sum(round_up(n) for sizes in buckets for n in sizes)
    assert exact <= e.disk < exact + PAGE * sum(map(len, buckets))
    window = sum(sorted((sum(round_up(n) for n in sizes) for sizes in buckets), reverse=True)[:buffer_count])
    resident = sum(b.nbytes for bucket in opt.partition.buckets for b in bucket.params.offloaded()  # params on the CPU
                   if b.placement.where is Where.HOST)
    loose = sum(t.untyped_storage().nbytes() for state in opt.inner.state.values() for t in state.values()
                if isinstance(t, torch.Tensor) and not t.dim())  # the step counts, in memory
    # (the step counts are priced per element, from a traced bucket's: to within their own few bytes)
    assert e.host == pytest.approx(window + resident + loose, abs=loose)
    assert e.host < e.disk or buffer_count >= len(buckets)
    opt.close()


@pytest.mark.parametrize(("stage", "precision", "params"), [(1, "fp32", "none"), (2, "mixed-fp32-reduce", "none"),
                                                            (3, "mixed", "cpu")], ids=str)
def test_the_cpu_estimate_is_the_host_memory_zero_optimizer_holds(stage, precision, params):
    """Host memory with offload to the CPU: the host buffers (the fp32 master included, in fp32 runs too) and the
    optimizer's state; no disk."""
    e = estimate(_workload(), stage=stage, world_size=1, micro_batch=2, precision=precision, offload=True,
                 params_offload=params)
    assert e.optimizer_offload == "cpu" and e.params_offload == params and e.disk == 0
    torch.manual_seed(0)
    model = GPT(SMALL)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage,
                        precision=PRECISIONS[precision], offload={"optimizer": "cpu", "params": params})
    x, y = synthetic_batch(0, 2, SMALL)
    model.loss(x, y).backward()
    opt.step()
    buffers = sum(b.nbytes for bucket in opt.partition.buckets
                  for b in bucket.offloaded_buffers() if b.placement.where.on_host)
    state = sum(t.untyped_storage().nbytes() for s in opt.inner.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    assert e.host == pytest.approx(buffers + state, abs=64)


def test_disk_keeps_the_device_bytes_of_cpu_offload_and_shrinks_host_memory():
    work = _workload()
    kw = dict(stage=3, world_size=1, micro_batch=2)
    none, cpu, disk = (estimate(work, offload=o, **kw) for o in ("none", "cpu", "disk"))
    assert cpu.categories == disk.categories and cpu.peak < none.peak  # the same buffers leave the device
    assert none.host == none.disk == cpu.disk == 0
    assert 0 < disk.host < cpu.host < disk.disk  # a window of the file in memory; the file, page-rounded
    hosts = [estimate(work, offload="disk", buffer_count=n, **kw).host for n in (1, 2, 3, 64)]
    assert hosts[0] < hosts[1] < hosts[2] == hosts[3]  # 3 units: a window of 3 or more is the whole file
    assert estimate(work, offload=True, **kw) == cpu and estimate(work, offload=False, **kw) == none
    assert estimate(work, offload="cpu", stage=2, world_size=1, micro_batch=2).optimizer_state == 0


def test_parameter_offload_takes_the_shards_off_the_device():
    work = _workload()
    kw = dict(stage=3, world_size=2, micro_batch=2)
    layout = work.layout(3, 2)
    shards = sum(b.shard for b in layout.buckets)
    optimizer_only, with_params = estimate(work, offload="cpu", **kw), estimate(work, params_offload="cpu", **kw)
    assert with_params.optimizer_offload == "cpu"  # (the parameters' offload takes the optimizer's side along)
    assert optimizer_only.parameters - with_params.parameters == shards
    assert with_params.host - optimizer_only.host == shards
    on_disk = estimate(work, params_offload="disk", **kw)
    assert on_disk.optimizer_offload == "disk" and on_disk.parameters == with_params.parameters
    assert on_disk.disk - estimate(work, offload="disk", **kw).disk >= shards


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # (ZeroConfig's own rules and messages: the estimator validates the configuration as ZeroOptimizer does)
        (dict(offload="nvme"), "offload.optimizer='nvme' should be 'none', 'cpu' or 'disk'"),
        (dict(params_offload=True), "offload.params=True should be 'none', 'cpu' or 'disk'"),
        (dict(params_offload="cpu", stage=2), "offload.params='cpu' needs stage 3 .got stage 2.*Use stage=3"),
        (dict(params_offload="disk", offload="cpu", stage=3), "set offload.optimizer='disk'"),
        (dict(offload="disk", stage=0), "offload.optimizer='disk' needs stage 1, 2 or 3.*Use stage 1 or higher"),
        (dict(offload="disk", buffer_count=0), "offload.buffer_count\n.*greater than or equal to 1"),
    ],
    ids=str,
)
def test_invalid_offload_is_refused_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate(_workload(), **{"stage": 2, "world_size": 1, "micro_batch": 1, **kwargs})


def test_the_planner_keeps_to_a_host_budget_and_chooses_disk_when_only_disk_fits():
    work = _workload()
    kw = dict(world_size=1, micro_batch=1)
    on_device = min(estimate(work, stage=s, **kw).peak for s in range(4))
    offloaded = estimate(work, stage=3, offload="cpu", **kw)
    disk = estimate(work, stage=3, offload="disk", **kw)
    assert offloaded.peak < on_device and disk.host < offloaded.host
    gpu = (offloaded.peak + on_device) / 2 / 0.9  # only offload fits the device ...
    host = (disk.host + offloaded.host) / 2  # ... and only disk's window the host
    result = plan(work, gpu_memory=gpu, world_size=1, micro_batches=[1], host_memory=host)
    assert result.fits and {e.optimizer_offload for e in result.fits} == {"disk"}
    assert (result.fits[0].stage, result.fits[0].checkpointing) == (3, False)
    fit_the_device = [(e, why) for e, why in result.rejected if e.optimizer_offload == "cpu" and e.peak <= 0.9 * gpu]
    assert fit_the_device  # ... rejected for host memory alone
    for e, why in fit_the_device:
        assert why == (f"needs {format_bytes(e.host)} of host memory > {format_bytes(host)} (master weights, "
                       "gradients and optimizer state)")
    without = plan(work, gpu_memory=gpu, world_size=1, micro_batches=[1])  # no host budget: no disk (cpu fits)
    assert {e.optimizer_offload for e in without.fits} == {"cpu"}
    assert all(e.optimizer_offload != "disk" for e, _ in without.rejected)
    with pytest.raises(ValueError, match="host memory must be positive"):
        plan(work, gpu_memory=gpu, world_size=1, micro_batches=[1], host_memory=0)


def test_no_offload_comes_before_cpu_before_disk():
    result = plan(_workload(), gpu_memory=2**30, world_size=1, micro_batches=[1], host_memory=2**30)
    assert not result.rejected
    order = [e.optimizer_offload for e in result.fits if not e.checkpointing and e.stage == 2]
    assert order == ["none", "cpu", "disk"]
    assert [e.optimizer_offload for e in result.fits[:4]] == ["none"] * 4  # stages 0-3 without offload first


def test_cli_host_memory_prices_disk_and_prints_host_and_disk(capsys, tmp_path):
    path = tmp_path / "estimates.json"
    args = ["estimate", "--gpu-memory", "20MiB", "--host-memory", "10MiB", "--world-size", "2", "--micro-batch", "1",
            "--show", "100", "--json", str(path), *MEDIUM]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "host budget 10 MiB" in out and "disk: the offload file" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("configuration"))
    assert header.split()[1:10] == ["peak", "params", "grads", "optim", "activ", "temps", "comm", "host", "disk"]
    assert re.search(r"^  stage 3, micro-batch 1, disk offload +\d", out, re.MULTILINE)
    first = re.search(r"^to run the first: ZeroOptimizer\(optimizer, model, (.*)\)$", out, re.MULTILINE).group(1)
    assert eval(f"dict({first})") == {"stage": 3, "offload": {"optimizer": "disk", "path": "/local_nvme/zero"}}
    assert "of host memory > 10 MiB" in out
    data = json.loads(path.read_text())
    for entry in data["fits"] + data["rejected"]:
        assert type(entry["disk"]) is int and type(entry["host"]) is int
        assert (entry["disk"] > 0) == (entry["optimizer_offload"] == "disk")
    assert data["fits"] and all(e["optimizer_offload"] == "disk" and e["host"] <= 10 * 2**20 for e in data["fits"])


@pytest.mark.parametrize(("flag", "value"), [("--host-memory", "0"), ("--host-memory", "1023KiB"),
                                             ("--host-memory", "65TiB"), ("--host-memory", "lots"),
                                             ("--buffer-count", "0"), ("--buffer-count", "65")])
def test_cli_offload_options_out_of_range_exit_2(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["estimate", "--gpu-memory", "24", flag, value, *MEDIUM])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zero estimate: error: argument {flag}: expected a ") and err.count("\n") == 1
