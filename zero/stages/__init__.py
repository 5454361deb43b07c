"""Stage policies: each decides where gradients live and how they are reduced and gathered.

Each stage builds on the one before; the reduction machinery shared by all
of them (gradient hooks, bucket ordering, overlap) lives in :mod:`zero.stages.reducer`, and
stage 3's parameter gathering (module hooks, prefetch) in :mod:`zero.stages.gatherer`.
"""

from zero.stages.stage0 import Stage0
from zero.stages.stage1 import Stage1
from zero.stages.stage2 import Stage2
from zero.stages.stage3 import Stage3

Stage = Stage0  # the protocol every stage implements


def make_stage(number: int) -> Stage0:
    """The policy object for ZeRO stage ``number`` (already validated by ``ZeroConfig``)."""
    stages = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}
    return stages[number]()


__all__ = ["Stage", "Stage0", "Stage1", "Stage2", "Stage3", "make_stage"]
