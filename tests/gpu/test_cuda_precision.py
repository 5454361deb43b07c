"""Mixed precision on CUDA with NCCL (world size 1): bf16 at stages 0-3 with torch's step against the hand-built
recipe (the same kernels: bit for bit, after 1 and after 4 steps), and ``torch.cuda.memory_allocated()`` after the
steps against the mixed formula. Skipped without CUDA. (The Triton step is compared with its reference in
``test_cuda_step.py``: two correct AdamW kernels round apart, and bf16 training makes that grow.)"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import CFG, bf16_recipe
from tests.readouts import master_weights
from zero import ZeroOptimizer
from zero.estimator.estimator import model_states
from zero.models import GPT, synthetic_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("force", [False, True], ids=["fast_path", "real_collectives"])
def test_cuda_bf16_matches_the_recipe_and_the_formula(nccl_world_of_one, stage, force, steps):
    expected = bf16_recipe(steps)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, force_collectives=force,
        precision={"param_dtype": "bf16", "reduce_dtype": "bf16"}, step_kernel="torch",
    )
    for step in range(steps):
        x, y = (t.cuda() for t in synthetic_batch(step, 4, CFG))
        opt.backward(model.loss(x, y))
        opt.step()
        if step < steps - 1:  # (the last step's gradients stay: the formula counts them)
            opt.zero_grad()
    del x, y
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    masters = master_weights(opt)
    assert torch.equal(masters, expected)  # at one rank, with the recipe's kernels: the recipe's numbers
    formula = model_states(opt.partition.padded_numel, 1, stage, "mixed").total
    assert held == pytest.approx(formula, rel=0.01), f"allocated {held}, formula {formula}"
