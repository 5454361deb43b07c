"""The estimator reads one ``ZeroConfig`` (issue 43): every field is priced or declared memory-neutral, in one place
(``zero.estimator.configuration``), and the fields the estimator once ignored (``unit_classes``, ``unit_size_mb``,
``reshard_after_forward``) reach it. Estimate against measured peak with each of them set:
``tests/distributed/test_estimate_world.py`` (the ``gpt6`` cases, within 2%)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zero import ZeroConfig
from zero.estimator import Estimate, Workload, estimate
from zero.estimator.configuration import (
    MEMORY_NEUTRAL,
    POLICIES,
    PRICED,
    SHORTHANDS,
    covered,
    leaf_fields,
    priced_config,
)
from zero.models import GPT, GPTConfig

WIDE = GPTConfig(vocab_size=64, seq_len=8, d_model=128, num_layers=4, num_heads=4)


def test_every_config_field_is_priced_or_declared_memory_neutral_and_not_both():
    fields = list(leaf_fields())
    assert "unit_classes" in fields and "precision.param_dtype" in fields  # (the listing itself works)
    neither = [f for f in fields if not covered(f, PRICED) and not covered(f, MEMORY_NEUTRAL)]
    assert not neither, f"ZeroConfig fields the estimator neither prices nor declares memory-neutral: {neither}"
    both = [f for f in fields if covered(f, PRICED) and covered(f, MEMORY_NEUTRAL)]
    assert not both, both


def test_the_tables_name_only_fields_that_exist():
    fields = set(leaf_fields())
    for name in [*PRICED, *MEMORY_NEUTRAL]:
        assert any(f == name or f.startswith(name + ".") for f in fields), f"no ZeroConfig field {name!r}"


def test_the_shorthands_are_zero_config_fields_spelled_the_estimator_s_old_way():
    assert set(SHORTHANDS) == {"precision", "checkpointing", "offload", "params_offload", "buffer_count",
                               "offload_ratio"}
    short = priced_config(stage=3, precision="mixed", checkpointing=True, params_offload="cpu", buffer_count=3)
    assert short == ZeroConfig(stage=3, precision=POLICIES["mixed"], activation_checkpointing={},
                               offload={"params": "cpu", "buffer_count": 3})
    assert priced_config(stage=2, offload=True, offload_ratio=0.5) == ZeroConfig(
        stage=2, offload={"optimizer": "cpu", "ratio": 0.5})
    disk = priced_config(stage=3, offload="disk")
    assert disk.offload.optimizer == "disk" and disk.offload.path  # (a stand-in directory: nothing is written)
    base = ZeroConfig(stage=3, unit_classes=["Block"], prefetch_units=2)
    assert priced_config(base, reshard_after_forward=False) == ZeroConfig(
        stage=3, unit_classes=["Block"], prefetch_units=2, reshard_after_forward=False)  # on top of the config


def _workload() -> Workload:
    return Workload(lambda: GPT(WIDE), lambda m, x: m.loss(x, x), lambda micro: (torch.randint(0, 64, (micro, 8)),))


@pytest.mark.parametrize("field", [{"reshard_after_forward": False}, {"unit_classes": ["CausalSelfAttention"]},
                                   {"unit_size_mb": 0.05}, {"prefetch_units": 0}], ids=str)
def test_stage_3_fields_once_ignored_reach_the_estimate(field):
    """Each changes the units or their schedule, hence the stage-3 peak or the gathers counted (the estimator once
    priced the default schedule whatever these said)."""
    work = _workload()
    default = estimate(work, stage=3, world_size=2, micro_batch=2)
    changed = estimate(work, ZeroConfig(stage=3, **field), world_size=2, micro_batch=2)
    assert changed.config == ZeroConfig(stage=3, **field)
    assert (changed.peak, changed.traffic) != (default.peak, default.traffic)


def test_the_config_is_the_one_estimated_and_carried():
    work = _workload()
    config = ZeroConfig(stage=3, unit_classes=["Block"], bucket_size_mb=1, precision={"param_dtype": "bf16"})
    e = estimate(work, config, world_size=2, micro_batch=2)
    assert e.config == config and e.precision == "mixed-fp32-reduce" and e.stage == 3
    assert e.as_dict()["config"] == config.model_dump(mode="json", exclude_defaults=True)
    with pytest.raises(ValueError, match="offload.ratio='auto' is chosen when ZeroOptimizer is built"):
        estimate(work, ZeroConfig(stage=2, offload={"optimizer": "cpu", "ratio": "auto", "gpu_memory": 2**30}),
                 world_size=2, micro_batch=2)


def test_the_estimate_reads_its_settings_from_the_config_it_carries():
    """``Estimate`` keeps the configuration once (issue 49): its settings are properties over ``config``, and
    ``as_dict()`` (``zero estimate --json``) still writes each of them."""
    fields = {f.name for f in dataclasses.fields(Estimate)}
    assert not fields & set(Estimate.SETTINGS), "a setting kept beside the config"
    config = ZeroConfig(stage=3, offload={"optimizer": "cpu", "params": "cpu", "buffer_count": 3},
                        precision=POLICIES["mixed"], activation_checkpointing={}, communication={"shard_size": 2})
    e = estimate(_workload(), config, world_size=4, micro_batch=1)
    expected = dict(stage=3, precision="mixed", offload=True, checkpointing=True, optimizer_offload="cpu",
                    params_offload="cpu", buffer_count=3, offload_ratio=1.0, communication_config={"shard_size": 2},
                    group_size=2, secondary_size=0)
    assert {name: getattr(e, name) for name in Estimate.SETTINGS} == expected
    assert {name: e.as_dict()[name] for name in Estimate.SETTINGS} == expected
    other = dataclasses.replace(e, config=ZeroConfig(stage=1))  # (one source: a new config changes every setting)
    assert (other.stage, other.offload, other.precision, other.group_size) == (1, False, "fp32", 4)
