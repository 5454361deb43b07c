"""Argument types of the ``zero`` command line, each with an accepted range.

A value outside its range, or one that is not a number of the right kind, is an argparse error that
``zero.cli`` prints in one line naming the argument and the range (``zero estimate: error: argument
--world-size: expected a whole number from 1 to 1048576, got '1e30'``), exit code 2, no traceback.
Each option's help states its range too (:func:`whole_number_range` and the like word it).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from zero.sizes import SIZE_SYNTAX, GiB, parse_size, quoted, size_range

SIZE_HELP = f"a bare number is GiB; or give a unit: {SIZE_SYNTAX}"


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high`` (inclusive)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also a number too long for int() (over 4300 digits)
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a whole number {whole_number_range(low, high)}, got {quoted(text)}"
            )
        return value

    return parse


def whole_number_range(low: int, high: int) -> str:
    """``"from 1 to 64"``."""
    return f"from {low} to {high}"


def real_number(above: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number greater than ``above`` and at most ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not above < value <= high:  # nan and inf fail here too
            raise argparse.ArgumentTypeError(
                f"expected a number {real_number_range(above, high)}, got {quoted(text)}"
            )
        return value

    return parse


def real_number_range(above: float, high: float) -> str:
    """``"above 0 and at most 1"``."""
    return f"above {above:g} and at most {high:g}"


def memory_size(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: bytes from ``24`` (GiB: a bare number is never bytes), ``24GiB``, ``80G``
    (binary, like ``free -g``), ``80GB`` (decimal) or ``512MiB`` (:func:`zero.sizes.parse_size`), from ``low``
    to ``high`` bytes."""

    def parse(text: str) -> int:
        try:
            value = parse_size(text, bare_unit=GiB)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a size {size_range(low, high)} ({SIZE_HELP}), got {quoted(text)}"
            )
        return value

    return parse


__all__ = ["SIZE_HELP", "memory_size", "real_number", "real_number_range", "whole_number", "whole_number_range"]
