"""`ernie-ir run` (logits of a model or an artifact on this machine's CPU) and `ernie-ir train`
(AdamW steps on a training artifact); a multi-rank artifact runs one paddle.distributed
process per rank, and its failure prints the rank's log.

Several machines (`--nnodes N --node-rank R --master HOST:PORT`, docs/parallel.md): each node
starts the same command with its own --node-rank; node 0 prints the command of every node
first, then the results (and writes the checkpoints); any other node prints one line
`node R of N done: ...` once its ranks finish."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .common import (
    BackendOpt,
    DisablePassOpt,
    DpOpt,
    LoraAdapterOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    MergeLoraOpt,
    ModelArg,
    PipelineOpt,
    QuantConfigOpt,
    QuantOpt,
    ShardingOpt,
    StopAfterOpt,
    TrustOpt,
    chosen_backend,
    err,
    full_pipeline,
    load_rewritten,
    out,
    rewrite,
    say_backend,
)
from .train_opts import (
    ArtifactArg,
    BatchSizeOpt,
    Beta1Opt,
    Beta2Opt,
    ClipNormOpt,
    ConfigOpt,
    DataOpt,
    EpochsOpt,
    EpsOpt,
    EvalDataOpt,
    EvalStepsOpt,
    ForceTrainOpt,
    GradAccumOpt,
    IgnoreIndexOpt,
    LrOpt,
    MaxSeqLenOpt,
    MicroBatchesOpt,
    OverridesArg,
    PackingOpt,
    PadIdOpt,
    PipelineScheduleOpt,
    ProgressOpt,
    ResumeFromOpt,
    ResumeOpt,
    SaveStepsOpt,
    SaveTotalLimitOpt,
    ScheduleOpt,
    SeedOpt,
    SplitOpt,
    StepsOpt,
    TrainJsonOpt,
    WarmupStepsOpt,
    WeightDecayOpt,
    flag_options,
)

if TYPE_CHECKING:
    import numpy as np

    from ernie_ir.backends.paddle.launch import NodeFinished, NodeSpec
    from ernie_ir.ir import Graph
    from ernie_ir.training.erniekit_config import ErnieKitRun


TimeoutOpt = Annotated[
    float | None,
    typer.Option("--timeout", help="Seconds a multi-rank paddle run may take (default: run 600, train 3600).")
]
NnodesOpt = Annotated[int | None, typer.Option(
    "--nnodes", help="Launch over N machines (paddle.distributed.launch --nnodes): start the same command "
    "on each with its --node-rank; N must divide the processes (each node runs processes / N).")]
NodeRankOpt = Annotated[int | None, typer.Option(
    "--node-rank", help="This machine's node, 0 .. N-1 (paddle's --rank); node 0 reports the results and "
    "writes the checkpoints.")]
MasterOpt = Annotated[str | None, typer.Option(
    "--master", help="HOST:PORT where the nodes meet: node 0's address and a free port, the same on every "
    "node.")]
MasterTimeoutOpt = Annotated[float | None, typer.Option(
    "--master-timeout", help="Seconds to wait for every node to join at --master before stopping (60).")]


def _node_commands(nodes: NodeSpec) -> list[str]:
    """The command line of each node: this one's, with --node-rank R."""
    import shlex
    import sys

    args = list(sys.argv[1:])
    for i, a in enumerate(args):
        if a == "--node-rank" and i + 1 < len(args):
            args[i + 1] = "NODE_RANK_"
        elif a.startswith("--node-rank="):
            args[i] = "--node-rank=NODE_RANK_"
    line = shlex.join(["ernie-ir", *args])
    return [line.replace("NODE_RANK_", str(r)) for r in range(nodes.nnodes)]


@contextmanager
def _nodes_launch(nodes: NodeSpec | None, processes: int) -> Iterator[None]:
    """Runs the enclosed launches as this node's share of `nodes` (None: plainly); node 0 first
    prints every node's command on stderr."""
    from ernie_ir.backends.paddle.launch import multi_node

    if nodes is not None:
        per = nodes.processes_per_node(processes)
        if nodes.node_rank == 0:
            err.print(f"multi-node launch: {nodes.nnodes} nodes x {per} process(es), master {nodes.master}; "
                      "start on each node (the artifact at the same path):", markup=False)
            for r, line in enumerate(_node_commands(nodes)):
                err.print(f"  node {r}: {line}", markup=False, highlight=False)
    with multi_node(nodes):
        yield


def _node_done(done: NodeFinished, json_out: bool) -> None:
    """What a node other than 0 prints: one line."""
    if json_out:
        import json

        print(json.dumps({"node_rank": done.node_rank, "nnodes": done.nnodes, "done": True}))
    else:
        out.print(str(done), markup=False)


def _parse_tokens(tokens: str) -> np.ndarray:
    """`1,2,3` (one sequence) or a .npy file of int token ids [batch, seq]."""
    import numpy as np

    from ernie_ir.ir import ErnieIRError

    if tokens.endswith(".npy"):
        from ernie_ir.ir.inputs import read_token_ids

        if not Path(tokens).exists():
            raise ErnieIRError(f"--tokens {tokens}: no such file")
        return read_token_ids(tokens, "--tokens file")
    try:
        values = [int(t) for t in tokens.split(",") if t.strip()]
        if not values:
            raise ErnieIRError("--tokens: give at least one token id")
        return np.asarray([values], dtype=np.int64)
    except (ValueError, OverflowError):
        raise ErnieIRError(f"--tokens {tokens!r}: expected comma-separated integers such as 1,2,3 "
                           "(each a valid token id) or a .npy file") from None


def _logits(graph: Graph, ids: np.ndarray, emulate: str | None) -> np.ndarray:
    from ernie_ir.ir import DType, ErnieIRError
    from ernie_ir.ops.positions import check_sequence_length
    from ernie_ir.runtime import Interpreter

    if len(graph.inputs) != 1 or not graph.inputs[0].type.dtype.is_int or not graph.outputs:
        raise ErnieIRError(f"graph {graph.name} does not take token ids: inputs "
                           f"{[v.name for v in graph.inputs]}")
    check_sequence_length(graph, int(ids.shape[1]))  # before any [batch, seq, hidden] is allocated
    mode = DType.parse(emulate) if emulate else None
    outputs = Interpreter(graph, emulate=mode).run({graph.inputs[0].name or "": ids})
    return outputs[graph.output_names[0]]


def _is_artifact(model: str) -> bool:
    """An artifact folder: it runs through its backend session (several ranks as SPMD)."""
    return (Path(model) / "manifest.json").is_file()


@contextmanager
def _rank_log_on_error() -> Iterator[None]:
    """A failed paddle.distributed run: its one-line error, then the tail of the rank's log."""
    from rich.markup import escape

    from ernie_ir.backends.paddle.launch import DistributedRunError

    try:
        yield
    except DistributedRunError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", markup=True)
        if e.log_tail:
            err.print("--- end of the rank's log ---", markup=False)
            err.print(e.log_tail, markup=False, highlight=False)
        raise typer.Exit(2) from None


def _check_finite(model: str, logits: np.ndarray) -> None:
    import numpy as np

    from ernie_ir.ir import ErnieIRError

    bad = int(np.size(logits) - np.count_nonzero(np.isfinite(logits)))
    if bad:
        raise ErnieIRError(f"{model}: {bad} of {np.size(logits)} logits are NaN or Inf: a weight of the "
                           "model is probably NaN/Inf or overflows; check or re-export the checkpoint")


def run(
    model: ModelArg,
    tokens: Annotated[str, typer.Option("--tokens", help="Token ids: 1,2,3 or a .npy [batch, seq].")],
    pipeline: PipelineOpt = None,
    compare_to: Annotated[
        str | None, typer.Option("--compare-to", help="Reference model (float) to compare logits with.")
    ] = None,
    save_logits: Annotated[
        Path | None, typer.Option("--save-logits", help="Write float32 logits [batch, seq, vocab].")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    emulate: Annotated[
        str | None, typer.Option("--emulate", help="Round activations typed bf16/f16 after each op.")
    ] = None,
    backend: BackendOpt = "auto",
    timeout: TimeoutOpt = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    master: MasterOpt = None,
    master_timeout: MasterTimeoutOpt = None,
    quant: QuantOpt = None,
    quant_config: QuantConfigOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_adapter: LoraAdapterOpt = None,
    merge_lora: MergeLoraOpt = False,
    disable_pass: DisablePassOpt = None,
    stop_after: StopAfterOpt = None,
    trust_pickle: TrustOpt = False,
) -> None:
    """Run a model or an artifact on this machine's CPU (float32 where the CPU lacks bf16).
    A multi-rank artifact with --backend paddle may run over several machines (--nnodes,
    --node-rank, --master): node 0 prints the results, every other node one line."""
    import json

    from ernie_ir.backends.paddle.launch import NodeFinished, parse_nodes
    from ernie_ir.ir import ErnieIRError

    pipeline = full_pipeline(pipeline, quant, quant_config, lora_rank, lora_alpha, lora_targets,
                              lora_adapter, merge_lora)
    nodes = parse_nodes(nnodes, node_rank, master, master_timeout)
    # a multi-node launch is paddle's; otherwise `auto` picks (and says which)
    backend, note = (("paddle", None) if nodes is not None and backend == "auto" else
                     chosen_backend(model, backend, as_compiled=not (pipeline or emulate)))
    processes = 1 if nodes is None else _node_run_processes(model, backend, nodes)
    if _is_artifact(model):
        _check_artifact_run(model, rewrites=bool(pipeline or emulate))
    from ernie_ir.backends import check_backend

    check_backend(backend)
    ids = _parse_tokens(tokens)
    _check_run_flags(timeout, emulate, save_logits)
    if (disable_pass or stop_after is not None) and not pipeline:
        raise ErnieIRError("--disable-pass/--stop-after need a pipeline (--pipeline, --quant or --lora-*)")
    reference = _reference(compare_to, trust_pickle)  # a missing one is refused before any work
    if backend == "interpreter" and not pipeline and not emulate and _is_artifact(model):
        from ernie_ir.backends import run_artifact

        logits = run_artifact(Path(model), ids, backend)
    elif backend != "interpreter":
        if pipeline or emulate:
            raise ErnieIRError(f"--backend {backend} runs an artifact as compiled: drop --pipeline, "
                               "--quant, --lora-* and --emulate (or use --backend interpreter)")
        from ernie_ir.backends import run_artifact

        try:
            with _rank_log_on_error(), _nodes_launch(nodes, processes):
                logits = run_artifact(Path(model), ids, backend, timeout_s=timeout)
        except NodeFinished as done:
            _node_done(done, json_out)
            return
    else:
        graph = load_rewritten(model, None, trust_pickle=trust_pickle)
        _check_ids(graph, ids)  # before any pass runs or warns
        logits = _logits(rewrite(graph, pipeline, disable_pass=disable_pass, stop_after=stop_after), ids,
                         emulate)
    _check_finite(model, logits)
    report = _run_report(model, backend, ids, logits, compare_to, trust_pickle, reference)
    if save_logits is not None:
        _save_logits(save_logits, logits)
        report["saved"] = str(save_logits)
    say_backend(note)
    if json_out:
        print(json.dumps(report))
        return
    out.print(f"logits {report['logits_shape']}  argmax {report['argmax']}", markup=False)
    if compare_to is not None:
        out.print(f"vs {compare_to}: max_abs_error {report['max_abs_error']:.3e}  rel_error "
                  f"{report['rel_error']:.3e}  top1_agreement {report['top1_agreement']:.3f}",
                  markup=False)


def _check_run_flags(timeout: float | None, emulate: str | None, save_logits: Path | None) -> None:
    """`run`'s flags that need no model, refused in one line before anything runs."""
    from ernie_ir.ir import ErnieIRError

    if timeout is not None and not 0 < timeout < float("inf"):
        raise ErnieIRError(f"--timeout {timeout}: give a finite number of seconds above 0")
    if emulate is not None and emulate not in ("bf16", "f16"):
        raise ErnieIRError(f"--emulate {emulate!r}: choose bf16 or f16 (activation rounding)")
    if save_logits is not None and not save_logits.parent.is_dir():
        raise ErnieIRError(f"--save-logits {save_logits}: folder {save_logits.parent} does not exist: "
                           "create it or choose another path")
    if save_logits is not None and save_logits.is_dir():
        raise ErnieIRError(f"--save-logits {save_logits}: cannot write it (it is a folder): name a "
                           f"file, e.g. {save_logits / 'logits.npy'}")


def _node_run_processes(model: str, backend: str, nodes: NodeSpec) -> int:
    """The processes a multi-node `run` starts: one per rank graph of the artifact (its Mapping's
    `rank_graphs`, pp x world_size), refused in one line before anything starts when that is one
    or does not split over the nodes."""
    from ernie_ir.artifacts import read_manifest
    from ernie_ir.ir import ErnieIRError

    processes = read_manifest(model).mapping.rank_graphs if _is_artifact(model) else 1
    if backend != "paddle" or processes == 1:
        given = (f"not --backend {backend}" if backend != "paddle" else
                 f"{model} is one rank graph" if _is_artifact(model) else f"{model} is not an artifact")
        raise ErnieIRError(f"--nnodes {nodes.nnodes}: a multi-node launch runs a multi-rank artifact "
                           f"with --backend paddle ({given})")
    nodes.processes_per_node(processes)
    return processes


def _check_artifact_run(model: str, *, rewrites: bool) -> None:
    """An artifact `run` can run: it holds weights, and --pipeline/--quant/--lora-*/--emulate (which
    rewrite or run one graph) only on an artifact of one rank graph: the rank-0 graph of several is a
    shard or the first pipeline stage, whose output is not the logits."""
    from ernie_ir.artifacts import read_manifest, require_weights
    from ernie_ir.ir import ErnieIRError

    manifest = read_manifest(model)
    require_weights(Path(model), manifest)
    mapping = manifest.mapping
    if rewrites and mapping.rank_graphs > 1:
        source = (manifest.source or {}).get("model")
        raise ErnieIRError(f"{model} holds {mapping.rank_graphs} rank graphs ({mapping.describe()}): "
                           "--pipeline, --quant, --lora-* and --emulate rewrite or run one graph; run the "
                           "artifact as compiled (drop them)"
                           + (f", or give them the model it was compiled from ({source})"
                              if isinstance(source, str) else ""))


def _check_ids(graph: Graph, ids: np.ndarray) -> None:
    """Token ids the model's embedding takes and a length its positions reach, checked on the
    loaded graph before any pass runs (or warns)."""
    from ernie_ir.backends.paddle.rank_worker import check_token_ids
    from ernie_ir.ops.positions import check_sequence_length

    if len(graph.inputs) == 1 and graph.inputs[0].type.dtype.is_int:
        check_token_ids(graph, ids)
        check_sequence_length(graph, int(ids.shape[1]))


def _reference(compare_to: str | None, trust_pickle: bool) -> Graph | None:
    """--compare-to's model, loaded (and so found, or refused in one line) before any work; an
    artifact is only checked here (None), it runs whole (every rank graph) in `_run_report`."""
    if compare_to is None:
        return None
    if _is_artifact(compare_to):
        from ernie_ir.artifacts import read_manifest, require_weights

        require_weights(Path(compare_to), read_manifest(compare_to))
        return None
    from ernie_ir.ir.verifier import verify
    from ernie_ir.load import load_input

    graph = load_input(compare_to, trust_pickle=trust_pickle)
    verify(graph)
    return graph


def _run_report(model: str, backend: str, ids: Any, logits: Any, compare_to: str | None,
                trust_pickle: bool, reference: Graph | None = None) -> dict[str, Any]:
    """`run`'s report: the logits' shape and argmax, and with --compare-to the comparison with
    the reference model's logits (run by the interpreter, or an artifact offering `backend` on it)."""
    import numpy as np

    from ernie_ir.ir import ErnieIRError
    from ernie_ir.ir.verifier import verify
    from ernie_ir.load import load_input
    from ernie_ir.runtime.compare import compare_logits

    report: dict[str, Any] = {"model": model, "backend": backend, "logits_shape": list(logits.shape),
                              "argmax": np.argmax(logits, axis=-1).tolist()}
    if compare_to is None:
        return report
    from ernie_ir.backends import reference_backend, run_artifact

    ref_backend = reference_backend(compare_to, backend)
    if ref_backend != "interpreter" or _is_artifact(compare_to):
        # an artifact offering this backend: compared on the same one; any artifact runs whole
        # (its rank-0 graph alone may be a shard or the first pipeline stage)
        ref_logits = run_artifact(Path(compare_to), ids, ref_backend)
    else:
        ref_graph = reference  # loaded and verified up front by `_reference`
        if ref_graph is None:
            ref_graph = load_input(compare_to, trust_pickle=trust_pickle)
            verify(ref_graph)
        ref_logits = _logits(ref_graph, ids, None)
    _check_finite(compare_to, ref_logits)
    if ref_logits.shape != logits.shape:
        raise ErnieIRError(f"--compare-to {compare_to}: its logits are {list(ref_logits.shape)}, "
                           f"{model}'s are {list(logits.shape)} (a different vocabulary): compare "
                           "against the float model this one was made from")
    report.update(compare_logits(logits, ref_logits).as_dict())
    report["compare_to"] = compare_to
    return report


def _save_logits(path: Path, logits: Any) -> None:
    """--save-logits: float32 logits at exactly that path (np.save(path) would append .npy)."""
    import numpy as np

    from ernie_ir.ir import ErnieIRError

    try:
        with open(path, "wb") as f:
            np.save(f, logits.astype(np.float32))
    except OSError as e:
        raise ErnieIRError(f"--save-logits {path}: cannot write it ({e.strerror or e}): "
                           "choose a writable path") from None


def train(
    ctx: typer.Context,
    artifact: ArtifactArg,
    overrides: OverridesArg = None,
    steps: StepsOpt = None,
    data: DataOpt = None,
    eval_data: EvalDataOpt = None,
    max_seq_len: MaxSeqLenOpt = None,
    num_train_epochs: EpochsOpt = None,
    split: SplitOpt = None,
    packing: PackingOpt = False,
    config: ConfigOpt = None,
    lr: LrOpt = None,
    batch_size: BatchSizeOpt = None,
    grad_accum: GradAccumOpt = None,
    clip_norm: ClipNormOpt = None,
    weight_decay: WeightDecayOpt = None,
    beta1: Beta1Opt = None,
    beta2: Beta2Opt = None,
    eps: EpsOpt = None,
    warmup_steps: WarmupStepsOpt = None,
    schedule: ScheduleOpt = None,
    seed: SeedOpt = None,
    pad_id: PadIdOpt = None,
    ignore_index: IgnoreIndexOpt = None,
    save_steps: SaveStepsOpt = None,
    save_total_limit: SaveTotalLimitOpt = None,
    eval_steps: EvalStepsOpt = None,
    dp: DpOpt = None,
    sharding: ShardingOpt = None,
    micro_batches: MicroBatchesOpt = None,
    pipeline_schedule: PipelineScheduleOpt = None,
    resume: ResumeOpt = False,
    resume_from: ResumeFromOpt = None,
    progress: ProgressOpt = None,
    json_out: TrainJsonOpt = False,
    force: ForceTrainOpt = False,
    timeout: TimeoutOpt = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    master: MasterOpt = None,
    master_timeout: MasterTimeoutOpt = None,
) -> None:
    """Train the trainable params (LoRA, QAT) of a training artifact with AdamW on CPU (a multi-rank
    artifact: one paddle.distributed gloo process per rank), or compile the model an ERNIEKit config
    names into its output_dir and train it there (`train CONFIG.yaml key=value ...`, as `erniekit
    train`). Every option defaults to the artifact's recipe (training/train.json), then --config, then
    the flag. Checkpoints go to ARTIFACT/training/checkpoints/run-K-step-N/ (at the end, every
    --save-steps), a LoRA one with adapter/ (a paddleformers adapter folder that
    `compile --lora-adapter` and paddleformers' LoRAModel.from_pretrained read); --resume
    continues the newest as a new run, bit for bit. Over several machines (--nnodes, --node-rank,
    --master; the artifact at the same path on each, shared for checkpoints) node 0 prints the
    losses and writes the checkpoints, every other node one line. A line per step (loss, lr,
    tokens/s), evaluation and checkpoint is printed as it happens; interrupted (Ctrl-C,
    SIGTERM), it prints the last step, the newest checkpoint and the command that resumes it."""
    from ernie_ir.backends.paddle.launch import NodeFinished, parse_nodes
    from ernie_ir.finetune import PACKING_REFUSED, FineTuneError, fine_tune, train_length
    from ernie_ir.training.hooks import TrainHooks

    from .train_log import TrainLog, resume_command

    if packing:
        raise FineTuneError(f"--packing: {PACKING_REFUSED}")
    kit, artifact = _config_run(artifact, overrides, config)
    if kit is not None:  # the config's data and length, where no flag gives them
        data, eval_data = data or kit.data, eval_data or kit.eval_data
        max_seq_len = max_seq_len or kit.max_seq_len
        if steps is None and num_train_epochs is None:
            steps, num_train_epochs = kit.steps, kit.epochs
    length = train_length(steps, num_train_epochs)
    options, start = _train_options(kit, flag_options(locals()), resume, resume_from)
    if kit is not None and kit.model is not None:
        _compile_config(kit, force, [data, eval_data])
    nodes = parse_nodes(nnodes, node_rank, master, master_timeout)
    processes = 1 if nodes is None else _node_processes(artifact, nodes, options)
    draw = (err.is_terminal if progress is None else progress) and (nodes is None or nodes.node_rank == 0)
    # --json: stdout is one JSON object at the end, so the live lines go to stderr (unless the bar
    # is drawn there)
    log = TrainLog(to_stdout=not json_out, synthetic=data is None, lines=not (json_out and draw))
    try:
        with (_rank_log_on_error(), _nodes_launch(nodes, processes),
              _train_progress(draw, steps) as on_bar):
            def on_progress(p: Any) -> None:
                if on_bar is not None:
                    on_bar(p)
                log.on_progress(p)

            hooks = TrainHooks(on_start=log.on_start, on_progress=on_progress, on_eval=log.on_eval,
                               on_checkpoint=log.on_checkpoint)
            result = fine_tune(artifact, length, data, eval_data=eval_data, max_seq_len=max_seq_len,
                               options=options, hooks=hooks, timeout_s=timeout, resume=start, split=split)
    except NodeFinished as done:
        _node_done(done, json_out)
        return
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (exits.py): say where the run stopped, then exit 130/143
        for line in log.interrupted(resume_command(ctx, keep_resume=log.checkpoint is None),
                                    resumed=bool(start)):
            err.print(line, markup=False, highlight=False)
        raise
    _print_trained(artifact, result.first_step + len(result.losses) - 1, result, options, json_out)


def _train_options(kit: ErnieKitRun | None, flags: dict[str, Any], resume: bool,
                   resume_from: str | None) -> tuple[dict[str, Any], str | bool | None]:
    """(the training options: the config's, replaced by the flags given; the checkpoint to resume:
    --resume-from-checkpoint, --resume, or the config's resume_from_checkpoint), a bad value or
    both resume flags refused in one line before the artifact is read."""
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.training.loop import resolve_options, split_run_keys

    config = {} if kit is None else {**kit.options, "resume_from_checkpoint": kit.resume}
    given, config_resume = split_run_keys(config)
    options = {**given, **flags}
    resolve_options({}, options)  # a bad value is refused before the artifact is read
    if resume and resume_from is not None:
        raise ErnieIRError("--resume continues the newest checkpoint, --resume-from-checkpoint a named one: "
                           "give one of them")
    return options, resume_from if resume_from is not None else (True if resume else config_resume)


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def _config_run(artifact: Path, overrides: list[str] | None,
                config: Path | None) -> tuple[ErnieKitRun | None, Path]:
    """(the config's run, the artifact to train): ARTIFACT an ERNIEKit config (its overrides
    merged; the artifact is its output_dir), or --config's keys, or neither."""
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.training.erniekit_config import config_values, erniekit_run
    from ernie_ir.training.loop import read_config

    if artifact.suffix.lower() in CONFIG_SUFFIXES and artifact.is_file():
        if config is not None:
            raise ErnieIRError(f"{artifact} is a config already: give it as ernie-ir train {artifact.name} "
                               "key=value ... or as --config of an artifact, not both")
        kit = erniekit_run(artifact, overrides or [])
        _say_notes(kit.notes)
        return kit, kit.output_dir or artifact
    if overrides:
        raise ErnieIRError(f"{overrides[0]}: key=value overrides follow an ERNIEKit config (ernie-ir train "
                           "CONFIG.yaml key=value ...); for an artifact give flags (--max-steps N, --lr X)")
    if config is None:
        return None, artifact
    kit = config_values(read_config(config), str(config))
    _say_notes(kit.notes)
    return kit, artifact


def _say_notes(notes: tuple[str, ...]) -> None:
    for note in notes:  # stderr: stdout stays the steps (or the JSON)
        err.print(f"note: {note}", markup=False, highlight=False)


def _compile_config(kit: ErnieKitRun, force: bool, data: list[Path | None]) -> None:
    """Compile the config's model into its output_dir (a training artifact for cuda), refused in one
    line where output_dir exists, unless overwrite_output_dir or --force replaces it, or where the
    data to train on is missing; an artifact there that resume_from_checkpoint continues is
    trained as it is."""
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.targets import CompileOptions, compile_model

    out = kit.output_dir
    if out is None or kit.model is None:  # a --config's keys: the artifact is compiled already
        return
    for path in data:  # a JSON Lines file, or pretraining data's PREFIX (PREFIX_ids.npy)
        if path is not None and not path.exists() and not Path(f"{path}_ids.npy").exists():
            raise ErnieIRError(f"{path} does not exist: give train_dataset_path / eval_dataset_path (or "
                               "--data, --eval-data) a data file")
    replace = force or kit.overwrite
    if out.exists() and not replace:
        if kit.resume is not None and (out / "manifest.json").is_file():
            return
        raise ErnieIRError(f"output_dir {out} exists: add overwrite_output_dir=True (or --force) to "
                           "replace it, resume_from_checkpoint=true to continue its run, or choose another "
                           "output_dir")
    options = CompileOptions.from_flags(**kit.compile, out=out, force=replace)
    report = compile_model(str(kit.model), "cuda", options)
    for w in report.warnings:
        err.print(f"warning: {w}", markup=False)
    err.print(f"compiled {kit.model} -> {out} ({report.pipeline or 'training'})", markup=False,
              highlight=False)


def _node_processes(artifact: Path, nodes: NodeSpec, options: dict[str, Any]) -> int:
    """The processes a multi-node run starts (dp x the artifact's rank graphs), refused in one
    line when it is one process or does not split over the nodes, before anything starts."""
    from ernie_ir.artifacts import artifact_mapping
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.training.loop import check_layout, read_training_artifact, resolve_options

    manifest, recipe, world = read_training_artifact(artifact)
    mapping = artifact_mapping(manifest)
    processes = check_layout(resolve_options(recipe, options), world, mapping.pp, mapping.micro_batches)
    if processes == 1:
        raise ErnieIRError(f"--nnodes {nodes.nnodes}: this run is one process (one rank, dp 1): a "
                           "multi-node launch trains a multi-rank artifact or --dp > 1")
    nodes.processes_per_node(processes)  # refused before anything starts
    return processes


def _print_trained(artifact: Path, steps: int, result: Any, options: dict[str, Any], json_out: bool) -> None:
    """`train`'s output at the end: one JSON object (with the options the run used), or the
    precision line (the step, evaluation and checkpoint lines were printed as they happened)."""
    if json_out:
        import json

        from ernie_ir.training.loop import read_training_artifact, resolve_options

        used = resolve_options(read_training_artifact(artifact)[1], options).model_dump()
        print(json.dumps({"artifact": str(artifact), "steps": steps, "first_step": result.first_step,
                          "losses": result.losses, "eval_losses": [list(e) for e in result.eval_losses],
                          "checkpoints": [str(p) for p in result.checkpoints], "options": used,
                          "precision": result.precision}))
        return
    if result.precision:  # one line on stderr: stdout stays the losses and checkpoints
        err.print(result.precision, markup=False)


@contextmanager
def _train_progress(draw: bool, steps: int | None) -> Iterator[object]:
    """A rich progress bar on stderr (loss, tokens/s, ETA) fed by train_artifact's on_progress."""
    if not draw:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ernie_ir.training.loop import StepProgress

    # stdout a terminal too: its step lines print above the bar; else they must stay on stdout
    bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TextColumn("ETA"), TimeRemainingColumn(),
                   console=err.get(), transient=False, redirect_stdout=out.is_terminal)
    task = bar.add_task("train", total=steps, status="")

    def on_progress(p: StepProgress) -> None:
        bar.update(task, completed=p.step, total=p.steps,
                   status=f"loss {p.loss:.4f}  lr {p.lr:.2e}  {p.tokens_per_s:,.0f} tok/s  "
                          f"eta {p.eta_s:.0f}s")

    with bar:
        yield on_progress
