"""wint2_dequantize: FastDeploy's WINT2 (CCQ, 2-bit convolutional-code) expert weights, decoded.

The format (REFERENCE section 14; FastDeploy's `wint2x_unzip.h`, the decoder its WINT2 MoE
GEMM runs). A weight W [..., K, N] (K = in, N = out, leading dims e.g. the experts of a
stack) is stored as

    quant_weight  u8  [..., K/4, N]     one 8-bit code per 4 consecutive rows of a column
    weight_scale  u8  [..., K/128, N]   two 4-bit group scales per byte, groups of 64 rows,
                                        the even group in the high nibble
    super_scales  bf16 [..., N]         one per output channel
    code_scale    f32 [..., N]          the linear map code -> 15-bit word, per channel
    code_zp       f32 [..., N]

and decoded, for row k and column n, as

    g     = k // 64
    s4    = (weight_scale[g // 2, n] >> (4 if g even else 0)) & 0xF
    scale = f32(s4) * f32(super_scales[n])                              (float32)
    word  = int32(floor(f32(code) * code_scale[n] + code_zp[n] + 0.5))  code = quant_weight[k // 4, n]
    q     = (word >> [9, 6, 3, 0][k % 4]) & 0x3F                        (four overlapping 6-bit windows)
    w     = f32(q - 32) * scale                                         (float32)

Precision (an assumption REFERENCE leaves open; FastDeploy's source settles it): every step is
float32 (`ScaleComputeT = float`), each operation rounded on its own, in the order written;
the int32 conversion saturates and maps NaN to 0 (CUDA's `cvt.rzi.s32.f32`). nvcc's default
`--fmad=true` may contract `code * code_scale + code_zp` into one FMA, which gives a different
word only where `code * code_scale` is not exact in float32. The encoder
(`ernie_ir.passes.quant.wint2_encoder`) writes only *exact* codebooks (`exact_codebook`):
code_scale and code_zp non-negative multiples of 2^-5 with 255 code_scale + code_zp + 0.5 <
2^19, so that every intermediate is a float32 without rounding and every evaluation order
(FMA or not, float32 or float64) gives the same words. FastDeploy writes the result in the
activation dtype (bf16): the op's `dtype` attribute rounds to it (nearest even).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import field_validator

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, same_dim

SHIFTS = (9, 6, 3, 0)
"""Right shifts of the four 6-bit windows: row 4j + i of a column reads bits SHIFTS[i]..+5."""
Q_MASK = 0x3F
Q_ZERO = 32
"""q - 32: the 6-bit window is an unsigned value with zero point 32 (range -32..31)."""
ROWS_PER_CODE = 4
GROUP_ROWS = 64
"""Rows per 4-bit group scale."""
ROWS_PER_SCALE_BYTE = 128
"""Two group scales per byte: weight_scale has K / 128 rows."""
CODES = 256
EXACT_FRACTION_BITS = 5
EXACT_LIMIT = 2.0 ** 19
"""An exact codebook keeps every intermediate below 2^19 on a 2^-5 grid (24 significant bits)."""


def wint2_words(codes: np.ndarray, code_scale: np.ndarray, code_zp: np.ndarray) -> np.ndarray:
    """int32(floor(f32(codes) * code_scale + code_zp + 0.5)), float32, each operation rounded on
    its own; the conversion saturates to the int32 range and maps NaN to 0 (as CUDA's does).
    codes, code_scale and code_zp broadcast together (the result has the broadcast shape)."""
    c = np.asarray(codes)
    cs, zp = np.asarray(code_scale, dtype=np.float32), np.asarray(code_zp, dtype=np.float32)
    f = np.empty(np.broadcast_shapes(c.shape, cs.shape, zp.shape), np.float32)
    f[...] = c  # exact: codes are u8
    np.multiply(f, cs, out=f)
    np.add(f, zp, out=f)
    np.add(f, np.float32(0.5), out=f)
    np.floor(f, out=f)
    if not np.isfinite(f).all() or (f.size and (f.min() < -2.0 ** 31 or f.max() >= 2.0 ** 31)):
        f = np.nan_to_num(f.astype(np.float64), nan=0.0)
        f = np.clip(f, -2.0 ** 31, 2.0 ** 31 - 1)
    return f.astype(np.int32)


def wint2_windows(words: np.ndarray) -> np.ndarray:
    """The four 6-bit windows of each word, minus 32: int8 [..., 4] (q - 32 for rows 4j .. 4j+3)."""
    w = np.asarray(words, dtype=np.int32)[..., None]
    q = (w >> np.asarray(SHIFTS, dtype=np.int32)) & Q_MASK
    return (q - Q_ZERO).astype(np.int8)


def wint2_codebook(code_scale: np.ndarray, code_zp: np.ndarray) -> np.ndarray:
    """The decoded values q - 32 of all 256 codes: int8 [..., 256, 4], one codebook per channel
    (code_scale / code_zp [...]); entry [c, i] is the value of row 4j + i for code c."""
    cs = np.asarray(code_scale, dtype=np.float32)[..., None]
    zp = np.asarray(code_zp, dtype=np.float32)[..., None]
    return wint2_windows(wint2_words(np.arange(CODES, dtype=np.uint8), cs, zp))


def exact_codebook(code_scale: np.ndarray, code_zp: np.ndarray) -> np.ndarray:
    """Where (code_scale, code_zp) make every word exactly, in any evaluation order (with or
    without FMA, in float32 or wider): both are non-negative multiples of 2^-5 and
    255 * code_scale + code_zp + 0.5 < 2^19. Bool, the broadcast shape."""
    cs = np.asarray(code_scale, dtype=np.float64)
    zp = np.asarray(code_zp, dtype=np.float64)
    unit = 2.0 ** EXACT_FRACTION_BITS
    on_grid = (np.floor(cs * unit) == cs * unit) & (np.floor(zp * unit) == zp * unit)
    return on_grid & (cs >= 0) & (zp >= 0) & (255 * cs + zp + 0.5 < EXACT_LIMIT)


def wint2_group_scales(weight_scale: np.ndarray, super_scales: np.ndarray) -> np.ndarray:
    """scale = f32(s4) * f32(super_scales) per group of 64 rows: f32 [..., K/64, N]."""
    ws = np.asarray(weight_scale, dtype=np.uint8)
    s4 = np.stack([ws >> 4, ws & 0xF], axis=-2)  # [..., K/128, 2, N]: even group high
    s4 = s4.reshape(*ws.shape[:-2], 2 * ws.shape[-2], ws.shape[-1])
    return s4.astype(np.float32) * np.asarray(super_scales).astype(np.float32)[..., None, :]


def pack_group_scales(s4: np.ndarray) -> np.ndarray:
    """u8 [..., G/2, N] from 4-bit values s4 [..., G, N] (G even): even group in the high nibble."""
    s = np.asarray(s4).astype(np.uint8)
    if s.shape[-2] % 2 or (s.size and s.max() > 0xF):
        raise ValueError(f"group scales must be 0..15 with an even group count, got shape {s.shape}")
    pairs = s.reshape(*s.shape[:-2], s.shape[-2] // 2, 2, s.shape[-1])
    return (pairs[..., 0, :] << 4) | pairs[..., 1, :]


def check_wint2_shapes(quant_weight: tuple[int, ...], weight_scale: tuple[int, ...]) -> None:
    """ValueError unless quant_weight [..., K/4, N] and weight_scale [..., K/128, N] agree."""
    if len(quant_weight) < 2 or tuple(weight_scale) != (*quant_weight[:-2], quant_weight[-2] // 32,
                                                        quant_weight[-1]) or quant_weight[-2] % 32:
        raise ValueError(f"wint2: quant_weight {list(quant_weight)} ([..., K/4, N], K a multiple of 128) "
                         f"and weight_scale {list(weight_scale)} ([..., K/128, N]) do not agree")


def wint2_dequantize(quant_weight: np.ndarray, weight_scale: np.ndarray, super_scales: np.ndarray,
                     code_scale: np.ndarray, code_zp: np.ndarray) -> np.ndarray:
    """W f32 [..., K, N] from a WINT2 weight (module docstring: the formula, bit for bit).

    quant_weight u8 [..., K/4, N]; weight_scale u8 [..., K/128, N]; super_scales, code_scale,
    code_zp [..., N] (float; super_scales is bf16 in a checkpoint, widened exactly)."""
    qw = np.asarray(quant_weight, dtype=np.uint8)
    check_wint2_shapes(qw.shape, np.shape(weight_scale))
    *lead, rows, n = qw.shape
    cs = np.asarray(code_scale, dtype=np.float32)[..., None, :]
    zp = np.asarray(code_zp, dtype=np.float32)[..., None, :]
    words = wint2_words(qw, cs, zp)  # [..., K/4, N]
    q = (words[..., None, :] >> np.asarray(SHIFTS, dtype=np.int32)[:, None]) & Q_MASK  # [..., K/4, 4, N]
    v = (q - Q_ZERO).astype(np.float32).reshape(*lead, rows // 16, GROUP_ROWS, n)
    scale = wint2_group_scales(weight_scale, super_scales)  # [..., K/64, N]
    return (v * scale[..., None, :]).reshape(*lead, 4 * rows, n)


class Wint2Attrs(OpAttrs):
    dtype: DType = DType.BF16
    """The float type of the result (FastDeploy writes the activation dtype, bf16)."""

    @field_validator("dtype")
    @classmethod
    def _float(cls, v: DType) -> DType:
        if not v.is_float:
            raise ValueError(f"wint2_dequantize produces a float tensor, not {v}")
        return v


@register_op
class Wint2Dequantize(OpDef):
    """w = dtype(f32(q - 32) * f32(s4) * f32(super_scales))     FastDeploy's WINT2 (CCQ) decode

    quant_weight u8 [..., K/4, N] (one code per 4 rows), weight_scale u8 [..., K/128, N]
    (4-bit group scales of 64 rows, even group in the high nibble), super_scales float [..., N],
    code_scale f32 [..., N], code_zp f32 [..., N]; K a multiple of 128; the leading dims (e.g.
    the experts of a [E, K, N] stack, fed to moe_experts) agree. For row k, column n:
      s4   = (weight_scale[k // 128, n] >> (4 if (k // 64) even else 0)) & 0xF
      word = int32(floor(f32(quant_weight[k // 4, n]) * code_scale[n] + code_zp[n] + 0.5))
      q    = (word >> [9, 6, 3, 0][k % 4]) & 0x3F
      w    = f32(q - 32) * (f32(s4) * f32(super_scales[n]))
    Float32, each operation rounded on its own (no FMA); the cast to `dtype` rounds to nearest
    even. Result: dtype [..., K, N].
    """

    name = "wint2_dequantize"
    inputs = (Input("quant_weight"), Input("weight_scale"), Input("super_scales"), Input("code_scale"),
              Input("code_zp"))
    Attrs = Wint2Attrs

    def infer(self, types: Sequence[TensorType | None], attrs: Wint2Attrs) -> list[TensorType]:
        names = ("quant_weight", "weight_scale", "super_scales", "code_scale", "code_zp")
        qw, ws, ss, cs, zp = (need(t, self.name, n) for t, n in zip(types, names, strict=False))
        if qw.dtype != DType.U8 or qw.rank < 2:
            raise OpError(f"wint2_dequantize: quant_weight must be u8 [..., K/4, N], got {qw}")
        if ws.dtype != DType.U8 or ws.rank != qw.rank:
            raise OpError(f"wint2_dequantize: weight_scale must be u8 [..., K/128, N] (rank {qw.rank}), "
                          f"got {ws}")
        if not ss.dtype.is_float or ss.rank != qw.rank - 1:
            raise OpError(f"wint2_dequantize: super_scales must be float [..., N] (rank {qw.rank - 1}), "
                          f"got {ss}")
        for t, n in ((cs, "code_scale"), (zp, "code_zp")):
            if t.dtype != DType.F32 or t.rank != qw.rank - 1:
                raise OpError(f"wint2_dequantize: {n} must be f32 [..., N] (rank {qw.rank - 1}), got {t}")
        lead, rows, n = qw.shape[:-2], qw.shape[-2], qw.shape[-1]
        for i in range(len(lead)):
            same_dim(ws.shape[i], lead[i], self.name, f"weight_scale and quant_weight dim {i}")
            for t, nm in ((ss, "super_scales"), (cs, "code_scale"), (zp, "code_zp")):
                same_dim(t.shape[i], lead[i], self.name, f"{nm} and quant_weight dim {i}")
        same_dim(ws.shape[-1], n, self.name, "weight_scale and quant_weight columns")
        for t, nm in ((ss, "super_scales"), (cs, "code_scale"), (zp, "code_zp")):
            same_dim(t.shape[-1], n, self.name, f"{nm} length and quant_weight columns")
        if not isinstance(rows, int):
            raise OpError(f"wint2_dequantize: quant_weight needs a static row count (K/4), got {qw}")
        if rows % 32:
            raise OpError(f"wint2_dequantize: quant_weight has {rows} rows (K/4): K = {4 * rows} is not "
                          "a multiple of 128 (one weight_scale byte covers two 64-row groups)")
        same_dim(ws.shape[-2], rows // 32, self.name, "weight_scale rows and K/128")
        return [TensorType(attrs.dtype, (*lead, 4 * rows, n))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: Wint2Attrs) -> list[np.ndarray]:
        qw, ws, ss, cs, zp = args
        assert qw is not None and ws is not None and ss is not None and cs is not None and zp is not None
        w = wint2_dequantize(qw, ws, ss, cs, zp)
        return [w if attrs.dtype == DType.F32 else w.astype(attrs.dtype.numpy)]

    def lower_onnx(self, node: Any, onnx: Any) -> list[str]:
        """Float32 ONNX ops only (Cast, Mul, Add, Floor, Sub, Concat, Reshape), exact: every
        window is t - 64 floor(t / 64) with t = floor(word / 2^shift), integers that float32
        holds exactly for |word| < 2^31 (the int32 range the kernel's words lie in; the kernel
        saturates beyond it, this lowering does not: no such word comes from a real codebook)."""
        qt = node.inputs[0].type
        lead = [int(d) for d in qt.shape[:-2]] if all(isinstance(d, int) for d in qt.shape) else None
        if lead is None:
            raise onnx.fail(f"wint2_dequantize needs static shapes, got {qt}")
        rows, n = int(qt.shape[-2]), int(qt.shape[-1])
        qw, ws, ss, cs, zp = (onnx.name(v) for v in node.inputs)
        f32 = 1  # TensorProto.FLOAT

        def unsq(x: str) -> str:
            return onnx.op("Unsqueeze", [x, onnx.const([-2])])

        def floor_mod(t: str, m: float) -> str:  # t - m floor(t / m), exact for integer t, m a power of 2
            quotient = onnx.op("Floor", [onnx.op("Mul", [t, onnx.f32(1 / m)])])
            return onnx.op("Sub", [t, onnx.op("Mul", [quotient, onnx.f32(m)])])

        f = onnx.op("Mul", [onnx.op("Cast", [qw], to=f32), unsq(cs)])
        word = onnx.op("Floor", [onnx.op("Add", [onnx.op("Add", [f, unsq(zp)]), onnx.f32(0.5)])])
        parts = []
        for sh in SHIFTS:
            t = word if sh == 0 else onnx.op("Floor", [onnx.op("Mul", [word, onnx.f32(2.0 ** -sh)])])
            parts.append(unsq(floor_mod(t, 64.0)))
        q = onnx.op("Sub", [onnx.op("Concat", parts, axis=-2), onnx.f32(Q_ZERO)])  # [..., K/4, 4, N]
        q = onnx.op("Reshape", [q, onnx.const([*lead, rows // 16, GROUP_ROWS, n])])
        b = onnx.op("Cast", [ws], to=f32)  # [..., K/128, N]
        lo = floor_mod(b, 16.0)
        hi = onnx.op("Mul", [onnx.op("Sub", [b, lo]), onnx.f32(1 / 16)])
        s4 = onnx.op("Reshape", [onnx.op("Concat", [unsq(hi), unsq(lo)], axis=-2),
                                 onnx.const([*lead, rows // 16, 1, n])])
        scale = onnx.op("Mul", [s4, onnx.op("Reshape", [ss, onnx.const([*lead, 1, 1, n])])])
        w = onnx.op("Reshape", [onnx.op("Mul", [q, scale]), onnx.const([*lead, 4 * rows, n])])
        return [onnx.round_to(w, node.attrs.dtype)]

    def lower_paddle(self, layer: Any, node: Any, args: list[Any]) -> list[Any]:
        """The same float32 steps as the ONNX lowering, in Paddle ops (exact; eager or traced)."""
        P = layer.P
        qt = node.inputs[0].type
        lead = [int(d) for d in qt.shape[:-2]]
        rows, n = int(qt.shape[-2]), int(qt.shape[-1])
        qw, ws, ss, cs, zp = args

        def floor_mod(t: Any, m: float) -> Any:
            return t - P.floor(t * (1 / m)) * m

        word = P.floor(P.cast(qw, "float32") * cs.unsqueeze(-2) + zp.unsqueeze(-2) + 0.5)
        parts = [floor_mod(word if sh == 0 else P.floor(word * 2.0 ** -sh), 64.0) for sh in SHIFTS]
        q = P.stack(parts, axis=-2) - float(Q_ZERO)  # [..., K/4, 4, N]
        q = P.reshape(q, [*lead, rows // 16, GROUP_ROWS, n])
        b = P.cast(ws, "float32")
        lo = floor_mod(b, 16.0)
        s4 = P.reshape(P.stack([(b - lo) * (1 / 16), lo], axis=-2), [*lead, rows // 16, 1, n])
        w = P.reshape(q * (s4 * P.reshape(P.cast(ss, "float32"), [*lead, 1, 1, n])), [*lead, 4 * rows, n])
        name = {DType.BF16: "bfloat16", DType.F16: "float16"}.get(node.attrs.dtype)
        return [w if name is None else P.cast(P.cast(w, name), "float32")]
