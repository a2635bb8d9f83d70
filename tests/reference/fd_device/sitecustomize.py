"""The GPU's compute capability for Paddle's `weight_quantize` in FastDeploy's loader on a CPU.

On the `PYTHONPATH` of the harness run only (tests/reference/fastdeploy_loader.py). Paddle's
`weight_quantize(..., arch=None)`, which FastDeploy calls when it quantizes routed experts of a
bf16 checkpoint at load, asks the GPU for its arch (`_get_arch_info`); here the answer is
`ERNIE_IR_FD_ARCH`, the number the harness gives FastDeploy's own device queries (FDCHECK_SM).
The quantization itself runs as it is, in Paddle's CPU kernel.
"""

import os

_ARCH = os.environ.get("ERNIE_IR_FD_ARCH")
if _ARCH:
    import paddle.nn.quant.quantized_linear as _quantized_linear

    _quantized_linear._get_arch_info = lambda: int(_ARCH)
