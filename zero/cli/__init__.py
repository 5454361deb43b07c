"""The ``zero`` command (``python -m zero``; ``main.py``): ``demo``, ``estimate``, ``report``, ``consolidate``, and the
ranged argument types they share (``types.py``, also used by :mod:`zero.models`)."""
