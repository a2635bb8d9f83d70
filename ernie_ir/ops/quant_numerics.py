"""Quantization numerics shared by the quantization ops and passes.

Not an op: the exact arithmetic that the quantization ops' kernels and the
quantization passes agree on, written once. Every function states the
reference it matches bit for bit (Paddle 3.3.1 on CPU, cross-checked in
tests/quant).

Weight-only (Paddle `weight_quantize`, CPU kernel, per output channel or per
group of `group_size` rows along the input axis; W is [..., K, N] = [in, out]):

    absmax[c]  = max_k |W[k, c]|                       (exact, on the stored values)
    scale[c]   = T(f32(absmax[c]) / f32(bound))         bound = 127 (int8) or 7 (int4);
                                                        T = the weight's dtype, rounded to
                                                        nearest even (Paddle returns bf16
                                                        scales for bf16 weights)
    q[k, c]    = clip(round(f32(W[k, c]) / f32(scale[c])), -bound, bound)
                                                        round = half away from zero (C `round`);
                                                        the division is one IEEE float32 division

An all-zero channel gets scale 0 and q = 0 (Paddle writes 127 or -7 into
such a channel, which its scale 0 also turns into 0: the dequantized values
agree). NaN or Inf weights are an error.

Fake quantization (Paddle `fake_*quantize_dequantize*` CPU kernels, float32):

    inv(s)  = 1 / (s + 1e-6) if s <= 1e-30 else 1 / s
    b       = 2^(bits-1) - 1
    round_type 0: y = (clip(rint((b * inv(s)) * x), -b - 1, b) * s) / b
    round_type 1: y = (round_half_away((b * inv(s)) * clip(x, -s, s)) * s) / b

FP8 (tensor-wise, e4m3): scale = absmax / 448 (1 for an all-zero tensor),
q = e4m3(clip(x / scale, -448, 448)) with ml_dtypes' round-to-nearest-even.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from ernie_ir.ir import DType, ErnieIRError

INT_BOUND = {8: 127, 4: 7}
"""Largest quantized magnitude per bit width (symmetric, as Paddle's weight-only kernels)."""

FP8_MAX = {DType.F8E4M3: 448.0, DType.F8E5M2: 57344.0}

_PREV_HALF = np.float32(0.49999997)  # the float32 just below 0.5 (bits 0x3EFFFFFF)


class NonFiniteWeightError(ErnieIRError):
    """A weight to be quantized holds NaN or Inf."""


def round_half_away(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """C `round` for float32: nearest integer, ties away from zero.

    Computed as trunc(x + copysign(0.49999997, x)), Eigen's vectorised round:
    adding the float just below 0.5 instead of 0.5 keeps 0.49999997 from
    rounding up, and every other finite float32 rounds as `round` does.
    """
    x = np.asarray(x, dtype=np.float32)
    half = np.copysign(_PREV_HALF, x)
    if out is None:
        return np.trunc(x + half)
    np.add(x, half, out=out)
    return np.trunc(out, out=out)


def scale_dtype_for(dtype: np.dtype) -> np.dtype:
    """The dtype Paddle returns weight-only scales in: the weight's own float dtype."""
    return np.dtype(dtype) if np.dtype(dtype) in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
                                                   np.dtype(np.float32)) else np.dtype(np.float32)


def num_groups(k: int, group_size: int) -> int:
    """Scale rows along the input axis: 1 per channel, ceil(K / g) grouped (the last may be short)."""
    return 1 if group_size == -1 else math.ceil(k / group_size)


def _check_args(w: np.ndarray, bits: int, group_size: int) -> None:
    if bits not in INT_BOUND:
        raise ValueError(f"weight-only quantization supports 8 or 4 bits, not {bits}")
    if group_size != -1 and group_size <= 0:
        raise ValueError(f"group_size must be -1 (per channel) or positive, not {group_size}")
    if w.ndim < 2:
        raise ValueError(f"a weight to quantize needs rank >= 2 ([..., in, out]), got shape {w.shape}")


def nonfinite_weight_error(w: np.ndarray, name: str) -> NonFiniteWeightError:
    """The error for a weight holding NaN or Inf: names the param, the index and the value."""
    bad = np.argwhere(~np.isfinite(w.astype(np.float32)))[0]
    value = w[tuple(bad)]
    return NonFiniteWeightError(
        f"param {name} holds {value} at index {list(int(i) for i in bad)}: "
        "a weight with NaN or Inf cannot be quantized (fix or re-export the checkpoint)"
    )


def _expand_groups(scale: np.ndarray, k: int, group_size: int) -> np.ndarray:
    """Per-row view of a scale: [..., N] -> [..., 1, N]; [..., G, N] -> [..., K, N]."""
    if group_size == -1:
        return scale[..., None, :]
    return np.repeat(scale, group_size, axis=-2)[..., :k, :]


def weight_scales(w: np.ndarray, bits: int, group_size: int = -1, *, name: str = "weight",
                  threads: int | None = None) -> np.ndarray:
    """The weight-only scales of `w` [..., K, N]: [..., N] per channel, [..., ceil(K/g), N] grouped.

    Raises NonFiniteWeightError (naming `name`) if `w` holds NaN or Inf.
    """
    _check_args(w, bits, group_size)
    dtype = scale_dtype_for(w.dtype)
    if group_size == -1 and w.dtype == np.dtype(ml_dtypes.bfloat16):
        bits16 = _absmax_bits_bf16(w, threads)
        if bits16.size and int(bits16.max()) >= 0x7F80:
            raise nonfinite_weight_error(w, name)
        absmax = (bits16.astype(np.uint32) << 16).view(np.float32)
    else:
        a = np.abs(w.astype(np.float32))
        if not np.isfinite(a).all():
            raise nonfinite_weight_error(w, name)
        if group_size == -1:
            absmax = a.max(axis=-2) if a.shape[-2] else np.zeros(a.shape[:-2] + a.shape[-1:], np.float32)
        else:
            k = a.shape[-2]
            g = num_groups(k, group_size)
            pad = g * group_size - k
            if pad:
                widths = [(0, 0)] * (a.ndim - 2) + [(0, pad), (0, 0)]
                a = np.pad(a, widths)
            absmax = a.reshape(*a.shape[:-2], g, group_size, a.shape[-1]).max(axis=-2)
    return (absmax / np.float32(INT_BOUND[bits])).astype(dtype)


def weight_quantize_reference(w: np.ndarray, bits: int, group_size: int = -1, *,
                              name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) for `w` [..., K, N], computed the straightforward way (whole array at once).

    q is int8 holding values in [-bound, bound]; scale is in the weight's dtype.
    The specification of `weight_quantize`, which must give identical bits.
    """
    scale = weight_scales(w, bits, group_size, name=name)
    sf = _expand_groups(scale.astype(np.float32), w.shape[-2], group_size)
    sf = np.where(sf == 0, np.float32(1), sf)  # an all-zero channel: 0 / 1 = 0
    t = w.astype(np.float32) / sf
    b = np.float32(INT_BOUND[bits])
    q = np.clip(round_half_away(t), -b, b).astype(np.int8)
    return q, scale


def weight_quantize(w: np.ndarray, bits: int, group_size: int = -1, *, name: str = "weight",
                    threads: int | None = None, out: np.ndarray | None = None,
                    scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(q, scale) for `w` [..., K, N]: bit-identical to `weight_quantize_reference`, faster.

    bf16 weights are processed in cache-sized row blocks: the absmax runs on
    the raw bits (`& 0x7fff`), each block is widened to float32 and
    multiplied by the reciprocal scale with a bias (`reciprocal_scales`, which
    proves it gives round_half_away of the exact division) and rounded into
    int8 (no clip is needed, see below); up to `threads` threads (default:
    min(2, cores)) share the rows. `out` (int8, w's shape) receives q if
    given; `scale`, if given, must be `weight_scales(w, bits, group_size)`
    (computed earlier: the absmax is not repeated). Scales outside
    [2^-120, 2^120] (no real weight has them) take one IEEE division per
    element instead; other dtypes use the reference path.
    """
    if w.dtype != np.dtype(ml_dtypes.bfloat16) or w.ndim < 2:
        q, scale = weight_quantize_reference(w, bits, group_size, name=name)
        if out is not None:
            np.copyto(out, q)
            q = out
        return q, scale
    if scale is None:
        scale = weight_scales(w, bits, group_size, name=name, threads=threads)
    lead = w.shape[:-2]
    k, n = w.shape[-2], w.shape[-1]
    w3 = np.ascontiguousarray(w).reshape(-1, k, n)
    s3 = scale.astype(np.float32).reshape(w3.shape[0], -1, n)
    s3 = np.where(s3 == 0, np.float32(1), s3)
    recip = reciprocal_scales(s3)
    bound = np.float32(INT_BOUND[bits])
    q = np.empty(w3.shape, np.int8) if out is None else out.reshape(w3.shape)
    rows = max(1, _BLOCK_BYTES // max(1, 4 * n))
    tasks = [(e, r0, min(k, r0 + rows)) for e in range(w3.shape[0]) for r0 in range(0, k, rows)]

    def rows_of(t: np.ndarray, e: int, r0: int, r1: int) -> np.ndarray:
        """The scale rows that weight rows r0:r1 of slice e use (per channel: the one row)."""
        return t[e, 0] if group_size == -1 else t[e, np.arange(r0, r1) // group_size]

    bits16 = w3.view(np.uint16)

    def run(chunk: list[tuple[int, int, int]]) -> None:
        buf = np.empty((rows, n), np.float32)
        half = None if recip is not None else np.empty((rows, n), np.uint32)
        for e, r0, r1 in chunk:
            f = buf[: r1 - r0]
            # No clip needed for a normal scale: bf16(absmax / bound) is at least (absmax / bound)(1 - 2^-8),
            # so |w / scale| <= bound / (1 - 2^-8) < bound + 0.5 (127.498, 7.03) and the rounded value
            # never exceeds the bound (the reference clips, as Paddle does; tests check equality).
            if recip is not None:
                # bf16 -> float32 is exact: its bits are the float's upper half. Widening the raw bits
                # (a SIMD integer cast and shift) runs ~1.2x faster than letting the multiply cast
                # each bf16 through ml_dtypes; the product and rounding are the same.
                x = f.view(np.uint32)
                np.copyto(x, bits16[e, r0:r1])
                np.left_shift(x, 16, out=x)
                np.multiply(f, rows_of(recip, e, r0, r1), out=f)
                np.rint(f, out=q[e, r0:r1], casting="unsafe")
                continue
            np.divide(w3[e, r0:r1], rows_of(s3, e, r0, r1), out=f, dtype=np.float32)
            x, h = f.view(np.uint32), half[: r1 - r0]  # h = copysign(0.49999997, f): sign | 0x3EFFFFFF
            np.bitwise_and(x, np.uint32(0x80000000), out=h)
            np.bitwise_or(h, np.uint32(0x3EFFFFFF), out=h)
            np.add(f, h.view(np.float32), out=f)
            np.clip(f, -bound, bound, out=f)  # a subnormal scale is coarse: |w / scale| can pass the bound
            np.copyto(q[e, r0:r1], f, casting="unsafe")  # float -> int truncates: the trunc of round

    _run_chunks(run, tasks, threads)
    return q.reshape(*lead, k, n), scale


_BLOCK_BYTES = 1024 * 1024
"""float32 bytes per row block of `weight_quantize`: the block, its bf16 source and its int8
result stay in L2 (2 MiB here); larger blocks also mean fewer GIL hand-offs between the threads."""

_RECIPROCAL_BIAS = np.float32(1 + 2.0 ** -19)
_RECIPROCAL_RANGE = (np.float32(2.0 ** -120), np.float32(2.0 ** 120))


def reciprocal_scales(scale: np.ndarray) -> np.ndarray | None:
    """Multipliers m = f32(f32(1 / s) * (1 + 2^-19)) with rint(f32(w * m)) = round_half_away(f32(w / s))
    for every bf16 w with |w / s| <= 127.5 and every bf16 scale s in [2^-120, 2^120]; None when
    a scale lies outside that range (the caller divides).

    Why it is exact: w = a 2^i and s = b 2^j with integer significands a, b <= 255 (bf16), so
    w / s is either a tie n + 1/2 exactly or at least 2^-16 of itself away from every tie (the
    distance |2w - (2n + 1)s| / 2s is a multiple of 2^min(i+1, j) / 2s: at least 1/510 when
    i >= j, at least (w / s) / 255 otherwise; and w / s <= 127.5). The product carries the bias
    (1 + 2^-19) and at most three float32 roundings (3 * 2^-24), so ties land above n + 1/2 and
    rint rounds them away from zero, as `round` does, while every other quotient stays on its
    side of the tie. tests/quant checks every bf16 w against all 128 significands of s at
    exponents across the range, against the division.
    """
    if scale.size and (scale.min() < _RECIPROCAL_RANGE[0] or scale.max() > _RECIPROCAL_RANGE[1]):
        return None
    return (np.float32(1) / scale.astype(np.float32)) * _RECIPROCAL_BIAS


def _run_chunks(fn: Callable[[list[Any]], Any], tasks: list[Any], threads: int | None) -> list[Any]:
    """fn over `threads` contiguous chunks of tasks (numpy releases the GIL in its loops)."""
    nthreads = max(1, min(threads or min(2, os.cpu_count() or 1), len(tasks)))
    if nthreads == 1:
        return [fn(tasks)]
    size = math.ceil(len(tasks) / nthreads)
    with ThreadPoolExecutor(nthreads) as pool:
        return list(pool.map(fn, [tasks[i:i + size] for i in range(0, len(tasks), size)]))


def _absmax_bits_bf16(w: np.ndarray, threads: int | None = None) -> np.ndarray:
    """max over axis -2 of the magnitude bits (`bits & 0x7fff`) of a bf16 array [..., K, N].

    For finite values the largest magnitude bits are the bits of the largest
    |w|; NaN and Inf give bits >= 0x7f80.
    """
    k, n = w.shape[-2], w.shape[-1]
    u = np.ascontiguousarray(w).view(np.uint16).reshape(-1, k, n)
    rows = max(1, (512 * 1024) // max(1, 2 * n))
    tasks = [(e, r0) for e in range(u.shape[0]) for r0 in range(0, k, rows)]

    def run(chunk: list[tuple[int, int]]) -> np.ndarray:
        part = np.zeros((u.shape[0], n), np.uint16)
        tmp = np.empty((min(rows, max(k, 1)), n), np.uint16)
        for e, r0 in chunk:
            blk = u[e, r0:r0 + rows]
            t = tmp[: blk.shape[0]]
            np.bitwise_and(blk, np.uint16(0x7FFF), out=t)
            np.maximum(part[e], t.max(axis=0), out=part[e])
        return part

    parts = _run_chunks(run, tasks, threads) if tasks else [np.zeros((u.shape[0], n), np.uint16)]
    out = parts[0]
    for p in parts[1:]:
        np.maximum(out, p, out=out)
    return out.reshape(*w.shape[:-2], n)


def grid_weight(q: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """The bf16 weight [..., K, N] standing for the codes `q` [..., K, N] with the per-channel
    `scale` [..., N], chosen so that Paddle's `weight_quantize` of it on a GPU, which is what
    FastDeploy runs when it quantizes a bf16 checkpoint at load, gives back `scale` and `q`.

    The channel's absmax becomes a = bf16(bound x s) (the elements at |q| = bound) and every
    element w = bf16(q x a / bound). Paddle's kernels store the scale as bf16(a / bound), which is
    `s` for every scale that came from a bf16 absmax (that absmax maps to `s`, and `a`, the bf16
    value nearest bound x s, lies in the same interval around it). The GPU kernel
    (`per_channel_quant_gpu`, weight_quantize_kernel_gpu_impl.h) codes lround(w / a x bound) from
    the unrounded absmax: |w / a x bound - q| <= |q| 2^-8 (+ float32 roundings) < 0.5 for
    |q| <= 127, so every code comes back. Its int4 sm70 path and the CPU kernel
    (`weight_quantize`, here bit for bit) divide by the rounded scale instead, which moves the
    quotient by up to another |q| 2^-8: int4 codes still come back (7 x 2^-7 < 0.5), a few int8
    codes above about 64 in magnitude move by one (`gpu_weight_codes` models the GPU kernel). An
    all-zero channel stays zero.
    """
    bound = np.float32(INT_BOUND[bits])
    a = (bound * np.asarray(scale).astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float64)
    return (np.asarray(q, np.float64) * (a / float(bound))[..., None, :]).astype(np.float32).astype(
        ml_dtypes.bfloat16)


def gpu_weight_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """The codes Paddle's GPU `weight_quantize` gives a bf16 weight [K, N] per channel (sm75 and
    later for int4; every arch for int8), as its kernel's source computes them
    (`per_channel_quant_gpu`): lround(clamp(f32(w) / absmax x bound, -bound, bound)) from the
    unrounded float absmax. A model of a kernel this machine cannot run (no GPU), kept to the
    source's order of float32 operations; the CPU kernel is `weight_quantize`."""
    bound = np.float32(INT_BOUND[bits])
    f = np.asarray(w).astype(np.float32)
    absmax = np.abs(f).max(axis=-2, keepdims=True)
    t = np.clip(np.divide(f, np.where(absmax == 0, np.float32(1), absmax)) * bound, -bound, bound)
    return round_half_away(t).astype(np.int8)


def weight_dequantize(q: np.ndarray, scale: np.ndarray, group_size: int = -1) -> np.ndarray:
    """float32 W[..., k, c] = f32(q[..., k, c]) * f32(scale[..., c or k // g, c]) (exact in float32)."""
    sf = np.asarray(scale).astype(np.float32)
    if sf.ndim == 0:
        return q.astype(np.float32) * sf
    return q.astype(np.float32) * _expand_groups(sf, q.shape[-2], group_size)


# -- fake quantization (Paddle's CPU kernels) ----------------------------------------------------------


def paddle_inverse(s: np.ndarray) -> np.ndarray:
    """1 / s, or 1 / (s + 1e-6) where s <= 1e-30 (Paddle's `inverse`), in float32."""
    s = np.asarray(s, dtype=np.float32)
    one = np.float32(1)
    with np.errstate(divide="ignore"):
        return np.where(s <= np.float32(1e-30), one / (s + np.float32(1e-6)), one / s).astype(np.float32)


def fake_quant_dequant(x: np.ndarray, scale: np.ndarray, bits: int, round_type: int) -> np.ndarray:
    """Paddle's ClipAndFakeQuantDequant with scale `scale` (broadcast against x), float32.

    round_type 0: (clip(rint((b * inv(s)) * x), -b - 1, b) * s) / b
    round_type 1: (round_half_away((b * inv(s)) * clip(x, -s, s)) * s) / b
    """
    x = np.asarray(x, dtype=np.float32)
    s = np.asarray(scale, dtype=np.float32)
    b = np.float32(2 ** (bits - 1) - 1)
    k = b * paddle_inverse(s)
    if round_type == 0:
        q = np.clip(np.rint(k * x), -b - np.float32(1), b)
    else:
        q = round_half_away(k * np.clip(x, -s, s))
    return ((q * s) / b).astype(np.float32)


def abs_max(x: np.ndarray, keep_axes: tuple[int, ...] = ()) -> np.ndarray:
    """max |x| over every axis not in `keep_axes` (float32; the kept axes keep their size)."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    keep = {ax % a.ndim for ax in keep_axes} if a.ndim else set()
    reduce = tuple(i for i in range(a.ndim) if i not in keep)
    if not reduce:
        return a
    if a.size == 0:
        return np.zeros([d for i, d in enumerate(a.shape) if i in keep], np.float32)
    return a.max(axis=reduce)


def moving_average_state(absmax: np.float32, accum: np.float32, state: np.float32,
                         rate: float) -> tuple[np.float32, np.float32, np.float32]:
    """Paddle's FindMovingAverageAbsMax: (scale, accum, state) after one training step (float32).

        state' = rate * state + 1;  accum' = rate * accum + absmax;  scale = accum' / state'
    """
    r = np.float32(rate)
    new_state = np.float32(r * np.float32(state) + np.float32(1))
    new_accum = np.float32(r * np.float32(accum) + np.float32(absmax))
    return np.float32(new_accum / new_state), new_accum, new_state


# -- FP8 -------------------------------------------------------------------------------------------


def fp8_scale(x: np.ndarray, fmt: DType = DType.F8E4M3) -> np.float32:
    """Tensor-wise FP8 scale: absmax / 448 (e4m3) or / 57344 (e5m2); 1 for an all-zero tensor."""
    m = np.float32(abs_max(x)) if np.asarray(x).size else np.float32(0)
    if not np.isfinite(m):
        raise NonFiniteWeightError("cannot compute an FP8 scale of a tensor holding NaN or Inf")
    if m == 0:
        return np.float32(1)
    return np.float32(m / np.float32(FP8_MAX[fmt]))


def fp8_quantize(x: np.ndarray, scale: np.ndarray | float, fmt: DType = DType.F8E4M3) -> np.ndarray:
    """fp8(clip(f32(x) / scale, -max, max)), rounded to nearest even by ml_dtypes (saturating)."""
    top = np.float32(FP8_MAX[fmt])
    t = np.asarray(x, dtype=np.float32) / np.asarray(scale, dtype=np.float32)
    return np.clip(t, -top, top).astype(fmt.numpy)


def fp8_fake_quant(x: np.ndarray, scale: np.ndarray | float, fmt: DType = DType.F8E4M3) -> np.ndarray:
    """f32(fp8_quantize(x, scale)) * scale: the value an FP8 GEMM sees, in float32."""
    return fp8_quantize(x, scale, fmt).astype(np.float32) * np.asarray(scale, dtype=np.float32)
