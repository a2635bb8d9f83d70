"""fp8_linear: static W8A8 FP8 linear layer (tensor-wise scales)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import Input, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_rank, same_dim
from .fake_quant_fp8 import FakeQuantFp8Attrs
from .quant_numerics import fp8_fake_quant


@register_op
class Fp8Linear(OpDef):
    """y = (f32(fp8(x / in_scale)) * in_scale) @ (f32(weight) * weight_scale) + bias

    x: float [..., K]; weight: `format` (f8e4m3 or f8e5m2) [K, N]; weight_scale and
    input_scale: f32[] (tensor-wise; input_scale is static, from calibration
    or QAT); bias: optional [N]. fp8() clips to the format's range and rounds
    to nearest even (ml_dtypes); the activation uses the weight's format.
    (The attribute repeats the weight's dtype because kernels see widened floats.)
    y: x.dtype [..., N]; the GEMM accumulates in float32.
    """

    name = "fp8_linear"
    no_onnx = "opset 21 MatMul takes no float8 inputs; Paddle runs it"
    inputs = (Input("x"), Input("weight"), Input("weight_scale"), Input("input_scale"),
              Input("bias", optional=True))
    Attrs = FakeQuantFp8Attrs

    def infer(self, types: Sequence[TensorType | None], attrs: FakeQuantFp8Attrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        w = need(types[1], self.name, "weight")
        ws = need(types[2], self.name, "weight_scale")
        xs = need(types[3], self.name, "input_scale")
        need_float(x, self.name, "x")
        if w.dtype != attrs.format:
            raise OpError(f"fp8_linear: weight must be {attrs.format} (the format attribute), got {w}")
        need_rank(w, 2, self.name, "weight")
        for t, n in ((ws, "weight_scale"), (xs, "input_scale")):
            need_rank(t, 0, self.name, n)
            need_float(t, self.name, n)
        same_dim(x.shape[-1], w.shape[0], self.name, "x's last dim and weight's in_features")
        bias = types[4] if len(types) > 4 else None
        if bias is not None:
            need_rank(bias, 1, self.name, "bias")
            same_dim(bias.shape[0], w.shape[1], self.name, "bias size and out_features")
        return [TensorType(x.dtype, (*x.shape[:-1], w.shape[1]))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: FakeQuantFp8Attrs) -> list[np.ndarray]:
        x, w, ws, xs = args[0], args[1], args[2], args[3]
        assert x is not None and w is not None and ws is not None and xs is not None
        bias = args[4] if len(args) > 4 else None
        xq = fp8_fake_quant(x, np.float32(xs), attrs.format)
        wd = np.asarray(w).astype(np.float32) * np.float32(ws)
        y = np.matmul(xq, wd)
        if bias is not None:
            y = y + bias
        return [y]
