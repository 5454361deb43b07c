"""Stage policies: each decides where gradients live and how they are reduced and gathered.

A stage (``stage.py``: the protocol) is its collectives plus a gradient handling (``gradients.py``), over the buffers
its plan gives each bucket; each stage class (``stage0.py`` ... ``stage3.py``) states its choice, under mixed precision
too. The reduction machinery shared by all of them (gradient hooks, bucket ordering, overlap) lives in
:mod:`zero.runtime.reduction`, and stage 3's parameter gathering (module hooks, prefetch) in
:mod:`zero.runtime.gathering.gatherer`.
"""

from zero.precision import MixedPrecision
from zero.runtime.stages.stage import Stage
from zero.runtime.stages.stage0 import Stage0
from zero.runtime.stages.stage1 import Stage1
from zero.runtime.stages.stage2 import Stage2
from zero.runtime.stages.stage3 import Stage3


def make_stage(number: int, precision: MixedPrecision | None = None) -> Stage:
    """The policy object for ZeRO stage ``number`` (already validated by ``ZeroConfig``) under ``precision``."""
    stages = {0: lambda: Stage0(precision), 1: lambda: Stage1(precision), 2: Stage2, 3: Stage3}
    return stages[number]()


__all__ = ["Stage", "Stage0", "Stage1", "Stage2", "Stage3", "make_stage"]
