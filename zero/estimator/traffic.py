"""What one training step sends: rank 0's collectives under a ``ZeroConfig.communication`` policy, counted as
``opt.comm_stats`` counts them (:mod:`zero.comm.communicator`).

The count follows the buckets ``ZeroOptimizer`` builds (the same plans the memory estimate prices,
``zero.runtime.buffers.plan``) and, at stage 3, how often the replayed step gathers each unit
(:mod:`zero.estimator.schedule`). Per step (one forward and backward, then ``step()``):

* every trainable bucket's gradients: stage 0 all-reduces its staging buffer; stages 1-3 reduce-scatter it (the
  padded bucket, ``P`` elements in the reduce dtype, ``C = P / group`` to each rank);
* stages 1-2: every trainable bucket's parameters all-gathered after the step (``P``, the parameters' dtype);
  stage 3: every bucket of a unit, each time the unit is gathered;
* the end of backward's agreement: one int32 all-reduce of a flag per trainable parameter, the step count twice
  and, at stage 3, the gathers' fingerprint twice;
* with optimizers stepped on whole parameters (stages 1-3), the owner step's two all-to-alls in the master's dtype
  (``zero.runtime.step.owner_step``): every shard's pieces of gradient and master to their owners (2x the pieces
  this rank holds of others' parameters), then the updates back (the others' pieces of the parameters it owns);
* with hierarchical sharding (``shard_size``, HSDP) all of the above inside the shard group (``group`` ranks), plus,
  across the ``replicas`` groups, each reduce-scatter's shard (``C``, the reduce dtype) all-reduced and the
  agreement's flags all-reduced again;
* with ZeRO++'s hierarchical partitioning (``hierarchy="hpz"``, stage 3) all of the above over every rank (the shard
  group is the whole world, as without hierarchy), except the gathers issued while autograd's backward runs
  (backward and activation checkpointing's recomputation) of a unit whose secondary copy is current (gathered since
  every unit was last released): those are all-gathers inside hpZ's group of ``shard_size`` ranks from the copies,
  exact whatever the codec (``P`` elements in the parameters' dtype; ``zero.runtime.gathering.secondary``).

Levels, and the names ``opt.comm_stats`` gives their kinds (:meth:`Traffic.comm_stats`):

=========  ====================================================================  =====================
level      between which ranks                                                   ``opt.comm_stats``
=========  ====================================================================  =====================
``intra``  the ranks the parameters are sharded over: every rank when flat and   ``<kind>``
           with hpZ, the shard group with HSDP (every collective of a flat run)
``inter``  across HSDP's shard groups                                            ``inter_<kind>``
``hpz``    inside hpZ's groups of ``shard_size`` ranks (backward's gathers from  ``intra_<kind>``
           the secondary copies)
=========  ====================================================================  =====================

(``opt.comm_stats``' ``intra_`` is ``zero.comm.hierarchy``'s name for hpZ's group communicator; here ``"intra"`` keeps
its meaning of the group the parameters are sharded over, so hpZ's group is the level ``"hpz"``.) ``numel`` is the
ZeRO paper's payload (a reduce-scatter's input, an all-gather's output) and ``bytes`` the bytes on the wire, as the
communicator counts them; a group of one sends nothing. The all-gathers, reduce-scatters and HSDP's all-reduces go
through the policy's codec (``zero.comm.hierarchy.codec_of``), which states their bytes on the wire and its wire's
dtype (``zero.comm.codec.Codec.gather_cost`` and the others: the identity's are the payload's; ZeRO++'s qwZ and qgZ
send ``group`` packets of ``zero.comm.quantization.packet_bytes(C, block_size)`` bytes, int8 or int4 blocks with an
fp32 scale each, and across HSDP's groups an all-to-all and an all-gather of ``replicas`` packets of ``ceil(C /
replicas)`` elements); the rest moves the tensors as they are.
Not counted: what a user's ``clip_grad_norm_()`` adds (one all-reduce of a scalar), and with accumulation under
``no_sync()`` stage 3's gathers for the earlier micro-batches (each forward and backward gathers again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch
from pydantic import ValidationError

from zero.comm.hierarchy import codec_of
from zero.comm.policy import Communication
from zero.estimator.configuration import raise_rule
from zero.precision import DTYPES

LEVELS = ("intra", "inter", "hpz")  # see the module docstring
PREFIXES = {"intra": "", "inter": "inter_", "hpz": "intra_"}  # opt.comm_stats' name of a level's <kind>
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
FLAGS = torch.int32  # the end of backward's agreement

CommunicationArg = Union[Communication, Mapping[str, Any], None]


@dataclass(frozen=True)
class Wire:
    """What one bucket sends, from its plan: sizes in elements and the dtypes of the buffers collectives move."""

    padded: int  # P: the padded bucket
    chunk: int  # C = P / group: one rank's chunk
    params: torch.dtype  # the gathered parameters
    reduce: torch.dtype  # the staging buffer that gradient collectives reduce
    trainable: bool
    unit: str | None  # stage 3: the unit that gathers it


@dataclass(frozen=True)
class Collective:
    """Rank 0's collectives of one kind, level and wire dtype in one step."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce" or "all_to_all"
    level: str  # "intra", "inter" or "hpz" (see the module docstring)
    dtype: str  # on the wire: "fp32", "bf16", "int32", or "int8" / "int4" (quantized: blocks and their fp32 scales)
    calls: int
    numel: int  # payload elements
    bytes: int  # bytes on the wire


@dataclass(frozen=True)
class Traffic:
    """One training step's collectives (rank 0's), by kind, level and wire dtype."""

    collectives: tuple[Collective, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.collectives)

    def level_bytes(self, level: str) -> int:
        return sum(c.bytes for c in self.collectives if c.level == level)

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes per kind, named as ``opt.comm_stats`` names them (``inter_<kind>`` across
        HSDP's groups, ``intra_<kind>`` inside hpZ's), for comparing with a run."""
        stats: dict[str, dict[str, int]] = {}
        for c in self.collectives:
            entry = stats.setdefault(f"{PREFIXES[c.level]}{c.kind}", {"calls": 0, "numel": 0, "bytes": 0})
            entry["calls"] += c.calls
            entry["numel"] += c.numel
            entry["bytes"] += c.bytes
        return stats

    def as_dict(self) -> dict[str, Any]:
        return {"collectives": [vars(c).copy() for c in self.collectives], "bytes": self.bytes,
                **{f"{level}_bytes": self.level_bytes(level) for level in LEVELS}}


def validated(communication: CommunicationArg) -> Communication:
    """The policy (a :class:`zero.Communication`, a mapping, or ``None``: exact and flat), checked as ``ZeroConfig``
    checks it: a rule it breaks is refused with the rule's own message (a ``ValueError``)."""
    if isinstance(communication, Communication):
        return communication
    try:
        return Communication.model_validate(dict(communication or {}))
    except ValidationError as err:
        raise_rule(err)
        raise


def communication_policy(communication: CommunicationArg, world_size: int) -> tuple[Communication, int]:
    """The policy (see :func:`validated`) and the size of the group the parameters are sharded over in a world of
    ``world_size`` ranks (``ValueError`` naming both when ``shard_size`` does not divide it): HSDP's shard group, or
    every rank (flat, and hpZ, whose groups hold only the secondary copies: :func:`secondary_size`)."""
    policy = validated(communication)
    group = policy.group_size(world_size)
    return policy, world_size if policy.hierarchy == "hpz" else group


def secondary_size(policy: Communication, world_size: int) -> int:
    """hpZ: the ranks of a group holding the secondary copies (``shard_size``); 0 without copies (another hierarchy,
    or hpZ's group is every rank or a single one, which ``zero.comm.hierarchy`` runs flat, as DeepSpeed's
    ``zero_hpz_partition_size=1`` is off)."""
    size = policy.group_size(world_size)
    return size if policy.hierarchy == "hpz" and 1 < size < world_size else 0


def stages_for(policy: Communication, stages: tuple[int, ...]) -> tuple[int, ...]:
    """The stages ``ZeroConfig`` runs ``policy`` at (qwZ: stage 3; qgZ and hierarchical sharding: stages 1-3)."""
    def runs(stage: int) -> bool:
        try:
            policy.check_stage(stage)
        except ValueError:
            return False
        return True

    return tuple(stage for stage in stages if runs(stage))


def step_traffic(stage: int, wires: tuple[Wire, ...], slots: int, gathers: Mapping[str, int],
                 policy: Communication, group: int, world_size: int, *, regathers: Mapping[str, int] | None = None,
                 secondary: int = 0, exchange: tuple[int, torch.dtype] | None = None) -> Traffic:
    """Rank 0's collectives in one step (see the module docstring): ``wires`` are the buckets, ``slots`` the
    trainable parameters, ``gathers`` how many times stage 3 gathers each unit, ``group`` the size of the group the
    parameters are sharded over; with hpZ's copies over groups of ``secondary`` ranks (:func:`secondary_size`),
    ``regathers`` how many of each unit's gathers backward issues while its copy is current
    (``zero.estimator.schedule.Peak.regathers``); ``exchange``: the owner step's elements sent, and their dtype
    (:meth:`zero.estimator.optimizers.Ownership.exchanged`), with whole-parameter optimizers over several shards."""
    counts: dict[tuple[str, str, str], list[int]] = {}
    sends = {"intra": group > 1, "inter": world_size > group, "hpz": secondary > 1}  # (a group of one sends nothing)
    codec = codec_of(policy)
    from_copies = (regathers or {}) if secondary else {}

    def add(kind: str, level: str, dtype: Any, numel: int, nbytes: int, calls: int = 1) -> None:
        if calls and sends[level]:
            entry = counts.setdefault((kind, level, _name(dtype)), [0, 0, 0])
            for i, value in enumerate((calls, numel, nbytes)):
                entry[i] += value

    for w in wires:
        if w.trainable and stage == 0:
            add("all_reduce", "intra", w.reduce, w.padded, w.padded * w.reduce.itemsize)
        elif w.trainable:
            cost = codec.reduce_scatter_cost(w.chunk, group, w.reduce)
            add("reduce_scatter", "intra", cost.dtype, w.padded, cost.wire)
            if sends["inter"]:  # HSDP: the reduced shard all-reduced across the groups
                cost = codec.all_reduce_cost(w.chunk, world_size // group, w.reduce)
                add("all_reduce", "inter", cost.dtype, w.chunk, cost.wire)
        if w.trainable and stage in (1, 2):  # after the step
            cost = codec.gather_cost(w.chunk, group, w.params)
            add("all_gather", "intra", cost.dtype, w.padded, cost.wire)
        if stage == 3:
            copies = from_copies.get(w.unit or "", 0)  # hpZ: exact, inside the group, from the secondary copies
            add("all_gather", "hpz", w.params, copies * w.padded, copies * w.padded * w.params.itemsize, copies)
            n = gathers.get(w.unit or "", 0) - copies
            cost = codec.gather_cost(w.chunk, group, w.params)
            add("all_gather", "intra", cost.dtype, n * w.padded, n * cost.wire, n)
    if exchange is not None:  # (two calls, however little they carry)
        add("all_to_all", "intra", exchange[1], exchange[0], exchange[0] * exchange[1].itemsize, 2)
    flags = slots + 2 + (2 if stage == 3 else 0)  # used flags, the step count (v, -v), stage 3's fingerprint
    for level in ("intra", "inter"):  # (over every rank with hpZ: once)
        add("all_reduce", level, FLAGS, flags, flags * FLAGS.itemsize)
    order = {kind: i for i, kind in enumerate(KINDS)}
    rows = sorted(counts.items(), key=lambda item: (LEVELS.index(item[0][1]), order[item[0][0]], item[0][2]))
    return Traffic(tuple(Collective(kind, level, dtype, *entry) for (kind, level, dtype), entry in rows))


def _name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    names = {v: k for k, v in DTYPES.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))
