"""Kernels of attention and rope against independent float64 formulations.

attention: a naive loop over (batch, head, query) with the GQA head map
h -> h // (H / KV), the causal offset j <= i + (T - S), bool (keep) and
additive masks broadcast to [B, H, S, T], and zeros for a fully masked row.
rope: each channel pair as a complex number multiplied by exp(i * angle).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _ops_testkit import F32_EPS, FAST, SLOW, assert_close, assert_within, rng_arrays, run1, seeds
from hypothesis import given
from hypothesis import strategies as st

# --------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------


def ref_attention(q, k, v, mask=None, causal=True, scale=None):
    """out[b, i, h] = sum_j softmax_j(scale q.k + mask) v[b, j, h // group], in float64 loops."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, s_, h_, d_ = q.shape
    t_, kv_ = k.shape[1], k.shape[2]
    group = h_ // kv_
    sc = 1.0 / math.sqrt(d_) if scale is None else scale
    full = None if mask is None else np.broadcast_to(mask, (b_, h_, s_, t_))
    out = np.zeros((b_, s_, h_, v.shape[3]))
    for b in range(b_):
        for h in range(h_):
            g = h // group
            for i in range(s_):
                logits = []
                for j in range(t_):
                    if causal and j > i + (t_ - s_):
                        continue
                    score = sc * float(np.dot(q[b, i, h], k[b, j, g]))
                    if full is not None:
                        m = full[b, h, i, j]
                        if full.dtype == np.bool_:
                            if not m:
                                continue
                        else:
                            score += float(m)
                    if score == -math.inf:
                        continue
                    logits.append((j, score))
                if not logits:
                    continue  # fully masked row: zeros
                top = max(sc_ for _, sc_ in logits)
                weights = [(j, math.exp(sc_ - top)) for j, sc_ in logits]
                total = sum(w for _, w in weights)
                for j, w in weights:
                    out[b, i, h] += (w / total) * v[b, j, g]
    return out


def _mask_shape(full: tuple[int, int, int, int], keep_dims: list[bool], rank: int) -> tuple[int, ...]:
    shape = tuple(n if keep else 1 for n, keep in zip(full, keep_dims, strict=True))
    return shape[4 - rank:]


@st.composite
def attention_cases(draw):
    b = draw(st.integers(1, 2))
    s = draw(st.integers(1, 4))
    t = draw(st.one_of(st.just(s), st.integers(1, 6)))  # S == T (prefill) or S != T (either way)
    kv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    d = draw(st.sampled_from([1, 2, 4, 8]))
    dv = draw(st.sampled_from([1, 3, 4]))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    seed = draw(seeds)
    h = kv * group
    q, k, v = rng_arrays(seed, (b, s, h, d), (b, t, kv, d), (b, t, kv, dv))
    mask = None
    if kind != "none":
        keep_dims = draw(st.lists(st.booleans(), min_size=4, max_size=4))
        rank = draw(st.integers(2, 4)) if not any(keep_dims[:2]) else 4
        shape = _mask_shape((b, h, s, t), keep_dims, rank)
        rng = np.random.default_rng(seed + 1)
        if kind == "bool":
            mask = rng.random(shape) < 0.7
        else:
            choices = np.array([0.0, -np.inf, -1.5, 0.75, -30.0], np.float32)
            mask = rng.choice(choices, size=shape).astype(np.float32)
    return q, k, v, mask, causal, scale


@SLOW
@given(attention_cases())
def test_attention_matches_naive_loop(case):
    q, k, v, mask, causal, scale = case
    args = (q, k, v) if mask is None else (q, k, v, mask)
    out = run1("attention", *args, causal=causal, scale=scale)
    ref = ref_attention(q, k, v, mask, causal, scale)
    # atol 5e-6, not 1e-6: the float32 scores q.k carry ~1 ulp per term, exp() passes that on
    # to the probabilities, and outputs that cancel to ~0 (v ~ N(0, 1), up to 6 keys) keep
    # that absolute error. Measured worst excess over rtol over 1500 cases: 8e-7.
    assert_close(out, ref, rtol=1e-5, atol=5e-6, what="attention")


def test_attention_gqa_head_mapping_is_h_div_group():
    # H=4 query heads over KV=2: heads 0,1 read kv head 0; heads 2,3 read kv head 1
    # (h // 2), not h % 2. v is constant per kv head, so the output names the head read.
    b, s, t, d = 1, 2, 3, 4
    q = np.zeros((b, s, 4, d), np.float32)
    k = np.zeros((b, t, 2, d), np.float32)
    v = np.zeros((b, t, 2, 1), np.float32)
    v[:, :, 0] = 10.0
    v[:, :, 1] = 20.0
    out = run1("attention", q, k, v, causal=False)
    np.testing.assert_array_equal(out[0, :, :, 0], [[10, 10, 20, 20]] * s)


def test_attention_causal_offset_with_cache():
    # S=2 new queries after 3 cached keys (T=5): query i sees keys j <= i + 3.
    # With q = 0 the weights are uniform over the visible keys; v[j] = one-hot(j).
    s, t = 2, 5
    q = np.zeros((1, s, 1, 2), np.float32)
    k = np.ones((1, t, 1, 2), np.float32)
    v = np.eye(t, dtype=np.float32)[None, :, None, :]
    out = run1("attention", q, k, v, causal=True)[0, :, 0]
    expect = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.float64)
    expect /= expect.sum(axis=1, keepdims=True)
    assert_close(out, expect, what="causal offset")


def test_attention_more_queries_than_keys_gives_zero_rows():
    # S=4 > T=2: query i sees j <= i - 2, so queries 0 and 1 see nothing and output zeros.
    q, k, v = rng_arrays(3, (1, 4, 2, 4), (1, 2, 1, 4), (1, 2, 1, 3))
    out = run1("attention", q, k, v, causal=True)
    assert np.all(out[0, :2] == 0)
    assert np.all(np.isfinite(out))
    assert_close(out, ref_attention(q, k, v, causal=True), atol=5e-6)


def test_attention_fully_masked_row_is_zero_and_additive_neg_inf_equals_bool_false():
    q, k, v = rng_arrays(4, (2, 3, 2, 4), (2, 3, 2, 4), (2, 3, 2, 5))
    keep = np.ones((2, 1, 3, 3), bool)
    keep[1, 0, 2, :] = False  # batch 1, query 2: nothing visible
    keep[0, 0, 1, 0] = False
    add = np.where(keep, 0.0, -np.inf).astype(np.float32)
    out_bool = run1("attention", q, k, v, keep, causal=False)
    out_add = run1("attention", q, k, v, add, causal=False)
    assert np.all(out_bool[1, 2] == 0)
    assert np.all(out_add[1, 2] == 0)
    assert_close(out_bool, out_add.astype(np.float64), what="bool vs additive -inf")
    assert_close(out_bool, ref_attention(q, k, v, keep, causal=False), atol=5e-6)


def test_attention_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = rng_arrays(5, (1, 3, 1, 16), (1, 3, 1, 16), (1, 3, 1, 2))
    a = run1("attention", q, k, v)
    b = run1("attention", q, k, v, scale=0.25)
    c = run1("attention", q, k, v, scale=1.0)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not np.allclose(a, c)


# --------------------------------------------------------------------------------------
# rope
# --------------------------------------------------------------------------------------


def ref_rope(x, pos, theta, style):
    """Pairs as complex numbers times exp(i * pos * theta^(-2i/D)), in float64/complex128."""
    x = np.asarray(x, np.float64)
    b, s, _, d = x.shape
    half = d // 2
    pos = np.broadcast_to(np.arange(s)[None, :] if pos is None else pos, (b, s)).astype(np.float64)
    freqs = np.array([theta ** (-2.0 * i / d) for i in range(half)])
    rot = np.exp(1j * pos[:, :, None, None] * freqs)  # [B, S, 1, D/2]
    z = x[..., 0::2] + 1j * x[..., 1::2] if style == "interleaved" else x[..., :half] + 1j * x[..., half:]
    z = z * rot
    out = np.empty_like(x)
    if style == "interleaved":
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:] = z.real, z.imag
    return out


def rope_bound(x: np.ndarray, max_pos: int) -> float:
    """Error bound of the float32 kernel: the angle pos * inv_freq in float32 is off by up to
    ~2 ulp of itself (<= 2.4e-7 * pos radians), float32 sin/cos add a few ulp, and the
    rotation products one more; each scales |x|."""
    return float(np.abs(x).max()) * (2.5e-7 * max_pos + 8 * F32_EPS) + 1e-7


@st.composite
def rope_cases(draw):
    b = draw(st.integers(1, 3))
    s = draw(st.integers(1, 5))
    n = draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 4, 6, 8, 16]))
    theta = draw(st.sampled_from([10000.0, 500000.0, 10.0, 1.5]))
    style = draw(st.sampled_from(["interleaved", "half"]))
    pos_kind = draw(st.sampled_from(["default", "batch", "shared"]))
    seed = draw(seeds)
    (x,) = rng_arrays(seed, (b, s, n, d))
    rng = np.random.default_rng(seed + 7)
    pos = None
    if pos_kind == "batch":
        pos = rng.integers(0, 300, (b, s)).astype(np.int64)
    elif pos_kind == "shared":
        pos = rng.integers(0, 300, (1, s)).astype(np.int32)
    return x, pos, theta, style


@FAST
@given(rope_cases())
def test_rope_matches_complex_rotation(case):
    x, pos, theta, style = case
    args = (x,) if pos is None else (x, pos)
    out = run1("rope", *args, theta=theta, style=style)
    ref = ref_rope(x, pos, theta, style)
    max_pos = x.shape[1] if pos is None else int(pos.max()) + 1
    assert out.dtype == np.float32
    # Looser than 1e-6: angles are float32 by definition (docstring), so their error grows with
    # the position; rope_bound derives it.
    assert_within(out, ref, rope_bound(x, max_pos), what=f"rope {style}")


@FAST
@given(rope_cases())
def test_rope_preserves_pair_norms(case):
    x, pos, theta, style = case
    args = (x,) if pos is None else (x, pos)
    out = run1("rope", *args, theta=theta, style=style).astype(np.float64)
    d = x.shape[-1]
    x64 = x.astype(np.float64)
    if style == "interleaved":
        n_in = np.hypot(x64[..., 0::2], x64[..., 1::2])
        n_out = np.hypot(out[..., 0::2], out[..., 1::2])
    else:
        n_in = np.hypot(x64[..., : d // 2], x64[..., d // 2:])
        n_out = np.hypot(out[..., : d // 2], out[..., d // 2:])
    np.testing.assert_allclose(n_out, n_in, rtol=1e-5, atol=1e-6)


def test_rope_dot_product_depends_only_on_relative_position():
    # <rope(q, m), rope(k, n)> is a function of m - n: shift both positions by 7.
    q, k = rng_arrays(11, (1, 1, 1, 8), (1, 1, 1, 8))
    for style in ("interleaved", "half"):
        def at(x, p, style=style):
            return run1("rope", x, np.array([[p]], np.int64), theta=10000.0, style=style)
        a = float(np.sum(at(q, 5) * at(k, 2)))
        b = float(np.sum(at(q, 12) * at(k, 9)))
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


def test_rope_default_positions_are_arange_and_shared_ids_broadcast():
    (x,) = rng_arrays(12, (2, 5, 3, 8))
    default = run1("rope", x, theta=10000.0)
    explicit = run1("rope", x, np.tile(np.arange(5), (2, 1)).astype(np.int64), theta=10000.0)
    shared = run1("rope", x, np.arange(5)[None, :].astype(np.int64), theta=10000.0)
    np.testing.assert_array_equal(default, explicit)
    np.testing.assert_array_equal(default, shared)
    # Position 0 is the identity.
    np.testing.assert_array_equal(default[:, 0], x[:, 0])


def test_rope_custom_positions_per_batch_row():
    (x,) = rng_arrays(13, (2, 3, 1, 4))
    pos = np.array([[0, 1, 2], [10, 20, 30]], np.int64)
    out = run1("rope", x, pos, theta=100.0)
    assert_within(out, ref_rope(x, pos, 100.0, "interleaved"), rope_bound(x, 31))
    # Row 0 must not have been rotated by row 1's positions.
    assert_within(out[0:1], ref_rope(x[0:1], pos[0:1], 100.0, "interleaved"), rope_bound(x, 3))


def test_rope_half_is_interleaved_on_permuted_channels():
    # half style == interleaved style after moving channel i to 2i and i + D/2 to 2i + 1.
    (x,) = rng_arrays(14, (1, 4, 2, 8))
    d = 8
    perm = np.empty(d, int)
    perm[0::2] = np.arange(d // 2)
    perm[1::2] = np.arange(d // 2) + d // 2
    half = run1("rope", x, theta=10000.0, style="half")
    inter = run1("rope", np.ascontiguousarray(x[..., perm]), theta=10000.0, style="interleaved")
    np.testing.assert_allclose(half[..., perm], inter, rtol=1e-6, atol=1e-7)
    assert not np.allclose(half, run1("rope", x, theta=10000.0, style="interleaved"))
