"""Offload, where it runs: each offload target's placement built for the run and the paging choice (``targets``: the
runtime's side of ``zero.offload.TARGETS``), host memory and its check before allocating (``host``), each rank's
preallocated offload file on disk (``disk``) and the walk that maps a window of buckets from a paging target into host
memory around their turn (``paging``; ``Resident`` when nothing pages). Where each buffer lives, device and host
memory included, is :mod:`zero.runtime.buffers.placement`'s; the policy and its table of targets are
:mod:`zero.offload`'s.

May import: ``torch``, the policies, :mod:`zero.runtime.buffers`."""
