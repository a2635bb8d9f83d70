"""weight_only_linear: a linear layer whose weight is stored as int8 / int4 plus scales.

`DequantizedLinear` is what every such linear shares: its kernel is `apply(x, float_weight(q,
scale))`, split in two so that an executor holding the weight as params (the interpreter) can
dequantize it once and reuse the float32 weight on every call, with the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field, field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_rank, same_dim
from .quant_numerics import num_groups, weight_dequantize


class WeightOnlyAttrs(OpAttrs):
    group_size: int = Field(default=-1)
    """-1: one scale per output channel; 64 or 128: one per group of rows along `in`."""

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v != -1 and v <= 0:
            raise ValueError("group_size must be -1 (per channel) or a positive group length")
        return v


def check_quantized_weight(op: str, weight: TensorType, scale: TensorType, group_size: int,
                           lead: int = 0) -> None:
    """Type rule shared by the weight-only ops: weight i8/i4 [lead..., K, N] with matching scales."""
    if weight.dtype not in (DType.I8, DType.I4):
        raise OpError(f"{op}: weight must be i8 or i4 (logical quantized values), got {weight}")
    need_rank(weight, 2 + lead, op, "weight")
    if not scale.dtype.is_float:
        raise OpError(f"{op}: scale must be a float tensor, got {scale}")
    k, n = weight.shape[-2], weight.shape[-1]
    if group_size == -1:
        need_rank(scale, 1 + lead, op, "scale")
        same_dim(scale.shape[-1], n, op, "scale length and out_features")
    else:
        need_rank(scale, 2 + lead, op, "scale")
        same_dim(scale.shape[-1], n, op, "scale columns and out_features")
        if isinstance(k, int):
            same_dim(scale.shape[-2], num_groups(k, group_size), op,
                     f"scale rows and ceil(in_features / {group_size})")
    for i in range(lead):
        same_dim(scale.shape[i], weight.shape[i], op, f"scale and weight dim {i}")


class DequantizedLinear(OpDef):
    """A linear y = x @ float_weight(weight, scale) + bias over inputs (x, weight, scale, bias?)."""

    def float_weight(self, q: np.ndarray, scale: np.ndarray, attrs: OpAttrs) -> np.ndarray:
        """The float32 weight [K, N] the kernel multiplies by (exact dequantization)."""
        raise NotImplementedError

    @staticmethod
    def apply(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> list[np.ndarray]:
        """The kernel's arithmetic given the float32 weight `w`."""
        y = np.matmul(x, w)
        if bias is not None:
            y = y + bias
        return [y]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        x, q, s = args[0], args[1], args[2]
        assert x is not None and q is not None and s is not None
        return self.apply(x, self.float_weight(q, s, attrs), args[3] if len(args) > 3 else None)


@register_op
class WeightOnlyLinear(DequantizedLinear):
    """y = x @ dequant(weight, scale) + bias     (Paddle `weight_only_linear`, logical layout)

    x: float [..., K]; weight: i8 or i4 [K, N] holding the quantized integers
    (not Paddle's arch-permuted bytes: targets pack at lowering); scale: float
    [N] (group_size -1) or [ceil(K / g), N] (group_size g, groups of rows
    along K); bias: optional [N].
      dequant(weight, scale)[k, n] = f32(weight[k, n]) * f32(scale[n or k // g, n])
    (exact in float32). y: x.dtype [..., N], computed in float32.
    """

    name = "weight_only_linear"
    inputs = (Input("x"), Input("weight"), Input("scale"), Input("bias", optional=True))
    Attrs = WeightOnlyAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: WeightOnlyAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        w = need(types[1], self.name, "weight")
        s = need(types[2], self.name, "scale")
        need_float(x, self.name, "x")
        if x.rank < 1:
            need_rank(x, 1, self.name, "x")
        check_quantized_weight(self.name, w, s, attrs.group_size)
        same_dim(x.shape[-1], w.shape[0], self.name, "x's last dim and weight's in_features")
        bias = types[3] if len(types) > 3 else None
        if bias is not None:
            need_rank(bias, 1, self.name, "bias")
            same_dim(bias.shape[0], w.shape[1], self.name, "bias size and out_features")
        return [TensorType(x.dtype, (*x.shape[:-1], w.shape[1]))]

    def float_weight(self, q: np.ndarray, scale: np.ndarray, attrs: OpAttrs) -> np.ndarray:
        assert isinstance(attrs, WeightOnlyAttrs)
        return weight_dequantize(q, scale, attrs.group_size)
