"""pact: PACT's learnable symmetric clip of activations (before their fake quantization)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import Input, OpAttrs, OpDef, TensorType, register_op

from ._checks import need, need_float, same_dim


@register_op
class Pact(OpDef):
    """y = (x - relu(x - alpha)) + relu(-alpha - x)      (PaddleSlim's PACT, float32)

    x: float; alpha: f32[1], learnable (PaddleSlim initialises it to 20 and
    trains it with a learning-rate multiplier of 1000). For alpha > 0 this is
    clip(x, -alpha, alpha); gradients flow to alpha where |x| > alpha.
    """

    name = "pact"
    inputs = (Input("x"), Input("alpha"))

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        x, a = need(types[0], self.name, "x"), need(types[1], self.name, "alpha")
        need_float(x, self.name, "x")
        need_float(a, self.name, "alpha")
        same_dim(tuple(a.shape), (1,), self.name, "shape of alpha (a [1] tensor)")
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        x = np.asarray(args[0], dtype=np.float32)
        a = np.float32(np.asarray(args[1], dtype=np.float32).reshape(-1)[0])
        zero = np.float32(0)
        left = np.maximum(x - a, zero)
        right = np.maximum(-a - x, zero)
        return [(x - left) + right]
