"""The Triton AdamW step of a whole bucket in one launch, with no read of a device value on the host.

Note: the step reads and writes flat buffers: the bucket's master chunk, its gradient chunk, its bf16
parameter chunk, and this rank's ``exp_avg`` and ``exp_avg_sq`` of the chunk (:class:`FlatAdamState`,
allocated at the bucket's first step, padding included). The wrapped optimizer's state keeps torch's format,
per piece (``step``, ``exp_avg``, ``exp_avg_sq``), with ``exp_avg`` and ``exp_avg_sq`` views of the flat
buffers: checkpoints, ``state_dict()``, schedulers and the memory profiler see what they always saw. A state
that was replaced (``load_state_dict()``, a checkpoint load) is copied into the flat buffers at the next step.

Note: the step count of each piece is kept on the host (a Python ``int``), so the bias corrections are computed
without reading ``state["step"]``; that tensor is still advanced (one ``_foreach_add_`` per bucket), and read
once only where it was replaced or advanced by another step (``forget_counts``). Hyperparameters are read from
the parameter groups at every step (schedulers change ``lr``).
"""

from __future__ import annotations

import torch

from zero.runtime.buffers.bucket import Bucket, LocalPiece
from zero.runtime.buffers.placement import to_device_async


class FlatAdamState:
    """One bucket's ``exp_avg`` and ``exp_avg_sq`` as flat buffers, and its pieces' step counts on the host."""

    def __init__(self, bucket: Bucket):
        master = bucket.master
        self.exp_avg = torch.zeros_like(master)  # 1D, the chunk
        self.exp_avg_sq = torch.zeros_like(master)
        self.counts: dict[int, tuple[torch.Tensor, int]] = {}  # piece index -> (its state["step"], the count)
        self.blocks: tuple[tuple[int, ...], torch.Tensor] | None = None  # (used pieces, their block table)

    def adopt(self, index: int, piece: LocalPiece, state: dict, on_device: bool) -> None:
        """Make the state of the bucket's piece ``index`` views of the flat buffers (creating it as torch would,
        or copying it in)."""
        start, numel = piece.piece.chunk_start, piece.piece.numel
        if not state:  # as torch.optim.Adam initializes it (a CPU step count unless fused or capturable)
            state["step"] = torch.zeros((), dtype=torch.float32, device=piece.tensor.device if on_device else None)
            self.counts[index] = (state["step"], 0)
        for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            view = flat.narrow(0, start, numel)
            current = state.get(key)
            if current is None or current.data_ptr() != view.data_ptr():
                if current is not None:
                    view.copy_(current)
                state[key] = view

    def count(self, index: int, step: torch.Tensor) -> int:
        """The piece's step count before this step (read from ``step`` only if it is not the tensor counted)."""
        known = self.counts.get(index)
        if known is not None and known[0] is step:
            return known[1]
        return int(step.item())  # once: a state created elsewhere, loaded, or advanced by another step

    def forget_counts(self) -> None:
        """Another step advanced the pieces (torch's step, with arguments to ``step()``): read them again."""
        self.counts.clear()


class FlatAdamW:
    """Steps buckets with the Triton kernel (``zero.kernels.triton_adamw``), one launch per bucket."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        self.states: dict[int, FlatAdamState] = {}  # by bucket index

    @torch.no_grad()
    def step(self, bucket: Bucket) -> None:
        from zero.kernels.triton_adamw import Segment, adamw_segments_, block_table, hyper_row

        flat = self.states.get(bucket.index)
        if flat is None:
            flat = self.states[bucket.index] = FlatAdamState(bucket)
        used = [(i, piece) for i, piece in enumerate(bucket.pieces) if piece.slot.used_anywhere]
        rows, steps = [], []
        for i, piece in used:
            group = self.optimizer.param_groups[piece.slot.group_index]
            state = self.optimizer.state[piece.tensor]
            flat.adopt(i, piece, state, on_device=bool(group.get("fused") or group.get("capturable")))
            count = flat.count(i, state["step"]) + 1
            flat.counts[i] = (state["step"], count)
            steps.append(state["step"])
            beta1, beta2 = group["betas"]
            rows.append(hyper_row(step=count, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                                  eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                                  decoupled=self.decoupled or bool(group.get("decoupled_weight_decay"))))
        if not used:
            return
        torch._foreach_add_(steps, 1)  # torch's format, as its fused step advances it
        key = tuple(i for i, _ in used)
        if flat.blocks is None or flat.blocks[0] != key:
            table = block_table([Segment(p.piece.chunk_start, p.piece.numel) for _, p in used])
            flat.blocks = (key, to_device_async(table, bucket.master.device))
        hyper = to_device_async(torch.tensor(rows, dtype=torch.float32), bucket.master.device)
        adamw_segments_(bucket.master, bucket.step_grads, flat.exp_avg, flat.exp_avg_sq, bucket.shard, flat.blocks[1],
                        hyper)

    def forget_counts(self, bucket: Bucket) -> None:
        if bucket.index in self.states:
            self.states[bucket.index].forget_counts()

