"""fake_quant_fp8: tensor-wise FP8 quantize-dequantize in float (FP8 QAT)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float
from .quant_numerics import FP8_MAX, abs_max, fp8_fake_quant, fp8_scale


class FakeQuantFp8Attrs(OpAttrs):
    format: DType = DType.F8E4M3
    axes: tuple[int, ...] = ()
    """Axes that keep their own scale (e.g. (0,) for per-expert scales of a stacked weight)."""

    @field_validator("format")
    @classmethod
    def _fp8(cls, v: DType) -> DType:
        if v not in (DType.F8E4M3, DType.F8E5M2):
            raise ValueError(f"format must be f8e4m3 or f8e5m2, not {v}")
        return v


@register_op
class FakeQuantFp8(OpDef):
    """y = f32(fp8(clip(x / s, -M, M))) * s,   s = max|x| / M   (1 if x is all zero)

    s is computed over the whole tensor, or separately for each index of
    `axes` (max over the other axes).

    M = 448 for e4m3, 57344 for e5m2; fp8() rounds to nearest even
    (ml_dtypes). Tensor-wise and dynamic: the scale is recomputed from each
    input, as ERNIEKit's FP8 QAT does for weights. Gradient: straight-through.
    """

    name = "fake_quant_fp8"
    no_onnx = "float8 rounding is not lowered to ONNX opset 21; Paddle runs it"
    inputs = (Input("x"),)
    Attrs = FakeQuantFp8Attrs

    def infer(self, types: Sequence[TensorType | None], attrs: FakeQuantFp8Attrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        need_float(x, self.name, "x")
        for a in attrs.axes:
            if not -x.rank <= a < x.rank:
                raise OpError(f"fake_quant_fp8: axis {a} out of range for {x}")
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: FakeQuantFp8Attrs) -> list[np.ndarray]:
        x = np.asarray(args[0], dtype=np.float32)
        if not attrs.axes:
            return [fp8_fake_quant(x, fp8_scale(x, attrs.format), attrs.format)]
        keep = tuple(a % x.ndim for a in attrs.axes)
        m = abs_max(x, keep).reshape([x.shape[i] if i in keep else 1 for i in range(x.ndim)])
        s = np.where(m == 0, np.float32(1), m / np.float32(FP8_MAX[attrs.format])).astype(np.float32)
        return [fp8_fake_quant(x, s, attrs.format)]
