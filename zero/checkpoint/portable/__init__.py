"""Portable checkpoints: :func:`save_checkpoint` on N ranks, :func:`load_checkpoint` on M, at any stage.

Every rank calls both. Saving (:mod:`zero.checkpoint.portable.save`), each rank writes what it alone owns
(its chunk of every bucket: master weights or parameters, and the optimizer state beside them; at
stage 0, where every rank owns everything, bucket ``b`` is written by rank ``b mod N``), plus its
share of the tensors kept whole (frozen parameters at stages 0-2, buffers), and the optimizer state
of the parameters it steps whole (Muon, Adafactor, ...: :mod:`zero.checkpoint.portable.whole_state`; at stage
0, the ``i``-th such parameter by rank ``i mod N``). Rank 0 then writes ``metadata.json`` (see
:mod:`zero.checkpoint.portable.reader`) and renames the directory into place. Loading
(:mod:`zero.checkpoint.portable.load`), each rank reads the ranges it owns now from whichever files hold
them, and the whole state of the parameters it owns now. Both see the model's tensors through
:mod:`zero.checkpoint.portable.model_tensors`. A tensor-parallel model's checkpoint (format 4) holds each tensor as
boxes of its global shape, one per tp rank's local tensor (:mod:`zero.checkpoint.portable.boxes`; a replicated one
once), in parts named by the rank over dp x tp, so that it loads at any tp and dp degree, and without tp. Every rank
of a pipeline saves into one checkpoint of the whole model, under its parts' names, each tensor once
(:mod:`zero.checkpoint.portable.pipeline`), which loads into the whole model or into parts at any pp degree.

Notes:

* **Atomic.** A save goes to ``PATH.partial``; only when every rank has written and fsynced its
  part and rank 0 has written the metadata (with each entry's CRC-32, and its own SHA-256 beside it)
  is it renamed to ``PATH``. Saving over an existing checkpoint renames the old one to
  ``PATH.replaced`` for the moment between the two renames. A crash at any point leaves a loadable
  checkpoint, and the next save finishes or clears what it left; nothing that this library did not
  write is ever deleted (:mod:`zero.checkpoint.portable.directory`: each step, and what a crash leaves).
* **Checked before anything changes.** A load checks the metadata (checksum, schema, the parts'
  headers: :mod:`zero.checkpoint.portable.reader`) and against the model and optimizer, and verifies the CRC
  of every byte this rank will read, on every rank, and the ranks agree, before the first value is
  written. A refused load leaves the running model and optimizer untouched.
* **Never hangs on one rank's error.** Each phase ends with ``Communicator.everywhere``: a small
  all-gather of every rank's outcome (with the timeout), so an error on one rank is raised on all of them.
* **Why not torch.distributed.checkpoint.** DCP reshards on load too, but its metadata is a pickle
  (loading one runs code), it has no checksums, and it writes into the target directory in place.
  Our pieces are plain 1D ranges of flattened parameters, so the resharding is one intersection
  (:meth:`zero.checkpoint.portable.reader.Checkpoint.read`), and the files are safetensors that any tool reads.

The modules: ``save`` and ``load``; ``reader`` (:class:`zero.checkpoint.portable.reader.Checkpoint`, what opening
one verifies); ``schema`` (``metadata.json``); ``tensorfile`` (the safetensors layout, a tensor at a time);
``directory`` (where a checkpoint lives, the atomic replacement); ``tree`` (nested state as JSON); ``whole_state``
(the state of parameters stepped whole); ``model_tensors`` (the model's tensors, what the checkpoint reads of
the optimizer, and the ranks it spans); ``boxes`` (a tensor-parallel model's boxes and reading across them);
``pipeline`` (what the pp ranks of a pipeline tell one another, so that they write one checkpoint of the whole model).
"""

from zero.checkpoint.portable.load import load_checkpoint
from zero.checkpoint.portable.save import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
