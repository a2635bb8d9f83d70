"""Ops that read routed-expert params as FastDeploy's W4A8 checkpoints hold them, one key per expert.

The cuda legalization (`ernie_ir.targets.cuda.legalize`) stores a W4A8 expert stack
(`moe_experts_w4a8`'s i4 [E, K, N] weights, [E, N] accumulator scales, [E] input scales) as
FastDeploy's per-expert keys, and rebuilds the stacked inputs in front of the op with:

- `unpack_int4_rows(packed...)`: E tensors int8 [K/2, N], two signed int4 values per byte along K
  (row 2i in the low nibble, row 2i + 1 in the high one) -> i4 [E, K, N];
- `stack_scaled(values...){factor}`: same-shaped float tensors stacked on a new leading axis and
  multiplied by `factor`, a power of two (exact in any float format short of overflow): FastDeploy's
  in-memory W4A8 `weight_scale` is ours / 16, so the graph reads it back times 16.

`stack` (ernie_ir/ops/packed_weight.py) stacks the per-expert input scales (f32 scalars).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float
from .moe_w4a8 import ACT_BOUND


def pack_int4_rows(q: np.ndarray) -> np.ndarray:
    """int8 [..., K/2, N] from int4 values q [..., K, N] (K even): byte (i, n) holds q[2i, n] in
    its low nibble and q[2i + 1, n] in its high nibble (two's complement nibbles)."""
    v = np.asarray(q).astype(np.int8)
    if v.shape[-2] % 2:
        raise ValueError(f"int4 rows: K = {v.shape[-2]} is odd (two rows per byte)")
    if v.size and (int(v.min()) < -8 or int(v.max()) > 7):
        raise ValueError("int4 rows: values outside [-8, 7]")
    u = v.view(np.uint8) & np.uint8(0x0F)
    return (u[..., 0::2, :] | (u[..., 1::2, :] << np.uint8(4))).view(np.int8)


def unpack_int4_rows_array(packed: np.ndarray) -> np.ndarray:
    """int8 [..., K, N] (values in [-8, 7]) from bytes [..., K/2, N] (`pack_int4_rows` inverted)."""
    b = np.asarray(packed).view(np.uint8) if np.asarray(packed).dtype == np.int8 else \
        np.asarray(packed).astype(np.uint8)
    lo = ((b & 0x0F).astype(np.int8) ^ 8) - 8
    hi = ((b >> 4).astype(np.int8) ^ 8) - 8
    out = np.stack([lo, hi], axis=-2)  # [..., K/2, 2, N]
    return out.reshape(*b.shape[:-2], 2 * b.shape[-2], b.shape[-1]).astype(np.int8)


def w4a8_float_weight(q: np.ndarray, scale: np.ndarray, in_scale: np.ndarray | float) -> np.ndarray:
    """The float weight [K, N] a W4A8 expert projection stands for, float32:
    q * (scale * f32(127 * in_scale)), each product rounded to float32 in that order.

    moe_experts_w4a8 computes y[n] = sum_k round(127 in_scale x[k]) q[k, n] * scale[n], which is
    x @ this weight but for the activation rounding (ernie_ir/ops/moe_w4a8.py). q: int4 values
    [K, N]; scale: the accumulator scale [N] (ours: FastDeploy's in-memory weight_scale x 16);
    in_scale: the expert's input scale (1 / abs-max)."""
    m = np.float32(ACT_BOUND) * np.asarray(in_scale, np.float32)
    col = (np.asarray(scale).astype(np.float32) * m).astype(np.float32)
    return np.asarray(q).astype(np.float32) * col[..., None, :]


@register_op
class UnpackInt4Rows(OpDef):
    """q = stack(unpack(packed_e) for each expert)     FastDeploy W4A8 bytes -> int4 values

    E inputs int8 [K/2, N] (same shape): two signed int4 values per byte along K, row 2i in the
    low nibble. Result: i4 [E, K, N].
    """

    name = "unpack_int4_rows"
    inputs = (Input("packed", variadic=True),)

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        ts = [need(t, self.name, "packed") for t in types]
        if not ts:
            raise OpError(f"{self.name}: needs at least one packed tensor")
        for t in ts:
            if t.dtype != DType.I8 or t.rank != 2:
                raise OpError(f"{self.name}: packed tensors must be int8 [K/2, N], got {t}")
            if t != ts[0]:
                raise OpError(f"{self.name}: packed tensors differ ({t} vs {ts[0]})")
        rows, cols = ts[0].shape
        k = 2 * rows if isinstance(rows, int) else rows
        return [TensorType(DType.I4, (len(ts), k, cols))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        q = np.stack([unpack_int4_rows_array(np.asarray(a)) for a in args if a is not None])
        return [q.astype(DType.I4.numpy)]

    def lower_onnx(self, node: Any, onnx: Any) -> list[str]:
        """The same integer arithmetic as the Paddle lowering, on the stacked bytes as int32
        (exact): u = b mod 256 (ONNX Mod takes the divisor's sign), nibbles u mod 16 and u / 16,
        each v - 16 where v >= 8; the result INT4 [E, K, N] (the IR's i4)."""
        rows, cols = node.inputs[0].type.shape
        if not (isinstance(rows, int) and isinstance(cols, int)):
            raise onnx.fail(f"{self.name} needs static packed shapes, got {node.inputs[0].type}")
        i32, i4 = 6, 22  # TensorProto.INT32, INT4
        b = onnx.op("Concat", [onnx.op("Unsqueeze", [onnx.name(v), onnx.const([0])]) for v in node.inputs],
                    axis=0)  # int8 [E, K/2, N]
        u = onnx.op("Mod", [onnx.op("Cast", [b], to=i32), onnx.const(256, np.int32)])
        sixteen = onnx.const(16, np.int32)

        def signed(v: str) -> str:
            wrap = onnx.op("Cast", [onnx.op("GreaterOrEqual", [v, onnx.const(8, np.int32)])], to=i32)
            v = onnx.op("Sub", [v, onnx.op("Mul", [wrap, sixteen])])
            return onnx.op("Unsqueeze", [v, onnx.const([2])])

        lo, hi = signed(onnx.op("Mod", [u, sixteen])), signed(onnx.op("Div", [u, sixteen]))
        pairs = onnx.op("Concat", [lo, hi], axis=2)  # [E, K/2, 2, N]
        q = onnx.op("Reshape", [pairs, onnx.const([len(node.inputs), 2 * rows, cols])])
        return [onnx.op("Cast", [q], to=i4)]

    def lower_paddle(self, layer: Any, node: Any, args: list[Any]) -> list[Any]:
        """Integer arithmetic on the bytes (as int32): u = b mod 256, nibbles u mod 16 and u // 16,
        each v - 16 (v >= 8); the result int8, as the runtime holds int4 values."""
        P = layer.P
        parts = []
        for b in args:
            u = P.remainder(b.astype("int32"), P.to_tensor(256, dtype="int32"))
            lo = P.remainder(u, P.to_tensor(16, dtype="int32"))
            hi = P.floor_divide(u, P.to_tensor(16, dtype="int32"))
            lo = lo - (lo >= 8).astype("int32") * 16
            hi = hi - (hi >= 8).astype("int32") * 16
            rows, cols = int(b.shape[0]), int(b.shape[1])
            parts.append(P.reshape(P.stack([lo, hi], axis=1), [2 * rows, cols]))
        return [P.stack(parts).astype("int8")]


class StackScaledAttrs(OpAttrs):
    factor: float = 1.0
    """A power of two (the product is exact)."""

    @field_validator("factor")
    @classmethod
    def _power_of_two(cls, v: float) -> float:
        m, _ = math.frexp(v)
        if not (v > 0 and math.isfinite(v) and m == 0.5):
            raise ValueError(f"factor must be a positive power of two (exact), not {v}")
        return v


@register_op
class StackScaled(OpDef):
    """y = stack(values...) * factor     per-expert scales back into [E, ...], times a power of two

    Same-shaped float values; the result keeps their dtype (the product by a power of two is
    exact unless it overflows).
    """

    name = "stack_scaled"
    inputs = (Input("values", variadic=True),)
    Attrs = StackScaledAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: StackScaledAttrs) -> list[TensorType]:
        ts = [need(t, self.name, "values") for t in types]
        if not ts:
            raise OpError(f"{self.name}: needs at least one value")
        for t in ts:
            need_float(t, self.name, "values")
            if t != ts[0]:
                raise OpError(f"{self.name}: values differ ({t} vs {ts[0]})")
        return [TensorType(ts[0].dtype, (len(ts), *ts[0].shape))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: StackScaledAttrs) -> list[np.ndarray]:
        vals = [np.asarray(a) for a in args if a is not None]
        y = np.stack(vals).astype(np.float32) * np.float32(attrs.factor)
        return [y.astype(vals[0].dtype)]

    def lower_onnx(self, node: Any, onnx: Any) -> list[str]:
        """Concat of the values (float32 in ONNX) times factor, rounded back to their dtype."""
        y = onnx.op("Concat", [onnx.op("Unsqueeze", [onnx.name(v), onnx.const([0])]) for v in node.inputs],
                    axis=0)
        return [onnx.round_to(onnx.op("Mul", [y, onnx.f32(node.attrs.factor)]), node.inputs[0].type.dtype)]

    def lower_paddle(self, layer: Any, node: Any, args: list[Any]) -> list[Any]:
        return [layer.P.stack(list(args)) * float(node.attrs.factor)]
