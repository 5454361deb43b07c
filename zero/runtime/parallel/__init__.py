"""The model's parallel dimensions beside data parallelism: tensor parallelism's tp dimension (``tensor_parallel``:
its communicator, the gradients it leaves partial, the norm's sum over it, a whole parameter's parts on its ranks),
pipeline parallelism's pp dimension (``pipeline``: the parts' ranks, when the reduction is due, the norm's sum over
them) and the weights tied across its parts (``ties``).

May import: ``torch``, ``zero.comm``, :mod:`zero.runtime.buffers`."""
