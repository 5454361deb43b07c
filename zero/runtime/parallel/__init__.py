"""The model's parallel dimensions beside data parallelism: tensor parallelism's tp dimension (``tensor_parallel``:
its communicator, the gradients it leaves partial, the norm's sum over it, a whole parameter's parts on its ranks).

May import: ``torch``, ``zero.comm``, :mod:`zero.runtime.buffers`."""
