"""The optimizer state of a parameter stepped whole (Muon, Adafactor, SOAP, ...) in a portable checkpoint.

Such an optimizer keeps its state in whatever form it likes: tensors in the parameter's shape (Muon's
``momentum_buffer``), of other shapes (Adafactor's ``row_var`` ``(m, 1)`` and ``col_var`` ``(1, n)``, SOAP's
lists of factor matrices), Python numbers. The parameter's owner writes it as it is: the state dict as a JSON tree
(:func:`zero.checkpoint.portable.tree.encode`: dicts, lists, tuples, strings, numbers, ``None``; nothing pickled), each
tensor an entry ``o/NAME/PATH`` of the owner's part, named by its place in the tree (``o/h.0.weight/momentum_buffer``,
``o/h.0.weight/Q[1]``), its values in its shape, in row-major order as every entry. The tensor's ``metadata.json``
record carries ``whole_state``: ``{"file", "keys", "tree", "layouts"}`` (the tree's ``{"__tensor__": i}`` is entry
``keys[i]`` of part ``file``). ``layouts`` gives, for a tensor the optimizer kept in another memory layout (SOAP's
eigenvector matrices are column-major, as ``torch.linalg.eigh`` returns them), its dimensions from the slowest
to the fastest: a load lays the tensor out again that way, since the optimizer's next matrix products round by
the layout of their inputs, and resuming must compute what the run that never stopped computes. Whichever rank
owns the parameter when the checkpoint is loaded, at any world size and stage, reads it back whole
(:meth:`zero.checkpoint.portable.reader.Checkpoint.whole_state`, :func:`laid_out`).
"""

from __future__ import annotations

from typing import Any

import torch

import zero.checkpoint.portable.tree as tree

PREFIX = "o/"


def encode(state: dict[Any, Any], name: str, optimizer_class: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The ``whole_state`` record of parameter ``name`` (``file`` to be added) and its tensors, in ``keys`` order.
    State the checkpoint cannot hold (an object of another type) is refused, naming the optimizer and parameter."""
    tensors: list[torch.Tensor] = []
    paths: list[str] = []
    try:
        encoded = tree.encode(state, tensors, paths=paths)
    except ValueError as err:
        raise ValueError(
            f"the {optimizer_class} state of {name!r} cannot be saved in a portable checkpoint ({err}); save this "
            "optimizer with the per-rank opt.state_dict() instead, at the same world size"
        ) from err
    keys = [f"{PREFIX}{name}/{path}" for path in paths]
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"the {optimizer_class} state of {name!r} has two tensors at the same place ({sorted(keys)[:4]}: a key "
            "holds '.' or '['); save this optimizer with the per-rank opt.state_dict() instead"
        )
    layouts = {key: order for key, order in ((key, dim_order(t)) for key, t in zip(keys, tensors))
               if order != list(range(len(order)))}
    return {"keys": keys, "tree": encoded, **({"layouts": layouts} if layouts else {})}, tensors


def dim_order(tensor: torch.Tensor) -> list[int]:
    """``tensor``'s dimensions from the largest stride to the smallest, when it is a permutation of a row-major
    tensor (a transpose, say); else ``0, 1, ...`` (it is saved, and loaded, row-major)."""
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))
    return order if tensor.permute(order).is_contiguous() else list(range(tensor.dim()))


def laid_out(tensor: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """``tensor`` (row-major) with the same values, laid out with its dimensions in ``order`` (slowest first)."""
    if order is None:
        return tensor
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return tensor.permute(order).contiguous().permute(inverse)

