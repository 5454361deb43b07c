"""Mixed precision where it runs (the policy, :class:`zero.MixedPrecision`, and the dtypes it gives each bucket are
:mod:`zero.precision`'s): the parameters' dtype when the optimizer is built (``parameters``: which keep full
precision, the one-time cast of those no bucket manages, whether the device computes in ``param_dtype``) and the
forward pre-hooks that cast the model's floating-point inputs (``casts``). The estimator applies the same casts to
the model it traces.

May import: ``torch``, the policies; nothing else of the runtime."""
