"""The quantization numerics on their own: rounding, the fast weight quantizer, bad weights, FP8."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from ernie_ir.ir import DType
from ernie_ir.ops.quant_numerics import (
    NonFiniteWeightError,
    fp8_fake_quant,
    fp8_quantize,
    fp8_scale,
    reciprocal_scales,
    round_half_away,
    weight_dequantize,
    weight_quantize,
    weight_quantize_reference,
    weight_scales,
)


def _neighbourhood(centers: np.ndarray, ulps: int) -> np.ndarray:
    """Every float32 within `ulps` steps of each center (both signs)."""
    bits = np.abs(centers).astype(np.float32).view(np.int32)
    offs = np.arange(-ulps, ulps + 1, dtype=np.int32)
    near = (bits[:, None] + offs[None, :]).reshape(-1).view(np.float32)
    near = near[np.isfinite(near)]
    return np.concatenate([near, -near])


def test_round_half_away_matches_c_round_near_every_tie() -> None:
    centers = np.concatenate([np.arange(0, 300) + 0.5, np.arange(1, 300), [0.25, 2.0**-20, 2.0**22 + 0.5]])
    x = _neighbourhood(centers.astype(np.float32), 64)
    expect = np.array([math.copysign(math.floor(abs(float(v)) + 0.5), float(v)) for v in x], np.float64)
    got = round_half_away(x).astype(np.float64)
    np.testing.assert_array_equal(got, expect)
    # the case that a naive trunc(x + 0.5) gets wrong
    assert round_half_away(np.float32(0.49999997)) == 0.0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [-1, 64, 128])
@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 48), (1, 1), (64, 7)])
def test_fast_quantizer_is_bit_identical_to_the_reference(bits: int, group: int, shape: tuple) -> None:
    rng = np.random.default_rng(sum(shape) + bits)
    w = (0.03 * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)
    if w.shape[-1] > 5:
        w[..., 5] = 0
    for threads in (1, 2):
        q, s = weight_quantize(w, bits, group, threads=threads)
        rq, rs = weight_quantize_reference(w, bits, group)
        np.testing.assert_array_equal(q, rq)
        np.testing.assert_array_equal(s.view(np.uint16), rs.view(np.uint16))
    b = 127 if bits == 8 else 7
    assert q.dtype == np.int8 and q.min() >= -b and q.max() <= b
    lead = shape[:-2]
    k = shape[-2]
    assert s.shape == ((*lead, shape[-1]) if group == -1 else (*lead, math.ceil(k / group), shape[-1]))


def test_quantizer_error_is_at_most_half_a_step() -> None:
    rng = np.random.default_rng(3)
    w = (0.05 * rng.standard_normal((512, 64))).astype(ml_dtypes.bfloat16)
    for bits in (8, 4):
        for group in (-1, 64):
            q, s = weight_quantize(w, bits, group)
            err = np.abs(weight_dequantize(q, s, group) - w.astype(np.float32))
            step = s.astype(np.float32) if group == -1 else np.repeat(s.astype(np.float32), group, 0)
            # half a step, plus what clipping at the bf16-rounded scale can add (< 1/256 of the range)
            assert (err <= step * 0.5 + np.abs(w.astype(np.float32)) / 128 + 1e-12).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_other_float_dtypes_keep_their_scale_dtype(dtype: type) -> None:
    w = np.random.default_rng(0).standard_normal((32, 16)).astype(dtype)
    q, s = weight_quantize(w, 8)
    assert s.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(q, weight_quantize_reference(w, 8)[0])


def test_all_zero_channels_give_zero_scale_and_values_no_nan() -> None:
    w = np.zeros((64, 8), ml_dtypes.bfloat16)
    w[:, 1] = 0.5
    for bits in (8, 4):
        for group in (-1, 64):
            q, s = weight_quantize(w, bits, group)
            assert np.isfinite(s.astype(np.float32)).all()
            assert (q[:, 0] == 0).all() and (s.astype(np.float32)[..., 0] == 0).all()
            np.testing.assert_allclose(weight_dequantize(q, s, group)[:, 1], 0.5, rtol=2e-3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_nan_or_inf_weights_are_an_error_naming_the_param(bad: float, dtype: type) -> None:
    w = np.ones((16, 8), dtype)
    w[3, 5] = bad
    with pytest.raises(NonFiniteWeightError, match=r"param layers\.0\.q\.weight holds .* at index \[3, 5\]"):
        weight_scales(w, 8, name="layers.0.q.weight")
    with pytest.raises(NonFiniteWeightError, match="cannot be quantized"):
        weight_quantize(w, 4, 64, name="layers.0.q.weight")


def test_bad_arguments() -> None:
    w = np.ones((8, 8), np.float32)
    with pytest.raises(ValueError, match="8 or 4 bits"):
        weight_quantize(w, 3)
    with pytest.raises(ValueError, match="rank >= 2"):
        weight_quantize(np.ones(8, np.float32), 8)


def test_fp8_scale_and_rounding_follow_ml_dtypes() -> None:
    x = np.array([[1.0, -3.0, 0.1], [448.0 * 2, 0.0, 5e-4]], np.float32)
    s = fp8_scale(x)
    assert s == np.float32(896.0) / np.float32(448.0)
    q = fp8_quantize(x, s)
    assert q.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(q, (x / s).astype(ml_dtypes.float8_e4m3fn))
    assert float(q.astype(np.float32).max()) == 448.0
    np.testing.assert_array_equal(fp8_fake_quant(x, s), q.astype(np.float32) * s)
    assert fp8_scale(np.zeros(4, np.float32)) == 1.0  # an all-zero tensor: no division by zero
    with pytest.raises(NonFiniteWeightError):
        fp8_scale(np.array([1.0, np.nan], np.float32))
    assert fp8_quantize(np.array([1e6], np.float32), 1.0, DType.F8E4M3).astype(np.float32)[0] == 448.0


@pytest.mark.parametrize("bits", [8, 4])
def test_fast_path_needs_no_clip_even_when_the_bf16_scale_rounds_down(bits: int) -> None:
    # every bf16 absmax in [2^-4, 2^4): the column is [+absmax, -absmax, ...], so |w / scale| is as
    # large as the bf16 rounding of absmax / bound allows; the reference clips, the fast path does not
    mags = (np.arange(0x3D80, 0x4180, dtype=np.uint16)).view(ml_dtypes.bfloat16)
    w = np.stack([mags, -mags, mags * ml_dtypes.bfloat16(0.5)]).astype(ml_dtypes.bfloat16)
    q, _ = weight_quantize(w, bits)
    rq, _ = weight_quantize_reference(w, bits)
    np.testing.assert_array_equal(q, rq)
    bound = 127 if bits == 8 else 7
    assert (np.abs(q[:2]) == bound).all()


_ALL_FINITE_BF16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
_ALL_FINITE_BF16 = _ALL_FINITE_BF16[np.isfinite(_ALL_FINITE_BF16.astype(np.float32))]


@pytest.mark.parametrize("exponent", [-120, -119, -64, -9, -1, 0, 1, 8, 63, 119])
def test_reciprocal_multiply_equals_the_division_for_every_bf16_weight(exponent: int) -> None:
    # every finite bf16 w against every bf16 significand of s at this exponent: rint(w * m) must be
    # round_half_away(f32(w / s)) wherever |w / s| <= 127.5 (the only quotients a scale of
    # bf16(absmax / bound) with absmax >= |w| produces)
    sig = np.arange(0x80, 0x100, dtype=np.uint32)  # bf16 significand bits 1.0000000 .. 1.1111111
    s = (((exponent + 127) << 23 | (sig - 0x80) << 16).astype(np.uint32)).view(np.float32)
    m = reciprocal_scales(s)
    assert m is not None
    w = _ALL_FINITE_BF16.astype(np.float32)
    for si, mi in zip(s, m, strict=True):
        exact = w / si
        keep = np.abs(exact) <= np.float32(127.5)
        np.testing.assert_array_equal(np.rint(w[keep] * mi), round_half_away(exact[keep]))


def test_reciprocal_multiply_meets_every_tie_and_near_tie() -> None:
    # w = (n + 1/2) s exactly (a tie: away from zero) and its bf16 neighbours (never a tie), for a
    # power-of-two scale (every n + 1/2 <= 127.5 is a bf16 multiple) and a scale of significand 1.5
    n = np.arange(0, 128, dtype=np.float32)
    ties = 0
    for s in (np.float32(2.0**-7), np.float32(1.5 * 2.0**-7)):
        exact_ties = ((n + np.float32(0.5)) * s).astype(ml_dtypes.bfloat16)
        nb = exact_ties.view(np.uint16)
        w = np.concatenate([nb, nb - 1, nb + 1]).view(ml_dtypes.bfloat16).astype(np.float32)
        w = np.concatenate([w, -w])
        exact = w / s
        keep = np.abs(exact) <= np.float32(127.5)
        got = np.rint(w[keep] * reciprocal_scales(np.array([s]))[0])
        np.testing.assert_array_equal(got, round_half_away(exact[keep]))
        ties += int((np.abs(exact[keep]) % 1 == np.float32(0.5)).sum())
    assert ties > 300  # 2 x 128 ties at s = 2^-7, 2 x 43 at s = 1.5 * 2^-7


def test_scales_outside_the_reciprocal_range_divide_and_stay_bit_identical() -> None:
    # a channel of subnormal weights: its scale is below 2^-120, so the quantizer divides
    rng = np.random.default_rng(7)
    w = (0.02 * rng.standard_normal((64, 16))).astype(ml_dtypes.bfloat16)
    w[:, 3] = (rng.standard_normal(64) * 1e-38).astype(ml_dtypes.bfloat16)
    assert reciprocal_scales(weight_scales(w, 8).astype(np.float32)) is None
    for bits in (8, 4):
        q, s = weight_quantize(w, bits)
        rq, rs = weight_quantize_reference(w, bits)
        np.testing.assert_array_equal(q, rq)
        np.testing.assert_array_equal(s.view(np.uint16), rs.view(np.uint16))
        assert np.abs(q[:, 3]).max() == (127 if bits == 8 else 7)  # clipped, not wrapped


@pytest.mark.parametrize("group", [-1, 64])
def test_scales_computed_earlier_give_the_same_values(group: int) -> None:
    # the weight-only pass computes the scales once and hands them to the read that quantizes
    from ernie_ir.ir.weights import ArraySource
    from ernie_ir.passes.quant.weight_only import QuantizedWeightSource

    w = (0.02 * np.random.default_rng(3).standard_normal((2, 192, 40))).astype(ml_dtypes.bfloat16)
    for bits in (8, 4):
        s = weight_scales(w, bits, group)
        q, s2 = weight_quantize(w, bits, group, scale=s)
        rq, rs = weight_quantize_reference(w, bits, group)
        np.testing.assert_array_equal(q, rq)
        np.testing.assert_array_equal(s2.view(np.uint16), rs.view(np.uint16))
        assert s2 is s
        with_scale = QuantizedWeightSource(ArraySource(w), bits, group, "w", s).read()
        without = QuantizedWeightSource(ArraySource(w), bits, group, "w").read()
        np.testing.assert_array_equal(with_scale.view(np.int8), without.view(np.int8))
