"""Run by ``tests/unit/test_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, set before anything imports triton): the Triton AdamW step against the plain-torch
reference, alone and inside ``ZeroOptimizer`` against the torch step. Prints ``ok`` at the end."""

from __future__ import annotations

import copy
import os

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from tests.toy import Net  # noqa: E402
from zero import ZeroOptimizer  # noqa: E402
from zero.kernels.reference import adamw_reference  # noqa: E402
from zero.kernels.triton_adamw import adamw_step_  # noqa: E402


def kernel_against_reference() -> None:
    """Odd sizes (a partial block), both weight decays, a bf16 and an fp32 gradient, several steps.

    The reference runs in float64. An fp32 one made this test flaky (1 process in 10-20 failed at its first
    step): in those processes torch's fp32 reference, run right after the interpreted launch, was off from a
    float64 computation by up to 1.5 * 2**-12 of the update, from element ~2050 on, while the kernel was within
    a few ulps of it everywhere; recomputed later in the same process the reference was exact again."""
    gen = torch.Generator().manual_seed(0)
    for numel, decoupled, grad_dtype in [(4099, True, torch.bfloat16), (1000, False, torch.float32)]:
        state = [torch.randn(numel, generator=gen), torch.zeros(numel), torch.zeros(numel)]
        ref = [t.double() for t in state]
        out, ref_out = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.bfloat16)
        for step in range(1, 4):
            grad = torch.randn(numel, generator=gen).to(grad_dtype)
            hyper = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=decoupled)
            adamw_step_(*state[:1], grad, *state[1:], out, **hyper)
            adamw_reference(ref[0], grad, ref[1], ref[2], out=ref_out, **hyper)
            for got, want in zip(state, ref):
                torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
            assert torch.equal(out, state[0].to(torch.bfloat16)), "bf16 output is not the master rounded to nearest"
            assert (out.float() - ref_out.float()).abs().max() <= ref_out.float().abs().max() * 2**-7  # one bf16 ulp


def train(stage: int, kernel: str) -> tuple[torch.nn.Module, ZeroOptimizer]:
    model = Net()
    groups = [  # two groups, so pieces of one bucket step with different hyperparameters
        {"params": [p for n, p in model.named_parameters() if n.startswith("blocks")], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("blocks")], "lr": 3e-3},
    ]
    opt = ZeroOptimizer(
        torch.optim.AdamW(groups, lr=1e-2, foreach=False), model, stage=stage, step_kernel=kernel,
        precision={"param_dtype": "bf16"},
    )
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(5, 6, generator=gen)
        opt.backward(model(x, use_aux=step % 2 == 1).float())  # aux has no gradient on even steps
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return model, opt


def inside_the_optimizer() -> None:
    for stage in (1, 3):
        model, opt = train(stage, "triton")
        assert opt.runtime.stepper.triton, "the Triton step was not used"
        ref_model, ref_opt = train(stage, "torch")
        assert not ref_opt.runtime.stepper.triton
        for got, want in zip(opt.state_dict()["master"], ref_opt.state_dict()["master"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        pieces = [(g, w) for a, b in zip(opt.param_groups, ref_opt.param_groups)
                  for g, w in zip(a["params"], b["params"])]
        for got, want in ((opt.state[g], ref_opt.state[w]) for g, w in pieces):
            assert float(got["step"]) == float(want["step"])
            torch.testing.assert_close(got["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        for bucket in opt.partition.trainable_buckets:  # the bf16 parameters are the masters rounded
            assert torch.equal(bucket.shard, bucket.master.to(torch.bfloat16))


def resumed_from_a_state_dict() -> None:
    """The Triton step's flat state through ``state_dict()``/``load_state_dict()``: a fresh optimizer loaded after two
    steps (its state replaced, copied into the flat buffers at its next step, its step counts read once) continues
    bit for bit as the one that went on."""

    def build() -> tuple[torch.nn.Module, ZeroOptimizer]:
        model = Net()
        return model, ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model, stage=2,
                                    step_kernel="triton", precision={"param_dtype": "bf16"})

    def steps(model, opt, which) -> None:
        for step in which:
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            opt.backward(model(x, use_aux=step % 2 == 1).float())
            opt.step()
            opt.zero_grad()

    model, opt = build()
    steps(model, opt, range(2))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # (its tensors are live views)
    steps(model, opt, range(2, 5))
    model2, opt2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    steps(model2, opt2, range(2, 5))
    assert torch.equal(torch.cat(opt.state_dict()["master"]), torch.cat(opt2.state_dict()["master"]))
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert float(a["step"]) == float(b["step"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


if __name__ == "__main__":
    kernel_against_reference()
    inside_the_optimizer()
    resumed_from_a_state_dict()
    print("ok")
