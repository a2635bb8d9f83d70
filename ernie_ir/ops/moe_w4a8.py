"""moe_experts_w4a8: routed SwiGLU experts with int4 weights and static int8 activations (W4A8).

The numerics are those of FastDeploy's `w4a8` MoE path (`moe_expert_dispatch` quantizes the
expert input, `moe_expert_ffn` runs the int8 x int4 grouped GEMMs, `MoeFastHardamardWrapper`
rotates and re-quantizes the down_proj input), written per expert e and routed row x:

    a     = clip(f32(127 * in_scale[e]) * x, -127, 127)
    x_q   = round_half_away(a)                                  int8 (C `round`)
    acc   = sum_k x_q[k] * w_q[e, k, n]                         int32, exact
    h     = f32(acc) * f32(scale[e, n])                         per output channel

`in_scale` is FastDeploy's in-memory input scale, 1 / abs-max of the expert's input; `scale` is
the dequantization factor of the int32 accumulator, ws / (127 * 7) / in_scale for weight
abs-max ws. FastDeploy's int4 GEMM sees each int4 value as 16 times itself (the nibble in the
high half of an int8), so its stored `weight_scale` is ours / 16 = ws / (127 * 112) / in_scale
(REFERENCE 14; the factor 16 is exact in any float format). The rounding helpers and the block
Hadamard transform are here too, for the `w4a8c8` pass and the tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_int, need_min_rank, need_rank, same_dim
from .moe import combine_experts, swiglu
from .quant_numerics import round_half_away

ACT_BOUND = 127
"""Largest int8 activation magnitude (FastDeploy clips to [-127, 127])."""
INT4_BOUND = 7
"""Largest int4 weight magnitude written by the quantizer (per channel, abs-max / 7)."""
FASTDEPLOY_INT4_FACTOR = 16
"""FastDeploy's W4A8 GEMM reads an int4 value q as the int8 16 * q (FastDeploy's weight_scale =
ours / 16)."""


def quantize_activation(x: np.ndarray, in_scale: np.ndarray | float) -> np.ndarray:
    """int8 round_half_away(clip(f32(127 * in_scale) * x, -127, 127)), FastDeploy's
    `max_bound * scale * x` in float32 (the multiplier first), clipped, rounded as C `round`."""
    m = np.float32(ACT_BOUND) * np.asarray(in_scale, np.float32)
    v = np.clip(m * np.asarray(x, np.float32), np.float32(-ACT_BOUND), np.float32(ACT_BOUND))
    return round_half_away(v).astype(np.int8)


def int_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b of integer arrays, exactly, as int32 (the GPU's accumulator).

    Computed as a float64 BLAS product: every partial sum is an integer below 2^53 in magnitude
    (int8 x int4 terms, |term| <= 127 * 8, fewer than 2^40 of them), so it is exact and equals the
    int32 accumulation whenever that does not overflow (|acc| < 2^31: K < 2.1M)."""
    out = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    return out.astype(np.int32)


def hadamard_matrix(n: int) -> np.ndarray:
    """The unnormalised Sylvester Hadamard matrix H_n (n a power of two), float32:
    H[i, j] = (-1)^popcount(i & j); symmetric, H @ H = n * I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard block is a power of two, not {n}")
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits = bits >> 1
    return np.where(parity == 1, np.float32(-1), np.float32(1)).astype(np.float32)


def hadamard_blocks(x: np.ndarray, block: int, axis: int = -1) -> np.ndarray:
    """x times blockdiag(H_block, ..., H_block) along `axis` (float32): each consecutive run of
    `block` elements is Walsh-Hadamard transformed, unnormalised, in natural (Sylvester) order,
    as FastDeploy's `moe_fast_hardamard_kernel` with `hadamard_block_size` does. block 0: x."""
    x = np.asarray(x, np.float32)
    if block == 0:
        return x
    x = np.moveaxis(x, axis, -1)
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"a Hadamard block of {block} does not divide {n}")
    y = np.matmul(x.reshape(*x.shape[:-1], n // block, block), hadamard_matrix(block))
    return np.moveaxis(y.reshape(x.shape), -1, axis)


class MoeW4A8Attrs(OpAttrs):
    hadamard_block: int = Field(default=0, ge=0)
    """0: the down_proj input is quantized as is; b (a power of two): it is first multiplied by
    blockdiag(H_b) (unnormalised Walsh-Hadamard in blocks of b, FastDeploy's
    `hadamard_block_size`); the down weights must then be stored rotated (H_b W / b)."""

    @field_validator("hadamard_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v and v & (v - 1):
            raise ValueError("hadamard_block must be 0 or a power of two")
        return v


_INPUTS = ("x", "weights", "indices", "up_gate", "up_gate_scale", "up_gate_in_scale",
           "down", "down_scale", "down_in_scale")


@register_op
class MoeExpertsW4A8(OpDef):
    """Grouped SwiGLU experts, int4 weights x static int8 activations, combined by routing weights.

    x: float [..., H]; weights: f32 [..., k]; indices: int [..., k] (as moe_experts);
    up_gate: i4 [E, H, 2I] ([gate | up] columns), down: i4 [E, I, H] (logical int4 values);
    up_gate_scale [E, 2I], down_scale [E, H]: float, per-output-channel dequantization factors
    of the int32 accumulators; up_gate_in_scale, down_in_scale: f32 [E], 1 / input abs-max.
    Per expert e and routed row v (I = down's rows, R = blockdiag of hadamard_block, or 1):
      q(u, s) = round_half_away(clip(f32(127 * s) * u, -127, 127))          int8
      h       = f32(q(v, up_gate_in_scale[e]) @ up_gate[e]) * up_gate_scale[e]   (int32 exact)
      a       = silu(h[:I]) * h[I:]
      y_e     = f32(q(a @ R, down_in_scale[e]) @ down[e]) * down_scale[e]
      out[t]  = sum_j weights[t, j] * y_{indices[t, j]}(x[t])     (float32)
    out: x.dtype [..., H]. FastDeploy's `w4a8` MoE (its weight_scale = ours / 16).
    """

    name = "moe_experts_w4a8"
    inputs = tuple(Input(n) for n in _INPUTS)
    Attrs = MoeW4A8Attrs

    def infer(self, types: Sequence[TensorType | None], attrs: MoeW4A8Attrs) -> list[TensorType]:
        x, wts, idx, ug, ugs, ugi, dn, dns, dni = (need(t, self.name, n)
                                                   for t, n in zip(types, _INPUTS, strict=False))
        need_float(x, self.name, "x")
        need_min_rank(x, 1, self.name, "x")
        need_float(wts, self.name, "weights")
        need_int(idx, self.name, "indices")
        same_dim(wts.shape, idx.shape, self.name, "shapes of weights and indices")
        same_dim(wts.shape[:-1], x.shape[:-1], self.name, "token dims of weights and x")
        for t, n in ((ug, "up_gate"), (dn, "down")):
            if t.dtype != DType.I4:
                raise OpError(f"{self.name}: input {n} must be i4 (logical int4 values), got {t}")
            need_rank(t, 3, self.name, n)
        for t, n in ((ugs, "up_gate_scale"), (dns, "down_scale")):
            need_float(t, self.name, n)
            need_rank(t, 2, self.name, n)
        for t, n in ((ugi, "up_gate_in_scale"), (dni, "down_in_scale")):
            need_float(t, self.name, n)
            need_rank(t, 1, self.name, n)
        experts = ug.shape[0]
        for t, n in ((dn, "down"), (ugs, "up_gate_scale"), (dns, "down_scale"),
                     (ugi, "up_gate_in_scale"), (dni, "down_in_scale")):
            same_dim(t.shape[0], experts, self.name, f"expert counts of up_gate and {n}")
        same_dim(ug.shape[1], x.shape[-1], self.name, "up_gate in-dim and x's last dim")
        same_dim(dn.shape[2], x.shape[-1], self.name, "down out-dim and x's last dim")
        same_dim(ugs.shape[1], ug.shape[2], self.name, "up_gate_scale columns and up_gate columns")
        same_dim(dns.shape[1], dn.shape[2], self.name, "down_scale columns and down columns")
        inter = dn.shape[1]
        if isinstance(inter, int) and ug.shape[2] != 2 * inter:
            raise OpError(f"{self.name}: up_gate has {ug.shape[2]} columns, expected 2 x {inter} "
                          "([gate | up])")
        if attrs.hadamard_block and isinstance(inter, int) and inter % attrs.hadamard_block:
            raise OpError(f"{self.name}: hadamard_block {attrs.hadamard_block} does not divide the "
                          f"expert intermediate size {inter}")
        return [x]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: MoeW4A8Attrs) -> list[np.ndarray]:
        x, wts, idx, ug, ugs, ugi, dn, dns, dni = args
        assert x is not None and wts is not None and idx is not None
        assert ug is not None and ugs is not None and ugi is not None
        assert dn is not None and dns is not None and dni is not None
        inter = dn.shape[1]
        ugs32, dns32 = np.asarray(ugs, np.float32), np.asarray(dns, np.float32)
        ugi32, dni32 = np.asarray(ugi, np.float32), np.asarray(dni, np.float32)

        def ffn(e: int, v: np.ndarray) -> np.ndarray:
            h = int_matmul(quantize_activation(v, ugi32[e]), ug[e]).astype(np.float32) * ugs32[e]
            a = hadamard_blocks(swiglu(h, inter), attrs.hadamard_block)
            return int_matmul(quantize_activation(a, dni32[e]), dn[e]).astype(np.float32) * dns32[e]

        return [combine_experts(self.name, x, wts, idx, ug.shape[0], ffn)]

    def lower_onnx(self, node: Any, onnx: Any) -> list[str]:
        """Every expert on every row (the dense, checking form, batched over the experts),
        weighted by its routing weight (0 where not chosen), summed over the experts in order.
        Integer products are float64 MatMuls of the integers (exact, see int_matmul);
        round_half_away is sign(v) floor(|v| + 0.49999997) (trunc(v + copysign(0.49999997, v))
        by symmetry: the kernel's rounding, ties included); the quantization, the scales and the
        combination are the kernel's float32 operations in its order. Not bit for bit: Exp (silu)
        and the Hadamard MatMul (float32 sums in another order) may differ from numpy's in the
        last bit, which moves a down_proj activation by one step only when it lies that close to
        a rounding boundary (tests/onnx/test_onnx_w4a8.py)."""
        w_v = node.inputs[1]
        e, hidden, _ = node.inputs[3].type.shape
        inter, k = node.inputs[6].type.shape[1], w_v.type.shape[-1]
        if not all(isinstance(z, int) for z in (e, hidden, inter, k)):
            raise onnx.fail(f"{self.name} needs static expert weights and top-k, got "
                            f"{node.inputs[3].type}, {node.inputs[6].type}, {w_v.type}")
        x, wts, idx, ug, ugs, ugi, dn, dns, dni = (onnx.name(v) for v in node.inputs)
        f32, f64, i64 = 1, 11, 7  # TensorProto.FLOAT, DOUBLE, INT64
        tokens = onnx.op("Reshape", [x, onnx.const([-1, hidden])])  # [T, H]
        flat_w = onnx.op("Reshape", [wts, onnx.const([-1, k])])
        flat_i = onnx.op("Reshape", [idx, onnx.const([-1, k])])
        if node.inputs[2].type.dtype != DType.I64:
            flat_i = onnx.op("Cast", [flat_i], to=i64)
        zeros = onnx.op("ConstantOfShape", [onnx.op("Concat", [onnx.shape_of(tokens, 0, 1), onnx.const([e])],
                                                    axis=0)])  # float32 +0 [T, E]
        route = onnx.op("ScatterElements", [zeros, flat_i, flat_w], axis=1, reduction="add")  # [T, E]

        def quant(u: str, s: str) -> str:  # u [E or 1, T, K], s [E] -> q [E, T, K] float64
            m = onnx.op("Reshape", [onnx.op("Mul", [onnx.f32(ACT_BOUND), s]), onnx.const([e, 1, 1])])
            v = onnx.op("Clip", [onnx.op("Mul", [m, u]), onnx.f32(-ACT_BOUND), onnx.f32(ACT_BOUND)])
            half = float(np.nextafter(np.float32(0.5), np.float32(0)))
            r = onnx.op("Floor", [onnx.op("Add", [onnx.op("Abs", [v]), onnx.f32(half)])])
            return onnx.op("Cast", [onnx.op("Mul", [onnx.op("Sign", [v]), r])], to=f64)

        def gemm(q: str, w: str, scale: str) -> str:  # [E, T, K] x [E, K, N] -> f32 [E, T, N]
            acc = onnx.op("MatMul", [q, onnx.op("Cast", [w], to=f64)])
            return onnx.op("Mul", [onnx.op("Cast", [acc], to=f32),
                                   onnx.op("Unsqueeze", [scale, onnx.const([1])])])

        h = gemm(quant(onnx.op("Unsqueeze", [tokens, onnx.const([0])]), ugi), ug, ugs)
        gate, up = onnx.op("Split", [h, onnx.const([inter, inter])], 2, axis=-1)
        den = onnx.op("Add", [onnx.f32(1.0), onnx.op("Exp", [onnx.op("Neg", [gate])])])
        a = onnx.op("Mul", [onnx.op("Div", [gate, den]), up])  # [E, T, I]
        block = node.attrs.hadamard_block
        if block:
            a = onnx.op("Reshape", [a, onnx.const([e, -1, inter // block, block])])
            a = onnx.op("MatMul", [a, onnx.const(hadamard_matrix(block), np.float32)])
            a = onnx.op("Reshape", [a, onnx.const([e, -1, inter])])
        y = gemm(quant(a, dni), dn, dns)  # [E, T, H]
        r = onnx.op("Unsqueeze", [onnx.op("Transpose", [route], perm=[1, 0]), onnx.const([-1])])  # [E, T, 1]
        weighted = onnx.op("Mul", [y, r])
        terms = onnx.op("Split", [weighted], e, axis=0, num_outputs=e) if e > 1 else [weighted]
        out = onnx.f32(0.0)
        for t in terms:  # the kernel's float32 sum, expert by expert in index order (+0 where not chosen)
            out = onnx.op("Add", [out, t])
        return [onnx.op("Reshape", [out, onnx.op("Shape", [x])])]  # float32, as the kernel's

    def lower_paddle(self, layer: Any, node: Any, args: list[Any]) -> list[Any]:
        """Every expert on every row (the dense, checking form), weighted by its routing weight
        (0 where not chosen). Integer products run as float64 matmuls (exact, see int_matmul);
        round_half_away is trunc(v + copysign(0.49999997, v)), as quant_numerics proves."""
        P = layer.P
        x, wts, idx, ug, ugs, ugi, dn, dns, dni = args
        e, hidden, inter = int(ug.shape[0]), int(x.shape[-1]), int(dn.shape[1])
        k = int(wts.shape[-1])
        xt = P.reshape(x, [-1, hidden]).astype("float32")
        combine = P.sum(layer.F.one_hot(P.reshape(idx, [-1, k]).astype("int64"), e)
                        * P.reshape(wts, [-1, k]).astype("float32").unsqueeze(-1), axis=1)  # [T, E]
        block = node.attrs.hadamard_block
        rot = P.to_tensor(hadamard_matrix(block)) if block else None

        def quant(u: Any, s: Any) -> Any:
            v = P.clip((s.astype("float32") * ACT_BOUND) * u, -float(ACT_BOUND), float(ACT_BOUND))
            return P.trunc(v + P.sign(v) * float(np.float32(0.49999997)))

        def gemm(q: Any, w: Any, scale: Any) -> Any:
            acc = P.matmul(q.astype("float64"), w.astype("float64"))
            return acc.astype("int32").astype("float32") * scale.astype("float32")

        out = P.zeros_like(xt)
        for ex in range(e):
            h = gemm(quant(xt, ugi[ex]), ug[ex], ugs[ex])
            a = layer.F.silu(h[:, :inter]) * h[:, inter:]
            if rot is not None:
                a = P.reshape(P.matmul(P.reshape(a, [-1, inter // block, block]), rot), [-1, inter])
            y = gemm(quant(a, dni[ex]), dn[ex], dns[ex])
            out = out + y * combine[:, ex:ex + 1]
        return [P.reshape(out, P.shape(x)).astype(x.dtype)]
