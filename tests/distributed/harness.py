"""Spawn a real world of N processes with gloo on 127.0.0.1 and collect each rank's result."""

from __future__ import annotations

import datetime
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


TEARDOWN_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, outdir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result: Any = {"ok": fn(rank, world_size, *args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    path = Path(outdir) / f"rank{rank}.pt"
    torch.save(result, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # atomic: the parent reads only complete results
    if "error" in result:
        raise RuntimeError(result["error"])
    dist.destroy_process_group()


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    ``fn`` must be importable (defined at module level). A rank that raises fails the
    call with that rank's traceback; a world that outlives ``timeout_s`` is killed, and so
    are ranks still tearing down ``TEARDOWN_S`` after every result is in (a test that left a
    collective unmatched on purpose cannot destroy its process group).
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, _free_port(), outdir, args), nprocs=world_size, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        paths = [Path(outdir) / f"rank{r}.pt" for r in range(world_size)]
        done_at = None
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {world_size} ranks running {fn.__name__} exceeded {timeout_s}s")
                if done_at is None and all(p.exists() for p in paths):
                    done_at = time.monotonic()
                if done_at is not None and time.monotonic() - done_at > TEARDOWN_S:
                    break
        except mp.ProcessRaisedException as err:
            raise AssertionError(f"a rank failed:\n{err}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = [torch.load(p, weights_only=False) for p in paths]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise AssertionError("a rank failed:\n" + errors[0])
    return [r["ok"] for r in results]
