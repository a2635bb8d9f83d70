"""Kernels of embedding, linear, lm_head, rms_norm and layer_norm against float64 formulas."""

from __future__ import annotations

import numpy as np
import pytest
from _ops_testkit import (
    F32_EPS,
    FAST,
    assert_close,
    assert_within,
    dot_bound,
    f32_arrays,
    rng_arrays,
    run1,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ernie_ir.ir import OpError

# --------------------------------------------------------------------------------------
# embedding
# --------------------------------------------------------------------------------------


@FAST
@given(
    ids_shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    vocab=st.integers(1, 9),
    hidden=st.integers(1, 5),
    seed=seeds,
)
def test_embedding_is_row_lookup(ids_shape, vocab, hidden, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, ids_shape).astype(np.int64)
    (table,) = rng_arrays(seed, (vocab, hidden))
    out = run1("embedding", ids, table)
    assert out.shape == (*ids_shape, hidden)
    for index in np.ndindex(*ids_shape):
        np.testing.assert_array_equal(out[index], table[int(ids[index])])


@pytest.mark.parametrize("bad", [7, -1, 100])
def test_embedding_out_of_range_id_raises_op_error(bad):
    table = np.zeros((7, 3), np.float32)
    ids = np.array([[0, 1], [bad, 2]], np.int64)
    with pytest.raises(OpError, match=rf"token id {bad} is outside the vocabulary \[0, 7\)"):
        run1("embedding", ids, table)


def test_embedding_int32_ids_and_last_valid_id():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = run1("embedding", np.array([3, 0, 3], np.int32), table)
    np.testing.assert_array_equal(out, [[9, 10, 11], [0, 1, 2], [9, 10, 11]])


# --------------------------------------------------------------------------------------
# linear and lm_head
# --------------------------------------------------------------------------------------


@FAST
@given(
    lead=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3),
    k=st.integers(1, 24),
    n=st.integers(1, 8),
    with_bias=st.booleans(),
    seed=seeds,
)
def test_linear_matches_float64(lead, k, n, with_bias, seed):
    x, w, bias = rng_arrays(seed, (*lead, k), (k, n), (n,))
    args = (x, w, bias) if with_bias else (x, w)
    y = run1("linear", *args)
    ref = np.zeros((*lead, n))
    for index in np.ndindex(*lead):
        for j in range(n):
            ref[(*index, j)] = sum(float(x[(*index, i)]) * float(w[i, j]) for i in range(k))
            if with_bias:
                ref[(*index, j)] += float(bias[j])
    # Cancellation in the K-term dot products makes a relative tolerance meaningless near
    # zero; the bound is the float32 matmul error bound gamma_K |x| |w| (plus the bias add).
    bound = dot_bound(x, w, k) + (2 * F32_EPS * np.abs(ref) if with_bias else 0)
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert_within(y, ref, bound, what="linear")


@FAST
@given(
    lead=hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=3),
    hidden=st.integers(1, 16),
    vocab=st.integers(1, 11),
    transpose=st.booleans(),
    seed=seeds,
)
def test_lm_head_matches_float64(lead, hidden, vocab, transpose, seed):
    x, w = rng_arrays(seed, (*lead, hidden), (hidden, vocab))
    weight = np.ascontiguousarray(w.T) if transpose else w
    logits = run1("lm_head", x, weight, transpose_weight=transpose)
    ref = np.einsum("...h,hv->...v", x.astype(np.float64), w.astype(np.float64))
    assert logits.dtype == np.float32
    assert_within(logits, ref, dot_bound(x, w, hidden), what="lm_head")


def test_lm_head_tied_weight_reads_rows_of_the_table():
    # transpose_weight with a [V, H] table: logit v is <x, table[v]>.
    table = np.array([[1, 0], [0, 1], [1, 1]], np.float32)
    x = np.array([[2, 3]], np.float32)
    np.testing.assert_array_equal(run1("lm_head", x, table, transpose_weight=True), [[2, 3, 5]])
    # A square, non-symmetric weight: the flag alone decides between x @ w and x @ w.T.
    w = np.array([[1, 2], [0, 1]], np.float32)
    np.testing.assert_array_equal(run1("lm_head", x, w), [[2, 7]])
    np.testing.assert_array_equal(run1("lm_head", x, w, transpose_weight=True), [[8, 3]])


# --------------------------------------------------------------------------------------
# rms_norm and layer_norm
# --------------------------------------------------------------------------------------

norm_shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6)
eps_values = st.sampled_from([1e-6, 1e-5, 1e-3, 0.5])


@st.composite
def norm_case(draw):
    shape = draw(norm_shapes)
    x = draw(f32_arrays(shape, -10.0, 10.0))
    w = draw(f32_arrays(shape[-1:], -2.0, 2.0))
    b = draw(f32_arrays(shape[-1:], -2.0, 2.0))
    return x, w, b, draw(eps_values)


@FAST
@given(norm_case())
def test_rms_norm_matches_float64(case):
    x, w, _, eps = case
    y = run1("rms_norm", x, w, eps=eps)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w.astype(np.float64)
    assert_close(y, ref, what="rms_norm")


def _layer_norm_ref(x, w, b, eps):
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)  # population variance
    y = (x64 - mean) / np.sqrt(var + eps)
    if w is not None:
        y = y * w.astype(np.float64)
    if b is not None:
        y = y + b.astype(np.float64)
    return y, var


@FAST
@given(norm_case(), st.sampled_from(["none", "weight", "both"]))
def test_layer_norm_matches_float64(case, affine):
    x, w, b, eps = case
    w = None if affine == "none" else w
    b = b if affine == "both" else None
    args = [x] if w is None else ([x, w] if b is None else [x, w, b])
    y = run1("layer_norm", *args, eps=eps)
    ref, var = _layer_norm_ref(x, w, b, eps)
    # Centering in float32 is off by up to ~H ulps of max|x| (the mean's rounding); the
    # normalisation divides that by sqrt(var + eps), which is large for near-constant rows.
    # Elsewhere the result is good to a few ulps, hence rtol 1e-5.
    h = x.shape[-1]
    wmag = 1.0 if w is None else np.abs(w.astype(np.float64))
    centering = (h + 2) * F32_EPS * np.abs(x).max(axis=-1, keepdims=True) / np.sqrt(var + eps)
    bound = 1e-5 * np.abs(ref) + centering * wmag + 1e-6
    assert y.dtype == np.float32
    assert_within(y, ref, bound, what=f"layer_norm ({affine})")


def test_layer_norm_without_affine_has_zero_mean_unit_variance():
    (x,) = rng_arrays(21, (4, 32), scale=3.0)
    y = run1("layer_norm", x, eps=1e-12).astype(np.float64)
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-6)
    np.testing.assert_allclose(y.var(axis=-1), 1, rtol=1e-5)


def test_norm_eps_is_added_to_the_variance_not_the_std():
    # A constant row of 3s: rms = 3; y = 3 / sqrt(9 + eps).
    x = np.full((1, 4), 3.0, np.float32)
    w = np.ones(4, np.float32)
    y = run1("rms_norm", x, w, eps=7.0)
    np.testing.assert_allclose(y, 3 / 4, rtol=1e-6)
    # layer_norm of the row [1, 3]: mean 2, var 1 -> (+-1) / sqrt(1 + 3) = +-0.5.
    y = run1("layer_norm", np.array([[1, 3]], np.float32), eps=3.0)
    np.testing.assert_allclose(y, [[-0.5, 0.5]], rtol=1e-6)
