"""zero: ZeRO data parallelism for PyTorch (sharded optimizer state, gradients and parameters)."""

from zero.activations import ActivationCheckpointing
from zero.auto_ratio import StepExample
from zero.checkpoint.consolidate import consolidate, load_consolidated
from zero.checkpoint.portable import load_checkpoint, save_checkpoint
from zero.comm.policy import Communication
from zero.config import ZeroConfig
from zero.estimator import estimate
from zero.estimator.activation_budget import blocks_within_budget
from zero.memory import ModelStateBytes, zero_model_state_bytes
from zero.offload import Offload
from zero.optimizer import ZeroOptimizer
from zero.precision import LossScale, MixedPrecision
from zero.profiler import profile
from zero.runtime.activations.checkpointing import checkpoint_activations
from zero.sharded_init import init_sharded
from zero.version import __version__

__all__ = [
    "ActivationCheckpointing", "Communication", "LossScale", "MixedPrecision", "ModelStateBytes", "Offload",
    "StepExample", "ZeroConfig", "ZeroOptimizer", "estimate", "init_sharded", "profile", "zero_model_state_bytes",
    "blocks_within_budget", "checkpoint_activations", "consolidate", "load_checkpoint", "load_consolidated",
    "save_checkpoint", "__version__",
]
