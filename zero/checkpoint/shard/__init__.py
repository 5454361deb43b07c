"""The per-rank optimizer shard (``ZeroOptimizer.state_dict`` / ``load_state_dict``): one rank's state as a
``state_dict`` (``state``), and its header, which records the run and the layout and refuses a shard of another run
(``header``). It loads at the same rank, world size, stage, precision and model only; the checkpoint that loads at
any world size is :mod:`zero.checkpoint.portable`."""
