"""Step kernels, each tested against the plain-torch reference:

* :mod:`zero.kernels.reference`: the AdamW (and Adam) step one torch operation at a time;
* :mod:`zero.kernels.triton_adamw`: one Triton pass for the mixed-precision step on the GPU (fp32 master,
  m and v updated, the bf16 parameter written), chosen by :mod:`zero.runtime.step.stepper`;
* :mod:`zero.kernels.grad_norm`: the gradient norm and scaling of clipping with torch's multi-tensor kernels.

The host step of CPU offload is torch's fused CPU AdamW (``fused=True``), which runs at memory bandwidth
(``benchmarks/optimizer_step.py``), followed by the cast of the master into the low-precision parameters.
"""
