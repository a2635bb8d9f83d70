"""Kernels of split, concat, reshape and transpose against numpy, and agreement with their
type rules: for static shapes the inferred type is the shape the kernel produces."""

from __future__ import annotations

import math

import numpy as np
from _ops_testkit import FAST, run_kernel, shapes
from hypothesis import given
from hypothesis import strategies as st

from ernie_ir.ir import GraphBuilder, f32, tensor


def infer(op: str, *arrays: np.ndarray, **attrs) -> list[tuple]:
    """Output shapes the op's type rule gives for these arrays' static shapes."""
    b = GraphBuilder("shape_check")
    ins = [b.input(f"x{i}", tensor(f32, *a.shape)) for i, a in enumerate(arrays)]
    out = b.op(op, *ins, **attrs)
    outs = out if isinstance(out, tuple) else (out,)
    return [v.type.shape for v in outs]


@st.composite
def split_case(draw):
    shape = draw(shapes(1, 4, 0, 6))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    n = shape[axis]
    count = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=count - 1, max_size=count - 1)))
    bounds = [0, *cuts, n]
    sizes = tuple(bounds[i + 1] - bounds[i] for i in range(count))
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape), axis, sizes


@FAST
@given(split_case())
def test_split_matches_numpy_slices(case):
    x, axis, sizes = case
    outs = run_kernel("split", x, axis=axis, sizes=sizes)
    assert len(outs) == len(sizes)
    offset = 0
    for out, size in zip(outs, sizes, strict=True):
        expect = np.take(x, np.arange(offset, offset + size), axis=axis)
        np.testing.assert_array_equal(out, expect)
        offset += size
    assert [o.shape for o in outs] == infer("split", x, axis=axis, sizes=sizes)


@st.composite
def concat_case(draw):
    shape = draw(shapes(1, 4, 1, 4))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    parts = []
    for i in range(draw(st.integers(1, 4))):
        s = list(shape)
        s[axis] = draw(st.integers(0, 3))
        parts.append(np.full(s, i, np.float32) + np.arange(math.prod(s), dtype=np.float32).reshape(s))
    return parts, axis


@FAST
@given(concat_case())
def test_concat_matches_numpy(case):
    parts, axis = case
    (out,) = run_kernel("concat", *parts, axis=axis)
    np.testing.assert_array_equal(out, np.concatenate(parts, axis=axis))
    assert [out.shape] == infer("concat", *parts, axis=axis)


@st.composite
def reshape_case(draw):
    shape = draw(shapes(0, 4, 1, 4))
    total = math.prod(shape)
    # A target of random factors of total; then maybe one -1 and some 0 (copy) entries.
    target = []
    rest = total
    while rest > 1:
        f = draw(st.sampled_from([d for d in range(2, rest + 1) if rest % d == 0]))
        target.append(f)
        rest //= f
    target += [1] * draw(st.integers(0, 1))
    target = draw(st.permutations(target))
    target = list(target)
    if target and draw(st.booleans()):
        target[draw(st.integers(0, len(target) - 1))] = -1
    for i in range(min(len(shape), len(target))):
        if target[i] == shape[i] and draw(st.booleans()):
            target[i] = 0
    return np.arange(total, dtype=np.float32).reshape(shape), tuple(target)


@FAST
@given(reshape_case())
def test_reshape_matches_numpy(case):
    x, target = case
    (out,) = run_kernel("reshape", x, shape=target)
    numpy_target = [x.shape[i] if t == 0 else t for i, t in enumerate(target)]
    np.testing.assert_array_equal(out, x.reshape(numpy_target))
    assert [out.shape] == infer("reshape", x, shape=target)


@FAST
@given(st.data())
def test_transpose_matches_numpy(data):
    shape = data.draw(shapes(0, 5, 1, 4))
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    (out,) = run_kernel("transpose", x, perm=perm)
    np.testing.assert_array_equal(out, np.transpose(x, perm))
    for index in np.ndindex(*out.shape):
        src = [0] * len(shape)
        for i, p in enumerate(perm):
            src[p] = index[i]
        assert out[index] == x[tuple(src)]
    assert [out.shape] == infer("transpose", x, perm=perm)


def test_reshape_zero_copies_the_input_dim_at_that_position():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    (out,) = run_kernel("reshape", x, shape=(0, 0, 2, -1))
    assert out.shape == (2, 3, 2, 2)
    (out,) = run_kernel("reshape", x, shape=(-1, 0))  # 0 at position 1 copies 3
    assert out.shape == (8, 3)
