"""Every way people call autograd, in their world (issue 41), at every stage, with and without activation
checkpointing, against single-process PyTorch on the global batch (rank 0 runs the reference in the same process):

* ``grad_input``: ``torch.autograd.grad(loss, x)`` with the input a leaf (saliency), then a step on the
  adversarial input ``x + eps * sign(grad)`` (FGSM training);
* ``penalty``: a gradient penalty (WGAN-GP, R1): ``torch.autograd.grad(out.sum(), x, create_graph=True)``, then one
  backward through the loss and the penalty (double backward);
* ``grad_params``: ``torch.autograd.grad(loss, parameters)`` (compared with the plain model's on this rank's rows),
  then a plain backward and step;
* ``backward_inputs``: ``loss.backward(inputs=[...])`` over some of the parameters (the rest get no gradient);
* ``retain``: ``backward(retain_graph=True)``, then a second backward through the same graph;
* ``two_forwards``: two forwards (two micro-batches), then one backward through both.

The model's middle block is called twice in every forward (a stage-3 unit called twice), and its rows are
independent (no batch statistics), so the per-rank gradients of the input are the global ones times the world size.
SGD with momentum keeps every run within rounding of the reference (1e-5)."""

from __future__ import annotations

import torch
from torch import nn

from tests.readouts import flat_params, max_diff
from tests.toy import CheckpointedNet, batch
from zero import ZeroOptimizer
from zero.models import local_slice

PATTERNS = ("grad_input", "penalty", "grad_params", "backward_inputs", "retain", "two_forwards")
STEPS = 3
ROWS = 6  # the global batch (divisible by 1, 2 and 3)
WIDTH = 6
EPS = 0.05  # the adversarial step
PENALTY = 0.5  # the gradient penalty's weight


class PenaltyNet(nn.Module):
    """An input layer, three residual blocks in an ``nn.ModuleList`` (stage-3 units; the middle one called twice)
    and a head giving one score per row."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.blocks[0](h)
        h = h + self.blocks[1](self.blocks[1](h))
        h = h + self.blocks[2](h)
        return self.head(h).squeeze(-1)


def build() -> PenaltyNet:
    torch.manual_seed(0)
    return PenaltyNet()


def _data(step: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1000 + step))


def _pattern(name: str, model: nn.Module, x: torch.Tensor, world_size: int) -> torch.Tensor:
    """One step's backward work of ``name`` on this rank's rows ``x`` (the loss: a mean over them); what it reads
    out: the gradient of the global loss with respect to ``x`` (or, for ``grad_params``, the parameters'
    gradients of this rank's loss, flat), or an empty tensor."""
    x = x.clone().requires_grad_(True)
    if name == "grad_input":
        (g,) = torch.autograd.grad(model(x).square().mean(), x)
        model(x.detach() + EPS * g.sign()).square().mean().backward()
        return g / world_size
    if name == "penalty":
        out = model(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.square().mean() + PENALTY * (g.norm(dim=1) - 1).square().mean()).backward()
        return g.detach()
    if name == "grad_params":
        loss = model(x).square().mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        return torch.cat([g.flatten() for g in grads])
    if name == "backward_inputs":
        loss = model(x).square().mean()
        loss.backward(inputs=list(model.head.parameters()) + list(model.blocks[1].parameters()))
        return torch.empty(0)
    if name == "retain":
        out = model(x)
        out.square().mean().backward(retain_graph=True)
        out.mean().backward()
        return torch.empty(0)
    assert name == "two_forwards"
    half = x.shape[0] // 2
    (model(x[:half]).square().sum() + model(x[half:]).square().sum()).div(x.shape[0]).backward()
    return torch.empty(0)


def run(name: str, rank: int, world_size: int, stage: int | None, checkpointing: bool) -> dict:
    """``STEPS`` steps of ``name``; ``stage=None``: single-process PyTorch on the whole batch (the reference). What
    each step read out (see :func:`_pattern`), and the whole parameters afterwards; for ``grad_params`` the plain
    model's parameter gradients on the same rows beside ours (the parameters are equal before each step)."""
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if stage is None:
        rank, world_size = 0, 1
        if checkpointing:
            return {}
    else:
        policy = {} if checkpointing else None
        opt = ZeroOptimizer(opt, model, stage=stage, bucket_size_mb=1e-4, activation_checkpointing=policy)
    readouts, plain_grads = [], []
    for step in range(STEPS):
        x = local_slice(_data(step), rank, world_size)
        if name == "grad_params":
            plain_grads.append(_plain_param_grads(model, opt, x))
        readouts.append(_pattern(name, model, x, world_size))
        opt.step()
        opt.zero_grad()
    return {"readouts": readouts, "plain_grads": plain_grads, "params": flat_params(model, opt)}


def _plain_param_grads(model: nn.Module, opt, x: torch.Tensor) -> torch.Tensor:
    """The parameters' gradients of this rank's loss in a plain copy of the model's current parameters."""
    plain = build()
    torch.nn.utils.vector_to_parameters(flat_params(model, opt), plain.parameters())
    grads = torch.autograd.grad(plain(x).square().mean(), list(plain.parameters()))
    return torch.cat([g.flatten() for g in grads])


def autograd_checks(rank: int, world_size: int) -> dict:
    """Per (pattern, stage or "reference", checkpointing): :func:`run`'s readouts and parameters (the reference on
    rank 0 only, without checkpointing)."""
    out = {}
    for name in PATTERNS:
        if rank == 0:
            out[(name, "reference", False)] = run(name, 0, 1, None, False)
        for stage in range(4):
            for checkpointing in (False, True):
                out[(name, stage, checkpointing)] = run(name, rank, world_size, stage, checkpointing)
    return out


def toy_paths(rank: int, world_size: int) -> dict:
    """Max |difference| from single-process PyTorch, per (case, stage), on the small ``CheckpointedNet``:
    "reentrant" (blocks under reentrant activation checkpointing) and "interrupted" (an error in the
    middle of a backward pass on step 1, then ``zero_grad()`` and the step again)."""

    def run(case: str, stage: int | None) -> torch.Tensor:
        model = CheckpointedNet(reentrant=case == "reentrant")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        if stage is not None:
            opt = ZeroOptimizer(opt, model, stage=stage, bucket_size_mb=1e-4)  # a bucket per parameter
        for step in range(4):
            x = batch(step) if stage is None else local_slice(batch(step), rank, world_size)
            if case == "interrupted" and step == 1:
                try:
                    model(x, boom=True).backward()
                except RuntimeError:
                    opt.zero_grad()
            model(x, step % 2 == 1).backward()
            opt.step()
            opt.zero_grad()
        return flat_params(model, opt)

    out = {}
    for case in ("reentrant", "interrupted"):
        ref = run(case, None)
        for stage in range(4):
            out[(case, stage)] = max_diff(run(case, stage), ref)
    return out


def checks(rank: int, world_size: int) -> dict:
    """Everything this world runs: the patterns (:func:`autograd_checks`) and :func:`toy_paths`."""
    return {"autograd": autograd_checks(rank, world_size), "toy_paths": toy_paths(rank, world_size)}
