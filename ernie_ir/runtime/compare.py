"""Comparing logits of a rewritten model against its float reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class LogitComparison:
    """max_abs_error = max |a - r|; rel_error = ||a - r||_F / ||r||_F (Frobenius);
    top1_agreement = fraction of positions whose argmax agree."""

    max_abs_error: float
    rel_error: float
    top1_agreement: float
    positions: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def compare_logits(actual: np.ndarray, reference: np.ndarray) -> LogitComparison:
    if actual.shape != reference.shape:
        raise ValueError(f"logit shapes differ: {actual.shape} vs {reference.shape}")
    a = actual.astype(np.float64)
    r = reference.astype(np.float64)
    diff = a - r
    denom = float(np.linalg.norm(r))
    rel = float(np.linalg.norm(diff)) / denom if denom > 0 else float(np.linalg.norm(diff))
    agree = np.argmax(a, axis=-1) == np.argmax(r, axis=-1)
    return LogitComparison(
        max_abs_error=float(np.max(np.abs(diff))) if diff.size else 0.0,
        rel_error=rel,
        top1_agreement=float(np.mean(agree)) if agree.size else 1.0,
        positions=int(agree.size),
    )
