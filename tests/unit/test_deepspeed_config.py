"""``ZeroConfig.from_deepspeed``: DeepSpeed's own documented ZeRO configs map field by field or are refused by key.

The configs below are written from DeepSpeed's documentation (deepspeedai/DeepSpeed): the ZeRO tutorial
(docs/_tutorials/zero.md), the ZeRO-Offload tutorial (docs/_tutorials/zero-offload.md), the ZeRO-3 page
(docs/code-docs/source/zero3.rst) and the config reference (docs/_pages/config-json.md); each notes its source.
"""

from __future__ import annotations

import json

import pytest
import torch

from zero import LossScale, ZeroConfig, ZeroOptimizer
from zero.deepspeed.reader import DeepSpeedConfig

MB = 2**20

# docs/_tutorials/zero.md, "Training a 1.5B parameter GPT-2 model" (ZeRO stage 1)
STAGE1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
# docs/_tutorials/zero.md, ZeRO stage 2
STAGE2 = {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
                                "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}}
# docs/_tutorials/zero.md, ZeRO stage 3 with CPU offload of optimizer and parameters
STAGE3_OFFLOAD = {"zero_optimization": {
    "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
    "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
    "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
# docs/_tutorials/zero-offload.md (its JSON has a missing and a trailing comma; fixed here)
STAGE2_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                        "contiguous_gradients": True, "overlap_comm": True}}
# docs/code-docs/source/zero3.rst, example 1 (the "optimizer" section is the caller's: see test_optimizer_section)
STAGE3_FP16 = {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}
# docs/code-docs/source/zero3.rst, the NVMe example
STAGE3_NVME = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme_data"},
                                     "offload_param": {"device": "nvme", "nvme_path": "/nvme_data"}}}
# docs/_pages/config-json.md, "FP16 training options" (every key at its documented example value)
FP16 = {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
        "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1, "fp16_master_weights_and_grads": False}
# docs/_pages/config-json.md, "BFLOAT16 training options" (its example enables bf16 master weights/optimizer states)
BF16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def refused(config, *words: str) -> str:
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_deepspeed(config)
    for word in words:
        assert word in str(info.value), info.value
    return str(info.value)


def test_stage1_tutorial():
    config, training = ZeroConfig.from_deepspeed(STAGE1)
    assert config.stage == 1 and config.bucket_size_mb == 5e8 * 4 / MB  # fp32: 4 bytes per element
    assert not config.precision.enabled and config.offload.optimizer == "none"
    assert training == {"gradient_clipping": None, "gradient_accumulation_steps": 1}


def test_stage2_tutorial():
    result = ZeroConfig.from_deepspeed(STAGE2)
    assert isinstance(result, DeepSpeedConfig)
    from zero.integrations import deepspeed_config  # the reader's former path still names the same class

    assert deepspeed_config.DeepSpeedConfig is DeepSpeedConfig
    assert result.config.stage == 2 and result.config.bucket_size_mb == 5e8 * 4 / MB
    assert set(result.ignored) == {f"zero_optimization.{k}" for k in
                                   ("contiguous_gradients", "overlap_comm", "reduce_scatter")}


def test_stage3_tutorial_with_offload():
    result = ZeroConfig.from_deepspeed(STAGE3_OFFLOAD)
    config = result.config
    assert config.stage == 3 and config.bucket_size_mb == 1e7 * 4 / MB
    assert (config.offload.optimizer, config.offload.params) == ("cpu", "cpu")
    for key in ("stage3_max_live_parameters", "stage3_prefetch_bucket_size", "sub_group_size"):
        assert f"zero_optimization.{key}" in result.ignored


def test_stage2_offload_tutorial():
    config, _ = ZeroConfig.from_deepspeed(STAGE2_OFFLOAD)
    assert config.stage == 2 and config.offload.optimizer == "cpu" and config.offload.params == "none"
    assert config.bucket_size_mb == ZeroConfig().bucket_size_mb  # no bucket key: zero's default


def test_stage3_fp16_defaults_follow_deepspeed():
    config, _ = ZeroConfig.from_deepspeed(STAGE3_FP16)
    assert config.stage == 3
    assert config.precision.param_dtype == "fp16" and config.precision.reduce_dtype == "fp16"
    assert config.precision.cast_forward_inputs is False  # fp16.auto_cast's default
    assert config.precision.loss_scale == LossScale(init_scale=2.0**16, growth_interval=1000, min_scale=1.0)


def test_nvme_offload_is_offload_to_disk():
    result = ZeroConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme_data", "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": "/nvme_data", "buffer_count": 4, "buffer_size": 1e8,
                          "max_in_cpu": 1e9}},
        "aio": {"block_size": 1048576, "queue_depth": 8}})
    offload = result.config.offload
    assert (offload.optimizer, offload.params, offload.path, offload.buffer_count) == ("disk", "disk", "/nvme_data", 4)
    assert {"aio", "zero_optimization.offload_param.buffer_size"} <= set(result.ignored)
    assert ZeroConfig.from_deepspeed(STAGE3_NVME).config.offload.buffer_count == 2  # zero's default
    param_only = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    refused(param_only, "zero_optimization.offload_param.device='nvme' needs zero_optimization.offload_param.nvme_path")
    two_paths = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
                                       "offload_param": {"device": "nvme", "nvme_path": "/b"}}}
    refused(two_paths, "nvme_path differ")
    refused({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/a"}}},
            "offload_param.device='nvme' needs zero_optimization.stage 3")
    refused({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "nvme", "nvme_path": "/a"}}},
            "keeps the optimizer side on disk too")


def test_fp16_documented_keys():
    refused({"fp16": FP16}, "fp16.hysteresis=2", "Set fp16.hysteresis to 1")
    custom = {**FP16, "hysteresis": 1, "initial_scale_power": 12, "loss_scale_window": 500, "min_loss_scale": 4,
              "auto_cast": True}
    config, _ = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}, "fp16": custom})
    assert config.precision.loss_scale == LossScale(init_scale=4096.0, growth_interval=500, min_scale=4.0)
    assert config.precision.cast_forward_inputs is True
    refused({"fp16": {**custom, "loss_scale": 128}}, "fp16.loss_scale=128", "static loss scaling")
    refused({"fp16": {**custom, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads")


def test_bf16_documented_keys():
    refused({"bf16": BF16}, "bf16.bf16_master_weights_and_grads=True")
    config, _ = ZeroConfig.from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                                           "communication_data_type": "fp32"})
    assert config.precision.param_dtype == "bf16" and config.precision.reduce_dtype == "fp32"
    assert config.precision.loss_scale is None
    refused({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "fp16.enabled and bf16.enabled")


def test_bucket_elements_count_in_the_compute_dtype():
    config, _ = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20},
                                           "bf16": {"enabled": True}})
    assert config.bucket_size_mb == 2.0  # 2**20 bf16 elements
    refused({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, "allgather_bucket_size": 2e6}},
            "zero_optimization.reduce_bucket_size and zero_optimization.allgather_bucket_size differ")


def test_training_settings_are_returned_apart():
    result = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
                                        "gradient_accumulation_steps": 4, "train_batch_size": 32,
                                        "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10,
                                        "wall_clock_breakdown": False})
    assert result.training == {"gradient_clipping": 1.0, "gradient_accumulation_steps": 4}
    assert {"train_batch_size", "steps_per_print", "wall_clock_breakdown"} <= set(result.ignored)
    assert ZeroConfig.from_deepspeed({"gradient_clipping": 0.0}).gradient_clipping is None


def test_unknown_and_unsupported_keys_are_refused_by_name():
    refused({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}},
            "unknown DeepSpeed key zero_optimization.reduce_bucket_sise")
    refused({"pipeline": {"stages": 2}}, "unknown DeepSpeed key pipeline")
    refused({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
            "zero_optimization.zero_quantized_nontrainable_weights=True", "zero_quantized_weights")
    refused({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
            "zero_optimization.zero_quantized_weights needs zero_optimization.stage 3")
    refused({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, "must be at least 1")
    refused({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "zero_optimization.offload_param.device='cpu' needs zero_optimization.stage 3")
    refused({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer.device='cpu' needs")
    refused({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4")
    refused({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage='2' must be an int")
    # a feature switched off (DeepSpeed's default) changes nothing and passes
    ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "zero_quantized_gradients": False}})


def test_zero_plus_plus_flags_map_to_the_communication_policy():
    config = ZeroConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 8}},
    ).config
    assert config.communication.quantized_weights and config.communication.quantized_gradients
    assert (config.communication.shard_size, config.communication.hierarchy) == (8, "hpz")
    plain = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}).config
    assert plain.communication.quantized_gradients and plain.communication.shard_size is None


def test_optimizer_section():
    with_optimizer = {**STAGE3_FP16, "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.8, 0.999],
                                                                              "eps": 1e-8, "weight_decay": 3e-7}}}
    refused(with_optimizer, "DeepSpeed key optimizer", "torch.optim")
    result = ZeroConfig.from_deepspeed(with_optimizer, ignore=["optimizer"])
    assert result.config.stage == 3 and "optimizer" in result.ignored


def test_auto_values():
    # as Hugging Face's DeepSpeed integration writes them
    hf = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto",
                                "overlap_comm": True, "stage3_prefetch_bucket_size": "auto"},
          "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    config, _ = ZeroConfig.from_deepspeed(hf)
    assert config.bucket_size_mb == ZeroConfig().bucket_size_mb
    refused({**hf, "gradient_clipping": "auto"}, "gradient_clipping='auto'", "Write the value")
    refused({**hf, "bf16": {"enabled": "auto"}}, "bf16.enabled='auto'")


def test_json_file(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**STAGE2, "bf16": {"enabled": True}, "gradient_clipping": 0.5}))
    config, training = ZeroConfig.from_deepspeed(path)
    assert config.stage == 2 and config.precision.param_dtype == "bf16" and training["gradient_clipping"] == 0.5
    assert ZeroConfig.from_deepspeed(str(path)).config == config
    path.write_text("{'stage': 2}")
    refused(path, "not valid JSON")


def train(config: ZeroConfig, clip: float | None, accumulation: int) -> list[torch.Tensor]:
    """Three steps of a tiny MLP, each of ``accumulation`` micro-batches (all but the last under no_sync)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, config=config)
    for step in range(3):
        for micro in range(accumulation):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + micro))
            loss = model(x).square().mean() / accumulation
            if micro < accumulation - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    with opt.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()]


def test_deepspeed_config_trains_like_the_hand_written_one():
    ds = {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                "reduce_bucket_size": 64, "allgather_bucket_size": 64},
          "gradient_clipping": 0.05, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4}
    config, training = ZeroConfig.from_deepspeed(ds)
    by_hand = ZeroConfig(stage=2, bucket_size_mb=64 * 4 / MB)
    assert config == by_hand
    ours = train(config, training["gradient_clipping"], training["gradient_accumulation_steps"])
    theirs = train(by_hand, 0.05, 2)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
