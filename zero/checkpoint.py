"""The per-rank optimizer checkpoint format: its header, and the checks before loading one."""

from __future__ import annotations

from typing import Any

from zero.partition import Partition

FORMAT = "zero.shard/1"


def header(*, stage: int, world_size: int, rank: int, partition: Partition) -> dict[str, Any]:
    """What a shard must match to be loaded: format, stage, world size, rank and layout."""
    return {
        "format": FORMAT,
        "stage": stage,
        "world_size": world_size,
        "rank": rank,
        "layout": {
            "params": [(s.name, tuple(s.param.shape), str(s.param.dtype)) for s in partition.slots],
            "buckets": [(b.layout.padded_numel, len(b.slots)) for b in partition.buckets],
        },
    }


def check_loadable(saved: Any, here: dict[str, Any]) -> None:
    """Raise a ValueError naming the mismatch if shard ``saved`` cannot be loaded where ``here`` describes."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(
            f"not a ZeroOptimizer state dict (missing format tag {FORMAT!r}); save it with ZeroOptimizer.state_dict()"
        )
    if saved["world_size"] != here["world_size"]:
        raise ValueError(
            f"this checkpoint was saved at world size {saved['world_size']} but this run has world size "
            f"{here['world_size']}. Loading on a different world size (resharding) is not supported yet: "
            f"resume on {saved['world_size']} ranks."
        )
    for key in ("stage", "rank"):
        if saved[key] != here[key]:
            raise ValueError(
                f"this shard was saved with {key}={saved[key]} but is being loaded with {key}={here[key]}; "
                "each rank must load its own shard, saved with the same ZeRO stage"
            )
    _compare_layouts(saved["layout"], here["layout"])


def _compare_layouts(saved: dict[str, Any], here: dict[str, Any]) -> None:
    for i, (a, b) in enumerate(zip(saved["params"], here["params"])):
        if (a[0], tuple(a[1]), a[2]) != (b[0], tuple(b[1]), b[2]):
            raise ValueError(
                f"this checkpoint does not match the model: parameter #{i} was {a[0]} {tuple(a[1])} {a[2]} "
                f"when saved but is {b[0]} {tuple(b[1])} {b[2]} now"
            )
    if len(saved["params"]) != len(here["params"]):
        raise ValueError(
            f"this checkpoint has {len(saved['params'])} trainable parameters; the model has {len(here['params'])}"
        )
    if [tuple(x) for x in saved["buckets"]] != [tuple(x) for x in here["buckets"]]:
        raise ValueError(
            "this checkpoint was saved with a different bucket layout (bucket_size_mb); "
            "resume with the same ZeroConfig.bucket_size_mb"
        )
