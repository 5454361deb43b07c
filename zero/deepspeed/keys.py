"""The tables of DeepSpeed config keys that :mod:`zero.deepspeed.reader` reads (for
``ZeroConfig.from_deepspeed``): the ones ignored with a reason, accepted at a neutral value only, refused with a fix,
and mapped (in code there)."""

from __future__ import annotations

from typing import Any

ZO = "zero_optimization"
AUTO = "auto"
_PERF = "communication scheduling: zero always {}; it changes no number"
_S3 = ("DeepSpeed's stage-3 gathering/persistence knob, counted in elements; zero gathers unit by unit "
       "(unit_classes or unit_size_mb, prefetch_units, reshard_after_forward); it changes no number")
_NVME = "DeepSpeed's NVMe tuning; zero's disk offload maps its file in buckets (offload.buffer_count)"

# key path -> why it changes nothing in zero (any value accepted, "auto" included)
IGNORED: dict[str, str] = {
    "train_batch_size": "the batch is the data loader's; zero averages gradients over ranks whatever its size",
    "train_micro_batch_size_per_gpu": "the batch is the data loader's; zero averages gradients over ranks",
    "steps_per_print": "logging only",
    "wall_clock_breakdown": "logging only (zero.profile measures the step's phases)",
    "memory_breakdown": "logging only (opt.named_memory() lists zero's buffers)",
    "dump_state": "logging only",
    "zero_allow_untested_optimizer": "zero wraps any elementwise torch.optim optimizer",
    "zero_force_ds_cpu_optimizer": "zero steps offloaded state with the torch optimizer you pass (use fused=True)",
    "tensorboard": "monitoring only", "wandb": "monitoring only", "csv_monitor": "monitoring only",
    "comet": "monitoring only", "comms_logger": "monitoring only (opt.comm_stats counts zero's traffic)",
    "flops_profiler": "monitoring only (zero.profile)",
    f"{ZO}.overlap_comm": _PERF.format("overlaps bucket reductions with backward (max_in_flight_buckets)"),
    f"{ZO}.contiguous_gradients": _PERF.format("keeps gradients in flat bucket buffers"),
    f"{ZO}.reduce_scatter": _PERF.format("reduce-scatters its buckets"),
    f"{ZO}.allgather_partitions": _PERF.format("all-gathers updated shards"),
    f"{ZO}.round_robin_gradients": _PERF.format("copies each reduced chunk to the host as it completes"),
    f"{ZO}.use_multi_rank_bucket_allreduce": _PERF.format("reduce-scatters its buckets"),
    f"{ZO}.ignore_unused_parameters": "zero skips parameters with no gradient on any rank, as PyTorch does",
    f"{ZO}.log_trace_cache_warnings": "logging only",
    f"{ZO}.sub_group_size": "DeepSpeed's optimizer-step granularity; zero steps bucket by bucket",
    f"{ZO}.stage3_gather_16bit_weights_on_model_save": "saving is zero.save_checkpoint / consolidate's",
    f"{ZO}.gather_16bit_weights_on_model_save": "saving is zero.save_checkpoint / consolidate's",
    f"{ZO}.offload_optimizer.pin_memory": "zero pins host buffers whenever the model is on a GPU",
    f"{ZO}.offload_param.pin_memory": "zero pins host buffers whenever the model is on a GPU",
    f"{ZO}.offload_optimizer.fast_init": _NVME, f"{ZO}.offload_param.buffer_size": _NVME,
    f"{ZO}.offload_param.max_in_cpu": _NVME, "aio": _NVME + " through the page cache, not libaio",
    "bf16.immediate_grad_update": "DeepSpeed's bf16 optimizer scheduling; it changes no number",
    "bf16.check_grad_overflow": "zero does not check bf16 gradients for inf/NaN (bf16 has fp32's range)",
}
for _key in ("max_live_parameters", "max_reuse_distance", "prefetch_bucket_size", "param_persistence_threshold",
             "model_persistence_threshold", "module_granularity_threshold"):
    IGNORED[f"{ZO}.stage3_{_key}"] = IGNORED[f"{ZO}.{_key}"] = _S3

# key path -> (the values accepted, and ignored; why any other value is refused, with the fix)
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "gradient_predivide_factor": ((1, 1.0), "zero divides the reduced gradients by the world size once"),
    "prescale_gradients": ((False,), "zero divides the reduced gradients by the world size once"),
    "gradient_allreduce_op": (("mean",), "zero averages gradients over ranks (the single-process update)"),
    "sparse_gradients": ((False,), "zero reduces dense gradients only"),
    "amp": ((None, {}, {"enabled": False}), "Apex AMP is not supported; use bf16 or fp16 (precision.param_dtype)"),
    "torch_autocast": ((None, {}, {"enabled": False}),
                       "torch.autocast is yours to call; zero's precision is precision.param_dtype (bf16/fp16)"),
    f"{ZO}.load_from_fp32_weights": ((True,), "zero's checkpoints always restore the fp32 master"),
    f"{ZO}.elastic_checkpoint": ((False,), "zero's checkpoints reshard on load (zero.load_checkpoint) anyway"),
    f"{ZO}.zero_quantized_nontrainable_weights": ((False,), "zero quantizes every stage-3 gather, frozen weights "
                                                  "included, or none: use zero_quantized_weights"),
    f"{ZO}.mics_shard_size": ((-1,), "MiCS sub-group sharding is not supported; zero shards over the whole group"),
    f"{ZO}.mics_hierarchical_params_gather": ((False,), "MiCS is not supported"),
    f"{ZO}.legacy_stage1": ((False,), "DeepSpeed's legacy stage 1 has no equivalent"),
    f"{ZO}.cpu_offload": ((False,), "deprecated in DeepSpeed: write offload_optimizer: {'device': 'cpu'}"),
    f"{ZO}.cpu_offload_param": ((False,), "deprecated in DeepSpeed: write offload_param: {'device': 'cpu'}"),
    f"{ZO}.cpu_offload_use_pin_memory": ((False,), "deprecated in DeepSpeed: use offload_*.pin_memory"),
    "fp16.loss_scale": ((0, 0.0), "static loss scaling is not supported: zero scales dynamically (use 0)"),
    "fp16.fp16_master_weights_and_grads": ((False,), "zero keeps fp32 master weights and gradients"),
    "bf16.bf16_master_weights_and_grads": ((False,), "zero keeps fp32 master weights and gradients"),
    "bf16.bf16_optimizer_states": ((False,), "zero keeps the optimizer's state in fp32"),
}

# known DeepSpeed keys refused whatever their value: key path -> the fix
REFUSED: dict[str, str] = {
    "optimizer": "build the torch.optim optimizer yourself (e.g. torch.optim.AdamW(model.parameters(), **params)) "
    "and wrap it in ZeroOptimizer; or pass ignore=['optimizer'] once you have",
    "scheduler": "build a torch.optim.lr_scheduler over the ZeroOptimizer (it shares the param_groups); "
    "or pass ignore=['scheduler'] once you have",
    "activation_checkpointing": "DeepSpeed's checkpointing API is not used; set ZeroConfig.activation_checkpointing "
    "(e.g. {} for every block) instead",
    f"{ZO}.zenflow": "ZenFlow is not supported",
    f"{ZO}.zeropp_loco_param": "ZeRO++ LoCo is not supported",
}

# the keys handled in code below (the mapped ones)
MAPPED = {
    "zero_optimization", "fp16", "bf16", "bfloat16", "gradient_clipping", "gradient_accumulation_steps",
    "communication_data_type",
    f"{ZO}.stage", f"{ZO}.reduce_bucket_size", f"{ZO}.allgather_bucket_size", f"{ZO}.offload_optimizer",
    f"{ZO}.offload_param", f"{ZO}.offload_optimizer.device", f"{ZO}.offload_param.device",
    f"{ZO}.zero_quantized_weights", f"{ZO}.zero_quantized_gradients", f"{ZO}.zero_hpz_partition_size",
    f"{ZO}.offload_optimizer.nvme_path", f"{ZO}.offload_param.nvme_path", f"{ZO}.offload_optimizer.buffer_count",
    f"{ZO}.offload_param.buffer_count", f"{ZO}.offload_optimizer.ratio",
    "fp16.enabled", "fp16.auto_cast", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.hysteresis",
    "fp16.consecutive_hysteresis", "fp16.min_loss_scale", "bf16.enabled",
}
