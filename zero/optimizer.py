"""``ZeroOptimizer``: the user-facing wrapper over any elementwise ``torch.optim`` optimizer."""

from __future__ import annotations

import inspect
import math
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from zero.comm import Communicator
from zero.config import ZeroConfig
from zero.memory import ModelStateBytes, storage_bytes
from zero.partition import build_partition
from zero.stages import make_stage
from zero.stages.reducer import GradReducer

# Update rules that act element by element: correct on any slice of a flattened parameter.
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
)
# Rules that need whole tensors (factored or matrix statistics) or a closure over the whole model.
NON_ELEMENTWISE_OPTIMIZERS = ("LBFGS", "SparseAdam", "Adafactor", "Muon")

STATE_DICT_FORMAT = "zero.shard/1"


class ZeroOptimizer(torch.optim.Optimizer):
    """Shard an optimizer's state (stage 1) and gradients (stage 2) over data-parallel ranks.

    Example::

        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model, stage=2)
        loss_fn(model(x), y).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    The wrapped optimizer must not have stepped yet; its class, parameter groups and
    per-group hyperparameters are kept, and it is rebuilt over this rank's shard (its
    ``param_groups`` are shared with this object, so LR schedulers work as usual).
    Every stage, at every world size, computes the same update as single-process
    training on the global batch (the mean of the per-rank mean losses): gradients are
    averaged over ranks, and parameters that got no gradient on any rank are skipped,
    exactly as PyTorch skips ``p.grad is None``.

    Args:
        optimizer: an instance of an elementwise ``torch.optim`` optimizer (SGD, Adam, AdamW,
            Adagrad, RMSprop, ...) over parameters of ``model``.
        model: the module being trained. Its trainable parameters become views into flat
            buffers owned by this optimizer; buffers and frozen parameters are left alone.
        config: a :class:`ZeroConfig`; keyword ``overrides`` (``stage=2``, ``bucket_size_mb=...``)
            are applied on top of it.
        process_group: the data-parallel group; defaults to the default group if one is
            initialized, else runs as world size 1.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        *,
        config: ZeroConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        **overrides: Any,
    ):
        self.config = _resolve_config(config, overrides)
        _check_optimizer(optimizer)
        self.module = model
        self.comm = Communicator(process_group, self.config.timeout_s)
        self.zero_stage = make_stage(self.config.stage)
        num_shards = self.zero_stage.num_shards(self.comm.world_size)
        self.partition = build_partition(
            optimizer,
            model,
            bucket_size_bytes=self.config.bucket_size_bytes,
            num_shards=num_shards,
            shard_index=self.comm.rank if num_shards > 1 else 0,
        )
        if self.config.sync_module_states:
            self._broadcast_module_states()
        for bucket in self.buckets:
            self.zero_stage.init_grads(bucket)
            bucket.build_pieces()
        self._inner = _rebuild_optimizer(optimizer, self.buckets)
        # Buckets are packed in reverse model order; model order is descending param_index.
        self._pieces_in_model_order = sorted(
            (p for b in self.buckets for p in b.pieces), key=lambda p: (-p.slot.span.param_index, p.piece.param_start)
        )
        super().__init__(self._inner.param_groups, self._inner.defaults)
        self.state = self._inner.state
        self._reducer = GradReducer(self.buckets, self.zero_stage, self.comm, self.config.max_in_flight_buckets)
        self.comm.stats.end_step()  # construction traffic is not a step's

    # ----- properties -------------------------------------------------------------------------------------

    @property
    def buckets(self):
        return self.partition.buckets

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, rebuilt over this rank's shard."""
        return self._inner

    @property
    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Payload counters of the last completed step, per collective kind.

        ``{"reduce_scatter": {"calls": .., "numel": .., "bytes": ..}, "all_gather": {...}, ...}``;
        a step's traffic runs from the end of the previous ``step()`` to the end of this one.
        """
        return self.comm.stats.as_dict("last_step")

    # ----- training -------------------------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, with no communication.

        The next backward pass outside reduces the accumulated sum, so ``k - 1`` micro-batches
        inside ``no_sync()`` and the last one outside equal one batch ``k`` times larger
        (with each micro-batch loss scaled by ``1/k``). At stage 2 the accumulated
        gradients are whole until then.
        """
        previous = self._reducer.sync_enabled
        self._reducer.sync_enabled = False
        try:
            yield
        finally:
            self._reducer.sync_enabled = previous

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the global gradient norm, as ``torch.nn.utils.clip_grad_norm_`` on the whole model.

        Computes the norm over every rank's shard (one small all-reduce), scales the
        gradients by ``min(1, max_norm / (norm + 1e-6))`` and returns the norm (same on every rank).
        """
        self._require_reduced_grads("clip_grad_norm_()")
        grads = self._local_grads()
        norm_type = float(norm_type)
        # Per-tensor norms, then the norm of the norms, in fp32 and model order: the same
        # arithmetic as torch.nn.utils.clip_grad_norm_, so unsharded runs match it bit for bit.
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros(())
        if self.zero_stage.num_shards(self.comm.world_size) > 1:
            what = "all-reduce of the gradient norm"
            if norm_type == math.inf:
                self.comm.all_reduce(total, op="max", what=what).wait()
            else:
                partial = total.to(torch.float64).pow(norm_type)
                self.comm.all_reduce(partial, what=what).wait()
                total = partial.pow(1.0 / norm_type).to(torch.float32)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"zero: the total gradient norm (order {norm_type}) is {total.item()}")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's shard with the wrapped optimizer, then share it with every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._require_reduced_grads("step()")
        for name, p in self.partition.frozen:
            if p.grad is not None:
                raise ValueError(
                    f"parameter {name!r} was frozen (requires_grad=False) when ZeroOptimizer was built but now "
                    "has a gradient; ZeroOptimizer does not manage it. Rebuild the optimizer after unfreezing."
                )
        for bucket in self.buckets:
            for piece in bucket.pieces:
                piece.tensor.grad = bucket.grad_piece(piece) if piece.slot.used_anywhere else None
        self._inner.step()
        handles = [self.zero_stage.gather_params(bucket, self.comm) for bucket in self.buckets]
        for handle in handles:
            if handle is not None:
                handle.wait()
        self.comm.end_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients. With ``set_to_none`` (the default) parameters count as having no
        gradient until the next backward, as in PyTorch; stages 0-1 keep their gradient
        buckets allocated (zeroed), as DDP does, while stage 2 releases its gradient shards."""
        for bucket in self.buckets:
            self.zero_stage.zero_grad(bucket, set_to_none)
            for piece in bucket.pieces:
                piece.tensor.grad = None
        if set_to_none:
            self._reducer.reset()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_reducer"):
            raise NotImplementedError(
                "ZeroOptimizer cannot add parameter groups after construction; add the group to the "
                "optimizer before wrapping it"
            )
        super().add_param_group(param_group)

    # ----- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (call on every rank; save one file per rank)."""
        return {
            "format": STATE_DICT_FORMAT,
            "stage": self.config.stage,
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "layout": self._fingerprint(),
            "optimizer": self._inner.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by :meth:`state_dict` on the same rank, world size, stage and model."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(
                "not a ZeroOptimizer state dict (missing format tag "
                f"{STATE_DICT_FORMAT!r}); save it with ZeroOptimizer.state_dict()"
            )
        saved, here = state_dict, self.state_dict()
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
        self._inner.load_state_dict(saved["optimizer"])
        self.param_groups = self._inner.param_groups  # load_state_dict made new group dicts
        self.state = self._inner.state

    # ----- memory -------------------------------------------------------------------------------------

    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes this rank holds in parameters, gradients and optimizer state (unique storages)."""
        params = [b.param_buffer.data for b in self.buckets] + [p for _, p in self.partition.frozen]
        grads = [b.grad_buffer.data for b in self.buckets if b.grad_buffer is not None]
        grads += [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        grads += [s.param.grad for s in self.partition.slots if s.param.grad is not None]
        states = [v for s in self._inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return ModelStateBytes(storage_bytes(params), storage_bytes(grads), storage_bytes(states))

    # ----- helpers ------------------------------------------------------------------------------------

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient pieces of parameters that have a gradient, in model order."""
        return [p.slot.bucket.grad_piece(p) for p in self._pieces_in_model_order if p.slot.used_anywhere]

    def _require_reduced_grads(self, what: str) -> None:
        if self._reducer.has_unreduced_local:
            raise ValueError(
                f"{what} called after backward passes inside no_sync() only: those gradients were never "
                "reduced across ranks. Run the last micro-batch's backward outside no_sync()."
            )
        if not self._reducer.has_reduced:
            raise ValueError(f"{what} called before backward(): there are no gradients to use yet")

    def _broadcast_module_states(self) -> None:
        if self.comm.world_size == 1:
            return
        tensors = [b.param_buffer.data for b in self.buckets]
        tensors += [p.data for _, p in self.partition.frozen] + list(self.module.buffers())
        handles = [self.comm.broadcast(t, 0, what="broadcast of rank 0's module states") for t in tensors]
        for handle in handles:
            handle.wait()

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "params": [(s.name, tuple(s.param.shape), str(s.param.dtype)) for s in self.partition.slots],
            "buckets": [(b.layout.padded_numel, len(b.slots)) for b in self.buckets],
        }


def _resolve_config(config: ZeroConfig | None, overrides: dict[str, Any]) -> ZeroConfig:
    if config is None:
        return ZeroConfig(**overrides)
    if not isinstance(config, ZeroConfig):
        raise ValueError(f"config must be a zero.ZeroConfig, got {type(config).__name__}")
    return ZeroConfig(**{**config.model_dump(), **overrides})  # re-validated


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"ZeroOptimizer wraps a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
    if isinstance(optimizer, ZeroOptimizer):
        raise ValueError("this optimizer is already a ZeroOptimizer; wrap the plain torch.optim optimizer once")
    name = type(optimizer).__name__
    if name in NON_ELEMENTWISE_OPTIMIZERS:
        raise ValueError(
            f"{name} is not supported: ZeRO steps flat slices of parameters, which is exact only for "
            f"elementwise update rules. Use one of: {', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}."
        )
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        warnings.warn(
            f"{name} is not a known elementwise optimizer; ZeroOptimizer is exact only if its update of each "
            "element depends on that element alone (no per-tensor norms or shapes).",
            stacklevel=3,
        )
    stepped = any("step" not in s or float(s["step"]) > 0 for s in optimizer.state.values())
    if stepped:
        raise ValueError(
            f"the {name} optimizer has already stepped; wrap it in ZeroOptimizer before the first step "
            "(to resume training, load a ZeroOptimizer state_dict instead)"
        )


def _rebuild_optimizer(optimizer: torch.optim.Optimizer, buckets) -> torch.optim.Optimizer:
    """A new optimizer of the same class whose groups hold this rank's pieces (same hyperparameters)."""
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        pieces = [p.tensor for b in buckets for p in b.pieces if p.slot.group_index == gi]
        groups.append({**hyper, "params": pieces})
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    return cls(groups, **kwargs)


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
