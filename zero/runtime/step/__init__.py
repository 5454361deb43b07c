"""The step: the wrapped optimizer rebuilt over this rank's pieces (``inner``), stepped bucket by bucket with the
kernel that suits each (``stepper``; ``flat_step``: the Triton step of a whole bucket), synchronously or one step
delayed in a background thread (``delayed``), on the host with the cores the rank owns (``host_threads``), and fp16's
loss scaling (``loss_scaler``).

May import: ``torch``, the policies, ``zero.comm``, ``zero.kernels``, :mod:`zero.runtime.buffers`,
:mod:`zero.runtime.offload`, :mod:`zero.runtime.parallel`, :mod:`zero.runtime.guards`."""
