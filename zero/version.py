"""The package's version (``zero.__version__``; pyproject.toml's ``version`` is the same)."""

__version__ = "0.2.0"
