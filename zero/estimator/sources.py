"""Where ``zero estimate`` gets the model it plans for: the built-in GPT, a Python callable
(``module:function``) or a Hugging Face config, each as a :class:`~zero.estimator.Workload`.

A language model (a Hugging Face model, or any module whose ``config`` has a ``vocab_size``) is fed
``micro_batch x seq_len`` token ids and trained on ``model(input_ids=ids, labels=ids)``'s loss, as the
Trainer does. Any other model: have the function return a ``Workload`` that says how to call it.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any, Callable

import torch
from torch import nn

from zero.estimator.workload import Workload
from zero.models import GPT, GPTConfig


def gpt(cfg: GPTConfig) -> Workload:
    """The built-in GPT, trained on its own ``loss``."""
    return Workload(lambda: GPT(cfg), lambda m, x: m.loss(x, x), _tokens(cfg.vocab_size, cfg.seq_len))


def from_callable(spec: str, seq_len: int) -> Workload:
    """``module:function`` (importable, e.g. ``my_models:build``); the function takes no arguments and
    returns an ``nn.Module`` (a language model, see the module docstring) or a ``Workload``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model wants module:function (e.g. my_models:build_model), got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {spec}: cannot import it ({err}); is its directory on PYTHONPATH?") from None
    if not callable(fn):
        raise ValueError(f"--model {spec}: {type(fn).__name__} is not callable")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # only to see what it returns: nothing is allocated
        made = fn()
    if isinstance(made, Workload):
        return made
    if not isinstance(made, nn.Module):
        raise ValueError(
            f"--model {spec} returned a {type(made).__name__}, not a torch.nn.Module (or a zero.estimator.Workload)"
        )
    return language_model(fn, made, seq_len, what=f"--model {spec}")


def from_hf_config(path: str, seq_len: int) -> Workload:
    """A Hugging Face causal LM built from its config (a ``config.json`` or a directory holding one)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError('--hf-config needs transformers: pip install "zero-dp[hf]"') from None
    if not os.path.exists(path):
        raise ValueError(f"--hf-config {path}: no such file or directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--hf-config {path}: not a Hugging Face config ({err})") from None
    build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    return Workload(build, hf_loss, _tokens(config.vocab_size, seq_len))


def language_model(build: Callable[[], nn.Module], model: nn.Module, seq_len: int, what: str) -> Workload:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(
            f"{what}: cannot tell this model's inputs and loss ({type(model).__name__} has no config.vocab_size). "
            "Return a zero.estimator.Workload(build, loss, batch) instead, with loss(model, *batch) -> the scalar "
            "loss and batch(micro_batch) -> the forward's inputs."
        )
    return Workload(build, hf_loss, _tokens(vocab, seq_len))


def hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The loss a Hugging Face model computes itself, given ``labels``: ``model(input_ids=ids, labels=ids).loss``.

    A forward that does not take those arguments (nanoGPT's ``forward(idx, targets)``) is refused before the
    call, with the way to say how to call it instead, so that its ``TypeError`` is not taken for a tracing failure."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to read (a builtin): let the call say
        signature = None
    if signature is not None and not _accepts(signature, input_ids=ids, labels=ids):
        vocab = getattr(getattr(model, "config", None), "vocab_size", "vocab_size")
        raise ValueError(
            f"{type(model).__name__}.forward({', '.join(signature.parameters)}) does not take input_ids= and labels=: "
            "a language model (one with config.vocab_size) is called the Hugging Face way, model(input_ids=ids, "
            "labels=ids), and trained on the output's .loss. For any other forward, have your function return a "
            "zero.estimator.Workload(build, loss, batch) that says how to call it; e.g. for forward(idx, targets) "
            "returning (logits, loss): Workload(build, lambda model, idx: model(idx, idx)[1], lambda micro_batch: "
            f"(torch.randint(0, {vocab}, (micro_batch, {ids.shape[-1]})),))"
        )
    out = model(input_ids=ids, labels=ids)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"the model's output ({type(out).__name__}) holds no loss when given labels: plan for the model with "
            "its language-modeling head (AutoModelForCausalLM), or return a Workload with your own loss"
        )
    return loss


def _accepts(signature: inspect.Signature, **kwargs: Any) -> bool:
    try:
        signature.bind(**kwargs)
    except TypeError:
        return False
    return True


def _tokens(vocab: int, seq_len: int) -> Callable[[int], tuple[Any, ...]]:
    def batch(micro_batch: int) -> tuple[torch.Tensor]:
        return (torch.zeros(micro_batch, seq_len, dtype=torch.long).random_(0, vocab),)

    return batch
