"""Argument types of the ``zero`` command line, each with an accepted range.

A value outside its range, or one that is not a number of the right kind, is an argparse error that
``zero.cli.main`` prints in one line naming the argument and the range (``zero estimate: error: argument
--world-size: expected a whole number from 1 to 1048576, got '1e30'``), exit code 2, no traceback.
Each option's help states its range too (:func:`whole_number_range` and the like word it).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from zero.sizes import SIZE_SYNTAX, GiB, parse_size, quoted, size_range

SIZE_HELP = f"a bare number is GiB; or give a unit: {SIZE_SYNTAX}"


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high`` (inclusive)."""
    return _ranged(int, lambda v: low <= v <= high, f"a whole number {whole_number_range(low, high)}")


def whole_number_range(low: int, high: int) -> str:
    """``"from 1 to 64"``."""
    return f"from {low} to {high}"


def real_number(above: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number greater than ``above`` and at most ``high`` (nan and inf fail)."""
    return _ranged(float, lambda v: above < v <= high, f"a number {real_number_range(above, high)}")


def real_number_range(above: float, high: float) -> str:
    """``"above 0 and at most 1"``."""
    return f"above {above:g} and at most {high:g}"


def memory_size(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: bytes from ``24`` (GiB: a bare number is never bytes), ``24GiB``, ``80G``
    (binary, like ``free -g``), ``80GB`` (decimal) or ``512MiB`` (:func:`zero.sizes.parse_size`), from ``low``
    to ``high`` bytes."""
    return _ranged(lambda text: parse_size(text, bare_unit=GiB), lambda v: low <= v <= high,
                   f"a size {size_range(low, high)} ({SIZE_HELP})")


def _ranged(convert: Callable[[str], Any], accepts: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """``convert(text)`` if it succeeds and ``accepts`` the value, else an argparse error: "expected ..., got ..."
    (a number too long for ``int()``, over 4300 digits, is a ``ValueError`` too)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {quoted(text)}")
        return value

    return parse


__all__ = ["SIZE_HELP", "memory_size", "real_number", "real_number_range", "whole_number", "whole_number_range"]
