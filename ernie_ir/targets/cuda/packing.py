"""cuda weight packing: Paddle's CUTLASS weight-only layout.

The layout math lives in `ernie_ir.ops.cuda_layout`, because the interpreter's
`weight_only_linear_packed` kernel reads the same bytes (ops may not import
targets); this module is the target's view of it.
"""

from ernie_ir.ops.cuda_layout import (
    CUDA_ARCHS,
    DEFAULT_CUDA_ARCH,
    check_arch,
    pack,
    packable,
    packed_shape,
    position_map,
    unpack,
)

__all__ = [
    "CUDA_ARCHS",
    "DEFAULT_CUDA_ARCH",
    "check_arch",
    "pack",
    "packable",
    "packed_shape",
    "position_map",
    "unpack",
]
