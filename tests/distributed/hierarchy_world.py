"""What each rank runs in ``test_hierarchy_world.py``: hierarchical sharding (``communication.shard_size``) in a
world of 4 ranks laid out as 2 groups of 2 (two machines of two ranks), and the quantized codecs on top of it.

* ``parity``: the parity scenarios of ``worlds.train`` at stages 1-3 with ``shard_size=2`` and at stage 3 under hpZ
  (``MATRIX``; ``--quick``: ``QUICK_MATRIX``), the single-process reference (rank 0) and DDP at 4 ranks (its noise,
  the yardstick for Adam);
* ``layout``: which ranks share a shard group and what each rank holds and sends;
* ``resume``: SGD at stage 3 with ``shard_size=2``: 3 steps, a portable checkpoint, 3 more steps; then a flat
  stage-2 run at 4 ranks loads the checkpoint and takes the same 3 steps;
* ``quantized``: ``shard_size=2`` with qwZ and qgZ: per-step traffic, and that gathers outside training are exact.
* ``heard``: ``Communicator.everywhere`` with one rank failing, inside its group and across the groups;
* ``traffic``: ``traffic_world.HIERARCHY_CASES``, a GPT's steady step's ``opt.comm_stats`` for the estimator (by
  the case's index; ``--quick``: ``QUICK_TRAFFIC``); ``traffic_hpz``: the same for ``traffic_world.HPZ_CASES`` (hpZ).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed import traffic_world
from tests.distributed.worlds import BUCKET_MB, CFG, build_model, make_optimizer, train
from tests.readouts import flat_params
from zero import ZeroOptimizer, load_checkpoint, save_checkpoint
from zero.models import local_slice, synthetic_batch

WORLD_SIZE = 4
SHARD_SIZE = 2
GLOBAL_BATCH = 12  # divisible by 4 (and by 1, for the reference)
HIERARCHY = {"shard_size": SHARD_SIZE}
QUANTIZED = {"shard_size": SHARD_SIZE, "quantized_weights": True, "quantized_gradients": True, "block_size": 64}
HPZ = {"shard_size": SHARD_SIZE, "hierarchy": "hpz"}
HPZ_RUNS = {  # stage 3 with ZeRO++'s secondary copies: backward gathers (recomputation's too) inside the group
    "hpz": {"communication": HPZ},
    "hpz-checkpointed": {"communication": HPZ, "activation_checkpointing": {}},
}
SCENARIOS = [("adamw", "plain"), ("sgd", "clip"), ("sgd", "edit"), ("sgd", "passes3"), ("sgd", "zero_grad_paths"),
             ("sgd", "finetune")]  # (zero_grad_paths: model.zero_grad(), zero_grad(set_to_none=False), none)
STAGES = (1, 2, 3)
RUNS = (*STAGES, *HPZ_RUNS)  # what a scenario trains at: stages 1-3 with shard_size=2, and stage 3 under hpZ
MATRIX = {scenario: RUNS for scenario in SCENARIOS}
QUICK_MATRIX = {  # --quick: plain AdamW at every run, each other scenario once, where hierarchy changes its path most
    ("adamw", "plain"): RUNS,
    ("sgd", "clip"): (3,),  # the norm of shards the other group holds too: summed inside the group only
    ("sgd", "edit"): (3, "hpz"),  # HSDP: rank 0's edit broadcast across the groups; hpZ: the unit's copies forgotten
    ("sgd", "passes3"): (1,),  # each pass's chunk, all-reduced across the groups, carried into the next pass
    ("sgd", "zero_grad_paths"): (2,),  # uncleared gradients: a shard summed across the groups must not be again
    ("sgd", "finetune"): ("hpz",),  # frozen buckets keep secondary copies too: backward gathers them in the group
}
TRAFFIC = tuple(range(len(traffic_world.HIERARCHY_CASES)))
QUICK_TRAFFIC = (  # --quick: both levels priced through the codec (plain HSDP is the same kinds at 4 bytes; flat qwZ
    1,  # and qgZ are codec_world's too). Stage 2, qgZ: int8 reduce-scatters in the groups, the all-reduce across
    3,  # stage 3, qwZ and qgZ under bf16: every kind of both levels
)
RESUME_STEPS = 3


def parity(rank: int, matrix: dict) -> dict:
    runs = {}
    for (kind, scenario), modes in matrix.items():
        if rank == 0:
            runs[(kind, scenario, "reference")] = train(kind, scenario, 0, 1, "reference", global_batch=GLOBAL_BATCH)
        if kind == "adamw":
            runs[(kind, scenario, "ddp")] = train(kind, scenario, rank, WORLD_SIZE, "ddp", global_batch=GLOBAL_BATCH)
        for stage in (m for m in modes if m in STAGES):
            runs[(kind, scenario, stage)] = train(kind, scenario, rank, WORLD_SIZE, f"stage{stage}",
                                                  global_batch=GLOBAL_BATCH, settings={"communication": HIERARCHY})
        for name in (m for m in modes if m in HPZ_RUNS):
            runs[(kind, scenario, name)] = train(kind, scenario, rank, WORLD_SIZE, "stage3", global_batch=GLOBAL_BATCH,
                                                 settings=HPZ_RUNS[name])
    return runs


def traffic(rank: int, cases: tuple[int, ...]) -> dict[int, dict]:
    """``traffic_world``'s steady step of each of ``cases`` (indices into ``HIERARCHY_CASES``), by index."""
    w = traffic_world
    return {i: w.steady_step_stats(rank, WORLD_SIZE, w.CFG, w.GLOBAL_BATCH, w.BUCKET_MB, *w.HIERARCHY_CASES[i])
            for i in cases}


def _steps(model: torch.nn.Module, opt: ZeroOptimizer, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        loss = model(local_slice(x, rank, WORLD_SIZE), local_slice(y, rank, WORLD_SIZE), step % 2 == 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _fresh(stage: int, communication: dict, kind: str = "sgd") -> tuple[torch.nn.Module, ZeroOptimizer]:
    model = build_model()
    return model, ZeroOptimizer(make_optimizer(kind, model), model, stage=stage, bucket_size_mb=BUCKET_MB,
                                communication=communication)


def layout(rank: int, communication: dict) -> dict:
    model, opt = _fresh(3, communication)
    _steps(model, opt, rank, range(2))
    groups = [None] * WORLD_SIZE
    dist.all_gather_object(groups, dist.get_process_group_ranks(opt.comm.group))
    secondary = getattr(opt.runtime.gatherer.source, "group", None)  # hpZ's
    return {
        "secondary_group": dist.get_process_group_ranks(secondary.group) if secondary is not None else None,
        "group_rank": opt.comm.rank, "group_size": opt.comm.world_size,
        "data_parallel_size": opt.comm.data_parallel_size, "groups": groups,
        "shard_numel": sum(b.shard.numel() for b in opt.buckets),
        "padded_numel": sum(b.layout.padded_numel for b in opt.buckets),
        "secondary_numel": sum(b.buffers["secondary"].numel for b in opt.buckets if "secondary" in b.buffers),
        "stats": opt.comm_stats,
    }


def resume(rank: int, directory: str, saving: dict, loading: tuple[int, dict]) -> dict:
    """3 steps at stage 3 with ``saving``, a checkpoint, 3 more; a fresh run at ``loading`` (stage, communication)
    loads the checkpoint and takes the same 3 steps."""
    model, opt = _fresh(3, saving)
    _steps(model, opt, rank, range(RESUME_STEPS))
    saved = save_checkpoint(Path(directory) / "-".join(map(str, saving.values())), model, opt, progress=False)
    _steps(model, opt, rank, range(RESUME_STEPS, 2 * RESUME_STEPS))
    straight = flat_params(model, opt)
    model2, opt2 = _fresh(*loading)
    load_checkpoint(saved, model2, opt2, progress=False)
    _steps(model2, opt2, rank, range(RESUME_STEPS, 2 * RESUME_STEPS))
    return {"saved": str(saved), "files": sorted(p.name for p in saved.iterdir()),
            "straight": straight, "resumed": flat_params(model2, opt2)}


def quantized(rank: int) -> dict:
    model, opt = _fresh(3, QUANTIZED, kind="adamw")
    initial = flat_params(build_model())
    with torch.no_grad():  # a forward without backward leaves the root unit gathered (int8 copies)
        x, y = synthetic_batch(0, GLOBAL_BATCH, CFG)
        model(local_slice(x, rank, WORLD_SIZE), local_slice(y, rank, WORLD_SIZE), False)
    before = flat_params(model, opt)  # through gathered_parameters(): must be exact
    losses = _steps(model, opt, rank, range(6))
    stats = opt.comm_stats
    after = flat_params(model, opt)
    opt.close()
    closed = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = build_model()
    plain_opt = ZeroOptimizer(make_optimizer("adamw", reference), reference, stage=3, bucket_size_mb=BUCKET_MB,
                              communication=HIERARCHY)
    plain_losses = _steps(reference, plain_opt, rank, range(6))
    return {"initial": initial, "before": before, "losses": losses, "plain_losses": plain_losses, "stats": stats,
            "after": after, "closed": closed}


def heard(rank: int) -> dict:
    """``opt.comm.everywhere`` (the shard group's communicator) when rank 3, of the second group, fails: without
    ``every_group`` and with it (the Trainer's export fails on one rank that way); what each rank raised."""
    _, opt = _fresh(3, HIERARCHY)

    def export() -> int:
        if rank == 3:
            raise ValueError("no space left")
        return rank

    outcomes = {}
    for every_group in (False, True):
        try:
            outcomes[str(every_group)] = opt.comm.everywhere(export, "exporting", every_group=every_group)
        except ValueError as err:
            outcomes[str(every_group)] = str(err)
    outcomes["shared"] = opt.comm.everywhere(lambda: rank, "sharing", share=True, every_group=True)
    return outcomes


def hierarchy_checks(rank: int, world_size: int, directory: str, matrix: dict = MATRIX,
                     traffic_cases: tuple[int, ...] = TRAFFIC) -> dict:
    """Everything this world runs (the module docstring); ``matrix`` and ``traffic_cases``: the parity runs and the
    traffic cases (``QUICK_MATRIX`` and ``QUICK_TRAFFIC`` under ``--quick``), returned with the results."""
    assert world_size == WORLD_SIZE
    return {"matrix": matrix, "parity": parity(rank, matrix), "layout": layout(rank, HIERARCHY),
            "layout_hpz": layout(rank, HPZ), "flat_stats": layout(rank, {})["stats"],
            "layout_hpz1": layout(rank, {**HPZ, "shard_size": 1}),
            "resume": resume(rank, directory, HIERARCHY, (2, {})), "resume_hpz": resume(rank, directory, HPZ, (3, HPZ)),
            "quantized": quantized(rank), "traffic": traffic(rank, traffic_cases),
            "traffic_hpz": traffic_world.hpz_traffic_checks(rank, world_size), "heard": heard(rank)}
