"""Ops that read weights in Paddle's CUDA weight-only layout (see ernie_ir/ops/cuda_layout.py).

They let a cuda-lowered graph, whose `<layer>.quant_weight` params hold
exactly the bytes `paddle.nn.quant.weight_quantize(w, algo, arch=A)` returns,
run in the reference interpreter:

- `weight_only_linear_packed(x, packed, scale, bias?)`: Paddle's
  `weight_only_linear` reading the packed bytes (= `weight_only_linear` on the
  unpacked logical values, exactly);
- `unpack_weight(packed...)`: packed bytes -> logical int values [K, N], or
  [E, K, N] (`stacked`) from one packed tensor per expert;
- `stack(values...)`: same-shaped tensors stacked on a new leading axis
  (per-expert scales back into one [E, ...] tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from pydantic import field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_rank, same_dim
from .cuda_layout import unpack
from .quant_numerics import weight_dequantize
from .weight_only_linear import DequantizedLinear, check_quantized_weight

_ARCHS = (70, 75, 80, 86, 89, 90)


class PackedAttrs(OpAttrs):
    arch: int = 80
    """CUDA arch the bytes are laid out for (70, 75, 80, 86, 89, 90)."""
    bits: int = 8
    """8 (int8, packed [N, K]) or 4 (int4, packed [N/2, K])."""
    in_features: int = 0
    """K: the packed shape alone does not say which dim is which."""

    @field_validator("arch")
    @classmethod
    def _arch(cls, v: int) -> int:
        if v not in _ARCHS:
            raise ValueError(f"arch must be one of {_ARCHS}")
        return v

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: int) -> int:
        if v not in (8, 4):
            raise ValueError("bits must be 8 or 4")
        return v


def _logical_type(op: str, packed: TensorType, attrs: PackedAttrs) -> TensorType:
    if packed.dtype != DType.I8:
        raise OpError(f"{op}: packed weight must be i8 (Paddle's bytes), got {packed}")
    need_rank(packed, 2, op, "packed weight")
    rows, k = packed.shape
    same_dim(k, attrs.in_features, op, "packed weight's second dim and in_features")
    if not isinstance(rows, int):
        raise OpError(f"{op}: packed weight needs a static shape, got {packed}")
    n = rows if attrs.bits == 8 else 2 * rows
    return TensorType(DType.I8 if attrs.bits == 8 else DType.I4, (attrs.in_features, n))


def _unpack(packed: np.ndarray, attrs: PackedAttrs) -> np.ndarray:
    rows = packed.shape[0]
    n = rows if attrs.bits == 8 else 2 * rows
    return unpack(packed, attrs.in_features, n, attrs.bits, attrs.arch)


class PackedLinearAttrs(PackedAttrs):
    group_size: int = -1
    """-1: one scale per output channel; 64 or 128: groups of rows along `in`."""


@register_op
class WeightOnlyLinearPacked(DequantizedLinear):
    """y = x @ dequant(unpack(packed), scale) + bias     (Paddle `weight_only_linear`, arch layout)

    packed: i8, Paddle's bytes for `arch` ([N, K] int8 or [N/2, K] int4);
    scale [N] or [ceil(K/g), N]; bias optional [N]. Equal to
    `weight_only_linear(x, unpack_weight(packed), scale, bias)` exactly.
    """

    name = "weight_only_linear_packed"
    inputs = (Input("x"), Input("weight"), Input("scale"), Input("bias", optional=True))
    Attrs = PackedLinearAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: PackedLinearAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        w = _logical_type(self.name, need(types[1], self.name, "weight"), attrs)
        s = need(types[2], self.name, "scale")
        need_float(x, self.name, "x")
        check_quantized_weight(self.name, w, s, attrs.group_size)
        same_dim(x.shape[-1], w.shape[0], self.name, "x's last dim and in_features")
        bias = types[3] if len(types) > 3 else None
        if bias is not None:
            need_rank(bias, 1, self.name, "bias")
            same_dim(bias.shape[0], w.shape[1], self.name, "bias size and out_features")
        return [TensorType(x.dtype, (*x.shape[:-1], w.shape[1]))]

    def float_weight(self, q: np.ndarray, scale: np.ndarray, attrs: OpAttrs) -> np.ndarray:
        assert isinstance(attrs, PackedLinearAttrs)
        return weight_dequantize(_unpack(q, attrs), scale, attrs.group_size)


class UnpackAttrs(PackedAttrs):
    stacked: bool = False
    """True: one packed tensor per expert, result [E, K, N]."""


def unpacked_type(op: str, types: Sequence[TensorType | None], stacked: bool,
                  logical: Callable[[TensorType], TensorType]) -> TensorType:
    """The logical type of one packed weight, or of E same-typed expert weights stacked [E, ...]."""
    ts = [need(t, op, "packed") for t in types]
    if not ts:
        raise OpError(f"{op}: needs at least one packed weight")
    if not stacked and len(ts) != 1:
        raise OpError(f"{op}: {len(ts)} inputs need stacked=true")
    for t in ts[1:]:
        if t != ts[0]:
            raise OpError(f"{op}: packed weights differ ({t} vs {ts[0]})")
    out = logical(ts[0])
    return TensorType(out.dtype, (len(ts), *out.shape)) if stacked else out


@register_op
class UnpackWeight(OpDef):
    """q = unpack(packed...)     Paddle's arch-permuted bytes back to logical int values

    One input: [K, N] (i8 or i4). With `stacked`, E inputs (one per expert,
    same shape): [E, K, N].
    """

    name = "unpack_weight"
    inputs = (Input("packed", variadic=True),)
    Attrs = UnpackAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: UnpackAttrs) -> list[TensorType]:
        return [unpacked_type(self.name, types, attrs.stacked,
                              lambda t: _logical_type(self.name, t, attrs))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: UnpackAttrs) -> list[np.ndarray]:
        parts = [_unpack(np.asarray(a), attrs) for a in args if a is not None]
        q = np.stack(parts) if attrs.stacked else parts[0]
        return [q if attrs.bits == 8 else q.astype(DType.I4.numpy)]


@register_op
class Stack(OpDef):
    """y = stack(values...)     same-shaped tensors on a new leading axis: [E, ...]"""

    name = "stack"
    inputs = (Input("values", variadic=True),)

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        ts = [need(t, self.name, "values") for t in types]
        if not ts:
            raise OpError(f"{self.name}: needs at least one value")
        for t in ts[1:]:
            if t != ts[0]:
                raise OpError(f"{self.name}: values differ ({t} vs {ts[0]})")
        return [TensorType(ts[0].dtype, (len(ts), *ts[0].shape))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        return [np.stack([np.asarray(a) for a in args if a is not None])]
