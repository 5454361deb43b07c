"""Start a real world of N processes with gloo on 127.0.0.1 and collect each rank's result; run a module in a
process of its own (as rank 0 of torch's fake process group) and read the JSON line it prints.

The ranks are forked by a fork server (``multiprocessing``'s "forkserver" start method), a fresh interpreter started
once per test session that imports torch and ``zero`` once (``PRELOAD``): every rank is a new process, in the state
the server was in, with the parent's ``sys.path`` and working directory, but without paying those imports again
(about 3 s of CPU a rank on the 2 cores CI has, which made starting a world the expensive part of a check). Its
environment is the parent's when the server started: a world that needs other variables sets them inside ``fn``.
"""

from __future__ import annotations

import datetime
import gc
import json
import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.quick import is_quick

TEARDOWN_S = 10
PRELOAD = [  # what the fork server imports once (a module that is not installed is skipped)
    "torch", "torch.distributed", "zero", "tests.distributed.harness", "tests.readouts", "tests.toy",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama", "transformers.trainer",
    "peft",  # the Hugging Face worlds' imports (stage 3, LoRA, the integrations): about 4 s of CPU a rank
]
ROOT = Path(__file__).resolve().parents[2]  # the repository: the working directory of the processes started here


def world_fixture(checks: Callable, sizes: tuple[int, ...] = (1, 2, 3), *args: Any, quick_args: tuple | None = None,
                  timeout_s: float = 600):
    """A test module's ``world`` fixture: one real world per size in ``sizes`` (ids ``world1``, ...; ``--quick``
    keeps ``world2``) runs ``checks(rank, world_size, *args)`` once for the module (``*quick_args`` instead under
    ``--quick``, where given: the part of its matrix a quick run keeps, ``tests/quick.py``); the fixture's value is
    ``(world_size, results by rank)``. Define it as ``world = world_fixture(checks)`` in the module."""

    @pytest.fixture(scope="module", params=sizes, ids=lambda n: f"world{n}")
    def world(request):
        run_args = quick_args if quick_args is not None and is_quick(request) else args
        return request.param, run_world(checks, request.param, *run_args, timeout_s=timeout_s)

    return world


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, outdir: str, args: tuple) -> None:
    # What the fork server imported (some 400k objects, most of them transformers' and torch's) is left out of every
    # garbage collection and of gc.get_objects(): a live-tensor scan or a collection took 0.2-0.4 s for them. The few
    # tensors among them were made by the imports, before ``fn``: every memory check measures from a baseline after
    gc.freeze()
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


def _failed(path: Path, proc) -> bool:
    """A rank that wrote an error, or died without writing anything."""
    if path.exists():
        return "error" in torch.load(path, weights_only=False)
    return not proc.is_alive()


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    ``fn`` must be importable (defined at module level). A rank that raises fails the
    call with that rank's traceback; a world that outlives ``timeout_s`` is killed, and so
    are ranks still tearing down ``TEARDOWN_S`` after every result is in (a test that left a
    collective unmatched on purpose cannot destroy its process group).
    """
    outcomes = run_world_outcomes(fn, world_size, *args, timeout_s=timeout_s, fail_fast=True)
    for outcome in outcomes:
        if "ok" not in outcome:
            raise AssertionError("a rank failed:\n" + outcome.get("error", f"it died: {outcome}"))
    return [outcome["ok"] for outcome in outcomes]


def run_world_outcomes(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 600, fail_fast: bool = False
) -> list[dict]:
    """Like :func:`run_world`, but every rank's outcome, whatever it is: ``{"ok": result}``, ``{"error":
    traceback}`` or ``{"exitcode": code}`` for a rank that died without a result (e.g. gloo aborted it).
    Only a world that outlives ``timeout_s`` raises. With ``fail_fast`` the other ranks are killed as soon
    as one fails (they might otherwise wait for it in a collective)."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), outdir, args), nprocs=world_size, join=False,
            start_method=_fork_server(),
        )
        deadline = time.monotonic() + timeout_s
        paths = [Path(outdir) / f"rank{r}.pt" for r in range(world_size)]
        try:
            while not all(p.exists() or not proc.is_alive() for p, proc in zip(paths, ctx.processes)):
                if fail_fast and any(_failed(p, proc) for p, proc in zip(paths, ctx.processes)):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {world_size} ranks running {fn.__name__} exceeded {timeout_s}s")
                time.sleep(0.2)
            teardown = time.monotonic() + TEARDOWN_S
            while any(proc.is_alive() for proc in ctx.processes) and time.monotonic() < teardown:
                time.sleep(0.2)
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        return [
            torch.load(p, weights_only=False) if p.exists() else {"exitcode": proc.exitcode}
            for p, proc in zip(paths, ctx.processes)
        ]


def _fork_server() -> str:
    """The start method of every world: "forkserver", its imports preloaded (set before its first use)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def global_mean(value: torch.Tensor, world_size: int) -> float:
    """The mean over the ranks of a scalar each rank holds (no collective in a world of one)."""
    total = value.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    return float(total) / world_size


def init_fake_world(world_size: int) -> None:
    """Make this process rank 0 of a world of ``world_size`` in torch's fake process group: collectives return at
    once and move nothing, so every byte the rank holds is real. (``dist.destroy_process_group()`` ends it.)"""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def run_module(module: str, *args: str, timeout: float) -> dict:
    """``python -m module *args`` from the repository root; the JSON of the last line it prints. It must exit 0
    (else the end of its stderr is the error) within ``timeout`` seconds."""
    return run_modules([(module, *args)], timeout=timeout)[0]


def run_modules(calls: list[tuple[str, ...]], *, timeout: float, side_by_side: int = 2) -> list[dict]:
    """:func:`run_module` for each ``(module, *args)`` of ``calls``, ``side_by_side`` processes at a time (the
    measuring worlds are single-threaded Python for the most part: two share CI's 2 cores at nearly half the time);
    their results in the order of ``calls``. Each is waited for ``timeout`` seconds at most."""
    # (OpenMP's idle threads sleep in them: tests/conftest.py sets OMP_WAIT_POLICY for the session)
    results: list[dict] = []
    for start in range(0, len(calls), side_by_side):
        procs = [subprocess.Popen([sys.executable, "-m", *call], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for call in calls[start:start + side_by_side]]
        try:
            outputs = [proc.communicate(timeout=timeout) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()  # (a no-op for those that exited; the rest were timed out)
        for proc, (out, err) in zip(procs, outputs):
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def value_error(fn: Callable[[], Any]) -> str:
    """The message of the ``ValueError`` that ``fn()`` raises ("" if it raises none): a refusal checked in a world."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    return ""
