"""The command line's options for the built-in GPT (``zero demo``, ``zero estimate``, ``zero report`` and the
benchmarks): ``--vocab --seq-len --d-model --layers --heads``, with their ranges."""

from __future__ import annotations

import argparse

from zero.cli.types import whole_number, whole_number_range
from zero.models import GPTConfig


def add_gpt_arguments(
    parser: argparse.ArgumentParser, *, vocab: int, seq_len: int, d_model: int, layers: int, heads: int
) -> None:
    """The ``--vocab --seq-len --d-model --layers --heads`` options, with the caller's defaults and the ranges
    below (a model beyond them is a typo, not a plan); :func:`gpt_config` checks that ``--d-model`` is a
    multiple of ``--heads``."""
    options = (
        ("--vocab", vocab, (1, 2**22), "vocabulary size"),
        ("--seq-len", seq_len, (1, 2**21), "tokens per sequence"),
        ("--d-model", d_model, (1, 2**16), "model width, a multiple of --heads"),
        ("--layers", layers, (1, 1024), "transformer blocks"),
        ("--heads", heads, (1, 1024), "attention heads; must divide --d-model"),
    )
    for flag, default, (low, high), what in options:
        parser.add_argument(flag, type=whole_number(low, high), default=default,
                            help=f"{what}, {whole_number_range(low, high)} (default {default})")


def gpt_config(args: argparse.Namespace) -> GPTConfig:
    """The GPTConfig named by :func:`add_gpt_arguments`' options; ``ValueError`` (phrased with the
    options' names, for ``parser.error``) if they cannot make a model."""
    if args.d_model % args.heads:
        raise ValueError(
            f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads}): each head gets "
            f"d_model / heads dimensions"
        )
    return GPTConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
