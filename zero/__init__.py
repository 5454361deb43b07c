"""zero: ZeRO data parallelism for PyTorch (sharded optimizer state, gradients and parameters)."""

from zero.config import ZeroConfig
from zero.memory import ModelStateBytes, zero_model_state_bytes
from zero.optimizer import ZeroOptimizer, init_sharded
from zero.offload import Offload
from zero.precision import LossScale, MixedPrecision
from zero.profiler import estimate, profile

__version__ = "0.2.0"

__all__ = [
    "LossScale", "MixedPrecision", "ModelStateBytes", "Offload", "ZeroConfig", "ZeroOptimizer", "estimate", "init_sharded", "profile", "zero_model_state_bytes",
    "__version__",
]
