"""Kernels of moe_gate and moe_experts against per-token loops written from the docstrings."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _ops_testkit import FAST, SLOW, assert_close, rng_arrays, run_kernel, seeds
from hypothesis import given
from hypothesis import strategies as st

from ernie_ir.ir import OpError

# --------------------------------------------------------------------------------------
# moe_gate
# --------------------------------------------------------------------------------------


def ref_moe_gate(x, w, bias, top_k, normalize=True, norm_min=1e-12):
    """Per token: p = softmax(x @ w); choose the top_k of p + bias (ties: lower index);
    weights are the unbiased p of the chosen, divided by max(sum, norm_min)."""
    x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    w64 = np.asarray(w, np.float64)
    b64 = None if bias is None else np.asarray(bias, np.float64).reshape(-1)
    n_exp = w.shape[1]
    weights, indices = [], []
    for tok in x2:
        logits = [float(np.dot(tok, w64[:, e])) for e in range(n_exp)]
        top = max(logits)
        ex = [math.exp(v - top) for v in logits]
        p = [v / sum(ex) for v in ex]
        # The docstring computes p + bias in float32: a tiny p is absorbed by the bias there,
        # which makes exact ties (broken by index) that float64 would not see.
        score = [p[e] if b64 is None else float(np.float32(np.float32(p[e]) + np.float32(b64[e])))
                 for e in range(n_exp)]
        order = sorted(range(n_exp), key=lambda e, score=score: (-score[e], e))
        chosen = order[:top_k]
        wts = [p[e] for e in chosen]
        if normalize:
            total = max(sum(wts), norm_min)
            wts = [v / total for v in wts]
        weights.append(wts)
        indices.append(chosen)
    lead = x.shape[:-1]
    return (np.array(weights).reshape(*lead, top_k), np.array(indices, np.int64).reshape(*lead, top_k))


@st.composite
def gate_case(draw):
    lead = draw(st.sampled_from([(1,), (5,), (2, 3), (1, 1, 4)]))
    hidden = draw(st.integers(1, 6))
    n_exp = draw(st.integers(1, 8))
    top_k = draw(st.integers(1, n_exp))
    # Small integers make every logit an exact integer in float32 and float64 alike, so
    # equal logits are exact ties (tie-break checked) and different ones differ by >= 1:
    # the float32 kernel and the float64 reference then rank experts identically.
    ints = st.integers(-2, 2)
    x = np.array(draw(st.lists(ints, min_size=math.prod(lead) * hidden, max_size=math.prod(lead) * hidden)),
                 np.float32).reshape(*lead, hidden)
    w = np.array(draw(st.lists(ints, min_size=hidden * n_exp, max_size=hidden * n_exp)),
                 np.float32).reshape(hidden, n_exp)
    bias_kind = draw(st.sampled_from(["none", "1d", "2d"]))
    bias = None
    if bias_kind != "none":
        # Multiples of 1/4 (exact in float32): large enough to override the softmax order.
        vals = draw(st.lists(st.integers(-4, 4), min_size=n_exp, max_size=n_exp))
        bias = (np.array(vals, np.float32) / 4).reshape((n_exp,) if bias_kind == "1d" else (1, n_exp))
    normalize = draw(st.booleans())
    norm_min = draw(st.sampled_from([1e-12, 0.5, 2.0]))
    return x, w, bias, top_k, normalize, norm_min


@FAST
@given(gate_case())
def test_moe_gate_matches_per_token_loop(case):
    x, w, bias, top_k, normalize, norm_min = case
    args = (x, w) if bias is None else (x, w, bias)
    weights, indices = run_kernel("moe_gate", *args, top_k=top_k, normalize=normalize, norm_min=norm_min)
    ref_w, ref_i = ref_moe_gate(x, w, bias, top_k, normalize, norm_min)
    assert indices.dtype == np.int64 and weights.dtype == np.float32
    np.testing.assert_array_equal(indices, ref_i)
    assert_close(weights, ref_w, what="moe_gate weights")


def _logits_to_gate(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x = identity rows and w = logits, so that x @ w gives exactly the chosen logits."""
    return np.eye(logits.shape[0], dtype=np.float32), logits.astype(np.float32)


def test_moe_gate_bias_changes_the_choice_but_not_the_weights():
    logits = np.array([[3.0, 2.0, 1.0, 0.0]])
    x, w = _logits_to_gate(logits)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    _plain_w, plain_i = run_kernel("moe_gate", x, w, top_k=2)
    np.testing.assert_array_equal(plain_i, [[0, 1]])
    bias = np.array([0.0, 0.0, 0.0, 1.0], np.float32)  # pushes the worst expert to the top
    wts, idx = run_kernel("moe_gate", x, w, bias, top_k=2)
    np.testing.assert_array_equal(idx, [[3, 0]])
    # The weights are the *unbiased* probabilities of experts 3 and 0, renormalised.
    expect = p[[3, 0]] / p[[3, 0]].sum()
    assert_close(wts, expect[None], what="biased choice, unbiased weights")
    wts_raw, _ = run_kernel("moe_gate", x, w, bias, top_k=2, normalize=False)
    assert_close(wts_raw, p[[3, 0]][None], what="unnormalised weights are p")


@SLOW
@given(seed=seeds, shift=st.sampled_from([-0.5, 0.25, 3.0]), top_k=st.integers(1, 4))
def test_moe_gate_bias_never_scales_the_weights(seed, shift, top_k):
    # A uniform bias changes no choice, so weights and indices equal the unbiased run;
    # with any bias, weights stay the unbiased softmax of the chosen experts.
    x, w, bias = rng_arrays(seed, (6, 5), (5, 4), (4,))
    base_w, base_i = run_kernel("moe_gate", x, w, top_k=top_k, normalize=False)
    uni_w, uni_i = run_kernel("moe_gate", x, w, np.full(4, shift, np.float32), top_k=top_k, normalize=False)
    np.testing.assert_array_equal(uni_i, base_i)
    np.testing.assert_array_equal(uni_w, base_w)
    wts, idx = run_kernel("moe_gate", x, w, bias, top_k=top_k, normalize=False)
    logits = x.astype(np.float64) @ w.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert_close(wts, np.take_along_axis(p, idx, axis=-1), what="weights are unbiased p")


def test_moe_gate_ties_choose_the_lower_index_best_first():
    logits = np.array([[1.0, 2.0, 2.0, 1.0, 2.0]])
    x, w = _logits_to_gate(logits)
    _, idx = run_kernel("moe_gate", x, w, top_k=4)
    np.testing.assert_array_equal(idx, [[1, 2, 4, 0]])
    # Ties created by the bias break the same way.
    _, idx = run_kernel("moe_gate", x, w, np.array([0, 0, 0, 0, 5], np.float32), top_k=2)
    np.testing.assert_array_equal(idx, [[4, 1]])


def test_moe_gate_norm_min_floors_the_renormalising_sum():
    logits = np.array([[0.0, 0.0, 0.0, 0.0]])  # p = 1/4 each; top-2 sum = 1/2
    x, w = _logits_to_gate(logits)
    floor, _ = run_kernel("moe_gate", x, w, top_k=2, norm_min=2.0)
    np.testing.assert_allclose(floor, [[0.125, 0.125]], rtol=1e-6)  # 0.25 / max(0.5, 2)
    unfloored, _ = run_kernel("moe_gate", x, w, top_k=2, norm_min=0.25)
    np.testing.assert_allclose(unfloored, [[0.5, 0.5]], rtol=1e-6)  # 0.25 / max(0.5, 0.25)


def test_moe_gate_2d_bias_equals_1d_bias():
    x, w, bias = rng_arrays(2, (3, 4), (4, 6), (6,))
    a = run_kernel("moe_gate", x, w, bias, top_k=3)
    b = run_kernel("moe_gate", x, w, bias.reshape(1, 6), top_k=3)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)


# --------------------------------------------------------------------------------------
# moe_experts
# --------------------------------------------------------------------------------------


def ref_moe_experts(x, weights, indices, up_gate, down):
    """out[t] = sum_j weights[t, j] * FFN_{indices[t, j]}(x[t]) in float64 loops."""
    hidden = x.shape[-1]
    inter = down.shape[1]
    xs = np.asarray(x, np.float64).reshape(-1, hidden)
    ws = np.asarray(weights, np.float64).reshape(xs.shape[0], -1)
    ids = np.asarray(indices).reshape(xs.shape[0], -1)
    ug, dn = np.asarray(up_gate, np.float64), np.asarray(down, np.float64)
    out = np.zeros_like(xs)
    for t in range(xs.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = xs[t] @ ug[e][:, :inter]
            up = xs[t] @ ug[e][:, inter:]
            act = gate / (1.0 + np.exp(-gate)) * up
            out[t] += ws[t, j] * (act @ dn[e])
    return out.reshape(x.shape)


@st.composite
def experts_case(draw):
    lead = draw(st.sampled_from([(1,), (4,), (2, 3)]))
    hidden = draw(st.integers(1, 6))
    inter = draw(st.integers(1, 5))
    n_exp = draw(st.integers(1, 5))
    k = draw(st.integers(1, 3))
    seed = draw(seeds)
    x, wts, ug, dn = rng_arrays(seed, (*lead, hidden), (*lead, k), (n_exp, hidden, 2 * inter),
                                (n_exp, inter, hidden))
    # Indices may repeat within a token (then that expert counts once per slot).
    idx = np.random.default_rng(seed + 3).integers(0, n_exp, (*lead, k))
    idx = idx.astype(draw(st.sampled_from([np.int64, np.int32])))
    return x, wts, idx, ug, dn


@SLOW
@given(experts_case())
def test_moe_experts_matches_per_token_loop(case):
    x, wts, idx, ug, dn = case
    (out,) = run_kernel("moe_experts", x, wts, idx, ug, dn)
    ref = ref_moe_experts(x, wts, idx, ug, dn)
    # atol 3e-6, not 1e-6: two chained float32 matmuls (H, I <= 6 terms) plus silu are good
    # to a few ulps of the magnitudes involved, which outputs that cancel to ~0 keep as
    # absolute error. Measured worst excess over rtol over 1500 cases: 4e-7.
    assert_close(out, ref, rtol=1e-5, atol=3e-6, what="moe_experts")


def test_moe_experts_gate_and_up_halves_are_not_swapped():
    # One expert, H = I = 1: up_gate = [gate | up] = [[2, 3]], down = [[1]].
    x = np.array([[1.0]], np.float32)
    ug = np.array([[[2.0, 3.0]]], np.float32)
    dn = np.array([[[1.0]]], np.float32)
    (out,) = run_kernel("moe_experts", x, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int64), ug, dn)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    np.testing.assert_allclose(out, [[silu(2.0) * 3.0]], rtol=1e-6)
    assert not np.isclose(out[0, 0], silu(3.0) * 2.0)


def test_moe_experts_zero_weight_contributes_nothing():
    x, ug, dn = rng_arrays(8, (3, 4), (2, 4, 6), (2, 3, 4))
    idx = np.array([[0, 1], [1, 0], [1, 1]], np.int64)
    wts = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], np.float32)
    (out,) = run_kernel("moe_experts", x, wts, idx, ug, dn)
    assert np.all(out[2] == 0)
    only = run_kernel("moe_experts", x, np.ones((3, 1), np.float32), np.array([[0], [0], [0]]), ug, dn)[0]
    np.testing.assert_allclose(out[:2], only[:2], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [-1, 3])
def test_moe_experts_index_out_of_range_raises_op_error(bad):
    x, wts, ug, dn = rng_arrays(9, (2, 4), (2, 1), (3, 4, 2), (3, 1, 4))
    idx = np.array([[0], [bad]], np.int64)
    with pytest.raises(OpError, match=r"expert index outside \[0, 3\)"):
        run_kernel("moe_experts", x, wts, idx, ug, dn)
