"""``zero.integrations.deepspeed_config``, kept for the imports that name it: DeepSpeed's JSON reader is
:mod:`zero.deepspeed.reader` (below :mod:`zero.config`, which imports it for ``ZeroConfig.from_deepspeed``)."""

from zero.deepspeed.reader import DeepSpeedConfig, read_deepspeed

__all__ = ["DeepSpeedConfig", "read_deepspeed"]
