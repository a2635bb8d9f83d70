"""dequantize: quantized values times their scales, back to a float weight."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, same_dim
from .quant_numerics import weight_dequantize
from .weight_only_linear import check_quantized_weight


class DequantizeAttrs(OpAttrs):
    dtype: DType = DType.BF16
    """The float type of the result."""
    group_size: int = -1
    """-1: per output channel (or tensor-wise for a scalar scale); g: groups of g rows along K."""

    @field_validator("dtype")
    @classmethod
    def _float(cls, v: DType) -> DType:
        if not v.is_float:
            raise ValueError(f"dequantize produces a float tensor, not {v}")
        return v


@register_op
class Dequantize(OpDef):
    """w = dtype(f32(q) * f32(scale))

    Integer form (weight-only): q i8/i4 [..., K, N], scale [..., N]
    (per output channel) or [..., ceil(K / g), N] (group_size g); the
    leading dims are e.g. the experts of a stacked [E, K, N] weight, each
    with its own scales. FP8 form: q f8e4m3/f8e5m2, scale f32[] (tensor-wise)
    or f32[E] for a stacked [E, K, N] q (tensor-wise per expert). The
    product is exact in float32; the cast to `dtype` rounds to nearest even
    (bf16 can lose bits of q * scale, as a bf16 GPU dequantize does).
    """

    name = "dequantize"
    inputs = (Input("q"), Input("scale"))
    Attrs = DequantizeAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: DequantizeAttrs) -> list[TensorType]:
        q, s = need(types[0], self.name, "q"), need(types[1], self.name, "scale")
        if q.dtype in (DType.F8E4M3, DType.F8E5M2):
            if s.rank > max(q.rank - 2, 0) or tuple(s.shape) != tuple(q.shape[: s.rank]):
                raise OpError(f"dequantize: an fp8 scale is f32[] or one per leading index of q "
                              f"({list(q.shape[:-2])}), got {s}")
            if attrs.group_size != -1:
                raise OpError("dequantize: fp8 values have a tensor-wise scale; group_size must be -1")
        else:
            if q.rank < 2:
                raise OpError(f"dequantize: q must have rank >= 2 ([..., in, out]), got {q}")
            check_quantized_weight(self.name, q, s, attrs.group_size, lead=q.rank - 2)
            for i in range(q.rank - 2):
                same_dim(s.shape[i], q.shape[i], self.name, f"scale and q dim {i}")
        return [q.with_dtype(attrs.dtype)]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: DequantizeAttrs) -> list[np.ndarray]:
        q, s = args[0], args[1]
        assert q is not None and s is not None
        s = np.asarray(s)
        q = np.asarray(q)
        if q.dtype.kind == "f":  # fp8 (widened): tensor-wise, or one scale per leading index
            w = q.astype(np.float32) * s.astype(np.float32).reshape(s.shape + (1,) * (q.ndim - s.ndim))
        else:
            w = weight_dequantize(q, s, attrs.group_size)
        if attrs.dtype != DType.F32:
            w = w.astype(attrs.dtype.numpy)
        return [w]
