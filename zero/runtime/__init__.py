"""The training runtime behind :class:`zero.ZeroOptimizer`, one sub-package per concern, in the order it is built
and runs (each package's docstring says what it owns and what it may import; none imports a package after it):

* ``guards``: the refusals every layer may call (``ddp``: DistributedDataParallel around the model; ``ownership``:
  one optimizer per parameter, and the model still using the parameters it was built with);
* ``precision`` and ``activations``: what the policies of :mod:`zero.precision` and :mod:`zero.activations` do to
  the model when the optimizer is built (the parameters' and the forward inputs' casts; the checkpoint hooks of the
  chosen blocks, their inputs kept in host memory);
* ``buffers``: what exists per bucket (the plan: buffers, their dtype and placement, the collectives that move them;
  computed once from the config, the model and the world, and priced by the estimator too), how parameters are packed
  into buckets and sharded (``layout``, ``partition``, stage 3's ``units``), the flat buffers and the bucket that owns
  them, and the tensors that stand in for whole ones (``sharded_param``, ``sharded_grad``);
* ``stages``: what each ZeRO stage keeps and which transitions it takes (policies over the buckets);
* ``offload``: the optimizer side on disk, paged through host memory (``disk``, ``paging``; where each buffer lives is
  ``buffers.placement``'s);
* ``step``: the optimizer step over this rank's shard, bucket by bucket (``stepper``; ``flat_step``, the Triton step
  of a whole bucket; ``delayed``; ``loss_scaler``; ``inner``; ``host_threads``);
* ``gathering``: stage 3's hooks that gather parameters in forward and backward, in the order ``gather_order``
  decides (the estimator follows the same object), and give the model back (``release``);
* ``reduction``: the hooks that reduce gradients, overlapped with backward, in the order ``reduction_order`` decides
  (the estimator follows it too);
* here: ``build`` assembles all of it (``materialize``: a model built on ``meta``) into the ``runtime``, which the
  facade in :mod:`zero.optimizer` calls; ``whole_parameters`` (``ZeroOptimizer.gathered_parameters``) and
  ``owned_memory`` are operations over the whole runtime.

Collectives are only in :mod:`zero.comm.communicator`.
"""
