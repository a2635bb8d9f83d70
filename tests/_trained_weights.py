"""Trained weights compared with a reference run's, for the full-parameter training tests
(tests/finetune/test_full_param_reference.py, tests/distributed/test_gloo_full_param.py).

    worst = compare_trained("dense pp 2", ours, ref, init, lr=2e-3, norm_tol=2e-3, elem_tol=0.25)

Importable from every test folder: tests/conftest.py puts tests/ on sys.path.

Why per tensor and in units of lr: Adam moves every element by about lr whatever its gradient's
size, so an element whose gradient is nearly zero by cancellation takes a step that float32
rounding decides. The norm of the difference over the norm of the tensor's update stays small
for a faithful run; one element may be off by a fraction of lr.
"""

from __future__ import annotations

import numpy as np


def compare_trained(label: str, ours: dict[str, np.ndarray], ref: dict[str, np.ndarray],
                    init: dict[str, np.ndarray], *, lr: float, norm_tol: float,
                    elem_tol: float) -> tuple[float, float]:
    """(worst |ours - ref| / |ref - init|, worst element / lr) over every tensor of `ours`, each
    present in `ref`, moved from `init` and within the bounds (asserted)."""
    assert ours and set(ours) <= set(ref), sorted(set(ours) - set(ref))
    worst_norm = worst_elem = 0.0
    for name in sorted(ours):
        o, r, w0 = (np.asarray(x, dtype=np.float64) for x in (ours[name], ref[name], init[name]))
        assert o.shape == r.shape == w0.shape, (name, o.shape, r.shape, w0.shape)
        step = float(np.linalg.norm(r - w0))
        assert step > 0.5 * lr * np.sqrt(r.size), f"{label}: {name} hardly trained ({step:.3g})"
        rel = float(np.linalg.norm(o - r)) / step
        elem = float(np.max(np.abs(o - r))) / lr
        assert rel < norm_tol, f"{label}: {name} differs by {rel:.3g} of its update norm"
        assert elem < elem_tol, f"{label}: {name} differs by {elem:.3g} lr in one element"
        worst_norm, worst_elem = max(worst_norm, rel), max(worst_elem, elem)
    return worst_norm, worst_elem
