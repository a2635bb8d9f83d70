"""Kernels of silu, gelu, softmax, add, mul and cast against float64 / bit-level references."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from _ops_testkit import FAST, assert_close, f32_arrays, run1, shapes
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ernie_ir.ir import DType

# --------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------


@FAST
@given(f32_arrays(shapes(0, 3), -30.0, 30.0))
def test_silu_matches_float64(x):
    y = run1("silu", x)
    ref = np.vectorize(lambda v: v / (1.0 + math.exp(-v)))(x.astype(np.float64))
    assert_close(y, ref, what="silu")


def test_silu_extremes_do_not_produce_nan():
    x = np.array([-1e4, -100.0, 0.0, 100.0, 1e4], np.float32)
    y = run1("silu", x)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, [0, 0, 0, 100, 1e4], atol=1e-30)


@FAST
@given(f32_arrays(shapes(0, 3), -10.0, 10.0))
def test_gelu_exact_matches_math_erf(x):
    y = run1("gelu", x)
    ref = np.vectorize(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))))(x.astype(np.float64))
    # The exact form is computed in float64 and rounded once: half an ulp.
    assert_close(y, ref, rtol=1e-6, atol=1e-12, what="gelu exact")


@FAST
@given(f32_arrays(shapes(0, 3), -8.0, 8.0))
def test_gelu_tanh_matches_float64(x):
    y = run1("gelu", x, approximate="tanh")
    c = math.sqrt(2.0 / math.pi)
    ref = np.vectorize(lambda v: 0.5 * v * (1.0 + math.tanh(c * (v + 0.044715 * v**3))))(
        x.astype(np.float64)
    )
    # For x << 0, 1 + tanh(.) cancels in float32: the absolute error is ~|x| ulp(1)/2 <= 5e-7.
    assert_close(y, ref, rtol=1e-5, atol=1e-6, what="gelu tanh")


def test_gelu_exact_and_tanh_differ():
    x = np.array([-3.0, -1.0, 0.5, 2.0], np.float32)
    exact, approx = run1("gelu", x), run1("gelu", x, approximate="tanh")
    assert np.all(np.abs(exact - approx) < 1e-3)
    assert not np.array_equal(exact, approx)


@st.composite
def softmax_case(draw):
    shape = draw(shapes(1, 3, 1, 5))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return draw(f32_arrays(shape, -30.0, 30.0)), axis


@FAST
@given(softmax_case())
def test_softmax_matches_float64_and_sums_to_one(case):
    x, axis = case
    y = run1("softmax", x, axis=axis)
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    ref = e / e.sum(axis=axis, keepdims=True)
    # x - max(x) spans up to 60, which float32 rounds by up to ulp(60)/2 ~ 2e-6: the same
    # relative error in exp.
    assert_close(y, ref, rtol=1e-5, atol=1e-6, what="softmax")
    np.testing.assert_allclose(y.astype(np.float64).sum(axis=axis), 1.0, rtol=1e-6)
    assert np.all(y >= 0)


def test_softmax_large_inputs_are_shift_invariant():
    x = np.array([[1000.0, 1001.0, 1002.0]], np.float32)
    y = run1("softmax", x)
    np.testing.assert_allclose(y, run1("softmax", x - 1000), rtol=1e-6)
    assert np.all(np.isfinite(y))


# --------------------------------------------------------------------------------------
# add and mul
# --------------------------------------------------------------------------------------


@FAST
@given(
    hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4),
    st.data(),
)
def test_add_and_mul_broadcast_and_round_once(bshapes, data):
    sa, sb = bshapes.input_shapes
    a = data.draw(f32_arrays(sa, -1e3, 1e3))
    b = data.draw(f32_arrays(sb, -1e3, 1e3))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    # The float64 sum/product of two float32 values rounded to float32 is the correctly
    # rounded float32 result, so these are bit-exact.
    s = run1("add", a, b)
    p = run1("mul", a, b)
    assert s.shape == p.shape == bshapes.result_shape
    np.testing.assert_array_equal(s, (a64 + b64).astype(np.float32))
    np.testing.assert_array_equal(p, (a64 * b64).astype(np.float32))


def test_add_integers_stay_integers():
    a = np.array([1, 2, 3], np.int64)
    np.testing.assert_array_equal(run1("add", a, np.int64(5)), [6, 7, 8])
    np.testing.assert_array_equal(run1("mul", a, a), [1, 4, 9])


# --------------------------------------------------------------------------------------
# cast
# --------------------------------------------------------------------------------------


def bf16_round_bits(x: np.ndarray) -> np.ndarray:
    """Round non-NaN float32 to bfloat16 bits, nearest-even, by integer arithmetic on the bits
    (overflow past the largest bf16 carries into the exponent and gives inf, as it should)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    return ((u + 0x7FFF + lsb) >> 16).astype(np.uint16)


@FAST
@given(hnp.arrays(np.float32, shapes(0, 2, 0, 6),
                  elements=st.floats(allow_nan=False, allow_infinity=True, width=32)))
def test_cast_to_bf16_rounds_to_nearest_even(x):
    y = run1("cast", x, dtype=DType.BF16)
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y.view(np.uint16), bf16_round_bits(x))
    np.testing.assert_array_equal(y.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_cast_to_bf16_ties_go_to_even():
    # 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties to the even mantissa (1.0);
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to 1 + 2^-6.
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], np.float32)
    y = run1("cast", x, dtype="bf16").astype(np.float64)
    np.testing.assert_array_equal(y, [1.0, 1 + 2**-6, 1 + 2**-7])


@FAST
@given(f32_arrays(shapes(0, 2), -6e4, 6e4))
def test_cast_to_f16_and_back_to_f32(x):
    y = run1("cast", x, dtype=DType.F16)
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, x.astype(np.float16))
    back = run1("cast", y, dtype=DType.F32)
    assert back.dtype == np.float32
    np.testing.assert_array_equal(back, y.astype(np.float64))  # widening is exact


@FAST
@given(f32_arrays(shapes(0, 2), -1e6, 1e6))
def test_cast_float_to_int_truncates_toward_zero(x):
    y = run1("cast", x, dtype=DType.I32)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, np.vectorize(math.trunc, otypes=[np.int64])(x))


@pytest.mark.parametrize("dtype", [DType.I64, DType.I8, DType.BOOL, DType.U8])
def test_cast_produces_the_storage_dtype(dtype):
    y = run1("cast", np.array([0.0, 1.0, 2.9], np.float32), dtype=dtype)
    assert y.dtype == dtype.numpy
