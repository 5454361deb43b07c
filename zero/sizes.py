"""Byte sizes and counts as people write and read them: the one parser of memory sizes (``24GiB``,
``80GB``, ``512MiB``) and the formatters of bytes and parameter counts that estimates print.

Units are case-insensitive. ``K``, ``M``, ``G``, ``T`` with or without ``iB`` are binary (``80G`` is
80 GiB, as ``free -g`` counts); with ``B`` alone they are decimal (``5GB`` is 5 × 10⁹ bytes, Hugging
Face's ``max_shard_size``). The number is a plain decimal (``1.5``, ``.5``), never an exponent, and
it is read exactly, so no spelling of a size overflows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from types import MappingProxyType

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

UNITS: Mapping[str, int] = MappingProxyType({
    "b": 1,
    "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": TiB, "tib": TiB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
})
SIZE_SYNTAX = "24GiB, 80G (= GiB), 80GB (10^9 bytes), 512MiB"
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str, *, bare_unit: int = 1) -> int:
    """The bytes that ``text`` names, rounded to a whole number: ``"24GiB"``, ``"80GB"``, ``"512 MiB"``, or a
    bare number counted in ``bare_unit`` bytes (bytes by default; the command line counts GiB).

    ``ValueError`` if ``text`` is not a size (a negative number, an exponent, an unknown unit). Zero is a size:
    callers check their own range (:func:`size_range` words it)."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if unit is None or (unit and unit not in UNITS) or len(match.group(1)) > 4000:  # int()'s limit is 4300 digits
        raise ValueError(f"not a memory size: {quoted(text)} (examples: {SIZE_SYNTAX})")
    return round(Fraction(match.group(1)) * (UNITS[unit] if unit else bare_unit))


def quoted(text: str, limit: int = 40) -> str:
    """``text`` as an error message quotes it: whole, or its start and its length if it is long (400 digits)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def size_range(low: int, high: int) -> str:
    """``"from 1 MiB to 16 TiB"``: an accepted range of sizes, in words."""
    return f"from {format_bytes(low)} to {format_bytes(high)}"


def format_bytes(nbytes: float) -> str:
    """``"512 B"``, ``"1.50 KiB"``, ``"21.6 GiB"``, ``"117 TiB"``, ``"16 TiB"``: the largest binary unit under
    ``nbytes``, three significant digits, or none after the point where the number is whole (bytes always)."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= scale:
            return f"{_three_digits(nbytes / scale)} {unit}"
    return f"{round(nbytes)} B"


def format_count(n: float) -> str:
    """``"850"``, ``"12.5K"``, ``"1.02M"``, ``"6.74B"``, ``"3.30T"``: a count (of parameters) with three significant
    digits."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= scale:
            return f"{_three_digits(n / scale)}{suffix}"
    return f"{round(n)}"


def _three_digits(x: float) -> str:
    if x == int(x):
        return f"{int(x)}"
    for decimals in (2, 1):
        text = f"{x:.{decimals}f}"
        if abs(float(text)) < 10 ** (3 - decimals):  # 9.999 is "10.0", not "10.00"
            return text
    return f"{x:.0f}"


__all__ = ["GiB", "KiB", "MiB", "SIZE_SYNTAX", "TiB", "UNITS", "format_bytes", "format_count", "parse_size", "quoted",
           "size_range"]
