"""Run by ``tests/unit/test_host_reads.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the Triton step on the
CPU): how many times ``zero``'s own code reads a tensor's value on the host during one training step (forward,
backward, clipping, ``step()``, ``zero_grad()``). On a GPU each such read (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool(t)``, ``float(t)``, ``int(t)``) makes the host wait for everything queued. Prints one JSON
line: the count per case, for a 2-block and a 6-block GPT."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

import zero  # noqa: E402
from zero.models import GPT, GPTConfig, synthetic_batch  # noqa: E402

ZERO = str(Path(zero.__file__).parent)
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
CASES = {  # name: (stage, ZeroConfig fields)
    "stage2-bf16": (2, {"precision": {"param_dtype": "bf16"}, "step_kernel": "triton"}),
    "stage3-bf16": (3, {"precision": {"param_dtype": "bf16"}, "step_kernel": "triton"}),
    "stage3-fp32": (3, {}),
}


@contextmanager
def counting(calls: list[str]):
    """Record each host read whose caller is in ``zero/`` (as ``file:line method``)."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(ZERO):
                calls.append(f"{caller.f_code.co_filename[len(ZERO) + 1:]}:{caller.f_lineno} {name}")
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def reads_per_step(stage: int, settings: dict, layers: int) -> list[str]:
    """The host reads of the third training step (the first two build state and tables)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, num_layers=layers, num_heads=2)
    model = GPT(cfg)
    opt = zero.ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage,
                             bucket_size_mb=0.01, **settings)
    if settings.get("step_kernel") == "triton":
        assert opt.runtime.stepper.triton, "the Triton step is not used"
    calls: list[str] = []
    for step in range(3):
        x, y = synthetic_batch(step, 4, cfg)
        with counting(calls) if step == 2 else nullcontext():
            loss = model.loss(x, y)
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    return calls


if __name__ == "__main__":
    print(json.dumps({f"{name}/{layers}": reads_per_step(stage, settings, layers)
                      for name, (stage, settings) in CASES.items() for layers in (2, 6)}))
