"""The package's version: the one place it is written (``zero.__version__``; pyproject.toml reads it)."""

__version__ = "0.2.0"
