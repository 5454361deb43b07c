"""CPU offload from a GPU (NCCL, world size 1): the hand-built recipe with its masters stepped on the host, bit for
bit (the host step is torch's CPU AdamW, the device step its CUDA one: those two round apart, so offload is compared
with the recipe that steps where offload steps), and less GPU memory than without offload. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import CFG, bf16_recipe, train
from tests.readouts import master_weights
from zero import ZeroOptimizer
from zero.models import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 4


def _train(stage: int, offload: dict) -> tuple[torch.Tensor, int]:
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), model, stage=stage, offload=offload,
        precision={"param_dtype": "bf16"}, step_kernel="torch",  # the Triton step is compared in test_cuda_step.py
    )
    train(model, opt, CFG, range(STEPS))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    return master_weights(opt).cpu(), held


@pytest.mark.parametrize("stage,what", [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params")])
def test_cuda_offload_equals_the_recipe_stepped_on_the_host_and_frees_the_gpu(nccl_world_of_one, stage, what):
    got, with_offload = _train(stage, {what: "cpu"})
    assert torch.equal(got, bf16_recipe(STEPS, master_device="cpu"))
    _, on_gpu = _train(stage, {})
    assert with_offload < on_gpu / 2  # master, m and v (12 of 16 bytes per parameter) left the GPU


def test_a_model_larger_than_the_gpu_cap_is_gathered_and_given_back_on_the_host(nccl_world_of_one):
    """Issue 34, item 6: with optimizer and parameters offloaded, a model whose bf16 parameters alone exceed the cap
    trains, is read whole inside gathered_parameters() and given back by close(), its whole parameters in host
    memory, without ever holding it on the GPU."""
    import zero
    from zero.models import GPTConfig, init_gpt_weights

    cfg = GPTConfig(vocab_size=8192, seq_len=64, d_model=1024, num_layers=24, num_heads=16)  # 311M: 622 MB in bf16
    cap = 512 * 2**20
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        model, opt = zero.init_sharded(lambda: GPT(cfg), lambda m: torch.optim.AdamW(m.parameters(), fused=True),
                                       init_fn=init_gpt_weights, device="cuda", precision={"param_dtype": "bf16"},
                                       offload={"optimizer": "cpu", "params": "cpu"}, activation_checkpointing={})
        assert opt.partition.numel * 2 > cap
        train(model, opt, cfg, range(1))
        with opt.gathered_parameters():
            assert all(p.device.type == "cpu" for p in model.parameters())
            norm = sum(float(p.float().norm()) for p in model.parameters())
        opt.close()
        assert all(p.device.type == "cpu" and type(p) is torch.nn.Parameter for p in model.parameters())
        assert sum(float(p.float().norm()) for p in model.parameters()) == pytest.approx(norm, rel=1e-6)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
