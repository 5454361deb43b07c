"""Checkpoints: each rank's optimizer shard header (``shard_header``), the portable sharded format that loads
at any world size (``portable``, ``files``, ``schema``, ``tensorfile``, ``directory``, ``tree``) and its export to
one plain model file (``consolidate``)."""
