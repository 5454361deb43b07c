"""Communication: the only package that talks to other ranks.

What it owns:

* :mod:`zero.comm.communicator`: the :class:`~zero.comm.communicator.Communicator`, the only module of ``zero``
  that calls ``torch.distributed``'s collectives (``tests/repo/test_architecture.py`` checks it); every other
  module, a codec included, goes through a communicator;
* :mod:`zero.comm.handles` (the handle of an in-flight collective, the per-kind counters) and
  :mod:`zero.comm.groups` (the device, the launcher's world, aborting a group): what a communicator needs besides
  its collectives;
* :mod:`zero.comm.codec` (how an all-gather or a reduce-scatter encodes what it moves, and what that costs on the
  wire and in memory: exact, ZeRO++'s quantized weights and gradients, or a codec the policy names by import path)
  over :mod:`zero.comm.quantization` (the block-wise int8/int4 wire format);
* :mod:`zero.comm.hierarchy`: the device mesh of hierarchical sharding (HSDP, hpZ), which builds the communicators
  and picks their codecs;
* :mod:`zero.comm.policy`: :class:`zero.Communication`, the user's settings (``ZeroConfig.communication``).

What it may import: ``torch`` (``torch.distributed`` included), ``pydantic`` for the policy, and its own modules,
nothing else of ``zero``: the runtime, the checkpoints and the estimator import from here, never the reverse. Its
modules import each other directly (``from zero.comm.codec import Codec``), not through this ``__init__``, which
imports nothing: ``zero.config`` reading the policy does not start the communicator.
"""
