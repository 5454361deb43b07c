"""What :func:`zero.estimator.estimate` returns: one rank's peak of one step by the tracker's categories, where it
happens, and the step's traffic, beside the configuration priced (whose settings it reads, never keeps twice)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from zero.config import ZeroConfig
from zero.estimator.configuration import precision_name
from zero.estimator.offloading import OffloadChoice
from zero.estimator.pipeline import Pipeline
from zero.estimator.traffic import Traffic, communication_policy
from zero.estimator.traffic import secondary_size as hpz_size
from zero.memory import CATEGORIES
from zero.offload import target_of


@dataclass(frozen=True)
class Estimate:
    """One rank's (``rank``'s) peak bytes of one training step, by the tracker's categories, and where it happens;
    and the step's traffic. What was priced is ``config`` (with the world's size, the micro-batch, tp and the
    pipeline part); the configuration's settings are read from it (``stage``, ``precision``, ``optimizer_offload`` ...:
    the names of ``SETTINGS``, properties, in ``as_dict()`` too), never kept twice."""

    world_size: int  # every rank (dp x tp); a pipeline part's: its dp ranks
    micro_batch: int
    categories: dict[str, float]  # device memory
    host: float  # host memory for what offload keeps there (on disk: the window of buckets mapped at a time)
    phase: str  # "forward", "backward" or "step"
    module: str
    event: str  # e.g. "gradient reduction", "add operator", "optimizer step"
    disk: float = 0.0  # the offload file (offload to disk), else 0
    traffic: Traffic = Traffic()  # one step's collectives, rank 0's (zero.estimator.traffic)
    rank: int = 0  # the rank priced: the one asked for, else the worst (see estimate()), else 0
    config: ZeroConfig = field(default_factory=ZeroConfig)  # the configuration priced, as ZeroOptimizer takes it
    tensor_parallel: int = 1  # the tp degree: world_size ranks as dp x tp, dp = world_size // tensor_parallel
    pipeline: Pipeline | None = None  # a pipeline part's place and schedule (world_size: the part's dp ranks)

    SETTINGS = ("stage", "precision", "offload", "checkpointing", "optimizer_offload", "params_offload", "buffer_count",
                "offload_ratio", "communication_config", "group_size", "secondary_size")  # (read from config)

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def precision(self) -> str:
        """The precision's shorthand (``"fp32"``, ``"mixed"`` ...), or its non-default fields."""
        return precision_name(self.config.precision)

    @property
    def checkpointing(self) -> bool:
        return self.config.activation_checkpointing is not None

    @property
    def _offload(self) -> OffloadChoice:
        return OffloadChoice.of(self.config.offload)

    @property
    def offload(self) -> bool:
        """The optimizer's side is off the device (in host memory or on disk: see ``optimizer_offload``)."""
        return self._offload.offloaded

    @property
    def optimizer_offload(self) -> str:
        """The optimizer side's offload target: ``"none"`` (the device), ``"cpu"``, ``"disk"`` ... (stage 3's
        parameter shards' offload takes it along)."""
        return self._offload.optimizer

    @property
    def params_offload(self) -> str:
        """Stage 3's parameter shards' target: ``"none"`` (the device), ``"cpu"``, ``"disk"`` ..."""
        return self._offload.params

    @property
    def buffer_count(self) -> int:
        """Offload to disk: buckets mapped in host memory at a time."""
        return self._offload.buffer_count

    @property
    def offload_ratio(self) -> float:
        """Partial offload: the share of the optimizer side offloaded (``offload.ratio``)."""
        return self._offload.ratio

    @property
    def communication_config(self) -> dict[str, Any]:
        """``ZeroConfig(communication=...)``, without its defaults."""
        return self.config.communication.model_dump(exclude_defaults=True)

    @property
    def group_size(self) -> int:
        """Ranks the model states are sharded over: the dp ranks, or HSDP's ``shard_size``."""
        return communication_policy(self.config.communication, self.world_size // self.tensor_parallel)[1]

    @property
    def secondary_size(self) -> int:
        """hpZ: ranks of a group holding the secondary copies (``shard_size``), else 0."""
        return hpz_size(self.config.communication, self.world_size // self.tensor_parallel)

    @property
    def peak(self) -> float:
        return sum(self.categories.values())

    @property
    def paged(self) -> bool:
        """The optimizer's side is in a target that pages through host memory (``host``: its window; ``disk``: the
        file)."""
        return target_of(self.optimizer_offload).pages

    def __getattr__(self, name: str) -> float:  # e.peak's parts by category: e.activations, e.parameters ...
        if name in CATEGORIES:
            return self.categories[name]
        raise AttributeError(name)

    def as_dict(self) -> dict[str, Any]:
        """The fields and the settings read from ``config``, with bytes as whole numbers (rounded: an optimizer's
        state per element can be fractional) and ``peak`` the sum of the rounded categories (what
        ``zero estimate --json`` writes)."""
        categories = {name: round(nbytes) for name, nbytes in self.categories.items()}
        return {**{name: getattr(self, name) for name in self.SETTINGS}, **asdict(self), "categories": categories,
                "host": round(self.host), "disk": round(self.disk), "peak": sum(categories.values()),
                "traffic": self.traffic.as_dict(), "config": self.config.model_dump(mode="json", exclude_defaults=True)}
