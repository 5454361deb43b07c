"""Hypothesis: every ``ZeroConfig`` input is refused naming its field, or trains like plain PyTorch.

Each field is drawn from a wide strategy (huge and negative ints, inf, nan, tiny floats, bools,
strings, None, lists). An independent oracle (:func:`field_ok`, the rules of ``zero/config.py``
restated) says which values are valid; the test checks that validation agrees exactly, that
a ``ValidationError`` names each bad field, and that every accepted config builds a
``ZeroOptimizer`` at world size 1 (no process group) whose two steps match plain ``torch.optim.SGD``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torch import nn

from tests.toy import Stack
from zero import ZeroConfig, ZeroOptimizer

INT_BOUNDS = {"stage": (0, 3), "max_in_flight_buckets": (1, 2**16), "prefetch_units": (0, 2**16)}
FLOAT_BOUNDS = {"bucket_size_mb": (0.0, 2.0**20), "unit_size_mb": (0.0, 2.0**20), "timeout_s": (0.001, 604800.0)}
OPEN_BELOW = {"bucket_size_mb", "unit_size_mb"}  # > 0 rather than >= the lower bound
BOOLS = ("sync_module_states", "reshard_after_forward", "force_collectives")
CHOICES = {"step_kernel": ("auto", "torch", "triton")}
OPTIMIZER_NAMES = ("elementwise_optimizers", "per_parameter_optimizers")  # class names declared: any strings
FIELDS = (*INT_BOUNDS, *FLOAT_BOUNDS, *BOOLS, *CHOICES, "unit_classes", *OPTIMIZER_NAMES)
CLASS_NAMES = ("Stack", "Linear", "ModuleList", "ModuleDict", "Block", "", " Linear", "a.B", "Linear2", "é")
STACK_CLASSES = {"Stack", "Linear", "ModuleList"}  # type(m).__name__ for m in Stack().modules()


# ----- the oracle ------------------------------------------------------------------------------------


def number_ok(value, low: float, high: float, *, integer: bool, open_below: bool = False) -> bool:
    """Strict ints for integer fields; finite ints or floats (never bools) otherwise; within bounds."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (low < value if open_below else low <= value) and value <= high


def classes_ok(value) -> bool:
    if value is None:
        return True
    if not isinstance(value, (list, tuple)) or not value:
        return False
    containers = {"ModuleList", "ModuleDict", "ParameterList", "ParameterDict"}
    return all(isinstance(n, str) and n.isidentifier() and n not in containers for n in value)


def field_ok(field: str, value) -> bool:
    """Whether ``value`` alone is valid for ``field``."""
    if field == "stage":
        return number_ok(value, 0, 3, integer=True)
    if field in INT_BOUNDS:
        return number_ok(value, *INT_BOUNDS[field], integer=True)
    if field == "unit_size_mb" and value is None:
        return True
    if field in FLOAT_BOUNDS:
        return number_ok(value, *FLOAT_BOUNDS[field], integer=False, open_below=field in OPEN_BELOW)
    if field in BOOLS:
        return isinstance(value, bool)
    if field in CHOICES:
        return isinstance(value, str) and value in CHOICES[field]
    if field in OPTIMIZER_NAMES:
        return isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in value)
    return classes_ok(value)


# ----- strategies -------------------------------------------------------------------------------------

edge_ints = st.sampled_from([0, 1, 2, 3, 4, -1, 2**16, 2**16 + 1, 2**20, 2**20 + 1, 604800, 604801, 2**63, 10**400])
edge_floats = st.sampled_from(
    [0.0, -0.0, 0.001, 0.000999, 5e-324, 1e-300, 2.0, 2.0**20, 2.0**20 + 1e-6, 604800.0, 604800.001, 1e308]
)
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    edge_ints,
    st.floats(),  # inf, -inf and nan included
    st.floats(min_value=0, max_value=0.01),
    edge_floats,
    st.text(max_size=6),
    st.sampled_from(["auto", "torch", "triton", "Triton", "cuda"]),
    st.lists(st.sampled_from(CLASS_NAMES), max_size=3),
    st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=4)), max_size=2),
    st.tuples(st.sampled_from(CLASS_NAMES)),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)
likely_valid = {  # so that many draws get as far as training
    **{f: st.integers(lo, hi) for f, (lo, hi) in INT_BOUNDS.items()},
    "bucket_size_mb": st.floats(1e-6, 2.0**20),
    "unit_size_mb": st.one_of(st.none(), st.floats(1e-6, 1.0)),
    "timeout_s": st.floats(0.001, 604800.0),
    **{f: st.booleans() for f in BOOLS},
    **{f: st.sampled_from(choices) for f, choices in CHOICES.items()},
    "unit_classes": st.one_of(st.none(), st.lists(st.sampled_from(sorted(STACK_CLASSES) + ["Block"]), max_size=3)),
    **{f: st.lists(st.sampled_from(["SGD", "Lion", "torch.optim.sgd.SGD"]), max_size=2) for f in OPTIMIZER_NAMES},
}


def value_for(field: str, tenths_valid: int) -> st.SearchStrategy:
    """``likely_valid`` about ``tenths_valid`` times in ten, else ``anything`` (one_of would flatten the two)."""
    return st.integers(0, 9).flatmap(lambda i: likely_valid[field] if i < tenths_valid else anything)


# ----- the check ------------------------------------------------------------------------------------


def train(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """Two forward/backward/step rounds on fixed data; the model's output afterwards."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return model(x)


def build_model(stage: int) -> nn.Module:
    torch.manual_seed(0)
    return Stack() if stage == 3 else nn.Linear(4, 2)


def check(kwargs: dict) -> None:
    """Validation agrees with the oracle, errors name the bad fields, accepted configs train exactly."""
    bad = {f for f, v in kwargs.items() if not field_ok(f, v)}
    both_policies = kwargs.get("unit_classes") is not None and kwargs.get("unit_size_mb") is not None
    try:
        cfg = ZeroConfig(**kwargs)
    except ValidationError as err:
        named = {e["loc"][0] for e in err.errors() if e["loc"]}
        assert named == bad or (not bad and both_policies and "unit_classes or unit_size_mb" in str(err)), err
        assert all(f in str(err) for f in bad)
        return
    assert not bad and not both_policies, f"accepted {kwargs}"
    model = build_model(cfg.stage)
    names = set(cfg.unit_classes or ())
    if cfg.stage == 3 and cfg.unit_classes is not None and not names & STACK_CLASSES:
        with pytest.raises(ValueError, match="matches no module"):  # model-dependent: checked at construction
            ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=cfg)
        return
    if cfg.step_kernel == "triton":  # SGD in fp32 on the CPU: refused at construction
        with pytest.raises(ValueError, match="step_kernel='triton'"):
            ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=cfg)
        return
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=cfg)
    reference = build_model(cfg.stage)
    expected = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    torch.testing.assert_close(train(model, opt), expected)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), field=st.sampled_from(FIELDS), stage=st.integers(0, 3))
def test_each_field_alone_is_refused_by_name_or_trains(data, field, stage):
    value = data.draw(value_for(field, 5), label=field)
    check({"stage": stage, field: value} if field != "stage" else {field: value})


@settings(max_examples=200, deadline=None)
@given(kwargs=st.fixed_dictionaries({}, optional={f: value_for(f, 8) for f in FIELDS}))
def test_all_fields_together_are_refused_by_name_or_train(kwargs):
    check(kwargs)


# ----- the nested precision policy ---------------------------------------------------------------------

DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", torch.bfloat16: "bf16", "fp16": "fp16", "half": "fp16",
               torch.float16: "fp16", "fp32": "fp32", "float32": "fp32", torch.float32: "fp32"}
dtype_values = st.sampled_from([None, *DTYPE_NAMES, "fp8", torch.float64, 16, True, "", "BF16"])
loss_scales = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={
        "init_scale": st.sampled_from([2.0**16, 1.0, 0.0, -1.0, float("inf"), 8, True]),
        "growth_interval": st.sampled_from([1, 2000, 0, 1.5]),
        "min_scale": st.sampled_from([1.0, 2.0**20, 0.0]),
    }),
)


def precision_ok(policy: dict) -> bool:
    """The rules of ``zero/precision.py`` restated."""
    names = {}
    for field in ("param_dtype", "reduce_dtype"):
        value = policy.get(field)
        if value is not None:
            if isinstance(value, bool) or value not in DTYPE_NAMES:
                return False
            names[field] = DTYPE_NAMES[value]
    param, reduce = names.get("param_dtype"), names.get("reduce_dtype")
    if param == "fp32" or (param is None and reduce is not None) or (param, reduce) == ("bf16", "fp16"):
        return False
    scale = policy.get("loss_scale")
    if scale is not None:
        init, interval, low = (scale.get(k, d) for k, d in (("init_scale", 2.0**16), ("growth_interval", 2000),
                                                             ("min_scale", 1.0)))
        if param != "fp16" or isinstance(init, bool) or not (0 < init < float("inf")):
            return False
        if not isinstance(interval, int) or interval < 1 or not (0 < low <= init):
            return False
    return isinstance(policy.get("cast_forward_inputs", True), bool)


@settings(max_examples=150, deadline=None)
@given(
    policy=st.fixed_dictionaries(
        {}, optional={"param_dtype": dtype_values, "reduce_dtype": dtype_values, "loss_scale": loss_scales,
                      "cast_forward_inputs": st.sampled_from([True, False, 1, None])},
    ),
    stage=st.integers(0, 3),
)
def test_precision_is_refused_by_name_or_trains(policy, stage):
    """Every refusal names ``precision``; every accepted policy trains (full precision: exactly like SGD)."""
    try:
        cfg = ZeroConfig(stage=stage, precision=policy)
    except ValidationError as err:
        assert not precision_ok(policy), f"refused {policy}: {err}"
        assert all(e["loc"][0] == "precision" for e in err.errors()), err
        return
    assert precision_ok(policy), f"accepted {policy}"
    model = build_model(stage)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=cfg)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    dtype = torch.float32
    if cfg.precision.param_dtype is not None and not cfg.precision.cast_forward_inputs:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision.param_dtype]
    for _ in range(2):
        opt.backward(model(x.to(dtype)).float().square().mean())
        opt.step()
        opt.zero_grad()
    if cfg.precision.param_dtype is None:
        reference = build_model(stage)
        expected = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected)


def test_the_oracle_knows_every_field():
    """A new ZeroConfig field must be added to the oracle (and so to the fuzzing) above."""
    # nested: own tests
    assert set(FIELDS) | {"precision", "offload", "communication", "activation_checkpointing"} == set(
        ZeroConfig.model_fields)
