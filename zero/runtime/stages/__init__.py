"""Stage policies: each decides where gradients live and how they are reduced and gathered.

Each stage builds on the one before; the reduction machinery shared by all
of them (gradient hooks, bucket ordering, overlap) lives in :mod:`zero.runtime.reduction.reducer`, and
stage 3's parameter gathering (module hooks, prefetch) in :mod:`zero.runtime.gathering.gatherer`.
Under mixed precision stages 0-1 take the variants of :mod:`zero.runtime.stages.mixed`.
"""

from zero.precision import MixedPrecision
from zero.runtime.stages.mixed import Stage0Mixed, Stage0MixedStaged, Stage1Staged
from zero.runtime.stages.stage0 import Stage0
from zero.runtime.stages.stage1 import Stage1
from zero.runtime.stages.stage2 import Stage2
from zero.runtime.stages.stage3 import Stage3

Stage = Stage0  # the protocol every stage implements


def make_stage(number: int, precision: MixedPrecision | None = None) -> Stage0:
    """The policy object for ZeRO stage ``number`` (already validated by ``ZeroConfig``) under ``precision``."""
    precision = precision or MixedPrecision()
    if precision.enabled and number in (0, 1):
        in_place = (precision.reduce_dtype or "fp32") == precision.param_dtype
        variants = {(0, True): Stage0Mixed, (0, False): Stage0MixedStaged, (1, True): Stage1, (1, False): Stage1Staged}
        return variants[number, in_place]()
    stages = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
    return stages[number]()


__all__ = ["Stage", "Stage0", "Stage1", "Stage2", "Stage3", "make_stage"]
