"""Offload to disk: each rank's preallocated offload file (``disk``) and the walk that maps a window of buckets from it
into host memory around their turn (``paging``; ``Resident`` when nothing is on disk). Where each buffer lives, host
memory included, is :mod:`zero.runtime.buffers.placement`'s; the policy is :mod:`zero.offload`'s.

May import: ``torch``, the policies, :mod:`zero.runtime.buffers`."""
