"""The parameters' dtype under a :class:`zero.MixedPrecision` policy, as the optimizer is built: the parameters that
keep full precision, the one-time cast of those no bucket manages, and the check that the device computes in
``param_dtype``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from zero.precision import DTYPES, MixedPrecision


def full_precision_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """Parameters of modules that hold floating-point buffers (BatchNorm's running statistics): they stay in
    their own dtype, as autocast keeps batch norm in fp32. Kernels take low-precision inputs with fp32
    weights and statistics, not bf16 weights with fp32 statistics, and the statistics keep their dtype."""
    kept = set()
    for module in model.modules():
        if any(b is not None and b.is_floating_point() for b in module.buffers(recurse=False)):
            kept.update(module.parameters(recurse=False))
    return kept


def cast_unmanaged_parameters(model: torch.nn.Module, policy: MixedPrecision, keep: set[torch.nn.Parameter]) -> None:
    """Cast the model's floating-point parameters not in ``keep`` (those the buckets manage, and those of
    :func:`full_precision_parameters`) to ``param_dtype``: frozen parameters kept whole at stages 0-2
    compute in it too (a one-time cast: nothing updates them)."""
    if policy.param_dtype is None:
        return
    dtype = DTYPES[policy.param_dtype]
    replaced = {}
    for p in model.parameters():
        if p not in keep and p.is_floating_point() and p.dtype != dtype:
            if isinstance(p, DTensor):  # (its dtype is fixed where it was made: a new DTensor)
                replaced[id(p)] = dtensor_like(p, p._local_tensor.detach().to(dtype))
            else:
                p.data = p.data.to(dtype)
    replace_parameters(model, replaced)


def dtensor_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """A new parameter with ``param``'s placements and global shape around ``local`` (its dtype may differ: a
    DTensor's dtype is fixed where it is made, so a cast is a new object), of ``param``'s class and ``zero``
    attributes."""
    spec = param._spec
    meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, local.dtype)
    new = DTensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=param.requires_grad)
    new.__class__ = type(param)  # (a stage-3 guard's class too)
    new.__dict__.update({k: v for k, v in param.__dict__.items() if k.startswith("_zero")}, _is_param=True)
    return new


def replace_parameters(model: torch.nn.Module, replaced: dict[int, torch.Tensor]) -> None:
    """Put ``replaced[id(old)]`` in place of each parameter ``old`` in every module that holds it (tied ones too)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in replaced:
                module._parameters[name] = replaced[id(param)]


def check_device_supports(policy: MixedPrecision, device: torch.device) -> None:
    """Raise if ``device`` cannot compute in ``policy.param_dtype`` (a tiny matmul is tried)."""
    if policy.param_dtype is None:
        return
    dtype = DTYPES[policy.param_dtype]
    reason = None
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        reason = "this GPU has no bf16 support (compute capability 8.0 or newer is needed)"
    else:
        try:
            a = torch.ones(2, 2, dtype=dtype, device=device)
            (a @ a).sum().item()
        except (RuntimeError, TypeError) as err:
            reason = f"a {policy.param_dtype} matmul fails there ({err})"
    if reason is not None:
        raise ValueError(
            f"precision.param_dtype={policy.param_dtype!r} cannot run on {device}: {reason}. Choose another "
            "param_dtype (bf16 runs on CPUs and on GPUs of compute capability 8.0+), or leave it unset."
        )
