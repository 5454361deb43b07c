"""``zero.sizes``: the one parser of memory sizes (exact, never overflowing) and the formatters of bytes and counts."""

from __future__ import annotations

import pytest

from zero.estimator import parse_size as estimator_parse_size
from zero.sizes import format_bytes, format_count, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1234", 1234), ("24GiB", 24 * 2**30), ("24 gib", 24 * 2**30), ("80G", 80 * 2**30), ("80GB", 80 * 10**9),
        ("1.5MB", 1_500_000), (".5k", 512), ("512MiB", 512 * 2**20), ("0", 0), ("0.4", 0), ("0.6", 1),
    ],
)
def test_parse_size_counts_bytes_exactly(text, expected):
    assert parse_size(text) == expected


def test_a_bare_number_is_counted_in_the_callers_unit():
    assert parse_size("24", bare_unit=2**30) == 24 * 2**30 and parse_size("24B", bare_unit=2**30) == 24


def test_a_huge_size_is_a_number_not_an_overflow():
    """float() once made 400 digits infinity, and rounding it raised OverflowError."""
    assert parse_size("9" * 400 + "GiB") == int("9" * 400) * 2**30


@pytest.mark.parametrize("text", ["lots", "-3GiB", "24 parsecs", "1e3", "inf", "nan", "", "GiB", "2 4", "9" * 5000])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size(text)


def test_the_estimators_parse_size_is_the_same_parser():
    assert estimator_parse_size is parse_size


@pytest.mark.parametrize(
    "nbytes,text",
    [
        (0, "0 B"), (512, "512 B"), (1024, "1 KiB"), (1536, "1.50 KiB"), (44.1 * 2**10, "44.1 KiB"),
        (10 * 2**20 - 1, "10.0 MiB"), (0.9 * 24 * 2**30, "21.6 GiB"), (24 * 2**30, "24 GiB"),
        (117.7 * 2**40, "118 TiB"),
    ],
)
def test_format_bytes_chooses_the_unit_by_magnitude(nbytes, text):
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize("n,text", [(850, "850"), (27_800, "27.8K"), (1_020_000, "1.02M"), (6.74e9, "6.74B"),
                                    (3.3e12, "3.30T")])
def test_format_count(n, text):
    assert format_count(n) == text
