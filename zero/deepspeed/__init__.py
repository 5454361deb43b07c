"""DeepSpeed's JSON config read into :class:`zero.ZeroConfig` field values, key by key (``ZeroConfig.from_deepspeed``):
the reader (``reader``: every key mapped, ignored with a reason, accepted at a neutral value only, or refused) and its
tables of keys (``keys``).

May import: the policies below :mod:`zero.config` (never ``zero.config`` itself: it imports this package, and
validates what the reader maps), nothing above them. It sits below the config, apart from the Trainer and Accelerate
adapters in :mod:`zero.integrations`, which import the whole library."""
