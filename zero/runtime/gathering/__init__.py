"""Stage 3's gathering: the schedule (``gather_order``: which unit is gathered, prefetched and released on which
event; the estimator drives the same object), the module hooks that tell it what happened and carry out its decisions
with all-gathers (``gatherer``; ``no_gatherer`` below stage 3), the end of a module's backward (``post_backward``),
the backward pass's state (``backward_pass``), checks on tensors saved for backward (``saved_params``), hpZ's
secondary copies (``secondary``), and giving the model back (``release``).

May import: ``torch``, the policies, ``zero.comm``, ``zero.outputs``, ``zero.weak``, :mod:`zero.runtime.buffers`,
:mod:`zero.runtime.stages`."""
