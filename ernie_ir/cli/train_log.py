"""What `ernie-ir train` prints while it runs (`TrainLog`): a line per step, evaluation and
checkpoint as each happens, flushed whether the output is a terminal, a pipe or a file; with the
first step's line, the line saying that a run without --data trains on the synthetic batch; and,
when the run is interrupted (Ctrl-C, SIGTERM), the last step done, the newest checkpoint this run
wrote and the command that continues it (`resume_command`).

Like every module of the CLI, this one imports nothing of the library at module level (see
app.py).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from .common import err, out

SYNTHETIC_LINE = ("no --data: training on the recipe's synthetic batch (fixed random token ids), not on "
                  "your data; give --data FILE.jsonl (or a pretraining PREFIX) to train on yours")

_RESUME_PARAMS = ("resume", "resume_from")
"""`train`'s parameters that name a checkpoint to continue: replaced by `--resume` in the command
that continues an interrupted run."""


class TrainLog:
    """The hooks' side of `train`'s output: `on_start`, `on_progress`, `on_eval` and
    `on_checkpoint` print as the run goes (`to_stdout`: stdout, else stderr, as with --json whose
    stdout is one JSON object; `lines` False: no step, evaluation or checkpoint lines, a progress
    bar shows them), and remember the last step and checkpoint for `interrupted`."""

    def __init__(self, to_stdout: bool, synthetic: bool, lines: bool = True) -> None:
        self.console = out if to_stdout else err
        self.synthetic, self.lines = synthetic, lines
        self.step: int | None = None
        self.start = 0
        self.steps: int | None = None
        self.checkpoint: Path | None = None

    def _line(self, text: str) -> None:
        if not self.lines:
            return
        self.console.print(text, markup=False, highlight=False)
        self.console.file.flush()  # a pipe is block-buffered: each line must reach it now

    def on_start(self, start: int, steps: int) -> None:
        self.start, self.steps = start, steps

    def on_progress(self, p: Any) -> None:
        if self.synthetic and self.step is None:
            # with the first step's line, not before: a run refused at its first step (NaN) stays
            # one error line
            err.print(SYNTHETIC_LINE, markup=False)
            err.file.flush()
        self.step, self.steps = p.step, p.steps
        self._line(f"step {p.step:4d}  loss {p.loss:.6f}  lr {p.lr:.2e}  {p.tokens_per_s:,.0f} tok/s")

    def on_eval(self, step: int, loss: float) -> None:
        self._line(f"step {step:4d}  eval_loss {loss:.6f}")

    def on_checkpoint(self, folder: Path) -> None:
        self.checkpoint = Path(folder)
        self._line(f"checkpoint {folder}")

    def interrupted(self, command: list[str], resumed: bool) -> list[str]:
        """The lines an interrupted run ends with: the last step, the newest checkpoint this run
        wrote and the command continuing from it (`command`: `resume_command`'s; `resumed`: the
        run itself continued a checkpoint, which still continues it if it wrote none)."""
        total = f" of {self.steps}" if self.steps is not None else ""
        done = (f"interrupted after step {self.step}{total}" if self.step is not None
                else f"interrupted before step {self.start + 1}{total} finished")
        if self.checkpoint is not None:
            if self.step is not None and self.step == self.steps:  # its last checkpoint was being written
                return [f"{done}; newest checkpoint: {self.checkpoint}",
                        "every step is done: nothing to resume"]
            return [f"{done}; newest checkpoint: {self.checkpoint}",
                    f"continue with: {shlex.join(command)}"]
        if resumed:
            return [f"{done}; this run wrote no checkpoint: the one it resumed from still continues it",
                    f"continue with: {shlex.join(command)}"]
        return [f"{done}; this run wrote no checkpoint (one is written at the end and every --save-steps "
                "N): nothing to resume, run it again (with --save-steps N to be able to resume)"]


def resume_command(ctx: Any, keep_resume: bool) -> list[str]:
    """`ernie-ir train` with the arguments and options given on the command line (from click's
    context `ctx`, in the command's parameter order, each option under its first name), the
    checkpoint options replaced by `--resume` (`keep_resume`: kept as given)."""
    words = ["ernie-ir", ctx.info_name or "train"]
    for param in ctx.command.params:
        name = param.name
        # by name: typer vendors click privately (see exits.py)
        if getattr(ctx.get_parameter_source(name), "name", None) != "COMMANDLINE":
            continue
        if name in _RESUME_PARAMS and not keep_resume:
            continue
        value = ctx.params[name]
        if param.param_type_name == "argument":
            words.append(str(value))
        elif getattr(param, "is_flag", False):
            if value:
                words.append(param.opts[0])
            elif param.secondary_opts:
                words.append(param.secondary_opts[0])
        else:
            for item in (value if isinstance(value, (list, tuple)) else [value]):
                words += [param.opts[0], str(item)]
    if not keep_resume:
        words.append("--resume")
    return words
