"""zero: ZeRO data parallelism for PyTorch (sharded optimizer state and gradients)."""

from zero.config import ZeroConfig
from zero.memory import ModelStateBytes, zero_model_state_bytes
from zero.optimizer import ZeroOptimizer

__version__ = "0.1.0"

__all__ = ["ModelStateBytes", "ZeroConfig", "ZeroOptimizer", "zero_model_state_bytes", "__version__"]
