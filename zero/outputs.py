"""Finding the tensors in a module's output (hooks that must see what a forward returned)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def tensors_in(output: Any) -> list[torch.Tensor] | None:
    """Tensors in a module's output: tensors, and tuples, lists, dicts (model outputs included)
    and dataclasses of them. ``None`` if it holds an object of another kind (it may hide tensors)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if output is None or isinstance(output, (int, float, bool, str)):
        return []
    if isinstance(output, (list, tuple)):
        items = list(output)
    elif isinstance(output, dict):
        items = list(output.values())
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        return None
    found = [tensors_in(item) for item in items]
    return None if any(f is None for f in found) else [t for f in found for t in f]
