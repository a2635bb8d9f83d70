"""`RankData`: what every rank of a training run trains and evaluates on, as the launcher hands
it to the rank workers (ernie_ir.training.launch) and a worker plans its run from it
(ernie_ir.training.rank_worker)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

Batches = list[tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class RankData:
    """A rank's training and evaluation data: batches the launcher cut (`batches`,
    `eval_batches`: every rank the same), else JSON lines files the worker cuts (`data`, `eval_data`);
    no training data at all: the recipe's synthetic batch."""

    batches: Batches | None = None
    data: Path | None = None
    eval_batches: Batches | None = None
    eval_data: Path | None = None
    synthetic: bool = False
    """`batches` are the recipe's synthetic batch (the launcher's run without data)."""
