"""What a training run reports as it goes: `TrainHooks`, the callbacks a caller gives
`train_artifact` (ernie_ir.training.loop), and the `StepProgress` its `on_progress` gets.

Imports neither the loop nor the launcher (ernie_ir.training.launch), which both take the hooks:
the loop calls them for a one-rank run, the launcher as rank 0 reports each step and checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepProgress:
    """What `train_artifact` reports after each optimizer step (the CLI draws it)."""

    step: int
    steps: int
    loss: float
    lr: float
    tokens: int
    """Real target tokens of this step (every accumulated batch)."""
    elapsed_s: float
    """Seconds since the first step began."""

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    total_tokens: int = 0
    """Real target tokens of this run's steps up to `step`."""
    start_step: int = 0
    """The step this run started after (a resumed checkpoint's step, else 0)."""

    @property
    def eta_s(self) -> float:
        return self.elapsed_s / max(1, self.step - self.start_step) * (self.steps - self.step)


@dataclass(frozen=True)
class TrainHooks:
    """What a run calls as it goes, in the caller's process (each None: nothing called)."""

    on_start: Callable[[int, int], Any] | None = None
    """(the step the run starts after, the run's total steps) once every check has passed, before
    the first step (a multi-rank run: before its processes start)."""
    on_step: Callable[[int, float], Any] | None = None
    """(step, loss) after each optimizer step."""
    on_progress: Callable[[StepProgress], Any] | None = None
    """A StepProgress after each optimizer step (after on_step)."""
    on_eval: Callable[[int, float], Any] | None = None
    """(step, evaluation loss) after each evaluation (every eval_steps steps and at the end)."""
    on_checkpoint: Callable[[Path], Any] | None = None
    """The folder of each checkpoint, once it is published (before older ones are removed)."""
