"""Normalisations: rms_norm and layer_norm, computed in float32."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, TensorType, register_op

from ._checks import need, need_float, need_min_rank, need_rank, same_dim


class NormAttrs(OpAttrs):
    eps: float = Field(gt=0)
    """Added to the variance; no default, because libraries disagree (read the config)."""


def _check_affine(op: str, x: TensorType, t: TensorType | None, name: str) -> None:
    if t is not None:
        need_rank(t, 1, op, name)
        same_dim(t.shape[0], x.shape[-1], op, f"{name} size and x's last dim")


@register_op
class RmsNorm(OpDef):
    """y = x / sqrt(mean(x^2, axis=-1) + eps) * weight

    x: float [..., H]; weight: [H]; y: x.dtype. Computed in float32 (as
    ERNIE's RMSNorm does, whatever the activation dtype).
    """

    name = "rms_norm"
    inputs = (Input("x"), Input("weight"))
    Attrs = NormAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: NormAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        need_float(x, self.name, "x")
        need_min_rank(x, 1, self.name, "x")
        _check_affine(self.name, x, need(types[1], self.name, "weight"), "weight")
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: NormAttrs) -> list[np.ndarray]:
        x, w = args
        assert x is not None and w is not None
        var = np.mean(np.square(x), axis=-1, keepdims=True)
        return [x / np.sqrt(var + np.float32(attrs.eps)) * w]


@register_op
class LayerNorm(OpDef):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias   (over the last axis)

    x: float [..., H]; weight, bias: optional [H] (absent: 1 and 0);
    var is the biased (population) variance. Computed in float32.
    """

    name = "layer_norm"
    inputs = (Input("x"), Input("weight", optional=True), Input("bias", optional=True))
    Attrs = NormAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: NormAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        need_float(x, self.name, "x")
        need_min_rank(x, 1, self.name, "x")
        _check_affine(self.name, x, types[1] if len(types) > 1 else None, "weight")
        _check_affine(self.name, x, types[2] if len(types) > 2 else None, "bias")
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: NormAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        w = args[1] if len(args) > 1 else None
        b = args[2] if len(args) > 2 else None
        mean = np.mean(x, axis=-1, keepdims=True)
        centered = x - mean
        var = np.mean(np.square(centered), axis=-1, keepdims=True)
        y = centered / np.sqrt(var + np.float32(attrs.eps))
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        return [y]
