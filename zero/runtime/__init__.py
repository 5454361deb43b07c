"""The training runtime behind :class:`zero.ZeroOptimizer`, in the order it is built and runs:

* ``plan``: what exists per bucket (buffers, their dtype and placement, the collectives that move them),
  computed once from the config, the model and the world; the estimator prices the same plan;
* ``layout``, ``partition``, ``units``: how parameters are packed into buckets and sharded; stage 3's units;
* ``flat_buffer``, ``placement``, ``bucket``: buffers with explicit states, where they live, and the bucket
  that owns them;
* ``stages``: what each ZeRO stage keeps and which transitions it takes (policies over the buckets);
* ``reducer``, ``gatherer`` (and ``backward_pass``, ``post_backward``, ``saved_params``): the hooks that
  reduce gradients and gather stage-3 parameters, overlapped with forward and backward, in the orders
  ``reduction_order`` and ``gather_order`` decide (the estimator follows the same objects);
* ``stepper`` (and ``flat_step``, the Triton step of a whole bucket), ``delayed``, ``loss_scaler``, ``inner``: the
  optimizer step over this rank's shard;
* ``build``: assembles all of it for the facade in :mod:`zero.optimizer`.

Collectives are only in :mod:`zero.comm.communicator`.
"""
