"""Activations: silu, gelu (exact and tanh) and softmax, computed in float32."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from ernie_ir.ir import Input, OpAttrs, OpDef, TensorType, register_op

from ._checks import need, need_float, norm_axis

_erf = np.frompyfunc(math.erf, 1, 1)


class _Unary(OpDef):
    inputs = (Input("x"),)

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        need_float(x, self.name, "x")
        return [x]


@register_op
class Silu(_Unary):
    """y = x * sigmoid(x) = x / (1 + exp(-x))"""

    name = "silu"

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        # exp(-x) overflows to inf for very negative x, giving x/inf = -0: the right limit.
        with np.errstate(over="ignore"):
            return [x / (np.float32(1) + np.exp(-x))]

    # The op's own lowerings (docs/ops.md): the emitters consult these before their tables.
    def lower_onnx(self, node: Any, onnx: Any) -> list[str]:
        x = onnx.name(node.inputs[0])
        return [onnx.op("Div", [x, onnx.op("Add", [onnx.f32(1.0), onnx.op("Exp", [onnx.op("Neg", [x])])])])]

    def lower_paddle(self, layer: Any, node: Any, args: list[Any]) -> list[Any]:
        return [layer.F.silu(args[0])]


class GeluAttrs(OpAttrs):
    approximate: Literal["none", "tanh"] = "none"


@register_op
class Gelu(_Unary):
    """none: y = 0.5 x (1 + erf(x / sqrt 2))
    tanh: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    (the exact form evaluates erf in float64, then rounds to float32)
    """

    name = "gelu"
    Attrs = GeluAttrs

    def kernel(self, args: Sequence[np.ndarray | None], attrs: GeluAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        if attrs.approximate == "tanh":
            c = np.float32(math.sqrt(2.0 / math.pi))
            inner = c * (x + np.float32(0.044715) * x * x * x)
            return [np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))]
        x64 = x.astype(np.float64)
        erf = np.asarray(_erf(x64 / math.sqrt(2.0)), dtype=np.float64)  # 0-d gives a float
        return [(0.5 * x64 * (1.0 + erf)).astype(np.float32)]


class SoftmaxAttrs(OpAttrs):
    axis: int = -1


@register_op
class Softmax(_Unary):
    """y = exp(x - max(x)) / sum(exp(x - max(x)))  along `axis`"""

    name = "softmax"
    Attrs = SoftmaxAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: SoftmaxAttrs) -> list[TensorType]:
        (x,) = super().infer(types, attrs)
        norm_axis(attrs.axis, x.rank, self.name)
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: SoftmaxAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        e = np.exp(x - np.max(x, axis=attrs.axis, keepdims=True))
        return [e / np.sum(e, axis=attrs.axis, keepdims=True)]
