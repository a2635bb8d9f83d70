"""Shared helpers of the op-set tests (imported as a plain module: tests/ops has no package).

Nothing here reimplements an op: references live in the test modules, written
from the op docstrings in float64, independently of the kernels' helpers.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ernie_ir.ir import get_op

F32_EPS = float(np.finfo(np.float32).eps)  # 2**-23: one ulp at 1.0

# Property tests are sized to keep the whole tests/ops suite well under a minute on 2 cores;
# ERNIE_IR_OPS_EXAMPLES=N multiplies the example counts by N for a soak run.
_SCALE = max(1, int(os.environ.get("ERNIE_IR_OPS_EXAMPLES", "1")))
FAST = settings(max_examples=100 * _SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=50 * _SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run_kernel(op: str, *args: np.ndarray | None, **attrs: Any) -> list[np.ndarray]:
    """Call op `op`'s reference kernel directly (attrs validated by its schema)."""
    opdef = get_op(op)
    return opdef.kernel(list(args), opdef.make_attrs(attrs))


def run1(op: str, *args: np.ndarray | None, **attrs: Any) -> np.ndarray:
    (out,) = run_kernel(op, *args, **attrs)
    return out


def f32_elements(lo: float = -4.0, hi: float = 4.0) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=32)


def f32_arrays(shape: Any, lo: float = -4.0, hi: float = 4.0) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, shape, elements=f32_elements(lo, hi))


def shapes(min_dims: int = 1, max_dims: int = 3, min_side: int = 1, max_side: int = 4):
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


def rng_arrays(seed: int, *shapes_: tuple[int, ...], scale: float = 1.0) -> list[np.ndarray]:
    """Normal float32 arrays from one seed (for inputs too large to draw element by element)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(np.float32) for s in shapes_]


seeds = st.integers(0, 2**32 - 1)


def assert_close(actual: np.ndarray, expected: np.ndarray, *, rtol: float = 1e-5, atol: float = 1e-6,
                 what: str = "") -> None:
    """float32 result vs float64 reference: same shape, float32, and close."""
    actual = np.asarray(actual)
    assert actual.shape == np.shape(expected), f"{what}: shape {actual.shape} vs {np.shape(expected)}"
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype}, expected float32"
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=rtol, atol=atol, err_msg=what)


def assert_within(actual: np.ndarray, expected: np.ndarray, bound: np.ndarray | float,
                  what: str = "") -> None:
    """|actual - expected| <= bound elementwise (bound: a rounding-error bound of the float32 math)."""
    actual = np.asarray(actual)
    assert actual.shape == np.shape(expected), f"{what}: shape {actual.shape} vs {np.shape(expected)}"
    err = np.abs(actual.astype(np.float64) - expected)
    bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {err.size} elements out of bound; worst "
        f"err {err[bad].max():.3g} vs bound {bound[bad][np.argmax(err[bad])]:.3g}"
    )


def dot_bound(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """Rounding bound of a float32 matmul a @ b with inner size k: gamma_k * (|a| @ |b|).

    The standard bound |fl(a.b) - a.b| <= k u |a|.|b| / (1 - k u), u = eps/2; doubled for
    the rounding of the float32 inputs' products and a little slack.
    """
    mag = np.matmul(np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64)))
    return (k + 2) * F32_EPS * mag + 1e-7
