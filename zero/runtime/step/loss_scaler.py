"""``LossScaler``: fp16 dynamic loss scaling, agreed by every rank at no extra collective.

The arithmetic is ``torch.amp.GradScaler``'s (the scale is an fp32 number; unscaling
multiplies fp32 gradients by the fp32 reciprocal of the scale; ``update`` backs off on an
overflow and grows after ``growth_interval`` clean steps), so a run skips the same steps with
the same scale sequence as a single-process run with ``GradScaler``.

Note on agreement: each rank checks its *local* gradients for inf/NaN as each bucket is
handed to its collective (before the reduction: a non-finite local gradient makes the sum
non-finite, and the check cannot race with the collective writing the buffer). The result
rides as one more integer on the end-of-backward all-reduce that already tells every rank
which parameters got gradients, so every rank learns of an overflow on any rank, and skips
the same step, without a collective of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from zero.precision import LossScale


class NoLossScaling:
    """No loss scaling (fp32, bf16): the identity, and no overflow flag on the reduction's all-reduce."""

    enabled = False
    found_inf = False
    inv_scale = 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def begin_pass(self) -> None:
        pass

    def observe(self, grads: torch.Tensor) -> None:
        pass

    def local_flags(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int32, device=device)

    def agree(self, agreed: list[int]) -> None:
        pass

    def update(self) -> None:
        pass

    def reset(self) -> None:
        pass


class LossScaler:
    """The scale, the growth tracker and this step's overflow flags (see the module docstring)."""

    enabled = True

    def __init__(self, policy: LossScale, device: torch.device):
        self.policy = policy
        self.scale = _fp32(policy.init_scale)
        self.growth_tracker = 0
        self._local = torch.zeros((), dtype=torch.int32, device=device)  # non-finite gradient seen here
        self.found_inf = False  # ... on any rank, as agreed at the end of a backward pass
        self._scaled_loss = False  # scale_loss() was called since the last backward pass began

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._scaled_loss = True
        return loss * self.scale

    def begin_pass(self) -> None:
        """A backward pass starts: its loss must have been scaled."""
        if not self._scaled_loss:
            raise ValueError(
                "fp16 training scales the loss before backward (precision.loss_scale), but this backward pass "
                "ran on a loss that was not scaled, so its gradients would be unscaled by a factor that never "
                "multiplied them. Call opt.backward(loss), or opt.scale_loss(loss).backward(), instead of "
                "loss.backward()."
            )
        self._scaled_loss = False

    def observe(self, grads: torch.Tensor) -> None:
        """Record whether ``grads`` (local gradients about to be reduced) hold inf or NaN."""
        self._local |= (~torch.isfinite(grads).all()).to(torch.int32)

    def local_flags(self, device: torch.device) -> torch.Tensor:
        """This rank's overflow flag (int32, 1 element), last on the end-of-backward all-reduce (MAX: set if
        any rank's is)."""
        return self._local.reshape(1)

    def agree(self, agreed: list[int]) -> None:
        """Take this scaler's flag off the end of the all-reduced flags."""
        self.found_inf = self.found_inf or bool(agreed.pop())

    @property
    def inv_scale(self) -> float:
        """``1 / scale`` as GradScaler computes it (in fp64, then rounded to fp32)."""
        return _fp32(1.0 / self.scale)

    def update(self) -> None:
        """After the step (taken or skipped): back off on an overflow, else grow on schedule."""
        p = self.policy
        if self.found_inf:
            backed_off = _fp32(self.scale * p.backoff_factor)
            if backed_off < p.min_scale:
                raise RuntimeError(
                    f"zero: the fp16 loss scale collapsed: gradients overflowed (inf/NaN) at a loss scale of "
                    f"{self.scale:g}, and backing off would go below precision.loss_scale.min_scale "
                    f"({p.min_scale:g}). The loss or the gradients are non-finite at any scale: training has "
                    "diverged (lower the learning rate, clip gradients) or the model produces inf/NaN; bf16 "
                    "(param_dtype='bf16') has fp32's range and needs no loss scaling."
                )
            self.scale = backed_off
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == p.growth_interval:
                grown = _fp32(self.scale * p.growth_factor)
                if grown != float("inf"):
                    self.scale = grown
                self.growth_tracker = 0

    def reset(self) -> None:
        """The gradients were cleared: forget their overflow (kept until then: a gradient that holds an
        inf after a skipped step still holds it)."""
        self._local.zero_()
        self.found_inf = False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 number (GradScaler keeps its scale in an fp32 tensor)."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))
