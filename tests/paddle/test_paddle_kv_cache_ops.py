"""The Paddle layer's lowerings of a decoder's ops (the kv-cache pass) equal the op kernels:
kv_cache_append, key_padding_mask, position_ids with a token index, and attention with a
padding mask, where a query whose every key is masked (a left pad's row) gives zeros, not NaN,
eager and traced."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ernie_ir.ops.attention import Attention, AttentionAttrs
from ernie_ir.ops.kv_cache import KeyPaddingMask, KeyPaddingMaskAttrs, KvCacheAppend, KvCacheAppendAttrs
from ernie_ir.ops.positions import PositionIds, PositionIdsAttrs

paddle = pytest.importorskip("paddle")

from ernie_ir.backends.paddle import layer as paddle_layer  # noqa: E402


class _Traced(paddle.nn.Layer):  # type: ignore[misc, name-defined]
    """Runs one op implementation as the built Layer's `_run` does: not AST-transformed."""

    def __init__(self, fn: Any, node: Any) -> None:
        super().__init__()
        self.P, self.F, self.fn, self.node = paddle, paddle.nn.functional, fn, node

    def forward(self, a: Any, b: Any = None, c: Any = None, d: Any = None) -> Any:
        return self._run([x for x in (a, b, c, d) if x is not None])

    @paddle.jit.not_to_static
    def _run(self, xs: list[Any]) -> Any:
        self._forward_cache: dict[Any, Any] = {}
        return self.fn(self, self.node, xs)[0]


def eager(op: str, attrs: Any, xs: list[np.ndarray]) -> np.ndarray:
    fn, node = paddle_layer.OPS[op], SimpleNamespace(attrs=attrs)
    layer = SimpleNamespace(P=paddle, F=paddle.nn.functional, _forward_cache={})
    with paddle.no_grad():
        first = fn(layer, node, [paddle.to_tensor(x) for x in xs])[0].numpy()
        again = fn(layer, node, [paddle.to_tensor(x) for x in xs])[0].numpy()  # the per-forward cache
    np.testing.assert_array_equal(first, again)
    return first


def _dynamic(x: np.ndarray) -> list[int | None]:
    """Batch and lengths dynamic: float [B, S|T, H, D] (q, k, v; a step's new keys) keep their
    heads and head dims, a keep mask [B, 1, 1, T] its broadcast axes; the rest is dynamic."""
    if x.ndim == 4 and x.dtype == np.bool_:
        return [None, 1, 1, None]
    if x.ndim == 4 and x.dtype == np.float32:
        return [None, None, *x.shape[2:]]
    return [None] * x.ndim


def traced(op: str, attrs: Any, xs: list[np.ndarray]) -> np.ndarray:
    fn, node = paddle_layer.OPS[op], SimpleNamespace(attrs=attrs)
    spec = [paddle.static.InputSpec(_dynamic(x), str(x.dtype)) for x in xs]
    static = paddle.jit.to_static(_Traced(fn, node), input_spec=spec, full_graph=True)
    with paddle.no_grad(), warnings.catch_warnings():  # as emit_paddle: Paddle's `place` notice
        warnings.filterwarnings("ignore", message=".*'place' interface.*")
        return static(*[paddle.to_tensor(x) for x in xs]).numpy()


RUN = {"eager": eager, "traced": traced}
# row 0: 3 pads then 3 tokens (a left-padded prompt); row 1: a hole at key 2, no pad at the start
MASK = np.array([[0, 0, 0, 1, 1, 1], [1, 1, 0, 1, 1, 1]], np.int64)


def qkv(s: int, t: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, s, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, t, 2, 8)).astype(np.float32) for _ in range(2))
    return [q, k, v]


@pytest.mark.parametrize("form", ["eager", "traced"])
def test_key_padding_mask_equals_kernel(form: str) -> None:
    ref = KeyPaddingMask().kernel([MASK], KeyPaddingMaskAttrs())[0]
    got = RUN[form]("key_padding_mask", KeyPaddingMaskAttrs(), [MASK])
    assert got.dtype == np.bool_ and got.shape == (2, 1, 1, 6)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("form", ["eager", "traced"])
@pytest.mark.parametrize(("p", "s"), [(0, 6), (5, 1), (3, 3)])
def test_kv_cache_append_equals_kernel(form: str, p: int, s: int) -> None:
    rng = np.random.default_rng(4)
    past = rng.standard_normal((2, 2, p, 8)).astype(np.float32)
    new = rng.standard_normal((2, s, 2, 8)).astype(np.float32)
    xs = [past, new, np.ones((2, p + s), np.int64)]
    ref = KvCacheAppend().kernel(xs, KvCacheAppendAttrs())[0]
    got = RUN[form]("kv_cache_append", KvCacheAppendAttrs(), xs)
    np.testing.assert_array_equal(got, ref)


def test_kv_cache_append_refuses_a_mask_of_another_length() -> None:
    xs = [np.zeros((1, 2, 3, 8), np.float32), np.zeros((1, 1, 2, 8), np.float32), np.ones((1, 5), np.int64)]
    with pytest.raises(paddle_layer.PaddleEmitError, match=r"^kv_cache_append: past length 3 \+ 1 new "
                                                           r"tokens = 4, but the attention_mask covers 5"):
        eager("kv_cache_append", KvCacheAppendAttrs(), xs)


@pytest.mark.parametrize("form", ["eager", "traced"])
@pytest.mark.parametrize("index", [False, True])
def test_position_ids_equals_kernel(form: str, index: bool) -> None:
    ids = np.arange(10, dtype=np.int64).reshape(2, 5)
    xs = [ids, np.array([[0, 0, 0, 1, 2], [7, 8, 9, 10, 11]], np.int64)] if index else [ids]
    attrs = PositionIdsAttrs(stride=8, offset=7)
    ref = PositionIds().kernel(xs, attrs)[0]
    got = RUN[form]("position_ids", attrs, xs)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("form", ["eager", "traced"])
@pytest.mark.parametrize(("s", "t"), [(6, 6), (1, 6), (3, 6)])
def test_padded_attention_equals_kernel_zeros_for_rows_that_see_no_key(form: str, s: int, t: int) -> None:
    """A prefill (S = T: row 0's first three queries are pads that see no key), a decode step
    (S = 1) and a chunk after a cache (S < T: the causal keep is made for T != S)."""
    xs = [*qkv(s, t), (MASK != 0)[:, None, None, :]]
    attrs = AttentionAttrs(causal=True)
    ref = Attention().kernel(xs, attrs)[0]
    got = RUN[form]("attention", attrs, xs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    if s == t:
        assert (got[0, :3] == 0).all()  # the pads' rows
        assert np.abs(got[0, 3:]).max() > 0.1


def test_fully_masked_rows_do_not_poison_the_next_matmul() -> None:
    """What a left pad's NaN row would do: the next layer's attention reads every row as a key or
    value; with NaN there, 0 * NaN makes every real row NaN too."""
    q, k, v = qkv(6, 6)
    keep = (MASK != 0)[:, None, None, :]
    attrs = AttentionAttrs(causal=True)
    first = eager("attention", attrs, [q, k, v, keep])
    out = first[:, :, :2, :]  # as the next layer's keys and values [B, T, KV, D]
    second = eager("attention", attrs, [q, out, out, keep])
    assert np.isfinite(second).all()
    ref = Attention().kernel([q, out, out, keep], attrs)[0]
    np.testing.assert_allclose(second, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_additive_mask_with_fully_masked_rows_equals_kernel(causal: bool) -> None:
    q, k, v = qkv(6, 6, seed=5)
    add = np.where(MASK != 0, 0.0, -np.inf).astype(np.float32)[:, None, None, :]
    add = np.broadcast_to(add, (2, 1, 6, 6)).copy()
    add[1, 0, 4] = -np.inf  # row 1's query 4 sees nothing: zeros
    add[1, 0, 5, 0] = -3.0  # an additive bias that is not a mask
    attrs = AttentionAttrs(causal=causal)
    ref = Attention().kernel([q, k, v, add], attrs)[0]
    got = eager("attention", attrs, [q, k, v, add])
    assert np.isfinite(got).all() and (got[1, 4] == 0).all()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)

