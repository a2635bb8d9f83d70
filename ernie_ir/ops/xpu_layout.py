"""Paddle's XPU weight-only layout (Kunlunxin P800) and the ops that read it.

Paddle's XPU `weight_only_linear` kernel (paddle/phi/kernels/xpu/weight_only_linear_kernel.cc)
reads the weight as int8 `[N, K]` (`n = weight.dims()[0]`, `k = weight.dims()[1]`, handed
to xblas `fc_fusion` as a transposed operand) and takes the per-channel scale as float32
(a non-float32 scale is cast to float32 on the device first). FastDeploy's XPU
`moe_expert_ffn` (custom_ops/xpu_ops/src/ops/moe_expert_ffn.cc) takes stacked expert
weights `[E, N, K]` (ffn1 `[E, inter, hidden]`, ffn2 `[E, hidden, inter / 2]`) with
float32 scales. So for int8 the layout is plain: the logical values `q` [K, N] (= [in,
out]) transposed, signed, unbiased; scales float32 [N]. int4 is not produced (the dense
kernel refuses it; the MoE kernel's nibble order is not confirmed).

- `weight_only_linear_xpu(x, packed, scale, bias?)`: `weight_only_linear` reading
  packed [N, K] int8 (equal to `weight_only_linear(x, unpack(packed), scale, bias)`
  exactly);
- `unpack_weight_xpu(packed...)`: [N, K] -> logical [K, N], or [E, K, N] (`stacked`)
  from one packed tensor per expert.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_rank, same_dim
from .packed_weight import unpacked_type
from .quant_numerics import weight_dequantize
from .weight_only_linear import check_quantized_weight


def pack_xpu(q: np.ndarray) -> np.ndarray:
    """Logical int8 values q [..., K, N] -> the XPU kernel's int8 [..., N, K]."""
    q = np.asarray(q)
    if q.dtype != np.int8:
        raise OpError(f"the XPU layout holds int8 values, got {q.dtype}")
    return np.ascontiguousarray(np.swapaxes(q, -1, -2))


def unpack_xpu(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_xpu`: [..., N, K] -> logical [..., K, N] (contiguous int8)."""
    return np.ascontiguousarray(np.swapaxes(np.asarray(packed), -1, -2)).astype(np.int8, copy=False)


def _logical_type(op: str, packed: TensorType) -> TensorType:
    if packed.dtype != DType.I8:
        raise OpError(f"{op}: packed weight must be i8 [N, K], got {packed}")
    need_rank(packed, 2, op, "packed weight")
    n, k = packed.shape
    return TensorType(DType.I8, (k, n))


@register_op
class WeightOnlyLinearXpu(OpDef):
    """y = x @ dequant(packedᵀ, scale) + bias     (Paddle XPU `weight_only_linear`, int8 [N, K])

    packed: i8 [N, K]; scale: float [N] (float32 as the XPU kernel takes it);
    bias optional [N]. Per-channel only. Equal to
    `weight_only_linear(x, unpack_weight_xpu(packed), scale, bias)` exactly.
    """

    name = "weight_only_linear_xpu"
    inputs = (Input("x"), Input("weight"), Input("scale"), Input("bias", optional=True))

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        w = _logical_type(self.name, need(types[1], self.name, "weight"))
        s = need(types[2], self.name, "scale")
        need_float(x, self.name, "x")
        check_quantized_weight(self.name, w, s, -1)
        same_dim(x.shape[-1], w.shape[0], self.name, "x's last dim and in_features")
        bias = types[3] if len(types) > 3 else None
        if bias is not None:
            need_rank(bias, 1, self.name, "bias")
            same_dim(bias.shape[0], w.shape[1], self.name, "bias size and out_features")
        return [TensorType(x.dtype, (*x.shape[:-1], w.shape[1]))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        x, p, s = args[0], args[1], args[2]
        assert x is not None and p is not None and s is not None
        bias = args[3] if len(args) > 3 else None
        y = np.matmul(x, weight_dequantize(unpack_xpu(p), s, -1))
        if bias is not None:
            y = y + bias
        return [y]


class UnpackXpuAttrs(OpAttrs):
    stacked: bool = False
    """True: one packed tensor per expert, result [E, K, N]."""


@register_op
class UnpackWeightXpu(OpDef):
    """q = unpack_xpu(packed...)     the XPU kernel's int8 [N, K] back to logical [K, N]

    One input: [K, N]. With `stacked`, E inputs (one per expert, same shape): [E, K, N].
    """

    name = "unpack_weight_xpu"
    inputs = (Input("packed", variadic=True),)
    Attrs = UnpackXpuAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: UnpackXpuAttrs) -> list[TensorType]:
        return [unpacked_type(self.name, types, attrs.stacked, lambda t: _logical_type(self.name, t))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: UnpackXpuAttrs) -> list[np.ndarray]:
        parts = [unpack_xpu(a) for a in args if a is not None]
        return [np.stack(parts) if attrs.stacked else parts[0]]
