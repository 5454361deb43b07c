"""A model's parts under one ``ZeroOptimizer`` in one process (a pipeline of one rank holding every part): saved as the
list of parts, the checkpoint holds the parts' own names (the whole model's, for ``zero.models.pipeline_parts``), not
the ``nn.ModuleList``'s; a ModuleList passed as the model without a pipeline keeps its index, as before. The
pipeline's own ranks are ``tests/distributed/test_pipeline_checkpoint_world.py``'s."""

from __future__ import annotations

import json

import pytest
import torch

import zero
from zero.models import LlamaConfig, LlamaGPT, pipeline_parts, synthetic_batch

CFG = LlamaConfig(vocab_size=32, seq_len=4, d_model=16, num_layers=2, num_heads=2)


def _parts(seed: int) -> tuple[LlamaGPT, list[torch.nn.Module], zero.ZeroOptimizer]:
    torch.manual_seed(seed)
    whole = LlamaGPT(CFG)
    parts = pipeline_parts(whole, 2)
    module = torch.nn.ModuleList(parts)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(module.parameters(), lr=1e-2), module, stage=2, bucket_size_mb=0.001)
    return whole, parts, opt


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_a_list_of_parts_saves_the_whole_model(tmp_path):
    whole, parts, opt = _parts(0)
    x, y = synthetic_batch(0, 2, CFG)
    whole.loss(x, y).backward()
    opt.step()
    opt.zero_grad()
    zero.save_checkpoint(tmp_path / "ckpt", parts, opt, progress=False)
    assert list(json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["tensors"]) == list(whole.state_dict())
    plain = LlamaGPT(CFG)
    zero.load_checkpoint(tmp_path / "ckpt", plain, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(_state(plain).values(), _state(whole).values()))
    other, other_parts, other_opt = _parts(1)
    zero.load_checkpoint(tmp_path / "ckpt", other_parts, other_opt, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(_state(other).values(), _state(whole).values()))


def test_a_module_list_without_a_pipeline_keeps_its_index(tmp_path):
    _, parts, opt = _parts(0)
    zero.save_checkpoint(tmp_path / "ckpt", opt.module, opt, progress=False)
    names = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["tensors"]
    assert list(names) == list(opt.module.state_dict()) and next(iter(names)).startswith("0.")


def test_parts_other_than_the_optimizers_are_refused(tmp_path):
    _, parts, opt = _parts(0)
    with pytest.raises(ValueError, match="these parts are not the ones this ZeroOptimizer wraps"):
        zero.save_checkpoint(tmp_path / "ckpt", parts[::-1], opt, progress=False)


def test_two_parts_with_one_name_for_two_tensors_are_refused(tmp_path):
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]  # both "weight" and "bias"
    opt = zero.ZeroOptimizer(torch.optim.AdamW(torch.nn.ModuleList(parts).parameters()), torch.nn.ModuleList(parts))
    with pytest.raises(ValueError, match="hold different tensors named 'weight'"):
        zero.save_checkpoint(tmp_path / "ckpt", list(opt.module), opt, progress=False)
