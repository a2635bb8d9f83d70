"""The rank worker: one paddle.distributed process of a multi-rank artifact.

Started once per rank by `paddle.distributed.launch` (gloo on CPU; nccl, xccl or bkcl on devices):

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir LOGS \\
        .../ernie_ir/runtime/paddle_dist.py run ARTIFACT --tokens 1,2,3 [--save-logits F.npy]
    python -m paddle.distributed.launch --gpus 0,1 \\
        .../ernie_ir/runtime/paddle_dist.py train ARTIFACT --steps N [--data F.jsonl] --device gpu

Each rank checks the sha256 of its own `rank{r}/` files against the manifest, builds its Paddle
Layer from its graph (ernie_ir.runtime.paddle_layer: collectives become paddle.distributed
calls), joins the process group and runs. `run`: rank 0 writes the logits. `generate` (from
`ernie-ir generate --backend paddle`): each rank builds its Layer from its decoder graph (the
text the launcher wrote to --workdir, the params the rank's weights) and runs the whole
generation loop; the logits every rank chooses from are rank 0's (broadcast), so all ranks pick
the same tokens; rank 0 streams each step's tokens and writes the result. `train`: every rank
takes the same batches and computes the same replicated loss; the Layer's "f" functions, the
sum of gradient slices that several ranks hold and the global-norm clip over the whole model
(`TensorParallelClip`) make every update the one-rank update; rank 0 appends each step's loss
to `--losses`. With `--save` (at the end, and every `--save-steps`) every rank writes its
trainable params, optimizer and RNG state and rank 0 merges the params back to global names and
shapes: `training/checkpoints/run-K-step-N/` holding `params.safetensors`, `rank{r}.safetensors`,
`optimizer.rank{r}.safetensors` and `trainer_state.json` (ernie_ir.runtime.train_state), listed
in the manifest; `--resume [CHECKPOINT]` continues such a run, `--eval-data` / `--eval-steps`
evaluate the loss. Data parallel (`--dp N`, `--sharding`; default: the artifact's), dp x ranks
processes: process g is replica g // ranks of rank graph g % ranks, takes its replica's rows of
each batch and sums gradients over its dp group (ernie_ir.runtime.data_parallel); one
checkpoint (replica 0's params; the optimizer shards of every process when sharded).

`ernie-ir run/train ARTIFACT` start this file through `ernie_ir.runtime.launcher`; the
artifact's launch recipe (`launch.sh`) starts it on devices. `main` is the script entry (it
prints and exits); the functions above it are the library.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a file: its folder (runtime/) must not shadow top-level modules
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse
import json
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import SHARD, stage_info
from ernie_ir.runtime.launch_files import ERROR_FILE, staging_dir


class WorkerError(ErnieIRError):
    """A rank cannot run: a wrong process count, a modified rank file, a missing peer."""


# -- the process group ---------------------------------------------------------------------------


def world_from_env() -> tuple[int, int]:
    """(rank, world size) of this process as paddle.distributed.launch set them (0, 1 without it)."""
    return int(os.environ.get("PADDLE_TRAINER_ID", "0")), int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))


def _wait_for_master(timeout_s: float) -> None:
    """Block until rank 0 listens at PADDLE_MASTER. Connecting before it does costs Paddle's
    TCP store a fixed 3 s retry; probing first keeps the start short."""
    master = os.environ.get("PADDLE_MASTER", "")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise WorkerError(f"rank 0 did not open the rendezvous at {master} within "
                                  f"{timeout_s:g} s: check that rank 0 started (its log)") from None
            time.sleep(0.05)


def init_process_group(rank: int, world: int, *, timeout_s: float = 600.0) -> None:
    """Join the default paddle.distributed group (nothing to do for one rank)."""
    if world == 1:
        return
    from ernie_ir.runtime.paddle_layer import require_paddle

    require_paddle()
    import paddle.distributed as dist

    if rank > 0:
        _wait_for_master(timeout_s)
    dist.init_parallel_env()
    if dist.get_rank() != rank or dist.get_world_size() != world:
        raise WorkerError(f"paddle.distributed reports rank {dist.get_rank()} of {dist.get_world_size()}, "
                          f"the launch environment rank {rank} of {world}")


def _watch_parent() -> None:
    """Exit when the process that started the launch is gone, so a killed `ernie-ir` leaves
    no rank running (the launcher and each rank live in their own sessions)."""
    pid = int(os.environ.get("ERNIE_IR_PARENT_PID", "0") or 0)
    if pid <= 0:
        return

    def watch() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(3)
            except PermissionError:
                pass
            time.sleep(0.5)

    threading.Thread(target=watch, name="ernie-ir-parent-watch", daemon=True).start()


def device_for(kind: str) -> str:
    """The Paddle device of this rank: "cpu", or `kind`:N with N what the launcher selected."""
    from ernie_ir.runtime.devices import set_device_string

    return set_device_string(kind)


# -- loading -----------------------------------------------------------------------------------


def load_rank_graph(root: Path, rank: int, world: int, dp: int = 1) -> tuple[dict[str, Any], Graph]:
    """(manifest, rank graph) with this rank's files checked against the manifest's sha256.
    `world`: the processes started; `dp`: data-parallel replicas (process `rank` runs rank graph
    `rank % ranks`, dp x ranks processes)."""
    from ernie_ir.artifacts import artifact_mapping, check_files, read_manifest
    from ernie_ir.ir.storage import load_graph

    manifest = read_manifest(root)
    mapping = artifact_mapping(manifest)
    want = mapping.rank_graphs * dp
    if want != world:
        layout = f" x dp {dp}" if dp > 1 else ""
        held = f"{mapping.rank_graphs} rank graph(s) ({mapping.pp} stages)" if mapping.pp > 1 else \
            f"{mapping.world_size} rank(s)"
        raise WorkerError(f"{root} has {held}{layout} but {world} process(es) were "
                          f"started: launch {want} (--nproc_per_node {want} or as many devices)")
    rank = rank % mapping.rank_graphs
    check_files(root, manifest, [f"rank{rank}/graph.ir", f"rank{rank}/weights.safetensors"])
    graph = load_graph(root / f"rank{rank}")
    meta = graph.metadata.get("parallel") or {}
    stage, mp_rank = mapping.stage_of(rank)
    if mapping.world_size > 1 and (not isinstance(meta, dict) or meta.get("rank") != mp_rank):
        raise WorkerError(f"artifact {root}: rank{rank}/graph.ir is not rank {mp_rank}'s graph")
    info = stage_info(graph.metadata)
    if mapping.pp > 1 and (info is None or info.get("stage") != stage):
        raise WorkerError(f"artifact {root}: rank{rank}/graph.ir is not stage {stage}'s graph")
    return manifest, graph


def parse_tokens(tokens: str) -> np.ndarray:
    """`1,2,3` or a .npy file of int ids [batch, seq]."""
    if tokens.endswith(".npy"):
        ids = np.load(tokens, allow_pickle=False)
    else:
        try:
            ids = np.asarray([[int(t) for t in tokens.split(",") if t.strip()]], dtype=np.int64)
        except ValueError:
            raise WorkerError(f"--tokens {tokens!r}: expected comma-separated integers or a .npy "
                              "file") from None
    ids = ids[None, :] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise WorkerError(f"--tokens: expected integer ids [batch, seq], got {ids.dtype}{list(ids.shape)}")
    return np.ascontiguousarray(ids, dtype=np.int64)


def check_token_ids(graph: Graph, ids: np.ndarray) -> None:
    """Ids the graph's (vocabulary-parallel) embedding accepts: a Paddle lookup would wrap or
    crash where the interpreter raises."""
    if not graph.inputs or ids.size == 0:
        return
    for node in graph.nodes:
        if node.inputs and node.inputs[0] is graph.inputs[0]:
            rows = None
            if node.op == "embedding":
                rows = node.inputs[1].type.shape[0]
            elif node.op == "vocab_parallel_embedding":
                rows = node.attrs.vocab_size
            if isinstance(rows, int) and (ids.min() < 0 or ids.max() >= rows):
                bad = int(ids.max()) if ids.max() >= rows else int(ids.min())
                raise ErnieIRError(f"embedding: token id {bad} is outside the vocabulary [0, {rows})")


# -- inference ---------------------------------------------------------------------------------


def run_rank(root: Path, ids: np.ndarray, *, device: str = "cpu") -> np.ndarray | None:
    """This rank's logits [B, S, V] (every rank holds the same, all-gathered). Pipelined: the
    batch's micro-batches (the artifact's count) through the stages, the logits of the last
    stage returned on the first (None on the stages between)."""
    from ernie_ir.artifacts import artifact_mapping
    from ernie_ir.runtime.paddle_layer import build_layer, require_paddle, set_model_parallel_group

    paddle = require_paddle()
    rank, world = world_from_env()
    manifest, graph = load_rank_graph(root, rank, world)
    mapping = artifact_mapping(manifest)
    if mapping.pp == 1:
        check_token_ids(graph, ids)
    layer = build_layer(graph, device=device_for(device))
    layer.eval()
    init_process_group(rank, world)
    if mapping.pp > 1:
        from ernie_ir.runtime.pipeline_parallel import PipelineStage, pipeline_groups

        groups = pipeline_groups(rank, mapping.pp, mapping.world_size)
        if mapping.world_size > 1:
            set_model_parallel_group(groups.mp)
        stage = PipelineStage(paddle, layer, graph, groups, micro_batches=mapping.micro_batches)
        with paddle.no_grad():
            _, logits = stage.run(ids, logits=True)
        return stage.logits_to_first(logits)
    with paddle.no_grad():
        out = layer(paddle.to_tensor(ids))
    return np.asarray(out.numpy())


# -- generation --------------------------------------------------------------------------------


def load_decoder_graph(root: Path, rank: int, world: int, path: Path) -> Graph:
    """Rank `rank`'s decoder graph: the text at `path` (the kv-cache pass applied by the caller),
    its params read from the artifact's rank{r}/weights.safetensors (checked against the
    manifest's sha256 first), as the rank graph's own params are."""
    from ernie_ir.ir.parser import parse_graph

    _, base = load_rank_graph(root, rank, world)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise WorkerError(f"cannot read the decoder graph {path}: {e}") from None
    graph = parse_graph(text, source=str(path))
    if not isinstance(graph.metadata.get("kv_cache"), dict):
        raise WorkerError(f"{path} is not a decoder graph (no kv_cache metadata)")
    if graph.metadata.get("parallel") != base.metadata.get("parallel"):
        raise WorkerError(f"{path} is not rank {rank}'s decoder graph of {root}")
    if set(graph.params) != set(base.params):
        odd = sorted(set(graph.params) ^ set(base.params))
        raise WorkerError(f"{path}: its params differ from rank {rank}'s graph of {root} ({odd[0]}, ...)")
    for name, p in graph.params.items():
        held = base.params[name]
        if p.type != held.type:
            raise WorkerError(f"{path}: param @{name} is {p.type}, rank {rank}'s graph holds {held.type}")
        p.source, p.digest = held.source, held.digest
    return graph


def decoder_step(paddle: Any, layer: Any, graph: Graph, world: int) -> Callable[[Any], dict[str, np.ndarray]]:
    """One call of a rank's decoder Layer for the generation loop: the graph's outputs as numpy,
    the logits of the last position only, rank 0's on every rank (broadcast), so that every rank
    chooses the same tokens from the same bits and the ranks stay in lockstep."""
    names = [v.name for v in graph.inputs]
    outs = list(graph.output_names)

    def step(feeds: Any) -> dict[str, np.ndarray]:
        with paddle.no_grad():
            res = layer(*[paddle.to_tensor(np.ascontiguousarray(feeds[n])) for n in names])
            res = res if isinstance(res, tuple) else (res,)
            out = dict(zip(outs, res, strict=True))
            last = out["logits"][:, -1:, :].clone()
            if world > 1:
                import paddle.distributed as dist

                dist.broadcast(last, src=0)
        result = {n: np.asarray(r.numpy()) for n, r in out.items() if n != "logits"}
        result["logits"] = np.asarray(last.numpy())
        return result

    return step


def generate_rank(root: Path, decoder: Path, prompts: list[list[int]], options: Any, *,
                  device: str = "cpu", on_tokens: Callable[[int, np.ndarray, list[bool]], Any] | None = None
                  ) -> Any:
    """This rank's part of generation: the whole loop (ernie_ir.runtime.decoding.decode) over its
    decoder Layer; every rank runs it in lockstep and returns the same DecodeResult."""
    from ernie_ir.runtime.decoding import cache_dtype_of, decode
    from ernie_ir.runtime.paddle_layer import build_layer, require_paddle

    paddle = require_paddle()
    rank, world = world_from_env()
    if not options.sampling.greedy and options.sampling.seed is None:
        raise WorkerError("sampling on several ranks needs a seed (every rank draws the same tokens)")
    graph = load_decoder_graph(root, rank, world, decoder)
    check_token_ids(graph, np.asarray([t for p in prompts for t in p], np.int64).reshape(1, -1))
    layers = tuple((int(kv), int(d)) for kv, d in graph.metadata["kv_cache"]["layers"])
    layer = build_layer(graph, device=device_for(device))
    layer.eval()
    init_process_group(rank, world)
    return decode(decoder_step(paddle, layer, graph, world), layers, prompts, options,
                  cache_dtype=cache_dtype_of(graph), on_tokens=on_tokens)


def _generate_main(args: argparse.Namespace, rank: int) -> None:
    """`generate`: every rank decodes; rank 0 streams each step's tokens and writes the result."""
    from ernie_ir.runtime.launch_files import (
        DECODE_LOGITS,
        DECODE_RESULT,
        DECODE_TOKENS,
        DECODER_GRAPH,
        read_decode_request,
    )

    work = args.workdir
    prompts, options = read_decode_request(work / args.request)

    def on_tokens(step: int, tokens: np.ndarray, live: list[bool]) -> None:
        if rank == 0:
            with open(work / DECODE_TOKENS, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "tokens": [int(t) for t in tokens], "live": live}) + "\n")

    result = generate_rank(args.artifact, work / DECODER_GRAPH.format(rank=rank), prompts, options,
                           device=args.device, on_tokens=on_tokens)
    if rank != 0:
        return
    if options.keep_logits:
        _save_npy(work / DECODE_LOGITS, np.stack(result.step_logits).astype(np.float32))
    tmp = work / f".{DECODE_RESULT}.tmp"
    tmp.write_text(json.dumps({"new_tokens": result.new_tokens, "finish_reasons": result.finish_reasons,
                               "prefill_ms": result.prefill_ms, "decode_ms": result.decode_ms}),
                   encoding="utf-8")
    os.replace(tmp, work / DECODE_RESULT)
    print(f"generated {sum(len(n) for n in result.new_tokens)} tokens in {len(prompts)} row(s)", flush=True)


# -- training ----------------------------------------------------------------------------------


def _cut_index(shard: dict[str, Any]) -> tuple[list[int], tuple[np.ndarray, ...]]:
    """(global shape, np.ix_ index of a rank's slice) from a `shard` annotation."""
    from ernie_ir.runtime.data_parallel import cut_index

    return cut_index(shard)


def tensor_parallel_clip(paddle: Any, layer: Any, graph: Graph, clip_norm: float | None,
                         group: Any = None, stages: Any = None) -> Any:
    """A Paddle gradient clip (AdamW's `grad_clip`) that makes the rank's gradients the whole
    model's and clips them by the global norm over the whole model.

    Params several ranks hold a slice of (KV heads replicated in groups) get the sum of those
    ranks' gradients (each reader contributes only its heads' part). The norm counts every
    element once: sharded slices summed over ranks, replicated params once, shared slices
    divided by how many ranks hold them (`data_parallel.GradientNorm`, over `group`: the
    model-parallel group, None for the default one; `stages`: the pipeline stages' group, whose
    squared norms add up). `clip_norm` None: no clipping, the sums only.
    """
    from paddle.nn.clip import ClipGradBase

    from ernie_ir.runtime.data_parallel import GradientNorm, clip_scale

    norm_of = GradientNorm(paddle, layer, graph, group, stages)

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


def train_rank(root: Path, steps: int, *, batches: list[tuple[np.ndarray, np.ndarray]] | None = None,
               data: Path | None = None, lr: float | None = None, seed: int | None = None,
               options: dict[str, Any] | None = None, save: bool = False,
               losses_file: Path | None = None, device: str = "cpu",
               on_step: Callable[[int, float], Any] | None = None,
               eval_batches: list[tuple[np.ndarray, np.ndarray]] | None = None, eval_data: Path | None = None,
               resume: str | Path | bool | None = None, stats_file: Path | None = None) -> Any:
    """This rank's part of training: the same session as the one-rank `train_artifact`
    (`training.train_session`: evaluation every eval_steps, checkpoints every save_steps and at
    the end), with exact tensor-parallel gradients; returns the TrainResult (the losses are
    replicated: every rank's are rank 0's). Settings: the recipe's, replaced by `options`
    (TrainOptions names or aliases, ERNIEKit's `resume_from_checkpoint` too), `lr` and `seed`.
    `resume`: a checkpoint folder, its name, or True / "latest"; every rank restores its own
    params, optimizer and RNG state from it. Rank 0 appends each step's loss, each evaluation
    and each published checkpoint to `losses_file` (launch_files.EVENT_*); with
    save_total_limit it removes older checkpoints itself (the launcher passes none and removes
    them after its on_checkpoint).

    Data parallel (options dp > 1; ernie_ir.runtime.data_parallel): this process is replica
    `rank // world` running rank graph `rank % world`; the graph's collectives span its
    replica's model-parallel group, the gradients are summed over its dp group and, with
    sharding, its AdamW holds its share of the params. `stats_file`: what it held at the end
    (JSON, data_parallel.rank_stats)."""
    from ernie_ir.artifacts import artifact_mapping, check_files, read_manifest
    from ernie_ir.runtime.data_parallel import (
        DataParallelOptimizer,
        GradientNorm,
        Replica,
        new_groups,
        partition,
        rank_stats,
        refuse_qat_state,
    )
    from ernie_ir.runtime.launch_files import EVENT_CHECKPOINT, EVENT_EVAL
    from ernie_ir.runtime.paddle_layer import build_layer, require_paddle, set_model_parallel_group
    from ernie_ir.runtime.train_state import (
        CheckpointRun,
        artifact_fingerprint,
        checkpoint_expected,
        prune_checkpoints,
        restore_rank,
        resume_point,
        trainer_state_base,
    )
    from ernie_ir.runtime.training import (
        RECIPE,
        check_layout,
        make_optimizer,
        resolve_options,
        split_run_keys,
        train_session,
        training_batches,
        whole_graph,
    )
    from ernie_ir.runtime.vocab_parallel import keep_vocab_shards

    paddle = require_paddle()
    rank, processes = world_from_env()
    manifest = read_manifest(root)
    if manifest.get("mode") != "training" or not (root / RECIPE).is_file():
        raise WorkerError(f"{root} is not a training artifact: compile it with --mode training --lora-rank R")
    check_files(root, manifest, [RECIPE.as_posix()])
    recipe = json.loads((root / RECIPE).read_text(encoding="utf-8"))
    given = {k: v for k, v in (("lr", lr), ("seed", seed)) if v is not None}
    values, config_resume = split_run_keys(options or {})
    opts = resolve_options(recipe, {**values, **given})  # an absent flag keeps the file's value
    mapping = artifact_mapping(manifest)
    world = mapping.world_size  # the model-parallel ranks
    graphs = mapping.rank_graphs  # pp x world: the rank graphs a replica runs
    check_layout(opts, graphs, mapping.pp, mapping.micro_batches)
    refuse_qat_state(recipe, opts.dp)
    dp_index, index = divmod(rank, graphs)
    mp_rank = index % world
    manifest, graph = load_rank_graph(root, rank, processes, dp=opts.dp)
    resume = config_resume if resume is None else resume
    whole = graph if mapping.pp == 1 else whole_graph(root)  # what the batches are checked against
    if batches is None:
        batches = training_batches(recipe, whole, data, options=opts)
    if eval_batches is None and eval_data is not None:
        eval_batches = training_batches(recipe, whole, eval_data, options=opts, what="eval_data")
    if opts.eval_steps is not None and eval_batches is None:
        raise WorkerError("--eval-steps needs evaluation data (--eval-data)")
    fingerprint = artifact_fingerprint(manifest, graphs)
    point = resume_point(root, resume, world=graphs, fingerprint=fingerprint, steps=steps,
                         options=opts.model_dump(), batches=batches)
    start = point.step if point is not None else 0
    # Each replica draws its own dropout; the ranks of one replica draw alike (replica 0: the seed).
    paddle.seed(opts.seed + dp_index * 2**32)
    # The loss on each rank's vocabulary shard: the graph's final all_gather of the logits goes
    # (the batches above read the whole vocabulary size from the graph as loaded).
    shard = keep_vocab_shards(graph) if opts.vocab_parallel_loss else None
    layer = build_layer(graph, device=device_for(device), grad_sync=True)
    layer.vocab_shard = shard
    layer.train()
    layer.track_state = True
    params = layer.trainable_parameters()
    if not params:
        where = f"rank {mp_rank}" if mapping.pp == 1 else f"stage {index // world} rank {mp_rank}"
        raise WorkerError(f"{root}: {where}'s graph has no trainable params")
    init_process_group(rank, processes)
    clip = opts.clip()
    replica = None
    pipeline = None
    if mapping.pp > 1:
        from ernie_ir.runtime.pipeline_parallel import PipelineStage, pipeline_groups

        groups = pipeline_groups(rank, mapping.pp, world)
        if world > 1:
            set_model_parallel_group(groups.mp)
        grad_clip = tensor_parallel_clip(paddle, layer, graph, clip, group=groups.mp, stages=groups.ring)
        optimizer = make_optimizer(paddle, params, opts, grad_clip)
        pipeline = PipelineStage(paddle, layer, graph, groups,
                                 micro_batches=opts.micro_batches or mapping.micro_batches,
                                 kind=opts.pipeline_schedule, ignore_index=opts.ignore_index)
    elif opts.dp > 1:
        mp_group, dp_group = new_groups(rank, opts.dp, world)
        set_model_parallel_group(mp_group)
        replica = Replica(opts.dp, dp_index, dp_group)
        owners = None
        if opts.sharding is not None:
            owners = partition({n: int(layer.tensor(n).size) for n in layer.trainable_names}, opts.dp)
        mine = [layer.tensor(n) for n in layer.trainable_names if owners is None or owners[n] == dp_index]
        inner = make_optimizer(paddle, mine, opts, None) if mine else None  # more replicas than params
        optimizer = DataParallelOptimizer(paddle, layer, inner, GradientNorm(paddle, layer, graph, mp_group),
                                          clip_norm=clip, replica=replica, world_rank=rank, world=world,
                                          sharding=opts.sharding, owners=owners)
        grad_clip: Any = optimizer
    else:
        if world > 1:
            grad_clip = tensor_parallel_clip(paddle, layer, graph, clip)
        else:
            grad_clip = paddle.nn.ClipGradByGlobalNorm(clip) if clip else None
        optimizer = make_optimizer(paddle, params, opts, grad_clip)

    def event(record: dict[str, Any]) -> None:
        if rank == 0 and losses_file is not None:
            with open(losses_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def report(step: int, loss: float) -> None:
        event({"step": step, "loss": loss, "grad_norm": getattr(grad_clip, "last_norm", None)})
        if on_step is not None:
            on_step(step, loss)

    names = list(recipe.get("trainable", [])) + list(recipe.get("qat_state", []))
    checkpoint = None
    if save:
        base = trainer_state_base(steps=steps, world=graphs, fingerprint=fingerprint,
                                  options=opts.model_dump(), batches=batches,
                                  resumed_from=None if point is None else point.name)
        run = CheckpointRun()
        expected = checkpoint_expected(manifest)

        def checkpoint(step: int, loss: float, eval_loss: float | None) -> Path | None:
            out = save_rank_checkpoint(root, paddle, layer, optimizer, names, step, index, graphs, base=base,
                                       loss=loss, eval_loss=eval_loss, run=run, expected=expected,
                                       process=rank, processes=processes, sharded=opts.sharding is not None)
            if out is not None:
                event({"event": EVENT_CHECKPOINT, "step": step, "path": str(out)})
                if opts.save_total_limit is not None:
                    prune_checkpoints(root, opts.save_total_limit)
            return out

    if point is not None:
        restore_rank(paddle, layer, optimizer, point, names, index, graphs, process=rank)
    result = train_session(paddle, layer, optimizer, batches, steps, options=opts, start=start, report=report,
                           eval_batches=eval_batches, checkpoint=checkpoint,
                           on_eval=lambda step, loss: event({"event": EVENT_EVAL, "step": step,
                                                             "loss": loss}),
                           replica=replica, pipeline=pipeline)
    if stats_file is not None:
        tmp = stats_file.with_name(f".{stats_file.name}.tmp")
        stats = rank_stats(layer, optimizer, dp_index, mp_rank)
        if pipeline is not None:
            stats["pipeline"] = pipeline.summary()
        tmp.write_text(json.dumps(stats), encoding="utf-8")
        os.replace(tmp, stats_file)
    return result


def save_rank_checkpoint(root: Path, paddle: Any, layer: Any, optimizer: Any, names: list[str], step: int,
                         rank: int, world: int, *, base: dict[str, Any], loss: float,
                         eval_loss: float | None, run: Any,
                         expected: dict[str, Any] | None = None, process: int | None = None,
                         processes: int | None = None, sharded: bool = False) -> Path | None:
    """Every rank stages its params, optimizer state and RNG state; rank 0 then merges the
    params (global names and shapes), writes trainer_state.json, names the folder
    `run-K-step-N` (`run`: a train_state.CheckpointRun, K chosen by the run's first checkpoint)
    and lists its files in the manifest; every rank waits for that. Returns the folder on rank
    0 (None elsewhere). Data parallel (`process` of `processes`; `rank` is the model-parallel
    rank of `world`): one checkpoint: the params from replica 0 (the replicas hold the same),
    the optimizer state of replica 0's ranks, or of every process when `sharded`."""
    from ernie_ir.runtime.train_state import publish_checkpoint, stage_rank_state, write_trainer_state

    g = rank if process is None else process
    total = world if processes is None else processes
    first = g < world  # replica 0
    stage = staging_dir(root, os.environ.get("PADDLE_MASTER", "local"))
    stage.mkdir(parents=True, exist_ok=True)
    stage_rank_state(stage, paddle, layer, optimizer, names, rank, world, step, process=g, params=first,
                     optimizer_state=first or sharded)
    if total > 1:
        import paddle.distributed as dist

        dist.barrier()  # every rank's files are complete before rank 0 reads them
    out = None
    if g == 0:
        try:
            if world > 1:
                _merge_ranks(root, stage, names, step, world)
            write_trainer_state(stage, base, step, loss, eval_loss)
            out = publish_checkpoint(root, stage, step, run, expected)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    if total > 1:
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
    from ernie_ir.runtime.train_state import FILE_FORMAT, PARAMS, RANK_PARAMS

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


# -- the script --------------------------------------------------------------------------------


def _write_error(rank: int, message: str) -> None:
    workdir = os.environ.get("ERNIE_IR_WORKDIR")
    if workdir:
        tmp = Path(workdir) / f".{ERROR_FILE.format(rank=rank)}.tmp"
        tmp.write_text(message.splitlines()[0] if message else "failed", encoding="utf-8")
        os.replace(tmp, Path(workdir) / ERROR_FILE.format(rank=rank))


def _load_batches(path: Path | None) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The batches of an .npz the launcher wrote (ids{i}, labels{i}); None for no file."""
    if path is None:
        return None
    with np.load(path) as z:
        return [(z[f"ids{i}"], z[f"labels{i}"]) for i in range(len(z.files) // 2)]


def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Script entry: parse, run this rank, report; exit status 0, 2 (user error) or 1."""
    parser = argparse.ArgumentParser(prog="paddle_dist.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="logits of --tokens (rank 0 reports)")
    run.add_argument("artifact", type=Path)
    run.add_argument("--tokens", required=True, help="1,2,3 or a .npy [batch, seq]")
    run.add_argument("--save-logits", type=Path, default=None, help="rank 0 writes float32 logits here")
    gen = sub.add_parser("generate", help="decode with a KV cache (rank 0 reports)")
    gen.add_argument("artifact", type=Path)
    gen.add_argument("--workdir", type=Path, required=True,
                     help="holds the request, each rank's decoder graph; rank 0 writes the result here")
    gen.add_argument("--request", default="request.json")
    train = sub.add_parser("train", help="train the trainable params")
    train.add_argument("artifact", type=Path)
    train.add_argument("--steps", type=int, required=True)
    train.add_argument("--data", type=Path, default=None)
    train.add_argument("--batches", type=Path, default=None, help=".npz of ids{i}/labels{i} (the launcher's)")
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--seed", type=int, default=None)
    train.add_argument("--options", "--config", dest="options", type=Path, default=None,
                       help="YAML or JSON of training options (ernie-ir train's names or ERNIEKit's), "
                            "as `ernie-ir train --config`")
    train.add_argument("--losses", type=Path, default=None,
                       help="rank 0 appends one JSON line per step (and per evaluation and checkpoint)")
    train.add_argument("--save", action="store_true",
                       help="write checkpoints (training/checkpoints/run-K-step-N/) at the end and every "
                            "--save-steps")
    train.add_argument("--save-steps", type=int, default=None, help="a checkpoint every N steps too")
    train.add_argument("--save-total-limit", type=int, default=None,
                       help="keep the artifact's newest N checkpoints (rank 0 removes older ones)")
    train.add_argument("--resume", nargs="?", const="latest", default=None,
                       help="continue from a checkpoint folder or its name (no value: the newest)")
    train.add_argument("--eval-data", type=Path, default=None, help="JSON lines to evaluate the loss on")
    train.add_argument("--eval-batches", type=Path, default=None,
                       help=".npz of ids{i}/labels{i} to evaluate on (the launcher's)")
    train.add_argument("--eval-steps", type=int, default=None, help="evaluate every N steps too")
    train.add_argument("--dp", type=int, default=None,
                       help="data-parallel replicas (default: the artifact's); dp x ranks processes")
    train.add_argument("--sharding", default=None, help="stage1, stage2 or none (default: the artifact's)")
    train.add_argument("--stats", default=None,
                       help="each rank writes what it held at the end (JSON) here; {rank} is its rank")
    for p in (run, gen, train):
        p.add_argument("--device", default="cpu", choices=["cpu", "gpu", "npu", "xpu"])
    args = parser.parse_args(argv)
    rank, _ = world_from_env()
    _watch_parent()
    try:
        if args.command == "run":
            logits = run_rank(args.artifact, parse_tokens(args.tokens), device=args.device)
            if rank == 0 and logits is not None:
                if args.save_logits is not None:
                    _save_npy(args.save_logits, logits.astype(np.float32))
                argmax = np.argmax(logits, axis=-1).tolist()
                print(f"logits {list(logits.shape)}  argmax {argmax}", flush=True)
        elif args.command == "generate":
            _generate_main(args, rank)
        else:
            batches = _load_batches(args.batches)
            eval_batches = _load_batches(args.eval_batches)

            def report(step: int, loss: float) -> None:
                if rank == 0:
                    print(f"step {step:4d}  loss {loss:.6f}", flush=True)

            options: dict[str, Any] = {}
            if args.options is not None:
                from ernie_ir.runtime.training import read_config

                options = read_config(args.options)
            flags = {"save_steps": args.save_steps, "save_total_limit": args.save_total_limit,
                     "eval_steps": args.eval_steps, "dp": args.dp, "sharding": args.sharding}
            options = {**options, **{k: v for k, v in flags.items() if v is not None}}
            train_rank(args.artifact, args.steps, batches=batches, data=args.data, lr=args.lr,
                       seed=args.seed, options=options, save=args.save, losses_file=args.losses,
                       device=args.device, on_step=report, eval_batches=eval_batches,
                       eval_data=args.eval_data, resume=args.resume,
                       stats_file=None if args.stats is None else Path(str(args.stats).format(rank=rank)))
    except ErnieIRError as e:
        _write_error(rank, str(e))
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException as e:
        _write_error(rank, f"{type(e).__name__}: {e}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
