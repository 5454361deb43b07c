"""Buffers: the plan of every bucket (``plan``: which buffers exist at each stage and precision, their sizes, dtypes
and placements), how parameters are packed into padded flat buckets and sharded (``layout``, ``partition``, stage 3's
``units``), where each buffer lives (``placement``: the device, pinned host memory, disk), the flat buffers with
explicit states (``flat_buffer``) and the ``bucket`` that owns them, and the tensors that stand in for whole ones
at stages 1-3 (``sharded_param``, ``sharded_grad``).

May import: ``torch``, the policies (``zero.precision``, ``zero.offload``), ``zero.memory``, :mod:`zero.runtime.guards`
(which optimizer owns which parameter; the DDP refusal); nothing else of the runtime."""
