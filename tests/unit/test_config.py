"""``ZeroConfig`` is strict: wrong types, non-finite numbers and out-of-range values fail at the edge."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from zero import ZeroConfig, ZeroOptimizer
from zero.config import MAX_COUNT, MAX_MB, MAX_TIMEOUT_S, MIN_TIMEOUT_S

INF, NAN = float("inf"), float("nan")


def rejects(field: str, value) -> str:
    """Assert that ``field=value`` fails validation on that field; return the message."""
    with pytest.raises(ValidationError) as info:
        ZeroConfig(**{field: value})
    assert [e["loc"][0] for e in info.value.errors()] == [field], info.value  # ("unit_classes", 0) for an item
    return str(info.value)


@pytest.mark.parametrize("field", ["stage", "max_in_flight_buckets", "prefetch_units"])
@pytest.mark.parametrize("value", [True, False, 2.0, 1.5, "2", None, [1], INF])
def test_integer_fields_take_ints_only(field, value):
    rejects(field, value)


@pytest.mark.parametrize(
    "field,bad,good",
    [
        ("stage", [-1, 4, 2**70], [0, 3]),
        ("max_in_flight_buckets", [0, -5, MAX_COUNT + 1, 10**30], [1, MAX_COUNT]),
        ("prefetch_units", [-1, MAX_COUNT + 1], [0, MAX_COUNT]),
    ],
)
def test_integer_bounds(field, bad, good):
    for value in bad:
        rejects(field, value)
    for value in good:
        assert getattr(ZeroConfig(**{field: value}), field) == value


@pytest.mark.parametrize("field", ["bucket_size_mb", "timeout_s", "unit_size_mb"])
@pytest.mark.parametrize("value", [INF, -INF, NAN, True, False, "1.5", [1.0], 10**400])
def test_float_fields_take_finite_numbers_only(field, value):
    rejects(field, value)


@pytest.mark.parametrize(
    "field,bad,good",
    [
        ("bucket_size_mb", [0, -1.5, 0.0, MAX_MB * 1.0001, 2**21], [4, 1e-9, MAX_MB]),
        ("unit_size_mb", [0, -1.0, MAX_MB + 1], [1, 0.5, MAX_MB]),
        ("timeout_s", [0, 0.0009, 1e-4, -1, MAX_TIMEOUT_S + 1], [MIN_TIMEOUT_S, 30, MAX_TIMEOUT_S]),
    ],
)
def test_float_bounds_and_ints_become_floats(field, bad, good):
    for value in bad:
        rejects(field, value)
    for value in good:
        got = getattr(ZeroConfig(**{field: value}), field)
        assert type(got) is float and got == value


def test_shortest_timeout_is_a_real_timeout():
    """1 ms is the shortest timeout; it must not round to a zero timedelta (which meant no timeout)."""
    model = nn.Linear(2, 2)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, timeout_s=MIN_TIMEOUT_S)
    assert opt.comm.timeout == datetime.timedelta(milliseconds=1)
    assert "greater than or equal to 0.001" in rejects("timeout_s", 0.0004)


@pytest.mark.parametrize("field", ["sync_module_states", "reshard_after_forward"])
@pytest.mark.parametrize("value", [0, 1, 1.0, "true", "False", None])
def test_bool_fields_take_bools_only(field, value):
    rejects(field, value)


def test_unit_classes_from_python_lists_and_tuples():
    assert ZeroConfig(unit_classes=["Block", "GPT2Block"]).unit_classes == ("Block", "GPT2Block")
    assert ZeroConfig(unit_classes=("Block",)).unit_classes == ("Block",)
    assert ZeroConfig(unit_classes=None).unit_classes is None


@pytest.mark.parametrize(
    "value,match",
    [
        ("Block", "must be a list of module class names"),
        ({"Block"}, "must be a list"),
        ({"Block": 1}, "must be a list"),
        ([], "at least one module class"),
        ([""], "not a class name"),
        (["Block", " Block"], "not a class name"),
        (["transformers.GPT2Block"], "without the module path"),
        (["ModuleList"], "container whose forward never runs"),
        ([3], "valid string"),
        ([b"Block"], "valid string"),
        ([None], "valid string"),
    ],
)
def test_bad_unit_classes(value, match):
    assert match in rejects("unit_classes", value)


def test_unit_policies_are_exclusive():
    with pytest.raises(ValidationError, match="either unit_classes or unit_size_mb"):
        ZeroConfig(unit_classes=["Block"], unit_size_mb=1)


def test_lists_and_numbers_from_json_and_yaml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"stage": 3, "unit_classes": ["Block"], "timeout_s": 5}))
    (tmp_path / "c.yaml").write_text("stage: 3\nunit_classes: [Block, GPT2Block]\nbucket_size_mb: 0.5\n")
    assert ZeroConfig.from_file(tmp_path / "c.json").unit_classes == ("Block",)
    assert ZeroConfig.from_file(tmp_path / "c.json").timeout_s == 5.0
    yaml_cfg = ZeroConfig.from_file(tmp_path / "c.yaml")
    assert (yaml_cfg.unit_classes, yaml_cfg.bucket_size_mb) == (("Block", "GPT2Block"), 0.5)


@pytest.mark.parametrize(
    "text,field",
    [
        ('{"stage": 2.0}', "stage"),
        ('{"stage": true}', "stage"),
        ('{"timeout_s": 1e400}', "timeout_s"),  # json reads it as inf
        ('{"bucket_size_mb": NaN}', "bucket_size_mb"),
        ('{"unit_classes": "Block"}', "unit_classes"),
        ('{"sync_module_states": "yes"}', "sync_module_states"),
    ],
)
def test_bad_json_names_the_field(tmp_path, text, field):
    (tmp_path / "c.json").write_text(text)
    with pytest.raises(ValidationError) as info:
        ZeroConfig.from_file(tmp_path / "c.json")
    assert [e["loc"] for e in info.value.errors()] == [(field,)]


def test_yaml_exponent_without_a_dot_is_a_string(tmp_path):
    """PyYAML reads ``1e-3`` as a string, which strict validation refuses (write ``1.0e-3``)."""
    (tmp_path / "c.yaml").write_text("timeout_s: 1e-3\n")
    with pytest.raises(ValidationError, match="timeout_s"):
        ZeroConfig.from_file(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("timeout_s: 1.0e-3\n")
    assert ZeroConfig.from_file(tmp_path / "c.yaml").timeout_s == 0.001


def test_optimizer_overrides_are_validated_strictly():
    model = nn.Linear(2, 2)
    for bad in ({"stage": True}, {"timeout_s": INF}, {"timeout_s": 1e-4}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=ZeroConfig(stage=1), **bad)
