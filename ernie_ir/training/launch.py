"""Train a multi-rank training artifact: its ranks as paddle.distributed processes on this CPU.

    result = train_distributed(Path("art"), 2, steps=3, batches=batches)   # a TrainResult

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
from collections.abc import Callable
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
from ernie_ir.training.checkpoints import TrainResult
from ernie_ir.training.recipe import WORKER

TRAIN_TIMEOUT_S = 3600.0


def train_distributed(artifact: Path, world: int, steps: int, batches: list[tuple[np.ndarray, np.ndarray]],
                      *, options: Any = None, save: bool = True,
                      on_step: Callable[[int, float], Any] | None = None,
                      eval_batches: list[tuple[np.ndarray, np.ndarray]] | None = None,
                      resume: Path | None = None, start: int = 0,
                      on_checkpoint: Callable[[Path], Any] | None = None,
                      timeout_s: float = TRAIN_TIMEOUT_S) -> TrainResult:
    """Train a multi-rank training artifact on `world` gloo processes (data parallel: dp x the
    artifact's ranks, the options' dp); a TrainResult, with what each process held at the end
    (`rank_stats`).

    Every rank takes `batches` (cycled) and the same `options` (a TrainOptions, or a dict of
    its names; None: the recipe's), evaluates on `eval_batches` every eval_steps and at the end,
    and with `resume` (a checkpoint folder; `start` its step) restores its state from it first.
    `on_step(step, loss)` is called as rank 0 reports each step. With `save`, rank 0 writes
    `training/checkpoints/run-K-step-N/` (every rank's trainable params, their merge to global
    names and shapes, every rank's optimizer state, trainer_state.json) at the end and every
    save_steps, and lists it in the manifest; as rank 0 reports each one, `on_checkpoint(folder)`
    is called here, then the artifact's newest save_total_limit are kept (removed here, not by
    the ranks, so the callback never races a removal). A failed run leaves no partial checkpoint.
    """
    from ernie_ir.backends.paddle.launch_files import EVENT_CHECKPOINT, EVENT_EVAL
    from ernie_ir.training.checkpoints import checkpoint_order, prune_checkpoints

    require_paddle()
    root = Path(artifact)
    workdir = Path(tempfile.mkdtemp(prefix="ernie-ir-dist-"))
    ranks: RankProcesses | None = None
    values = dict(options if isinstance(options, dict) or options is None else options.model_dump())
    keep = values.get("save_total_limit")
    try:
        _save_batches(workdir / "batches.npz", batches)
        losses_file = workdir / "losses.jsonl"
        losses: list[float] = []
        evals: list[tuple[int, float]] = []
        published: list[Path] = []
        handled: set[str] = set()
        seen = 0

        def unhandled(name: str) -> bool:
            """A checkpoint of this run whose event is not read yet: rank 0 may publish several
            before a poll reads them, and each must reach on_checkpoint before any removal."""
            key, ours = checkpoint_order(name), checkpoint_order(published[0].name)
            return key is not None and ours is not None and key[0] == ours[0] and name not in handled
        args = ["--steps", str(steps), "--batches", str(workdir / "batches.npz"),
                "--losses", str(losses_file), "--stats", str(workdir / "stats.rank{rank}.json")]
        if options is not None:
            values["save_total_limit"] = None  # removed here, after on_checkpoint
            (workdir / "options.json").write_text(json.dumps(values), encoding="utf-8")
            args += ["--options", str(workdir / "options.json")]
        if eval_batches is not None:
            _save_batches(workdir / "eval.npz", eval_batches)
            args += ["--eval-batches", str(workdir / "eval.npz")]
        if resume is not None:
            args += ["--resume", str(Path(resume).resolve())]
        if save:
            args.append("--save")

        def poll() -> None:
            nonlocal seen
            if not losses_file.is_file():
                return
            lines = losses_file.read_text(encoding="utf-8").splitlines(keepends=True)
            for line in lines[seen:]:
                if not line.endswith("\n"):
                    break  # rank 0 is still writing it
                seen += 1
                record = json.loads(line)
                kind = record.get("event")
                if kind == EVENT_CHECKPOINT:
                    folder = Path(record["path"])
                    published.append(folder)
                    if on_checkpoint is not None:
                        on_checkpoint(folder)
                    handled.add(folder.name)
                    if keep is not None:
                        prune_checkpoints(root, int(keep), unhandled)
                elif kind == EVENT_EVAL:
                    evals.append((int(record["step"]), float(record["loss"])))
                else:
                    losses.append(float(record["loss"]))
                    if on_step is not None:
                        on_step(int(record["step"]), losses[-1])

        ranks = RankProcesses(root, None, args, world, workdir, worker=WORKER)
        ranks.start()
        ranks.wait(timeout_s, poll)
        finish_node(ranks)
        if len(losses) != steps - start:
            raise DistributedRunError(f"rank 0 reported {len(losses)} of {steps - start} steps",
                                      log_tail(ranks.logs / "workerlog.0"))
        stats = []
        for r in range(world):
            with contextlib.suppress(OSError, ValueError):
                stats.append(json.loads((workdir / f"stats.rank{r}.json").read_text(encoding="utf-8")))
        return TrainResult(losses, evals, [p for p in published if p.exists()], start + 1, stats)
    except BaseException:
        # Node 0 only: another node's ranks never publish, and its files are node 0's to remove.
        if ranks is not None and ranks.first_rank == 0 and ranks.rendezvous is not None:
            shutil.rmtree(staging_dir(root, ranks.rendezvous), ignore_errors=True)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _save_batches(path: Path, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
    arrays = {}
    for i, (ids, labels) in enumerate(batches):
        arrays[f"ids{i}"], arrays[f"labels{i}"] = ids, labels
    np.savez(path, **arrays)
