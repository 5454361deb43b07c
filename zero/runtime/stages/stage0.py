"""Stage 0: plain data parallelism, the reference point.

Every rank holds whole parameters, whole gradients and whole optimizer state, as
``DistributedDataParallel`` does: gradients live in persistent flat buckets (each
``p.grad`` is a view into one), each bucket is all-reduced in place as soon as its
gradients are ready (divided by the world size first, as DDP does). There is one shard per bucket: the whole of it.

In full precision ``p.grad`` is always the real, whole, averaged gradient, so
``torch.nn.utils.clip_grad_norm_`` and ``model.zero_grad()`` work on it as with DDP
(:class:`~zero.runtime.stages.gradients.WholeGradients`).

Under mixed precision (``precision.param_dtype`` set) the optimizer steps fp32 master weights, so the reduced gradient
it needs is not what ``p.grad`` (in the parameters' low-precision dtype) can hold: ``p.grad`` shows a
:class:`~zero.runtime.buffers.sharded_grad.ShardedGrad` guard after a reduction, as at stages 1-3, and the gradients
are handled as at stage 1 (:func:`~zero.runtime.stages.gradients.buffered_gradients`), with one shard and an all-reduce.
"""

from __future__ import annotations

from zero.precision import MixedPrecision
from zero.runtime.stages.gradients import WholeGradients, buffered_gradients
from zero.runtime.stages.stage import AllReduce, Stage

MASTER_REASON = (
    "belongs to the fp32 master weights (mixed precision); p.grad, in the parameters' low-precision dtype, does not "
    "hold it"
)


class Stage0(Stage):
    number = 0

    def __init__(self, precision: MixedPrecision | None = None):
        precision = precision or MixedPrecision()
        gradients = buffered_gradients(precision, MASTER_REASON) if precision.enabled else WholeGradients()
        super().__init__(AllReduce(), gradients)
