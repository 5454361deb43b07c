"""The ``zero`` command (``python -m zero``): ``demo``, ``estimate``, ``report``, ``consolidate`` (see ``main``)."""

from zero.cli.main import main

__all__ = ["main"]
