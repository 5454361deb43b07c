"""Portable checkpoints in one process (``zero.save_checkpoint``/``load_checkpoint``/``consolidate``): resuming
across stages, precisions and offload bit for bit, what the files hold, and every refusal.

World size 1 and no process group; across world sizes see ``tests/distributed/test_checkpoint_world.py``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zero
from tests.checkpoints import rewrite_metadata
from tests.distributed.worlds import CFG, GLOBAL_BATCH, build_model, make_optimizer
from tests.readouts import flat_params
from zero.checkpoint.consolidate import shard_size_bytes
from zero.checkpoint.portable import tree
from zero.checkpoint.portable.reader import METADATA, Checkpoint
from zero.cli.main import main as cli_main
from zero.models import GPT, synthetic_batch

MIXED = {"param_dtype": "bf16"}
OFFLOAD = {"optimizer": "cpu"}


class MixedNet(nn.Module):
    """A tied-embedding GPT plus a frozen parameter, in the same call shape as ``ParityNet`` (which divides
    by an fp32 buffer, so it cannot run in bf16)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(CFG)
        self.frozen_bias = nn.Parameter(torch.randn(CFG.vocab_size) * 0.01, requires_grad=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, use_aux: bool) -> torch.Tensor:
        logits = (self.gpt(idx) + self.frozen_bias).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def model_for(seed: int, precision: dict | None = None) -> nn.Module:
    if precision is None:
        return build_model(seed)
    torch.manual_seed(seed)
    return MixedNet()


def build(stage: int, seed: int = 0, optimizer: str = "adamw", **overrides):
    model = model_for(seed, overrides.get("precision"))
    opt = zero.ZeroOptimizer(make_optimizer(optimizer, model), model, stage=stage, bucket_size_mb=0.01, **overrides)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(model, opt, scheduler, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        loss = model(x, y, step % 2 == 1)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def snapshot(model, opt) -> tuple[torch.Tensor, dict]:
    """Every parameter and the optimizer's shard (deep copies): what a refused load must leave alone."""
    return flat_params(model, opt), copy.deepcopy(opt.inner.state_dict())


def saved(tmp_path: Path, stage: int = 2, **overrides) -> tuple[Path, tuple]:
    model, opt, scheduler = build(stage, **overrides)
    train(model, opt, scheduler, range(3))
    path = tmp_path / "ckpt"
    zero.save_checkpoint(path, model, opt, scheduler=scheduler, extra={"epoch": 3}, progress=False)
    return path, (model, opt, scheduler)


# ----- resuming ----------------------------------------------------------------------------------------------

CASES = [
    ({"stage": 2}, {"stage": 3}),
    ({"stage": 3}, {"stage": 0}),
    ({"stage": 0}, {"stage": 1}),
    ({"stage": 1, "precision": MIXED}, {"stage": 3, "precision": MIXED, "offload": OFFLOAD}),
    ({"stage": 3, "precision": MIXED, "offload": {"optimizer": "cpu", "params": "cpu"}},
     {"stage": 2, "precision": MIXED}),
    ({"stage": 2, "offload": {"optimizer": "cpu", "delayed_step": True}},
     {"stage": 2, "offload": {"optimizer": "cpu", "delayed_step": True}}),
]


@pytest.mark.filterwarnings("ignore:offloaded AdamW steps on the host")
@pytest.mark.parametrize("before,after", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_resume_equals_continuing(tmp_path, before, after):
    """Save after 3 steps, load into a fresh run (other weights, other bucket size, ``after``'s settings) and
    train 3 more: the same losses, parameters and learning rates as going on without saving, bit for bit."""
    model, opt, scheduler = build(**before)
    train(model, opt, scheduler, range(3))
    zero.save_checkpoint(tmp_path / "c", model, opt, scheduler=scheduler, extra={"epoch": 3}, progress=False)
    expected = train(model, opt, scheduler, range(3, 6))
    model2 = model_for(1, after.get("precision"))
    opt2 = zero.ZeroOptimizer(make_optimizer("adamw", model2), model2, bucket_size_mb=0.02, **after)
    scheduler2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    assert zero.load_checkpoint(tmp_path / "c", model2, opt2, scheduler=scheduler2, progress=False) == {"epoch": 3}
    assert train(model2, opt2, scheduler2, range(3, 6)) == expected
    opt.flush()
    opt2.flush()
    assert torch.equal(flat_params(model2, opt2), flat_params(model, opt))
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


def test_fp16_loss_scale_resumes(tmp_path):
    path, (model, opt, _) = saved(tmp_path, stage=2, precision={"param_dtype": "fp16"})
    scale = opt.loss_scaler.state_dict()
    _, opt2, _ = build(2, seed=1, precision={"param_dtype": "fp16", "loss_scale": {"init_scale": 8.0}})
    zero.load_checkpoint(path, opt2.module, opt2, progress=False)
    assert opt2.loss_scaler.state_dict() == scale


def test_extra_round_trips_without_pickle(tmp_path):
    model, opt, _ = build(1)
    extra = {"rng": torch.get_rng_state(), "pos": (3, [1.5, None]), 7: {"nested": True}, "s": "x"}
    zero.save_checkpoint(tmp_path / "c", model, opt, extra=extra, progress=False)
    got = zero.load_checkpoint(tmp_path / "c", model, opt, progress=False)
    assert torch.equal(got["rng"], extra["rng"]) and got["pos"] == (3, [1.5, None]) and got[7] == {"nested": True}
    with pytest.raises(ValueError, match=r"cannot save function at extra.f: .*no pickled objects"):
        zero.save_checkpoint(tmp_path / "d", model, opt, extra={"f": lambda: 0}, progress=False)
    assert not (tmp_path / "d").exists()


def test_tree_keeps_types():
    tensors: list[torch.Tensor] = []
    value = {"a": (1, 2), "b": [torch.ones(2)], 3: None, "__x__": 1.0}
    encoded = tree.encode(value, tensors)
    json.dumps(encoded)
    back = tree.decode(json.loads(json.dumps(encoded)), lambda i: tensors[i])
    assert back["a"] == (1, 2) and back[3] is None and back["__x__"] == 1.0 and torch.equal(back["b"][0], torch.ones(2))


def test_weights_only_into_a_plain_model(tmp_path):
    path, (model, opt, _) = saved(tmp_path, stage=3)
    plain = build_model(seed=1)
    assert zero.load_checkpoint(path, plain, progress=False) == {"epoch": 3}
    assert torch.equal(flat_params(plain), flat_params(model, opt))
    assert torch.equal(plain.temperature, model.temperature)


def test_progress_reports_bytes(tmp_path):
    model, opt, _ = build(2)
    calls: list[tuple[int, int]] = []
    zero.save_checkpoint(tmp_path / "c", model, opt, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))


# ----- the files -----------------------------------------------------------------------------------------


def test_files_are_safetensors_with_checksums(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    path, (model, opt, _) = saved(tmp_path, stage=2)
    meta = json.loads((path / METADATA).read_text())
    assert meta["world_size"] == 1 and meta["stage"] == 2 and meta["step"] == 3
    assert meta["aliases"] == {"gpt.head.weight": "gpt.wte.weight"}  # the tied head, stored once
    assert not meta["tensors"]["frozen_bias"]["trainable"] and meta["tensors"]["temperature"]["kind"] == "buffer"
    part = safetensors.load_file(path / meta["files"][0]["name"])
    pieces = meta["tensors"]["scale"]["pieces"]
    assert torch.equal(part[pieces[0][3]], model.scale.detach().flatten())
    assert "exp_avg" in pieces[0][4] and "step" in pieces[0][4]


def test_saving_over_a_checkpoint_replaces_it_and_a_crash_between_renames_keeps_the_old(tmp_path):
    path, (model, opt, scheduler) = saved(tmp_path)
    first = flat_params(model, opt)
    train(model, opt, scheduler, range(3, 4))
    zero.save_checkpoint(path, model, opt, progress=False)
    assert not (tmp_path / "ckpt.replaced").exists() and not (tmp_path / "ckpt.partial").exists()
    assert Checkpoint(path).meta.step == 4
    # what a crash between the two renames leaves: only the old checkpoint, set aside
    zero.save_checkpoint(tmp_path / "old", *build(2)[:2], progress=False)
    (tmp_path / "old").rename(tmp_path / "new.replaced")
    assert Checkpoint(tmp_path / "new").path == tmp_path / "new.replaced"
    (tmp_path / "notes").mkdir()
    with pytest.raises(FileExistsError, match="not a zero checkpoint.*refusing to replace"):
        zero.save_checkpoint(tmp_path / "notes", model, opt, progress=False)
    assert first.numel() == flat_params(model, opt).numel()


# ----- refusals: nothing changes -------------------------------------------------------------------------


def _refused(path, model, opt, match: str, exc=ValueError) -> None:
    before = snapshot(model, opt)
    with pytest.raises(exc, match=match):
        zero.load_checkpoint(path, model, opt, progress=False)
    after = snapshot(model, opt)
    assert torch.equal(before[0], after[0])
    assert repr(before[1]) == repr(after[1])


def test_another_model_is_refused_naming_each_side(tmp_path):
    """Which side has which names, how many, and that the list is cut; shape mismatches first, alone when they
    are the only difference (issue 24 item 10: it said "the model has [] that it lacks, and it has [...]")."""
    path, _ = saved(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2)
    _refused(path, model, opt, r"ckpt is a checkpoint of another model: the checkpoint has 36 tensors that the model "
             r"lacks \('aux.bias', 'aux.weight', 'frozen_bias', 'gpt.blocks.0.attn.proj.bias', and 32 more\); "
             r"the model has 2 tensors that the checkpoint lacks \('0.bias', '0.weight'\)$")
    narrow = nn.Sequential(nn.Linear(32, 4), nn.Linear(4, 2))
    zero.save_checkpoint(tmp_path / "narrow", narrow, zero.ZeroOptimizer(torch.optim.SGD(narrow.parameters()), narrow),
                         progress=False)
    wide = nn.Sequential(nn.Linear(128, 4), nn.Linear(4, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"narrow is a checkpoint of another model: 1 tensor of another shape "
                       r"\('0.weight' is \(4, 32\) in the checkpoint but \(4, 128\) in the model\); "
                       r"the model has 2 tensors that "
                       r"the checkpoint lacks \('3.bias', '3.weight'\)$"):
        zero.load_checkpoint(tmp_path / "narrow", wide, progress=False)


def test_other_shapes_class_or_groups_are_refused(tmp_path):
    path, _ = saved(tmp_path)
    model, opt, _ = build(2, optimizer="sgd")
    _refused(path, model, opt,
             "holds the state of a torch.optim.adamw.AdamW but this ZeroOptimizer wraps a torch.optim.sgd.SGD")
    model = build_model(1)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters()), model, stage=2)
    _refused(path, model, opt, "in param group 0 when saved but is in group 1 now|param groups")


def test_corrupted_truncated_missing_and_unknown_are_refused(tmp_path):
    path, _ = saved(tmp_path)
    model, opt, _ = build(3, seed=1)
    meta = json.loads((path / METADATA).read_text())
    part = path / meta["files"][0]["name"]
    data = bytearray(part.read_bytes())
    data[-5] ^= 0xFF
    part.write_bytes(bytes(data))
    _refused(path, model, opt, r"part-00000-of-00001.safetensors is corrupted: the bytes of '.*' have CRC-32")
    part.write_bytes(bytes(data[:-100]))
    _refused(path, model, opt, r"part-00000-of-00001.safetensors has \d+ bytes but \d+ were written: it is truncated")
    part.unlink()
    _refused(path, model, opt, r"part-00000-of-00001.safetensors is missing: this checkpoint lacks a rank's part")
    rewrite_metadata(path, lambda m: m.update(format="zero.checkpoint/9"))
    _refused(path, model, opt, r"format 'zero.checkpoint/9', which this version of zero cannot read")
    rewrite_metadata(path, "{not json")
    _refused(path, model, opt, "is not valid JSON")
    (path / METADATA).unlink()
    _refused(path, model, opt, "not a zero checkpoint")
    _refused(tmp_path / "nowhere", model, opt, "no checkpoint at", FileNotFoundError)
    (tmp_path / "unfinished.partial").mkdir()
    _refused(tmp_path / "unfinished", model, opt, "never finished")


def test_wrong_arguments_are_refused(tmp_path):
    model, opt, _ = build(2)
    with pytest.raises(ValueError, match="take the ZeroOptimizer"):
        zero.save_checkpoint(tmp_path / "c", model, opt.inner)
    with pytest.raises(ValueError, match="built for another model"):
        zero.save_checkpoint(tmp_path / "c", build_model(), opt)


# ----- export -------------------------------------------------------------------------------------------


def test_consolidate_streams_every_layout_and_checks_crcs(tmp_path):
    path, (model, opt, _) = saved(tmp_path, stage=3, precision=MIXED)
    with opt.gathered_parameters():
        gathered = {k: v.clone() for k, v in model.state_dict().items()}
    for out in ("dir", "one.safetensors", "sd.pt"):
        files = zero.consolidate(path, tmp_path / out, max_shard_size="40KB" if out == "dir" else "5GB", progress=False)
        assert all(f.exists() for f in files)
        state = (torch.load(tmp_path / out, weights_only=True) if out.endswith(".pt")
                 else zero.load_consolidated(tmp_path / out))
        plain = model_for(1, MIXED)
        plain.load_state_dict(state, strict=True)
        trained = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        for name, value in gathered.items():  # trained: fp32 masters, equal to the bf16 parameters once cast
            assert state[name].dtype == (torch.float32 if name in trained else value.dtype), name
            assert torch.equal(state[name].to(value.dtype), value), name
    assert len(list((tmp_path / "dir").glob("model-*-of-*.safetensors"))) > 1
    index = json.loads((tmp_path / "dir" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(Checkpoint(path).tensors)
    half = zero.load_consolidated(
        zero.consolidate(path, tmp_path / "bf16.safetensors", dtype="bf16", progress=False)[0]
    )
    assert half["gpt.blocks.0.attn.qkv.weight"].dtype == torch.bfloat16
    meta = json.loads((path / METADATA).read_text())
    part = path / meta["files"][0]["name"]
    data = bytearray(part.read_bytes())
    data[-3] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupted"):
        zero.consolidate(path, tmp_path / "bad", progress=False)
    assert not list((tmp_path / "bad").glob("*.safetensors"))  # nothing half-written under a final name


def test_consolidate_cli(tmp_path, capsys):
    path, _ = saved(tmp_path)
    ok = subprocess.run([sys.executable, "-m", "zero", "consolidate", str(path), str(tmp_path / "m.safetensors")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "exported" in ok.stderr and (tmp_path / "m.safetensors").is_file()
    # the refusal in this process: the same main(), whose code ``python -m zero`` exits with (zero/__main__.py), as
    # above; an exception would fail this test where a process would print a traceback
    assert cli_main(["consolidate", str(tmp_path / "none"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "Traceback" not in err


def test_shard_size_bytes():
    assert shard_size_bytes("5GB") == 5 * 10**9 and shard_size_bytes("2GiB") == 2 * 2**30
    assert shard_size_bytes("1.5MB") == 1_500_000
    assert shard_size_bytes(1234) == 1234
    for bad in ("lots", "0KB", 0, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            shard_size_bytes(bad)


def test_hugging_face_gpt2_export_loads_with_from_pretrained(tmp_path):
    """Stage 3, bf16 with fp32 masters, the first block frozen: the sharded export plus the config is a
    directory ``from_pretrained`` loads, with the head tied to the embedding again and every weight equal
    to the gathered parameters (cast)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    for name, p in model.named_parameters():
        p.requires_grad_(".h.0." not in name)
    inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt = zero.ZeroOptimizer(inner, model, stage=3, precision=MIXED)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    zero.save_checkpoint(tmp_path / "ckpt", model, opt, progress=False)
    assert Checkpoint(tmp_path / "ckpt").meta.aliases == {"lm_head.weight": "transformer.wte.weight"}
    files = zero.consolidate(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="60KB", progress=False)
    assert files[-1].name == "model.safetensors.index.json" and len(files) > 2
    config.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    with opt.gathered_parameters():
        gathered = {k: v.clone() for k, v in model.state_dict().items()}
    state = loaded.state_dict()
    for name, value in gathered.items():
        assert torch.equal(state[name].to(value.dtype), value), name
