"""Train a multi-rank training artifact: its ranks as paddle.distributed processes on this CPU.

    result = train_distributed(Path("art"), 2, steps=3, data=RankData(batches=batches))   # a TrainResult

The processes are started, bounded and stopped as every multi-rank run is
(ernie_ir.backends.paddle.launch: a free rendezvous port, a timeout, every process killed on a
failure, several nodes); each runs the training rank worker (`python -m
ernie_ir.training.rank_worker`). Rank 0 reports each step, evaluation and published checkpoint
as a JSON line, which the poll here turns into callbacks.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends.paddle.launch import (
    DistributedRunError,
    RankProcesses,
    finish_node,
    log_tail,
    require_paddle,
)
from ernie_ir.backends.paddle.launch_files import staging_dir
from ernie_ir.ir import ErnieIRError
from ernie_ir.training.checkpoints import ResumePoint, TrainResult
from ernie_ir.training.hooks import TrainHooks
from ernie_ir.training.rank_data import RankData

WORKER = "ernie_ir.training.rank_worker"
"""The training rank worker's module, started with `python -m` once per process (the recipe's
launch lines name it too)."""
TRAIN_TIMEOUT_S = 3600.0
STARTED = "started"
"""The file rank 0 makes (in the run's temp folder, beside the losses) as its first step begins."""


def train_distributed(artifact: Path, world: int, steps: int, data: RankData, *, options: Any = None,
                      save: bool = True, hooks: TrainHooks | None = None, resume: ResumePoint | None = None,
                      timeout_s: float = TRAIN_TIMEOUT_S) -> TrainResult:
    """Train a multi-rank training artifact on `world` gloo processes (data parallel: dp x the
    artifact's ranks, the options' dp); a TrainResult, with what each process held at the end
    (`rank_stats`).

    Every rank takes `data.batches` (cycled; `data.synthetic`: the recipe's synthetic batch, which
    the checkpoints record) and the same `options` (a TrainOptions, or a dict of
    its names; None: the recipe's), evaluates on `data.eval_batches` every eval_steps and at the end,
    and with `resume` (a checkpoint checked against this run: training.checkpoints.ResumePoint)
    restores its state from it first and continues after its step. `hooks.on_step(step, loss)`
    is called as rank 0 reports each step, `hooks.on_eval(step, loss)` each evaluation,
    `hooks.on_start(start, steps)` as rank 0 begins its first step. With `save`, rank 0 writes
    `training/checkpoints/run-K-step-N/` (every rank's trainable params, their merge to global
    names and shapes, every rank's optimizer state, trainer_state.json) at the end and every
    save_steps, and lists it in the manifest; as rank 0 reports each one,
    `hooks.on_checkpoint(folder)` is called here, then the artifact's newest save_total_limit are
    kept (removed here, not by the ranks, so the callback never races a removal). A failed run
    leaves no partial checkpoint. Interrupted (KeyboardInterrupt: SIGINT, or the CLI's SIGTERM),
    every process is stopped, the checkpoints rank 0 published meanwhile reach on_checkpoint (a
    LoRA run's adapter), one it had renamed but not yet listed in the manifest is removed, and the
    interrupt goes on.
    """
    require_paddle()
    root = Path(artifact)
    start = 0 if resume is None else resume.step
    workdir = Path(tempfile.mkdtemp(prefix="ernie-ir-dist-"))
    ranks: RankProcesses | None = None
    values = dict(options if isinstance(options, dict) or options is None else options.model_dump())
    keep = values.get("save_total_limit")
    events = _RankEvents(root, workdir / "losses.jsonl", hooks or TrainHooks(), keep, start, steps)
    try:
        _save_batches(workdir / "batches.npz", data.batches or [])
        args = _worker_args(workdir, steps, events.path, values if options is not None else None,
                            data.eval_batches, resume, save)
        if data.synthetic:
            args.append("--synthetic")
        ranks = RankProcesses(root, None, args, world, workdir, worker=WORKER)
        ranks.start()
        ranks.wait(timeout_s, events.poll)
        finish_node(ranks)
        if len(events.losses) != steps - start:
            raise DistributedRunError(f"rank 0 reported {len(events.losses)} of {steps - start} steps",
                                      log_tail(ranks.logs / "workerlog.0"))
        stats = []
        for r in range(world):
            with contextlib.suppress(OSError, ValueError):
                stats.append(json.loads((workdir / f"stats.rank{r}.json").read_text(encoding="utf-8")))
        published = [p for p in events.published if p.exists()]
        return TrainResult(events.losses, events.evals, published, start + 1, stats)
    except BaseException as e:
        # Node 0 only: another node's ranks never publish, and its files are node 0's to remove.
        if ranks is not None and ranks.first_rank == 0 and ranks.rendezvous is not None:
            shutil.rmtree(staging_dir(root, ranks.rendezvous), ignore_errors=True)
        if isinstance(e, KeyboardInterrupt) and ranks is not None and ranks.first_rank == 0:
            _finish_interrupted(root, ranks, events)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _finish_interrupted(root: Path, ranks: RankProcesses, events: _RankEvents) -> None:
    """After an interrupt (every process stopped: RankProcesses.wait stops them on any exit): the
    events rank 0 wrote before it stopped reach the hooks, and a checkpoint it had renamed but not
    listed is removed; a second signal waits (training.interrupts)."""
    from ernie_ir.training.checkpoints import drop_unlisted_checkpoints
    from ernie_ir.training.interrupts import deferred_signals

    with deferred_signals():
        ranks.stop()
        with contextlib.suppress(ValueError, OSError):
            events.poll()
        with contextlib.suppress(ErnieIRError, OSError):  # the interrupt, not a lock, is the news
            drop_unlisted_checkpoints(root)


def _worker_args(workdir: Path, steps: int, losses_file: Path, values: dict[str, Any] | None,
                 eval_batches: list[tuple[np.ndarray, np.ndarray]] | None, resume: ResumePoint | None,
                 save: bool) -> list[str]:
    """The rank worker's arguments (after the artifact), its input files written to `workdir`:
    the options as JSON (`values`; their save_total_limit left to the launcher, which removes
    older checkpoints after on_checkpoint), the evaluation batches, the checkpoint to resume."""
    args = ["--steps", str(steps), "--batches", str(workdir / "batches.npz"),
            "--losses", str(losses_file), "--stats", str(workdir / "stats.rank{rank}.json"),
            "--started", str(losses_file.with_name(STARTED))]
    if values is not None:
        values = {**values, "save_total_limit": None}  # removed here, after on_checkpoint
        (workdir / "options.json").write_text(json.dumps(values), encoding="utf-8")
        args += ["--options", str(workdir / "options.json")]
    if eval_batches is not None:
        _save_batches(workdir / "eval.npz", eval_batches)
        args += ["--eval-batches", str(workdir / "eval.npz")]
    if resume is not None:
        args += ["--resume", str(Path(resume.folder).resolve())]
    if save:
        args.append("--save")
    return args


class _RankEvents:
    """Rank 0's first step begun (the file STARTED beside `path`: on_start), then its JSON lines
    (launch_files: a loss per step, EVENT_EVAL, EVENT_CHECKPOINT) read as
    they are written, each turned into the hooks' call; a checkpoint's on_checkpoint runs before
    the artifact's newest `keep` are kept."""

    def __init__(self, root: Path, path: Path, hooks: TrainHooks, keep: int | None, start: int = 0,
                 steps: int = 0) -> None:
        self.root, self.path, self.hooks, self.keep = root, path, hooks, keep
        self.start, self.steps = start, steps
        self.began = False
        self.losses: list[float] = []
        self.evals: list[tuple[int, float]] = []
        self.published: list[Path] = []
        self.handled: set[str] = set()
        self.seen = 0

    def unhandled(self, name: str) -> bool:
        """A checkpoint of this run whose event is not read yet: rank 0 may publish several
        before a poll reads them, and each must reach on_checkpoint before any removal."""
        from ernie_ir.training.checkpoints import checkpoint_order

        key, ours = checkpoint_order(name), checkpoint_order(self.published[0].name)
        return key is not None and ours is not None and key[0] == ours[0] and name not in self.handled

    def poll(self) -> None:
        from ernie_ir.backends.paddle.launch_files import EVENT_CHECKPOINT, EVENT_EVAL
        from ernie_ir.training.checkpoints import prune_checkpoints
        from ernie_ir.training.interrupts import deferred_signals

        if not self.began and self.path.with_name(STARTED).exists():
            self.began = True
            if self.hooks.on_start is not None:
                self.hooks.on_start(self.start, self.steps)
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        for line in lines[self.seen:]:
            if not line.endswith("\n"):
                break  # rank 0 is still writing it
            self.seen += 1
            record = json.loads(line)
            kind = record.get("event")
            if kind == EVENT_CHECKPOINT:
                folder = Path(record["path"])
                self.published.append(folder)
                with deferred_signals():  # its adapter and the pruning are not cut in half
                    if self.hooks.on_checkpoint is not None:
                        self.hooks.on_checkpoint(folder)
                    self.handled.add(folder.name)
                    if self.keep is not None:
                        prune_checkpoints(self.root, int(self.keep), self.unhandled)
            elif kind == EVENT_EVAL:
                self.evals.append((int(record["step"]), float(record["loss"])))
                if self.hooks.on_eval is not None:
                    self.hooks.on_eval(*self.evals[-1])
            else:
                self.losses.append(float(record["loss"]))
                if self.hooks.on_step is not None:
                    self.hooks.on_step(int(record["step"]), self.losses[-1])


def _save_batches(path: Path, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
    arrays = {}
    for i, (ids, labels) in enumerate(batches):
        arrays[f"ids{i}"], arrays[f"labels{i}"] = ids, labels
    np.savez(path, **arrays)
