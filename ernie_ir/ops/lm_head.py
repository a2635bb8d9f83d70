"""lm_head: hidden states to vocabulary logits."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import Input, OpAttrs, OpDef, TensorType, f32, register_op

from ._checks import need, need_float, need_min_rank, need_rank, same_dim


class LmHeadAttrs(OpAttrs):
    transpose_weight: bool = False
    """True when weight is [V, H] (a tied embedding table); False for [H, V]."""


@register_op
class LmHead(OpDef):
    """logits = x @ weight            (weight [H, V])
    logits = x @ weight.T          (transpose_weight, weight [V, H]: tied embeddings)

    x: float [..., H]; logits: f32 [..., V] (logits are always float32).
    """

    name = "lm_head"
    inputs = (Input("x"), Input("weight"))
    Attrs = LmHeadAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: LmHeadAttrs) -> list[TensorType]:
        x, w = need(types[0], self.name, "x"), need(types[1], self.name, "weight")
        need_float(x, self.name, "x")
        need_min_rank(x, 1, self.name, "x")
        need_rank(w, 2, self.name, "weight")
        hidden, vocab = (w.shape[1], w.shape[0]) if attrs.transpose_weight else w.shape
        same_dim(x.shape[-1], hidden, self.name, "x's last dim and weight's hidden size")
        return [TensorType(f32, (*x.shape[:-1], vocab))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: LmHeadAttrs) -> list[np.ndarray]:
        x, w = args
        assert x is not None and w is not None
        return [np.matmul(x, w.T if attrs.transpose_weight else w)]
