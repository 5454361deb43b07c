"""Helpers for tests that save tiny portable checkpoints, damage them, or hand-craft them.

The file names are spelled out here rather than imported, so that the tests that use them also run against
older versions of ``zero`` (how each new test was seen to fail before its fix).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import zero

METADATA = "metadata.json"
CHECKSUM = "metadata.json.sha256"
PART = "part-00000-of-00001.safetensors"  # a small checkpoint's one part


class Tiny(nn.Module):
    """A few KB of weights: two layers, a tied head, a buffer, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 32)
        self.out = nn.Linear(32, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.out(torch.tanh(self.hidden(self.embed(idx)))) + self.frozen
        return self.head(x * self.scale[0]).square().mean()


def tiny(seed: int = 0, stage: int = 2) -> tuple[Tiny, zero.ZeroOptimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, zero.ZeroOptimizer(torch.optim.AdamW(params, lr=1e-2), model, stage=stage, bucket_size_mb=0.001)


def step(model: Tiny, opt: zero.ZeroOptimizer, seed: int = 0) -> None:
    idx = torch.randint(0, 16, (4, 3), generator=torch.Generator().manual_seed(seed))
    opt.backward(model(idx))
    opt.step()
    opt.zero_grad()


def saved_tiny(path: Path, extra: Any = None) -> tuple[Tiny, zero.ZeroOptimizer]:
    """``tiny()`` after one ``step``, saved to ``path`` with ``extra``."""
    model, opt = tiny()
    step(model, opt)
    zero.save_checkpoint(path, model, opt, extra=extra, progress=False)
    return model, opt


def weights(model: nn.Module, opt: zero.ZeroOptimizer | None = None) -> dict[str, torch.Tensor]:
    """Every ``state_dict`` tensor, cloned (gathered first at stage 3)."""
    if opt is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    with opt.gathered_parameters():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def loaded(path: Path, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The weights ``zero.load_checkpoint`` puts into a fresh plain model (other initial values)."""
    torch.manual_seed(99)
    model = Tiny()
    zero.load_checkpoint(path, model, progress=False, **kwargs)
    return weights(model)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, dtypes, shapes and bits."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
        for k in a
    )


def rewrite_metadata(path: Path, edit: Callable[[dict[str, Any]], Any] | str) -> None:
    """Edit ``path``'s ``metadata.json`` (``edit`` changes the parsed JSON in place, or is the new text) and record
    its new SHA-256, as someone who edits both files on purpose would: what the schema alone must catch."""
    if isinstance(edit, str):
        text = edit.encode()
    else:
        meta = json.loads((path / METADATA).read_text())
        edit(meta)
        text = json.dumps(meta).encode()
    (path / METADATA).write_bytes(text)
    (path / CHECKSUM).write_text(f"{hashlib.sha256(text).hexdigest()}  {METADATA}\n")


def rewrite_header(file: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite a safetensors file's JSON header (``edit`` changes it in place), keeping the tensors' bytes."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
