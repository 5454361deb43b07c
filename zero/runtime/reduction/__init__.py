"""Gradient reduction: the hooks that reduce each bucket's gradients once complete, overlapped with backward, with
at most ``max_in_flight_buckets`` outstanding (``reducer``), in the order ``reduction_order`` decides (the estimator
drives the same object); what the user did to ``p.grad`` between passes (``user_edits``); and what the ranks agree on
at the end of each round, one named record in one all-reduce (``agreement``).

May import: ``torch``, the policies, ``zero.comm``, ``zero.weak``, :mod:`zero.runtime.buffers`,
:mod:`zero.runtime.stages`, :mod:`zero.runtime.gathering`, :mod:`zero.runtime.step` (the loss scaler)."""
