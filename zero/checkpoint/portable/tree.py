"""Nested Python state (an LR scheduler's or optimizer group's ``state_dict``, the caller's ``extra``) as JSON.

:func:`encode` turns a tree of dicts, lists, tuples, strings, numbers, booleans, ``None`` and
tensors into JSON-compatible values, setting tensors aside (each becomes ``{"__tensor__": i}``,
its index in the returned list, to be written to a tensor file); :func:`decode` rebuilds the
tree. Tuples and dicts with non-string keys keep their type. Anything else (a function, an
arbitrary object) is refused with the path to it: a checkpoint never holds a pickle, so it
never runs code when loaded.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_SCALARS = (str, int, float, bool, type(None))


def encode(tree: Any, tensors: list[torch.Tensor], path: str = "", paths: list[str] | None = None) -> Any:
    """The JSON form of ``tree``; its tensors are appended to ``tensors`` (and, with ``paths``, where each one is
    in the tree to ``paths``: ``key.inner[0]``)."""
    if isinstance(tree, _SCALARS):
        return tree
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach())
        if paths is not None:
            paths.append(path)
        return {"__tensor__": len(tensors) - 1}
    if isinstance(tree, tuple):
        return {"__tuple__": [encode(v, tensors, f"{path}[{i}]", paths) for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [encode(v, tensors, f"{path}[{i}]", paths) for i, v in enumerate(tree)]
    if isinstance(tree, dict):
        if all(isinstance(k, str) for k in tree) and not any(k.startswith("__") and k.endswith("__") for k in tree):
            return {k: encode(v, tensors, f"{path}.{k}" if path else k, paths) for k, v in tree.items()}
        bad = [k for k in tree if not isinstance(k, _SCALARS)]
        if bad:
            raise ValueError(f"cannot save the dict key {bad[0]!r} at {path or 'the top'}: "
                             "keys must be str, int, float, bool or None")
        return {"__items__": [[k, encode(v, tensors, f"{path}[{k!r}]", paths)] for k, v in tree.items()]}
    raise ValueError(
        f"cannot save {type(tree).__name__} at {path or 'the top'}: checkpoints hold only dicts, lists, tuples, "
        "strings, numbers, booleans, None and tensors (no pickled objects); convert it to one of those"
    )


def decode(value: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    """Rebuild a tree from :func:`encode`'s JSON; ``tensor(i)`` gives the ``i``-th tensor set aside."""
    if isinstance(value, list):
        return [decode(v, tensor) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__tensor__"}:
        return tensor(value["__tensor__"])
    if set(value) == {"__tuple__"}:
        return tuple(decode(v, tensor) for v in value["__tuple__"])
    if set(value) == {"__items__"}:
        return {k: decode(v, tensor) for k, v in value["__items__"]}
    return {k: decode(v, tensor) for k, v in value.items()}
