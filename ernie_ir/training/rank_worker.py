"""The training rank worker: one paddle.distributed process of a multi-rank training run.

Started once per process by `paddle.distributed.launch` (gloo on CPU; nccl, xccl or bkcl on
devices), as a module, with the launcher's interpreter:

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir LOGS \\
        "$(which python)" -m ernie_ir.training.rank_worker ARTIFACT --steps N [--data F.jsonl]

Every rank takes the same batches and computes the same replicated loss; the Layer's "f"
functions, the sum of gradient slices that several ranks hold and the global-norm clip over the
whole model (`TensorParallelClip`) make every update the one-rank update; rank 0 appends each
step's loss to `--losses`. With `--save` (at the end, and every `--save-steps`) every rank
writes its trainable params, optimizer and RNG state and rank 0 merges the params back to global
names and shapes: `training/checkpoints/run-K-step-N/` (ernie_ir.training.checkpoints), listed
in the manifest; `--resume [CHECKPOINT]` continues such a run, `--eval-data` / `--eval-steps`
evaluate the loss. Data parallel (`--dp N`, `--sharding`; default: the artifact's), dp x ranks
processes: process g is replica g // ranks of rank graph g % ranks, takes its replica's rows of
each batch and sums gradients over its dp group (ernie_ir.training.data_parallel).

The process group, the rank's graph and the error contract are the inference worker's
(ernie_ir.backends.paddle.rank_worker); `ernie-ir train ARTIFACT` starts this module through
ernie_ir.training.launch, and the artifact's launch recipe (`launch.sh`) starts it on devices.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ernie_ir.artifacts.manifest import Manifest
from ernie_ir.backends.paddle.launch_files import staging_dir
from ernie_ir.backends.paddle.rank_worker import (
    WorkerError,
    add_device_flag,
    device_for,
    init_process_group,
    load_rank_graph,
    rank_main,
    world_from_env,
)
from ernie_ir.ir import Graph
from ernie_ir.ir.mapping import SHARD, Mapping
from ernie_ir.training.checkpoints import CheckpointContext, RankPlace, ResumePoint
from ernie_ir.training.rank_data import Batches, RankData

if TYPE_CHECKING:
    from ernie_ir.training.loop import Trainee, TrainOptions

# -- one rank of training ----------------------------------------------------------------------------------


def _cut_index(shard: dict[str, Any]) -> tuple[list[int], tuple[np.ndarray, ...]]:
    """(global shape, np.ix_ index of a rank's slice) from a `shard` annotation."""
    from ernie_ir.training.data_parallel import cut_index

    return cut_index(shard)


def tensor_parallel_clip(paddle: Any, layer: Any, graph: Graph, clip_norm: float | None,
                         group: Any = None, stages: Any = None, tied: Any = None) -> Any:
    """A Paddle gradient clip (AdamW's `grad_clip`) that makes the rank's gradients the whole
    model's and clips them by the global norm over the whole model.

    Params several ranks hold a slice of (KV heads replicated in groups) get the sum of those
    ranks' gradients (each reader contributes only its heads' part). The norm counts every
    element once: sharded slices summed over ranks, replicated params once, shared slices
    divided by how many ranks hold them (`data_parallel.GradientNorm`, over `group`: the
    model-parallel group, None for the default one; `stages`: the pipeline stages' group, whose
    squared norms add up; `tied`: a pipeline end's tied embedding, whose gradient is summed
    with the other end's and counted once). `clip_norm` None: no clipping, the sums only.
    """
    from paddle.nn.clip import ClipGradBase

    from ernie_ir.training.data_parallel import GradientNorm, clip_scale

    norm_of = GradientNorm(paddle, layer, graph, group, stages, tied)

    class TensorParallelClip(ClipGradBase):  # type: ignore[misc, name-defined]
        last_norm: float | None = None
        """The global gradient norm of the last step, before clipping."""

        def __str__(self) -> str:
            return f"tensor-parallel global-norm clip {clip_norm}"

        def _dygraph_clip(self, params_grads: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
            with paddle.no_grad():
                grads = {p.name: g for p, g in params_grads}
                norm_of.sum_shared(grads)
                norm = norm_of.norm(norm_of.terms(grads))
                self.last_norm = float(norm.numpy()[0])
                out = [(p, grads[p.name]) for p, _ in params_grads]
                if clip_norm is None:
                    return out
                scale = clip_scale(paddle, norm, clip_norm)  # what ClipGradByGlobalNorm applies
                return [(p, g if g is None else g * scale) for p, g in out]

    return TensorParallelClip()


@dataclass(frozen=True)
class RankFiles:
    """Where a rank reports: `losses`, to which rank 0 appends each step's loss, each evaluation
    and each published checkpoint (launch_files.EVENT_*); `stats`, what this process held at the
    end (JSON, data_parallel.rank_stats); `started`, a file rank 0 makes as its first step begins."""

    losses: Path | None = None
    stats: Path | None = None
    started: Path | None = None


@dataclass(frozen=True)
class _RankRun:
    """One rank's run, read and checked before its process group starts (`_plan_rank`)."""

    root: Path
    steps: int
    manifest: Manifest
    recipe: dict[str, Any]
    options: TrainOptions
    mapping: Mapping
    """The artifact's layout: `world_size` model-parallel ranks, `pp` stages."""
    graph: Graph
    place: RankPlace
    """Rank graph `place.rank` of the pp x world_size of a replica; process of dp x that."""
    batches: Batches
    eval_batches: Batches | None
    fingerprint: str
    point: ResumePoint | None
    """The checkpoint the run continues (None: a fresh run)."""
    synthetic: bool = False
    """No data: the run trains on the recipe's synthetic batch (trainer_state.json says so)."""

    @property
    def mp_rank(self) -> int:
        return self.place.rank % self.mapping.world_size

    @property
    def names(self) -> list[str]:
        return list(self.recipe.get("trainable", [])) + list(self.recipe.get("qat_state", []))

    @property
    def start(self) -> int:
        return 0 if self.point is None else self.point.step


def train_rank(root: Path, steps: int, data: RankData | None = None, *, options: dict[str, Any] | None = None,
               save: bool = False, resume: str | Path | bool | None = None, device: str = "cpu",
               on_step: Callable[[int, float], Any] | None = None, files: RankFiles | None = None) -> Any:
    """This rank's part of training: the same session as the one-rank `train_artifact`
    (`training.train_session`: evaluation every eval_steps, checkpoints every save_steps and at
    the end), with exact tensor-parallel gradients; returns the TrainResult (the losses are
    replicated: every rank's are rank 0's). Settings: the recipe's, replaced by `options`
    (TrainOptions names or aliases, ERNIEKit's `resume_from_checkpoint` too).
    `resume`: a checkpoint folder, its name, or True / "latest"; every rank restores its own
    params, optimizer and RNG state from it. Rank 0 appends each step's loss, each evaluation
    and each published checkpoint to `files.losses` (launch_files.EVENT_*); with
    save_total_limit it removes older checkpoints itself (the launcher passes none and removes
    them after its on_checkpoint).

    Data parallel (options dp > 1; ernie_ir.training.data_parallel): this process is replica
    `rank // world` running rank graph `rank % world`; the graph's collectives span its
    replica's model-parallel group, the gradients are summed over its dp group and, with
    sharding, its AdamW holds its share of the params. `files.stats`: what it held at the end
    (JSON, data_parallel.rank_stats)."""
    from ernie_ir.backends.paddle.launch_files import EVENT_EVAL
    from ernie_ir.backends.paddle.layer import require_paddle
    from ernie_ir.training.checkpoints import restore_rank
    from ernie_ir.training.loop import train_session

    paddle = require_paddle()
    files = RankFiles() if files is None else files
    run = _plan_rank(Path(root), steps, RankData() if data is None else data, options or {}, resume)
    # Each replica draws its own dropout; the ranks of one replica draw alike (replica 0: the seed).
    paddle.seed(run.options.seed + run.place.replica * 2**32)
    layer = _rank_layer(paddle, run, device)
    init_process_group(run.place.process, run.place.processes)
    model, grad_clip = _rank_trainee(paddle, layer, run)

    def event(record: dict[str, Any]) -> None:
        if run.place.process == 0 and files.losses is not None:
            with open(files.losses, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def report(step: int, loss: float) -> None:
        event({"step": step, "loss": loss, "grad_norm": getattr(grad_clip, "last_norm", None)})
        if on_step is not None:
            on_step(step, loss)

    checkpoint = _rank_checkpoints(run, model, event) if save else None
    if run.point is not None:
        restore_rank(paddle, layer, model.optimizer, run.point, run.names, run.place)
    if run.place.process == 0 and files.started is not None:
        files.started.touch()  # the launcher's clock for tokens/s starts here, not at the launch
    result = train_session(model, run.batches, steps, options=run.options, start=run.start, report=report,
                           eval_batches=run.eval_batches, checkpoint=checkpoint,
                           on_eval=lambda step, loss: event({"event": EVENT_EVAL, "step": step,
                                                             "loss": loss}))
    if files.stats is not None:
        _write_stats(files.stats, model, run)
    return result


def _plan_rank(root: Path, steps: int, data: RankData, options: dict[str, Any],
               resume: str | Path | bool | None) -> _RankRun:
    """This process's run: the recipe and its options, the layout checked, its rank graph, the
    batches, and the checkpoint it resumes (`options`' resume_from_checkpoint unless `resume`)."""
    from ernie_ir.artifacts import artifact_mapping, check_files, read_manifest
    from ernie_ir.training.checkpoints import artifact_fingerprint, resume_point
    from ernie_ir.training.data_parallel import refuse_qat_state
    from ernie_ir.training.loop import (
        RECIPE,
        check_layout,
        resolve_options,
        split_run_keys,
        training_batches,
        whole_graph,
    )

    rank, processes = world_from_env()
    manifest = read_manifest(root)
    if manifest.mode != "training" or not (root / RECIPE).is_file():
        raise WorkerError(f"{root} is not a training artifact: compile it with --mode training")
    check_files(root, manifest, [RECIPE.as_posix()])
    recipe = json.loads((root / RECIPE).read_text(encoding="utf-8"))
    values, config_resume = split_run_keys(options)
    opts = resolve_options(recipe, values)  # an absent flag keeps the file's value
    mapping = artifact_mapping(manifest)
    graphs = mapping.rank_graphs  # pp x world: the rank graphs a replica runs
    check_layout(opts, graphs, mapping.pp, mapping.micro_batches)
    refuse_qat_state(recipe, opts.dp)
    place = RankPlace(rank=rank % graphs, world=graphs, process=rank, processes=processes)
    manifest, graph = load_rank_graph(root, rank, processes, dp=opts.dp)
    resume = config_resume if resume is None else resume
    whole = graph if mapping.pp == 1 else whole_graph(root)  # what the batches are checked against
    batches = data.batches
    if batches is None:
        batches = training_batches(recipe, whole, data.data, options=opts)
    eval_batches = data.eval_batches
    if eval_batches is None and data.eval_data is not None:
        eval_batches = training_batches(recipe, whole, data.eval_data, options=opts, what="eval_data")
    if opts.eval_steps is not None and eval_batches is None:
        raise WorkerError("--eval-steps needs evaluation data (--eval-data)")
    fingerprint = artifact_fingerprint(manifest, graphs)
    point = resume_point(root, resume, world=graphs, fingerprint=fingerprint, steps=steps,
                         options=opts.model_dump(), batches=batches)
    synthetic = data.synthetic or (data.batches is None and data.data is None)
    return _RankRun(root, steps, manifest, recipe, opts, mapping, graph, place, batches, eval_batches,
                    fingerprint, point, synthetic)


def _rank_layer(paddle: Any, run: _RankRun, device: str) -> Any:
    """The rank graph's Paddle Layer in training mode (QAT state tracked), the loss on its
    vocabulary shard of the logits unless the options gather them; WorkerError for a graph with
    nothing to train."""
    from ernie_ir.backends.paddle.layer import build_layer
    from ernie_ir.training.vocab_parallel import keep_vocab_shards

    # The loss on each rank's vocabulary shard: the graph's final all_gather of the logits goes
    # (the batches read the whole vocabulary size from the graph as loaded).
    shard = keep_vocab_shards(run.graph) if run.options.vocab_parallel_loss else None
    layer = build_layer(run.graph, device=device_for(device), grad_sync=True)
    layer.vocab_shard = shard
    layer.train()
    layer.track_state = True
    if not layer.trainable_parameters():
        world = run.mapping.world_size
        stage = "" if run.mapping.pp == 1 else f"stage {run.place.rank // world} "
        where = f"{stage}rank {run.mp_rank}"
        raise WorkerError(f"{run.root}: {where}'s graph has no trainable params")
    return layer


def _rank_trainee(paddle: Any, layer: Any, run: _RankRun) -> tuple[Trainee, Any]:
    """(the Trainee, its gradient clip: what reports the step's global norm) of this process: a
    pipeline stage (its groups, the tensor-parallel clip over its stages), a data-parallel
    replica (its groups, the DataParallelOptimizer, sharded or not) or a model-parallel rank
    (the tensor-parallel clip; one rank: Paddle's global-norm clip)."""
    from functools import partial

    from ernie_ir.backends.paddle.layer import set_model_parallel_group
    from ernie_ir.training.data_parallel import (
        DataParallelOptimizer,
        GradientNorm,
        Replica,
        new_groups,
        partition,
    )
    from ernie_ir.training.loop import Trainee, logits_loss_sum
    from ernie_ir.training.loop import make_optimizer as adamw
    from ernie_ir.training.precision import Precision

    opts, graph, world, process = run.options, run.graph, run.mapping.world_size, run.place.process
    # on a device: AdamW(multi_precision=True) and the recorded moment dtype; on a CPU: f32 AdamW
    make_optimizer = partial(adamw, precision=Precision.from_recipe(run.recipe))
    params = layer.trainable_parameters()
    clip = opts.clip()
    if run.mapping.pp > 1:
        from ernie_ir.backends.paddle.pipeline import PipelineStage, pipeline_groups, tied_weights

        groups = pipeline_groups(process, run.mapping.pp, world)
        if world > 1:
            set_model_parallel_group(groups.mp)
        grad_clip = tensor_parallel_clip(paddle, layer, graph, clip, group=groups.mp, stages=groups.ring,
                                         tied=tied_weights(graph, groups))
        optimizer = make_optimizer(paddle, params, opts, grad_clip, names=layer.trainable_names)
        pipeline = PipelineStage(paddle, layer, graph, groups,
                                 micro_batches=opts.micro_batches or run.mapping.micro_batches,
                                 kind=opts.pipeline_schedule, ignore_index=opts.ignore_index,
                                 loss_sum=logits_loss_sum)
        return Trainee(paddle, layer, optimizer, pipeline=pipeline), grad_clip
    if opts.dp > 1:
        mp_group, dp_group = new_groups(process, opts.dp, world)
        set_model_parallel_group(mp_group)
        replica = Replica(opts.dp, run.place.replica, dp_group)
        owners = None
        if opts.sharding is not None:
            owners = partition({n: int(layer.tensor(n).size) for n in layer.trainable_names}, opts.dp)
        mine_names = [n for n in layer.trainable_names if owners is None or owners[n] == replica.index]
        mine = [layer.tensor(n) for n in mine_names]
        inner = (make_optimizer(paddle, mine, opts, None, names=mine_names)
                 if mine else None)  # more replicas than params
        optimizer = DataParallelOptimizer(paddle, layer, inner, GradientNorm(paddle, layer, graph, mp_group),
                                          clip_norm=clip, replica=replica, world_rank=process, world=world,
                                          sharding=opts.sharding, owners=owners)
        return Trainee(paddle, layer, optimizer, replica=replica), optimizer
    if world > 1:
        grad_clip = tensor_parallel_clip(paddle, layer, graph, clip)
    else:
        grad_clip = paddle.nn.ClipGradByGlobalNorm(clip) if clip else None
    return Trainee(paddle, layer, make_optimizer(paddle, params, opts, grad_clip,
                                                 names=layer.trainable_names)), grad_clip


def _rank_checkpoints(run: _RankRun, model: Trainee, event: Callable[[dict[str, Any]], None]
                      ) -> Callable[[int, float, float | None], Path | None]:
    """The `checkpoint` of this rank's train_session: every rank stages its part, rank 0
    publishes the folder, reports it as an event and keeps the newest save_total_limit."""
    from ernie_ir.backends.paddle.launch_files import EVENT_CHECKPOINT
    from ernie_ir.training.checkpoints import (
        CheckpointContext,
        checkpoint_expected,
        prune_checkpoints,
        trainer_state_base,
    )

    opts = run.options
    base = trainer_state_base(steps=run.steps, world=run.place.world, fingerprint=run.fingerprint,
                              options=opts.model_dump(), batches=run.batches,
                              resumed_from=None if run.point is None else run.point.name,
                              synthetic=run.synthetic)
    ctx = CheckpointContext(run.root, run.names, base, expected=checkpoint_expected(run.manifest))

    def checkpoint(step: int, loss: float, eval_loss: float | None) -> Path | None:
        out = save_rank_checkpoint(ctx, model, run.place, step, loss, eval_loss,
                                   sharded=opts.sharding is not None)
        if out is not None:
            event({"event": EVENT_CHECKPOINT, "step": step, "path": str(out)})
            if opts.save_total_limit is not None:
                prune_checkpoints(run.root, opts.save_total_limit)
        return out

    return checkpoint


def _write_stats(path: Path, model: Trainee, run: _RankRun) -> None:
    """What this process held at the end (data_parallel.rank_stats; a pipeline stage's timing
    too), JSON written atomically to `path`."""
    from ernie_ir.training.data_parallel import rank_stats

    tmp = path.with_name(f".{path.name}.tmp")
    stats = rank_stats(model.layer, model.optimizer, run.place.replica, run.mp_rank)
    if model.pipeline is not None:
        stats["pipeline"] = model.pipeline.summary()
    tmp.write_text(json.dumps(stats), encoding="utf-8")
    os.replace(tmp, path)


def save_rank_checkpoint(ctx: CheckpointContext, model: Trainee, place: RankPlace, step: int, loss: float,
                         eval_loss: float | None, *, sharded: bool = False) -> Path | None:
    """Every rank stages its params, optimizer state and RNG state; rank 0 then merges the
    params (global names and shapes), writes trainer_state.json, names the folder
    `run-K-step-N` (`ctx.run`, K chosen by the run's first checkpoint) and lists its files in the
    manifest; every rank waits for that. `model`: the loop's Trainee (paddle, layer, optimizer).
    Returns the folder on process 0 (None elsewhere). Data parallel (`place`: rank graph
    `place.rank` of `place.world`, process `place.process` of `place.processes`): one
    checkpoint: the params from replica 0 (the replicas hold the same), the optimizer state of
    replica 0's ranks, or of every process when `sharded`."""
    from ernie_ir.training.checkpoints import publish_checkpoint, stage_rank_state, write_trainer_state

    root, world = ctx.root, place.world
    first = place.first_replica
    stage = staging_dir(root, os.environ.get("PADDLE_MASTER", "local"))
    stage.mkdir(parents=True, exist_ok=True)
    stage_rank_state(stage, model.paddle, model.layer, model.optimizer, ctx.names, place, step,
                     params=first, optimizer_state=first or sharded)
    if place.processes > 1:
        import paddle.distributed as dist

        dist.barrier()  # every rank's files are complete before rank 0 reads them
    out = None
    if place.process == 0:
        try:
            if world > 1:
                _merge_ranks(root, stage, ctx.names, step, world)
            write_trainer_state(stage, ctx.base, step, loss, eval_loss)
            out = publish_checkpoint(root, stage, step, ctx.run, ctx.expected)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    if place.processes > 1:
        import paddle.distributed as dist

        dist.barrier()  # the staging folder is free again before any rank stages the next checkpoint
    return out


def merge_shards(name: str, pieces: list[tuple[np.ndarray, dict[str, Any] | None]]) -> np.ndarray:
    """The global tensor of param `name` from every rank's (slice, `shard` annotation), rank
    order. Uncut params are rank 0's; slices held by several ranks take rank 0's copy."""
    shards = [s for _, s in pieces if s is not None]
    if not shards:
        return pieces[0][0]
    shape = [int(d) for d in shards[0]["global_shape"]]
    out = np.zeros(shape, pieces[0][0].dtype)
    filled = np.zeros(shape, bool)
    for arr, shard in reversed(pieces):  # rank 0 written last: its copy wins where slices overlap
        if shard is None:
            out[...] = arr
            filled[...] = True
            continue
        _, index = _cut_index(shard)
        out[index] = arr
        filled[index] = True
    if not filled.all():
        raise WorkerError(f"checkpoint: the rank slices of {name} do not cover its global shape {shape}")
    return out


def _merge_ranks(root: Path, stage: Path, names: list[str], step: int, world: int) -> None:
    """params.safetensors in `stage`: every rank's staged params merged to global names and
    shapes by the `shard` annotations of the rank graphs (`world`: all of them, every pipeline
    stage's; a param is merged from the rank graphs that hold it)."""
    from safetensors.numpy import load_file, save_file

    from ernie_ir.ir.parser import parse_graph
    from ernie_ir.training.checkpoints import FILE_FORMAT, PARAMS, RANK_PARAMS

    annotations: list[dict[str, Any]] = []
    for r in range(world):
        text = (root / f"rank{r}" / "graph.ir").read_text(encoding="utf-8")
        g = parse_graph(text, source=f"rank{r}/graph.ir")
        annotations.append({n: p.annotations.get(SHARD) for n, p in g.params.items()})
    ranks = [load_file(str(stage / RANK_PARAMS.format(rank=r))) for r in range(world)]
    merged = {}
    for n in names:
        holders = [(t, a) for t, a in zip(ranks, annotations, strict=True) if n in a]  # pipeline: its stage
        if not holders or any(n not in t for t, _ in holders):
            raise WorkerError(f"checkpoint: param {n} is missing from a rank's checkpoint")
        merged[n] = np.ascontiguousarray(merge_shards(n, [(t[n], a.get(n)) for t, a in holders]))
    save_file(merged, str(stage / PARAMS), metadata={"format": FILE_FORMAT, "step": str(step),
                                                      "world_size": str(world), "layout": "global"})


def _load_batches(path: Path | None) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The batches of an .npz the launcher wrote (ids{i}, labels{i}); None for no file."""
    if path is None:
        return None
    with np.load(path) as z:
        return [(z[f"ids{i}"], z[f"labels{i}"]) for i in range(len(z.files) // 2)]


_OPTION_FLAGS = ("lr", "seed", "save_steps", "save_total_limit", "eval_steps", "dp", "sharding")
"""The worker's flags that set a TrainOptions field of the same name (over --options)."""


def main(argv: list[str] | None = None) -> int:
    """Script entry (`python -m ernie_ir.training.rank_worker ARTIFACT --steps N ...`)."""
    parser = argparse.ArgumentParser(prog="python -m ernie_ir.training.rank_worker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--batches", type=Path, default=None,
                         help=".npz of ids{i}/labels{i} (the launcher's)")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--options", "--config", dest="options", type=Path, default=None,
                        help="YAML or JSON of training options (ernie-ir train's names or ERNIEKit's), "
                             "as `ernie-ir train --config`")
    parser.add_argument("--losses", type=Path, default=None,
                        help="rank 0 appends one JSON line per step (and per evaluation and checkpoint)")
    parser.add_argument("--save", action="store_true",
                        help="write checkpoints (training/checkpoints/run-K-step-N/) at the end and every "
                             "--save-steps")
    parser.add_argument("--save-steps", type=int, default=None, help="a checkpoint every N steps too")
    parser.add_argument("--save-total-limit", type=int, default=None,
                        help="keep the artifact's newest N checkpoints (rank 0 removes older ones)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        help="continue from a checkpoint folder or its name (no value: the newest)")
    parser.add_argument("--eval-data", type=Path, default=None, help="JSON lines to evaluate the loss on")
    parser.add_argument("--eval-batches", type=Path, default=None,
                        help=".npz of ids{i}/labels{i} to evaluate on (the launcher's)")
    parser.add_argument("--eval-steps", type=int, default=None, help="evaluate every N steps too")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel replicas (default: the artifact's); dp x ranks processes")
    parser.add_argument("--sharding", default=None, help="stage1, stage2 or none (default: the artifact's)")
    parser.add_argument("--started", type=Path, default=None,
                        help="rank 0 makes this file as its first step begins")
    parser.add_argument("--synthetic", action="store_true",
                        help="the --batches are the recipe's synthetic batch (recorded in the checkpoints)")
    parser.add_argument("--stats", default=None,
                        help="each rank writes what it held at the end (JSON) here; {rank} is its rank")
    add_device_flag(parser)
    args = parser.parse_args(argv)

    def body(rank: int) -> None:
        batches = _load_batches(args.batches)
        eval_batches = _load_batches(args.eval_batches)

        def report(step: int, loss: float) -> None:
            if rank == 0:
                print(f"step {step:4d}  loss {loss:.6f}", flush=True)

        options: dict[str, Any] = {}
        if args.options is not None:
            from ernie_ir.training.erniekit_config import training_values
            from ernie_ir.training.loop import read_config

            options = training_values(read_config(args.options))  # `train --config`'s keys, the run's alone
        flags = {k: getattr(args, k) for k in _OPTION_FLAGS}
        options = {**options, **{k: v for k, v in flags.items() if v is not None}}  # a flag over the file
        data = RankData(batches, args.data, eval_batches, args.eval_data, args.synthetic)
        stats = None if args.stats is None else Path(str(args.stats).format(rank=rank))
        train_rank(args.artifact, args.steps, data, options=options, save=args.save, resume=args.resume,
                   device=args.device, on_step=report, files=RankFiles(args.losses, stats, args.started))

    return rank_main(body)


if __name__ == "__main__":
    sys.exit(main())
