"""The wrapped optimizers' part of one rank's step, traced on fake tensors (what :mod:`zero.estimator.optimizers`
describes): each bucket's optimizer state on the priced rank and the largest temporaries of its step.

Every optimizer is rebuilt as the runtime rebuilds it (``zero.runtime.step.inner``: its class, defaults and groups'
hyperparameters) over fake tensors in the master's dtype, stepped once to make its state, then once more under a
:class:`~zero.estimator.timeline.Recorder` (the steady state). The traces are kept by what was traced.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from zero.estimator.failure import explained
from zero.estimator.optimizers import Assignment, fake_params, owner_step_bytes, state_bytes, steps
from zero.estimator.schedule import Layout, StepTrace
from zero.estimator.timeline import Recorder
from zero.precision import DTYPES, MixedPrecision
from zero.runtime.buffers.bucket import adopt_edits_


class OptimizerSteps:
    """The fake steps of a workload's optimizers (``assignment()``: :meth:`zero.estimator.Workload.assignment`),
    under its fake mode."""

    def __init__(self, mode: Any, assignment: Callable[[], Assignment]) -> None:
        self.mode, self.assignment = mode, assignment
        self._traced: dict[tuple[Any, ...], Any] = {}

    def step(self, layout: Layout, policy: MixedPrecision) -> StepTrace:
        """What ``ZeroOptimizer.step()`` holds besides the buffers on the layout's rank: each bucket's optimizer state
        (the flat optimizers' on the rank's pieces, the whole-parameter ones' on the whole parameters it owns), and
        the step's largest temporaries: under mixed precision the masters first adopt edits of the parameters
        (``zero.runtime.buffers.bucket.adopt_edits_``, traced on the largest chunk), the owners step the whole
        parameters (:func:`zero.estimator.optimizers.owner_step_bytes`), then each flat optimizer steps its pieces of
        one bucket at a time (traced on the chunk with the most of its elements and on the one holding its largest
        piece: a foreach step's temporaries grow with the chunk, a per-tensor step's with the largest piece)."""
        dtype = master_dtype(policy)
        low = DTYPES[policy.param_dtype] if policy.enabled else None
        a = self.assignment()
        buckets = [b for b in layout.buckets if b.params]
        state = {b.params: 0.0 for b in buckets}
        update = 0.0
        rates = self.flat_rates(dtype)
        for b in buckets:  # (each flat piece's state: per element and per piece, by its optimizer and group)
            state[b.params] += sum(n * rates[name][0] + rates[name][1]
                                   for n, name in zip(b.pieces, b.piece_params) if name in rates)
        for k in (k for k, whole in enumerate(a.whole) if not whole):
            chunks = [chunk for chunk in (tuple((n, a.group_of[name]) for n, name in zip(b.pieces, b.piece_params)
                                                if a.optimizer_of(name) == k) for b in buckets) if chunk]
            if chunks:
                candidates = {max(chunks, key=lambda c: sum(n for n, _ in c)), max(chunks, key=lambda c: max(c)[0])}
                update = max(update, *(self._flat(k, dtype, c, record=True)[1] for c in candidates))
        chunk = max((sum(b.pieces) for b in buckets), default=0)
        adopt = self._adopt(dtype, low, chunk) if low is not None and chunk else 0.0
        owners, whole = layout.owners, 0.0
        if owners.owned or owners.lent:
            states = self.whole_states(dtype)
            for o in owners.owned:
                state[layout.buckets[o.bucket].params] += states[o.name]
            offloaded = [b.offloaded for b in layout.buckets]
            here = tuple(o.name for o in owners.owned if not offloaded[o.bucket])  # (their step runs on the device)
            whole = owner_step_bytes(owners, offloaded, dtype.itemsize, self._owner_step(here, dtype) if here else 0)
        return StepTrace(state, adopt, update, whole)

    def whole_states(self, dtype: torch.dtype) -> dict[str, float]:
        """Each whole parameter's optimizer state (bytes), by name: its optimizer stepping every one once."""
        key = ("whole states", dtype)
        if key not in self._traced:
            a = self.assignment()
            names = tuple(name for name in a.group_of if a.is_whole(name))
            with self.mode, explained("tracing the optimizers' step"):
                params, optimizers = self._wholes(names, dtype)
                steps(optimizers)
                self._traced[key] = {n: sum(state_bytes(o.state.get(params[n], {})) for o in optimizers) for n in names}
        return self._traced[key]

    def flat_rates(self, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
        """Each flat-path parameter's optimizer state per element and per piece (bytes), by name: its optimizer (and
        group) traced on two pieces of 1 and 2 elements (an elementwise rule's state is tensors shaped like the piece,
        and scalars)."""
        key = ("flat rates", dtype)
        if key not in self._traced:
            a = self.assignment()
            rates = {}
            for k in (k for k, whole in enumerate(a.whole) if not whole):
                groups = tuple(sorted({a.group_of[n] for n in a.group_of if a.optimizer_of(n) == k}))
                state = self._flat(k, dtype, tuple((n, gi) for gi in groups for n in (1, 2)))[0]
                by_group = {gi: (state[2 * i + 1] - state[2 * i], 2 * state[2 * i] - state[2 * i + 1])
                            for i, gi in enumerate(groups)}
                rates.update({n: by_group[a.group_of[n]] for n in a.group_of if a.optimizer_of(n) == k})
            self._traced[key] = rates
        return self._traced[key]

    def _flat(self, k: int, dtype: torch.dtype, pieces: tuple[tuple[int, int], ...],
              record: bool = False) -> tuple[tuple[float, ...], float]:
        """Flat optimizer ``k`` rebuilt over 1-D ``pieces`` (elements, global group): each piece's state after a step
        and, with ``record``, the largest temporaries of the next."""
        key = ("flat", k, dtype, pieces, record)
        if key not in self._traced:
            with self.mode, explained("tracing the optimizer's step"):
                holder = nn.Module()
                holder.pieces = nn.ParameterList(fake_params([(n,) for n, _ in pieces], dtype))
                groups: dict[int, list] = {}
                for p, (_, gi) in zip(holder.pieces, pieces):
                    groups.setdefault(gi, []).append(p)
                opt = self.assignment().rebuilt(k, groups)
                recorder = steps([opt], _recorder(holder, opt) if record else None)
                self._traced[key] = (tuple(state_bytes(opt.state.get(p, {})) for p in holder.pieces),
                                     float(largest(recorder)) if record else 0.0)
        return self._traced[key]

    def _adopt(self, dtype: torch.dtype, low: torch.dtype, numel: int) -> float:
        """The largest temporaries of a chunk's masters adopting edits of its parameters."""
        key = ("adopt", dtype, low, numel)
        if key not in self._traced:
            with self.mode, explained("tracing the optimizer's step"):
                shard, master = torch.zeros(numel, dtype=low), torch.zeros(numel, dtype=dtype)
                adopting = Recorder(nn.Module(), existing=(shard, master))
                with torch.no_grad(), adopting:
                    adopt_edits_(master, shard)
                self._traced[key] = float(largest(adopting))
        return self._traced[key]

    def _owner_step(self, names: tuple[str, ...], dtype: torch.dtype) -> float:
        """The largest temporaries of the whole-parameter optimizers stepping ``names`` (the steady state)."""
        key = ("owner step", names, dtype)
        if key not in self._traced:
            with self.mode, explained("tracing the optimizers' step"):
                params, optimizers = self._wholes(names, dtype)
                holder = nn.Module()
                holder.wholes = nn.ParameterList(params.values())
                self._traced[key] = float(largest(steps(optimizers, _recorder(holder, *optimizers))))
        return self._traced[key]

    def _wholes(self, names: tuple[str, ...], dtype: torch.dtype) -> tuple[dict[str, nn.Parameter], list]:
        """Whole parameters ``names`` (zero, with zero gradients) and the whole-parameter optimizers rebuilt over them
        as the runtime rebuilds them over the stand-ins of those a rank owns."""
        a = self.assignment()
        params = dict(zip(names, fake_params([a.shapes[n] for n in names], dtype)))
        groups: dict[int, list] = {}
        for name, p in params.items():
            groups.setdefault(a.group_of[name], []).append(p)
        return params, [a.rebuilt(k, groups) for k, whole in enumerate(a.whole) if whole]


def master_dtype(policy: MixedPrecision) -> torch.dtype:
    """The dtype of the master weights the optimizers step under ``policy``."""
    return torch.promote_types(DTYPES[policy.param_dtype or "fp32"], torch.float32)


def largest(recorder: Recorder) -> int:
    """The most temporaries a recorded step held at once."""
    return max((p.temporaries for p in recorder.points), default=0)


def _recorder(holder: nn.Module, *optimizers: torch.optim.Optimizer) -> Callable[[], Recorder]:
    """A recorder of a step of ``optimizers`` over ``holder``'s parameters, made once their state exists."""
    return lambda: Recorder(holder, existing=([p.grad for p in holder.parameters()],
                                              [list(o.state.values()) for o in optimizers]))
