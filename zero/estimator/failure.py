"""Why running a step on fake tensors failed, in words: the operation that raised, the module running it, and
what to do about it (the data-dependence hint only when the operation needed the data)."""

from __future__ import annotations

import os
import traceback
from types import TracebackType
from typing import Any

import torch
from torch import nn

_TORCH = os.path.dirname(torch.__file__)
_ESTIMATOR = os.path.dirname(__file__)
_INTERNAL = ("_", "autograd", "fx")  # beside any file or folder whose name starts with "_"


def describe_failure(what: str, exc: BaseException) -> str:
    """The message of the ``ValueError`` the estimator raises when ``what`` ("tracing the step") failed with ``exc``."""
    where = _where(exc.__traceback__)
    text = f"the estimator failed while {what} on fake tensors{where} ({type(exc).__name__}: {exc})."
    if _needs_data(exc):
        return (f"{text} Estimation runs without data: data-dependent control flow (.item(), .tolist(), nonzero(), a "
                "branch on a value) cannot be traced; make the forward and loss depend only on shapes.")
    return (f"{text} The estimator runs your model's own forward and backward on fake tensors; if the same step runs "
            "on real tensors, this operation is one the estimator cannot follow: please report it with this message.")


def _needs_data(exc: BaseException) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    kinds: tuple[type, ...] = (DataDependentOutputException, DynamicOutputShapeException)
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        kinds += (GuardOnDataDependentSymNode,)
    except ImportError:  # (older torch)
        pass
    return isinstance(exc, kinds)


def _where(tb: TracebackType | None) -> str:
    """`` at FILE:LINE `CODE` (calling torch/FILE:LINE `CODE`), in MODULE.forward``: the innermost line of the user's
    code, the innermost line of torch's public code below it (the operation, as ``F.relu`` runs it), and the
    innermost module whose forward was running."""
    user, api, module = None, None, None
    for frame, lineno in traceback.walk_tb(tb):
        path = frame.f_code.co_filename
        if frame.f_code.co_name == "_call_impl" and isinstance(frame.f_locals.get("self"), nn.Module):
            module = frame.f_locals["self"]  # (nn.Module's own frame calling a module's forward)
        if _internal(path):
            continue
        line = traceback.FrameSummary(path, lineno, frame.f_code.co_name)
        if path.startswith(_TORCH):
            api = line
        else:
            user, api = line, None
    text = "".join(f" {how} {_short(line.filename)}:{line.lineno} `{(line.line or '').strip()}`"
                   for how, line in (("at", user), ("calling", api)) if line is not None)
    if module is not None:
        text += f", in {repr(module) if not list(module.children()) else type(module).__name__}.forward"
    return text


def _internal(path: str) -> bool:
    if path.startswith(_ESTIMATOR):
        return True
    if not path.startswith(_TORCH):
        return False
    inside = path[len(_TORCH) + 1:]
    return inside.startswith(_INTERNAL) or "/_" in inside


def _short(path: str) -> str:
    """A torch file relative to torch's folder (``torch/nn/functional.py``), any other as it is."""
    return os.path.join("torch", path[len(_TORCH) + 1:]) if path.startswith(_TORCH) else path


class explained:
    """Turns a failure while tracing into a ``ValueError`` that says what was being done, where it failed and what
    to check (:func:`describe_failure`)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, ValueError):
            return False
        raise ValueError(describe_failure(self.what, exc)) from exc
