"""The Paddle layer's rope (a gathered partner lane, angles cached per forward) and causal
attention (mask made once per forward, none for one query row) equal the op kernels, eager and
traced, for both rope styles, with and without position ids."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ernie_ir.ops.attention import Attention, AttentionAttrs
from ernie_ir.ops.rope import Rope, RopeAttrs

paddle = pytest.importorskip("paddle")

from ernie_ir.backends.paddle import layer as paddle_layer  # noqa: E402


class _Traced(paddle.nn.Layer):  # type: ignore[misc, name-defined]
    """Runs one op implementation as the built Layer's `_run` does: not AST-transformed."""

    def __init__(self, fn: Any, node: Any) -> None:
        super().__init__()
        self.P, self.F, self.fn, self.node = paddle, paddle.nn.functional, fn, node

    def forward(self, a: Any, b: Any = None, c: Any = None) -> Any:
        return self._run([x for x in (a, b, c) if x is not None])

    @paddle.jit.not_to_static
    def _run(self, xs: list[Any]) -> Any:
        self._forward_cache: dict[Any, Any] = {}
        return self.fn(self, self.node, xs)[0]


def eager(fn: Any, node: Any, xs: list[np.ndarray]) -> np.ndarray:
    layer = SimpleNamespace(P=paddle, F=paddle.nn.functional, _forward_cache={})
    with paddle.no_grad():
        first = fn(layer, node, [paddle.to_tensor(x) for x in xs])[0].numpy()
        again = fn(layer, node, [paddle.to_tensor(x) for x in xs])[0].numpy()  # from the cache
    np.testing.assert_array_equal(first, again)
    return first


def traced(fn: Any, node: Any, xs: list[np.ndarray]) -> np.ndarray:
    spec = [paddle.static.InputSpec([None, None, *x.shape[2:]], str(x.dtype)) for x in xs]
    static = paddle.jit.to_static(_Traced(fn, node), input_spec=spec, full_graph=True)
    with paddle.no_grad(), warnings.catch_warnings():  # as emit_paddle: Paddle's `place` notice
        warnings.filterwarnings("ignore", message=".*'place' interface.*")
        return static(*[paddle.to_tensor(x) for x in xs]).numpy()


@pytest.mark.parametrize("style", ["interleaved", "half"])
@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("form", ["eager", "traced"])
def test_rope_equals_kernel(style: str, positions: bool, form: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    xs = [x, (rng.integers(0, 4000, (2, 5))).astype(np.int64)] if positions else [x]
    attrs = RopeAttrs(theta=10000.0, style=style)
    ref = Rope().kernel(xs, attrs)[0]
    run = eager if form == "eager" else traced
    got = run(paddle_layer.OPS["rope"], SimpleNamespace(attrs=attrs), xs)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("s", "t"), [(1, 1), (1, 7), (4, 4), (3, 6)])
@pytest.mark.parametrize("form", ["eager", "traced"])
def test_causal_attention_equals_kernel(s: int, t: int, form: str) -> None:
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, s, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, t, 2, 8)).astype(np.float32) for _ in range(2))
    attrs = AttentionAttrs(causal=True)
    ref = Attention().kernel([q, k, v], attrs)[0]
    run = eager if form == "eager" else traced
    got = run(paddle_layer.OPS["attention"], SimpleNamespace(attrs=attrs), [q, k, v])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
