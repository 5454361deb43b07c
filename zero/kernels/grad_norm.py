"""The gradient-norm arithmetic of ``ZeroOptimizer.clip_grad_norm_``, on this rank's pieces.

Per-tensor norms with torch's multi-tensor kernels (one launch per device and dtype), then the
norm of the norms in model order, and the scaling likewise: the arithmetic of
``torch.nn.utils.clip_grad_norm_``, so an unsharded run matches it bit for bit. The sum across
ranks (the only collective) is the caller's.
"""

from __future__ import annotations

import torch


def tensor_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The ``norm_type`` norm of each tensor of ``grads`` (0-dim, in order), one multi-tensor launch per kind."""
    norms: list[torch.Tensor] = [torch.empty(())] * len(grads)
    for group in _groups(grads).values():
        for i, norm in zip(group, torch._foreach_norm([grads[i] for i in group], norm_type)):
            norms[i] = norm
    return norms


def total_norm(norms: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type`` norm of the per-tensor ``norms`` (in order), as a 0-dim fp32 tensor on ``device`` (zero
    for none)."""
    if not norms:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type).to(device)


def scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every tensor of ``grads`` in place by the 0-dim ``coef``."""
    for group in _groups(grads).values():
        first = grads[group[0]]
        torch._foreach_mul_([grads[i] for i in group], coef.to(first.device, first.dtype))


def _groups(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``tensors`` by (device, dtype), in order (a multi-tensor kernel takes one kind)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups
