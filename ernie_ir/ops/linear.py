"""linear: the dense layer in Paddle's weight layout."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import Input, OpAttrs, OpDef, TensorType, register_op

from ._checks import need, need_float, need_rank, same_dim


@register_op
class Linear(OpDef):
    """y = x @ weight + bias

    x: float [..., K]; weight: float [K, N] (Paddle `nn.Linear` layout,
    in_features first); bias: optional [N]; y: x.dtype [..., N].
    Computed in float32.
    """

    name = "linear"
    inputs = (Input("x"), Input("weight"), Input("bias", optional=True))

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        x, w = need(types[0], self.name, "x"), need(types[1], self.name, "weight")
        need_float(x, self.name, "x")
        need_rank(w, 2, self.name, "weight")
        if x.rank < 1:
            need_rank(x, 1, self.name, "x")
        same_dim(x.shape[-1], w.shape[0], self.name, "x's last dim and weight's in_features")
        bias = types[2] if len(types) > 2 else None
        if bias is not None:
            need_rank(bias, 1, self.name, "bias")
            same_dim(bias.shape[0], w.shape[1], self.name, "bias size and out_features")
        return [TensorType(x.dtype, (*x.shape[:-1], w.shape[1]))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        y = np.matmul(x, w)
        if bias is not None:
            y = y + bias
        return [y]
