"""The rank worker: one paddle.distributed process of a multi-rank artifact.

Started once per rank by `paddle.distributed.launch` (gloo on CPU; nccl, xccl or bkcl on devices):

    python -m paddle.distributed.launch --nproc_per_node 2 --log_dir LOGS \\
        .../ernie_ir/backends/paddle/rank_worker.py run ARTIFACT --tokens 1,2,3 [--save-logits F.npy]
    python -m paddle.distributed.launch --gpus 0,1 \\
        .../ernie_ir/backends/paddle/rank_worker.py train ARTIFACT --steps N [--data F.jsonl] --device gpu

Each rank checks the sha256 of its own `rank{r}/` files against the manifest, builds its Paddle
Layer from its graph (ernie_ir.backends.paddle.layer: collectives become paddle.distributed
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
`optimizer.rank{r}.safetensors` and `trainer_state.json` (ernie_ir.training.checkpoints), listed
in the manifest; `--resume [CHECKPOINT]` continues such a run, `--eval-data` / `--eval-steps`
evaluate the loss. Data parallel (`--dp N`, `--sharding`; default: the artifact's), dp x ranks
processes: process g is replica g // ranks of rank graph g % ranks, takes its replica's rows of
each batch and sums gradients over its dp group (ernie_ir.training.data_parallel); one
checkpoint (replica 0's params; the optimizer shards of every process when sharded).

`ernie-ir run/train ARTIFACT` start this file through `ernie_ir.backends.paddle.launch`; the
artifact's launch recipe (`launch.sh`) starts it on devices. `main` is the script entry (it
prints and exits); the functions above it are the library.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends.paddle.launch_files import ERROR_FILE
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import stage_info


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
    from ernie_ir.backends.paddle.layer import require_paddle

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
    from ernie_ir.backends.paddle.devices import set_device_string

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
    from ernie_ir.backends.paddle.layer import build_layer, require_paddle, set_model_parallel_group

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
        from ernie_ir.backends.paddle.pipeline import PipelineStage, pipeline_groups

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
    from ernie_ir.backends.paddle.layer import build_layer, require_paddle
    from ernie_ir.runtime.decoding import cache_dtype_of, decode

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
    from ernie_ir.backends.paddle.launch_files import (
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


# -- the script --------------------------------------------------------------------------------


def _write_error(rank: int, message: str) -> None:
    workdir = os.environ.get("ERNIE_IR_WORKDIR")
    if workdir:
        tmp = Path(workdir) / f".{ERROR_FILE.format(rank=rank)}.tmp"
        tmp.write_text(message.splitlines()[0] if message else "failed", encoding="utf-8")
        os.replace(tmp, Path(workdir) / ERROR_FILE.format(rank=rank))


def _save_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)


def rank_main(body: Callable[[int], None]) -> int:
    """Run this rank's `body(rank)` as a script: watch the parent, turn a user error into one
    line on stderr and in the workdir's error file; exit status 0, 2 (user error) or 1."""
    rank, _ = world_from_env()
    _watch_parent()
    try:
        body(rank)
    except ErnieIRError as e:
        _write_error(rank, str(e))
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException as e:
        _write_error(rank, f"{type(e).__name__}: {e}")
        raise
    return 0


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """--device, which every rank command takes."""
    parser.add_argument("--device", default="cpu", choices=["cpu", "gpu", "npu", "xpu"])


def main(argv: list[str] | None = None) -> int:
    """Script entry (`python -m ernie_ir.backends.paddle.rank_worker run|generate ...`)."""
    parser = argparse.ArgumentParser(prog="python -m ernie_ir.backends.paddle.rank_worker",
                                     description=__doc__.splitlines()[0])
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
    for p in (run, gen):
        add_device_flag(p)
    args = parser.parse_args(argv)

    def body(rank: int) -> None:
        if args.command == "generate":
            _generate_main(args, rank)
            return
        logits = run_rank(args.artifact, parse_tokens(args.tokens), device=args.device)
        if rank == 0 and logits is not None:
            if args.save_logits is not None:
                _save_npy(args.save_logits, logits.astype(np.float32))
            argmax = np.argmax(logits, axis=-1).tolist()
            print(f"logits {list(logits.shape)}  argmax {argmax}", flush=True)

    return rank_main(body)


if __name__ == "__main__":
    sys.exit(main())
