"""Checkpoints, in two formats, and an export:

* ``shard``: one rank's optimizer shard as a ``state_dict`` (``ZeroOptimizer.state_dict`` / ``load_state_dict``;
  ``state``), with the header that refuses to load it into another run (``header``): loads at the same rank, world
  size, stage and model only;
* ``portable``: the checkpoint directory that loads at any world size, tp or pp degree and stage
  (``zero.save_checkpoint``, ``zero.load_checkpoint``): the save and the load, its reader (``reader``:
  :class:`Checkpoint` and every check of what it opens), the metadata's schema, the tensor files, the directory's
  atomic replacement, the nested state (``tree``), the whole-parameter optimizer state (``whole_state``) and a
  pipeline's parts saved as one checkpoint of the whole model (``pipeline``);
* ``consolidate``: a portable checkpoint exported to one plain model file (``zero.consolidate``).

Both formats record the wrapped optimizers with ``optimizer_set``; ``progress`` reports long saves, loads and exports.

May import: the runtime and everything below it; not the facade (:mod:`zero.optimizer` imports ``shard``; the
portable format reads the optimizer through :class:`zero.checkpoint.portable.model_tensors.Checkpointable`)."""
