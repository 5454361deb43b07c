"""The optimizers a ``ZeroOptimizer`` wraps, as its checkpoints record them, and the refusal of a checkpoint saved
with another set.

Each wrapped optimizer is recorded in order as ``{"class", "path", "groups"}``: its class with its module
(``torch.optim.muon.Muon``), its step path (``"flat"``: pieces of the flat shards, the elementwise optimizers;
``"whole"``: whole parameters, each stepped by its owner; ``zero.runtime.step.inner``) and its number of param
groups. The per-rank shard (``zero.checkpoint.shard.header``) and the portable checkpoint
(``zero.checkpoint.portable.schema``: ``optimizers``) both record the list, and both refuse to load into another one
with :func:`check_same`: the state of an optimizer does not carry over to another class, another path or other groups.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from zero.runtime.step.inner import Inner

PATHS = {"flat": "flat pieces of its parameters (an elementwise optimizer)",
         "whole": "whole parameters, each by its owner"}


def class_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class with its module, e.g. ``torch.optim.adamw.AdamW``."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def records(inners: Sequence[Inner]) -> list[dict[str, Any]]:
    """Each wrapped optimizer's class, step path and number of param groups, in order."""
    return [{"class": class_name(i.optimizer), "path": "whole" if i.whole else "flat", "groups": len(i.groups)}
            for i in inners]


def described(optimizers: Sequence[dict[str, Any]]) -> str:
    """``a torch.optim.adamw.AdamW``, or ``2 optimizers [torch.optim.muon.Muon, torch.optim.adamw.AdamW]``."""
    classes = [o["class"] for o in optimizers]
    return f"a {classes[0]}" if len(classes) == 1 else f"{len(classes)} optimizers [{', '.join(classes)}]"


def check_same(saved: Sequence[dict[str, Any]], here: Sequence[dict[str, Any]], what: str,
               paths: bool = True) -> None:
    """Raise a ValueError naming the first difference between the optimizers ``what`` (a checkpoint) was saved with
    and those of this run: their classes and order, each one's step path (unless ``paths`` is False: a checkpoint
    without optimizer state), each one's number of param groups."""
    if [o["class"] for o in saved] != [o["class"] for o in here]:
        wanted = ", ".join(f"{o['class'].rsplit('.', 1)[-1]}(...)" for o in saved)
        wanted = f"[{wanted}]" if len(saved) > 1 else wanted
        raise ValueError(
            f"{what} holds the state of {described(saved)} but this ZeroOptimizer wraps {described(here)}; build "
            f"the same optimizers, in the same order, to resume from it (ZeroOptimizer({wanted}, model)): "
            "optimizer state does not carry over between classes"
        )
    for i, (a, b) in enumerate(zip(saved, here)):
        if paths and a["path"] != b["path"]:
            raise ValueError(
                f"{what} holds the state of optimizer #{i} ({a['class']}) stepped on {PATHS[a['path']]}, but this "
                f"run steps it on {PATHS[b['path']]}; the state of one path does not fit the other. Resume with the "
                "same ZeroConfig.elementwise_optimizers as when it was saved; a checkpoint from a zero that stepped "
                "every optimizer flat cannot give this one its state: load its weights into the model before wrapping "
                "it (zero.load_checkpoint(path, model)) and start the optimizer afresh"
            )
        if a["groups"] != b["groups"]:
            raise ValueError(
                f"optimizer #{i} ({a['class']}) had {a['groups']} param groups when {what} was saved but has "
                f"{b['groups']} now; build it with the same param groups as when it was saved"
            )
