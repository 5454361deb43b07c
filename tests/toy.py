"""Tiny models shared by the tests, and their input batches."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Stack(nn.Module):
    """Two Linear layers in an nn.ModuleList: one stage-3 unit each (no root unit)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Net(nn.Module):
    """Blocks in an nn.ModuleList (stage-3 units), a head, and a branch used on odd steps only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 1)
        self.aux = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        if use_aux:
            x = x + self.aux(x)
        return self.head(x).square().mean()


class Blocks(nn.Module):
    """``count`` Linear blocks in an nn.ModuleList (one stage-3 unit each) run in the order given per call (some
    not at all, some twice), and a head (the root unit). Not seeded: seed before building."""

    def __init__(self, count: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(count))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return self.head(x).sum()


def batch(step: int, rows: int = 6, width: int = 6) -> torch.Tensor:
    """A reproducible input batch (6 rows: divisible by world sizes 1, 2 and 3; 6 wide: ``Net``'s input)."""
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(step))


def train_net(model: Net, opt, steps: int, first: int = 0) -> None:
    """``steps`` steps of ``model`` from step ``first``: two micro-batches (the first under ``opt.no_sync()``, the
    second through the odd steps' branch), ``opt.backward``, clipping at 0.1, ``step()``, ``zero_grad()``."""
    for step in range(first, first + steps):
        with opt.no_sync():
            opt.backward(model(batch(step)) / 2)
        opt.backward(model(batch(step + 10), step % 2 == 1) / 2)
        opt.clip_grad_norm_(0.1)
        opt.step()
        opt.zero_grad()


class Boom(torch.autograd.Function):
    """Identity whose backward raises when ``armed``: an error in the middle of a backward pass."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed:
            raise RuntimeError("boom")
        return grad, None


class CheckpointedNet(Net):
    """Net with its blocks under activation checkpointing, and an optional error between them."""

    def __init__(self, reentrant: bool, first_grad_inside: bool = False) -> None:
        super().__init__()
        self.reentrant, self.first_grad_inside = reentrant, first_grad_inside

    def forward(self, x: torch.Tensor, use_aux: bool = False, boom: bool = False) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        x = Boom.apply(x, boom)  # block 1 and the head get their gradients first
        x = checkpoint(lambda h: torch.tanh(self.blocks[1](h)), x, use_reentrant=self.reentrant)
        if use_aux:
            x = x + self.aux(x)
        if self.first_grad_inside:
            return checkpoint(lambda h: self.head(h).square().mean(), x, use_reentrant=self.reentrant)
        return self.head(x).square().mean()


class DropoutBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class DropoutNet(nn.Module):
    """Residual blocks with dropout in an nn.ModuleList, and a head: for activation checkpointing (the
    recomputation must draw the same dropout masks)."""

    def __init__(self, blocks: int = 4, width: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(DropoutBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


TINY_GPT2 = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=16)


def tiny_hf(family: str, seed: int = 0, **config):
    """A tiny Hugging Face GPT-2 (``family="gpt2"``) or Llama (``"llama"``) causal LM with random weights, built
    from a config (``TINY_GPT2`` or ``TINY_LLAMA``, ``config`` replacing any of its fields) after
    ``torch.manual_seed(seed)``."""
    import transformers

    if family == "gpt2":
        cfg, build = transformers.GPT2Config(**{**TINY_GPT2, **config}), transformers.GPT2LMHeadModel
    elif family == "llama":
        cfg, build = transformers.LlamaConfig(**{**TINY_LLAMA, **config}), transformers.LlamaForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    return build(cfg)


class _Inner(nn.Module):
    """Not a unit: takes its parent's hidden state and a tensor the parent made in fp32."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor, cast) -> torch.Tensor:
        return self.proj(cast(x + y))  # a bf16 activation plus an fp32 tensor: fp32 (type promotion)


class FreshTensors(nn.Module):
    """Floating tensors made in fp32 inside forward reaching modules that compute in bf16 (the mixed-precision peer
    tests' cases): a tensor of the default dtype passed to a submodule (``torch.ones``, FSDP2's
    ``test_submodules_with_external_inputs``), added to a bf16 activation, and a value cast up for numerics
    (``x.float()``) before an activation-checkpointed ``Linear``. ``recipe=True``: the hand-built bf16 recipe of it,
    each fp32 tensor cast to bf16 by hand where it enters a module holding parameters (``zero`` casts it there).
    Input ``(N, width)``. Not seeded: seed before building."""

    def __init__(self, recipe: bool = False, width: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.inner = _Inner(width)
        self.ckpt = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        self.cast = (lambda t: t.to(torch.bfloat16)) if recipe else (lambda t: t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = torch.tanh(self.inner(h, 0.1 * torch.ones(h.shape), self.cast))
        h = checkpoint(self.ckpt, self.cast(h.float()), use_reentrant=False)
        return self.head(torch.tanh(h)).float().square().mean()
