"""The communicators a ``ZeroConfig.communication`` policy asks for: the codec on the wire and, with hierarchical
sharding, a 2-D layout of the ranks (``torch.distributed.device_mesh``).

Hierarchical sharding (FSDP2's HSDP) lays the ``world_size`` ranks out as ``replicas x shard_size``::

    rank = replica * shard_size + local        (shard groups are consecutive ranks: one machine under torchrun)

Each row (a shard group) shards the model as a flat world of ``shard_size`` ranks would; each column (the ranks
holding the same shard) is a replica group. The runtime sees only the shard group's communicator, whose ``rank``
and ``world_size`` are within the group, so the plan, the partition, the gatherer and checkpoints are those of a
``shard_size``-rank world. What crosses the groups is that communicator's business
(:class:`zero.comm.communicator.Communicator`, ``replicas``): every reduce-scatter's shard is then all-reduced
across the groups (gradients are divided by every rank's count before), broadcasts reach every rank, and the
agreement on which parameters got gradients is taken over every rank.

ZeRO++'s hierarchical partitioning (``hierarchy="hpz"``, stage 3) uses the same mesh differently: the runtime
shards over every rank as without hierarchy, and the shard groups only carry backward's gathers from each rank's
secondary copy of its group's chunk of the parameters (``zero.runtime.gathering.secondary``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from zero.comm.codec import Codec, IdentityCodec, PerCollective, QuantizedGradients, QuantizedWeights
from zero.comm.communicator import Communicator
from zero.comm.policy import Communication, codec_class


def codec_of(policy: Communication) -> Codec:
    """The codec the policy puts on the wire, the one the runtime runs and the estimator prices: the identity, or
    :class:`~zero.comm.codec.PerCollective` of the all-gathers' (qwZ, or ``gather_codec``) and the reductions' (qgZ,
    or ``reduce_codec``), each the identity where the policy names none."""
    gather: Codec | None = None
    reduce: Codec | None = None
    if policy.quantized_weights:
        gather = QuantizedWeights(policy.block_size)
    elif policy.gather_codec is not None:
        gather = codec_class(policy.gather_codec, "gather_codec")()
    if policy.quantized_gradients:
        reduce = QuantizedGradients(policy.block_size, policy.gradient_bits)
    elif policy.reduce_codec is not None:
        reduce = codec_class(policy.reduce_codec, "reduce_codec")()
    if gather is None and reduce is None:
        return IdentityCodec()
    return PerCollective(gather or IdentityCodec(), reduce or IdentityCodec())


def hierarchical(world: Communicator, policy: Communication) -> tuple[Communicator, Communicator | None]:
    """The communicator the runtime shards over, and hpZ's communicator within a group (``None`` without hpZ)
    (collective: every rank builds the mesh).

    Without hierarchy, or when one group would hold every rank: ``world`` itself. HSDP: a communicator over this
    rank's shard group, with the one across the groups as its ``replicas``. hpZ: ``world``, which counts the
    group's traffic as its ``intra`` level, and the group's."""
    size = policy.group_size(world.world_size)
    if size == world.world_size or (policy.hierarchy == "hpz" and size == 1):  # (hpZ over groups of one: off)
        return world, None
    if world.group is not dist.group.WORLD:
        raise ValueError(
            "communication.shard_size lays out every rank of the job as groups of that size, so it needs the default "
            "process group; leave process_group= unset (or shard_size=None to shard over the group you pass)"
        )
    mesh = init_device_mesh(world.device.type, (world.world_size // size, size), mesh_dim_names=("replicate", "shard"))
    timeout_s = world.timeout.total_seconds()
    if policy.hierarchy == "hpz":
        group = Communicator(mesh.get_group("shard"), timeout_s, device=world.device,
                             force_collectives=world.force_collectives)
        world.levels["intra"] = group
        return world, group
    across = Communicator(mesh.get_group("replicate"), timeout_s, device=world.device)
    shard = Communicator(mesh.get_group("shard"), timeout_s, device=world.device,
                         force_collectives=world.force_collectives, replicas=across)
    return shard, None
