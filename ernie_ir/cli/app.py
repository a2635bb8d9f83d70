"""The typer application behind the `ernie-ir` console script.

Every command parses its options, calls the library and prints. User errors
(`ErnieIRError`) and usage errors (unknown command or option, missing argument)
become one line on stderr and exit code 2; see `main`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import ernie_ir
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify
from ernie_ir.load import load_input

from .summary import summary_tables

app = typer.Typer(
    name="ernie-ir",
    help="A declarative graph compiler for ERNIE and GPT models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
golden_app = typer.Typer(help="Check or update golden-graph files.", no_args_is_help=True)
app.add_typer(golden_app, name="golden")
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)

ModelArg = Annotated[
    str, typer.Argument(help="An .ir file, a graph folder, a model folder or a built-in name.")
]
PipelineOpt = Annotated[
    str | None,
    typer.Option("--pipeline", "-p", help="Passes to run: 'canonicalize,cse,dce' or a YAML file."),
]
QuantOpt = Annotated[
    str | None,
    typer.Option("--quant", help="Quantization preset: none, wint8, wint4, wint8mix, qat-int8, fp8 "
                 "(or an ERNIEKit/FastDeploy alias)."),
]
QuantConfigOpt = Annotated[
    Path | None, typer.Option("--quant-config", help="A YAML quantization config (rules by scope).")
]
LoraRankOpt = Annotated[int | None, typer.Option("--lora-rank", help="Insert LoRA adapters of rank R.")]
LoraAlphaOpt = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA alpha (default 2*rank).")]
LoraTargetsOpt = Annotated[
    str | None,
    typer.Option("--lora-targets",
                 help="Comma-separated regexes, each matching a whole module name (e.g. '.*qkv_proj')."),
]
LoraAdapterOpt = Annotated[
    Path | None, typer.Option("--lora-adapter", help="Import a paddleformers LoRA adapter folder.")
]
TrustOpt = Annotated[
    bool, typer.Option("--trust-pickle", help="Allow loading pickle-based .pdparams checkpoints.")
]


def _version(value: bool) -> None:
    if value:
        print(f"ernie-ir {ernie_ir.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """A declarative graph compiler for ERNIE and GPT models."""


def _full_pipeline(pipeline: str | None, quant: str | None, quant_config: Path | None,
                   lora_rank: int | None, lora_alpha: float | None, lora_targets: str | None,
                   lora_adapter: Path | None) -> str | None:
    """The user's --pipeline, then what the quantization and LoRA flags expand to."""
    from ernie_ir.passes.quant_cli import pipeline_for

    if pipeline and pipeline.endswith((".yaml", ".yml")) and (quant or quant_config or lora_rank
                                                              or lora_adapter):
        raise ErnieIRError("--pipeline FILE.yaml cannot be combined with --quant/--lora-* flags: "
                           "put those passes in the YAML file")
    targets = [t.strip() for t in lora_targets.split(",") if t.strip()] if lora_targets else None
    extra = pipeline_for(quant, quant_config, lora_rank, lora_alpha, targets, lora_adapter)
    parts = [p for p in (pipeline, extra) if p]
    return ",".join(parts) or None


MetaOpt = Annotated[bool, typer.Option("--meta", help="Read a checkpoint folder's config.json only: "
                                       "the full-size graph without weights.")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree (attention heads, FFN, vocab).")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel degree (whole routed experts per group).")]


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def _load_rewritten(model: str, pipeline: str | None, *, trust_pickle: bool, meta: bool = False,
                    print_before: Sequence[str] = (), print_after: Sequence[str] = (),
                    dump_dir: Path | None = None, timing: bool = False) -> Graph:
    """MODEL loaded, verified, and rewritten by `pipeline` under the requested instruments."""
    graph = load_input(model, trust_pickle=trust_pickle, meta=meta)
    verify(graph)
    _run_pipeline(graph, pipeline, print_before=list(print_before), print_after=list(print_after),
                  dump_dir=dump_dir, timing=timing)
    return graph


def _run_pipeline(graph: Graph, pipeline: str | None, *, print_before: list[str],
                  print_after: list[str], dump_dir: Path | None, timing: bool) -> None:
    from ernie_ir.passes import (
        DumpInstrument,
        PrintIRInstrument,
        TimingInstrument,
        load_pipeline,
        run_pipeline,
    )
    from ernie_ir.passes.base import graph_properties

    if not pipeline:
        if print_before or print_after or dump_dir or timing:
            raise ErnieIRError("--print-before/--print-after/--dump-dir/--timing need --pipeline")
        return
    pl = load_pipeline(pipeline, initial=graph_properties(graph))
    names = {p.name for p in pl}
    for n in [*print_before, *print_after]:
        if n != "*" and n not in names:
            raise ErnieIRError(f"--print-before/--print-after: pass {n!r} is not in the pipeline "
                               f"({', '.join(sorted(names))})")
    instruments = []
    tim = TimingInstrument()
    if timing:
        instruments.append(tim)
    if print_before or print_after:
        instruments.append(PrintIRInstrument(lambda s: err.print(s, markup=False),
                                             before=print_before, after=print_after))
    if dump_dir is not None:
        try:
            dump_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ErnieIRError(f"--dump-dir {dump_dir}: cannot create the folder ({e.strerror or e}): "
                               "choose a writable folder") from None
        instruments.append(DumpInstrument(dump_dir))
    result = run_pipeline(graph, pl, instruments=instruments)
    for w in result.warnings:
        err.print(f"warning: {w}", markup=False)
    if timing:
        t = Table(title=f"pipeline {pl}")
        t.add_column("#", justify="right")
        t.add_column("pass")
        t.add_column("ms", justify="right")
        t.add_column("changed")
        t.add_column("rewrites")
        for r in tim.rows:
            counts = result.stats.get(f"{r.index}:{r.spec.split('{')[0]}", {})
            t.add_row(str(r.index), r.spec, f"{r.seconds * 1e3:.2f}", "yes" if r.changed else "no",
                      ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        t.add_row("", "total", f"{tim.total * 1e3:.2f}", "", "", style="bold")
        err.print(t)


@app.command()
def show(
    model: ModelArg,
    pipeline: PipelineOpt = None,
    summary: Annotated[bool, typer.Option("--summary", help="Print counts instead of the IR.")] = False,
    hashes: Annotated[bool, typer.Option("--hashes", help="Print a content hash per param.")] = False,
    print_before: Annotated[
        list[str] | None, typer.Option("--print-before", help="Print the IR before PASS (if it changes).")
    ] = None,
    print_after: Annotated[
        list[str] | None, typer.Option("--print-after", help="Print the IR after PASS (if it changed).")
    ] = None,
    dump_dir: Annotated[
        Path | None, typer.Option("--dump-dir", help="Write every step to numbered .ir files.")
    ] = None,
    timing: Annotated[bool, typer.Option("--timing", help="Print a timing table of the passes.")] = False,
    quant: QuantOpt = None,
    quant_config: QuantConfigOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_adapter: LoraAdapterOpt = None,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    rank: Annotated[int, typer.Option("--rank", help="With --tp/--ep: which rank's graph to print.")] = 0,
    meta: MetaOpt = False,
    trust_pickle: TrustOpt = False,
) -> None:
    """Print a model's IR (exactly the text format, so it can be parsed back)."""
    pipeline = _full_pipeline(pipeline, quant, quant_config, lora_rank, lora_alpha, lora_targets,
                              lora_adapter)
    if tp != 1 or ep != 1:
        pipeline = ",".join(x for x in (pipeline, f"split{{tp={tp},ep={ep},rank={rank}}}") if x)
    elif rank:
        raise ErnieIRError("--rank needs --tp and/or --ep (a one-rank graph has rank 0 only)")
    graph = _load_rewritten(model, pipeline, trust_pickle=trust_pickle, meta=meta,
                            print_before=_split(print_before), print_after=_split(print_after),
                            dump_dir=dump_dir, timing=timing)
    if summary:
        for table in summary_tables(graph):
            out.print(table)
        return
    sys.stdout.write(print_graph(graph, with_hashes=hashes))


def _parse_tokens(tokens: str) -> np.ndarray:
    """`1,2,3` (one sequence) or a .npy file of int token ids [batch, seq]."""
    if tokens.endswith(".npy"):
        path = Path(tokens)
        if not path.is_file():
            raise ErnieIRError(f"--tokens {tokens}: no such file")
        try:
            # Mapped, not read: a header claiming 10**9 rows must not allocate them before the
            # size check (mapping a file shorter than its header says is a ValueError).
            with np.errstate(over="ignore"):  # the size of a huge declared shape overflows
                ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, EOFError, OSError, OverflowError) as e:  # EOFError: an empty file
            raise ErnieIRError(f"--tokens {tokens}: not a plain .npy array ({e})") from None
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ErnieIRError(f"--tokens {tokens}: expected integer ids [batch, seq], got "
                               f"{ids.dtype}{list(ids.shape)}")
        if ids.size == 0:
            raise ErnieIRError(f"--tokens {tokens}: the array is empty {list(ids.shape)}: give at "
                               "least one token id per sequence")
        return ids.astype(np.int64)
    try:
        values = [int(t) for t in tokens.split(",") if t.strip()]
        if not values:
            raise ErnieIRError("--tokens: give at least one token id")
        return np.asarray([values], dtype=np.int64)
    except (ValueError, OverflowError):
        raise ErnieIRError(f"--tokens {tokens!r}: expected comma-separated integers such as 1,2,3 "
                           "(each a valid token id) or a .npy file") from None


def _logits(graph: Graph, ids: np.ndarray, emulate: str | None) -> np.ndarray:
    from ernie_ir.ir import DType
    from ernie_ir.runtime import Interpreter

    if len(graph.inputs) != 1 or not graph.inputs[0].type.dtype.is_int or not graph.outputs:
        raise ErnieIRError(f"graph {graph.name} does not take token ids: inputs "
                           f"{[v.name for v in graph.inputs]}")
    mode = DType.parse(emulate) if emulate else None
    outputs = Interpreter(graph, emulate=mode).run({graph.inputs[0].name or "": ids})
    return outputs[graph.output_names[0]]


def _is_multi_rank(model: str) -> bool:
    """An artifact folder with more than one rank (the interpreter runs its ranks as SPMD)."""
    if not (Path(model) / "manifest.json").is_file():
        return False
    from ernie_ir.targets import artifact_mapping, read_manifest

    return artifact_mapping(read_manifest(model)).world_size > 1


TimeoutOpt = Annotated[
    float | None,
    typer.Option("--timeout", help="Seconds a multi-rank paddle run may take (default: run 600, train 3600).")
]


@contextmanager
def _rank_log_on_error() -> Iterator[None]:
    """A failed paddle.distributed run: its one-line error, then the tail of the rank's log."""
    from ernie_ir.runtime.launcher import DistributedRunError

    try:
        yield
    except DistributedRunError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", markup=True)
        if e.log_tail:
            err.print("--- end of the rank's log ---", markup=False)
            err.print(e.log_tail, markup=False, highlight=False)
        raise typer.Exit(2) from None


def _check_finite(model: str, logits: np.ndarray) -> None:
    bad = int(np.size(logits) - np.count_nonzero(np.isfinite(logits)))
    if bad:
        raise ErnieIRError(f"{model}: {bad} of {np.size(logits)} logits are NaN or Inf: a weight of the "
                           "model is probably NaN/Inf or overflows; check or re-export the checkpoint")


@app.command()
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
    backend: Annotated[
        str, typer.Option("--backend", help="interpreter, or for an artifact: onnxruntime or paddle "
                          "(several ranks: one paddle.distributed process per rank).")
    ] = "interpreter",
    timeout: TimeoutOpt = None,
    quant: QuantOpt = None,
    quant_config: QuantConfigOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_adapter: LoraAdapterOpt = None,
    trust_pickle: TrustOpt = False,
) -> None:
    """Run a model or an artifact on this machine's CPU (float32 where the CPU lacks bf16)."""
    import json

    from ernie_ir.runtime.compare import compare_logits

    pipeline = _full_pipeline(pipeline, quant, quant_config, lora_rank, lora_alpha, lora_targets,
                              lora_adapter)
    if (Path(model) / "manifest.json").is_file():
        from ernie_ir.targets import read_manifest, require_weights

        require_weights(Path(model), read_manifest(model))
    ids = _parse_tokens(tokens)
    if emulate is not None and emulate not in ("bf16", "f16"):
        raise ErnieIRError(f"--emulate {emulate!r}: choose bf16 or f16 (activation rounding)")
    if save_logits is not None and not save_logits.parent.is_dir():
        raise ErnieIRError(f"--save-logits {save_logits}: folder {save_logits.parent} does not exist: "
                           "create it or choose another path")
    if backend == "interpreter" and not pipeline and not emulate and _is_multi_rank(model):
        from ernie_ir.runtime.artifact_runner import run_artifact

        logits = run_artifact(Path(model), ids, backend)
    elif backend != "interpreter":
        if pipeline or emulate:
            raise ErnieIRError(f"--backend {backend} runs an artifact as compiled: drop --pipeline, "
                               "--quant, --lora-* and --emulate (or use --backend interpreter)")
        from ernie_ir.runtime.artifact_runner import run_artifact

        with _rank_log_on_error():
            logits = run_artifact(Path(model), ids, backend, timeout_s=timeout)
    else:
        graph = _load_rewritten(model, pipeline, trust_pickle=trust_pickle)
        logits = _logits(graph, ids, emulate)
    _check_finite(model, logits)
    report: dict[str, object] = {
        "model": model,
        "backend": backend,
        "logits_shape": list(logits.shape),
        "argmax": np.argmax(logits, axis=-1).tolist(),
    }
    if compare_to is not None:
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
    if save_logits is not None:
        try:
            np.save(save_logits, logits.astype(np.float32))
        except OSError as e:
            raise ErnieIRError(f"--save-logits {save_logits}: cannot write it ({e.strerror or e}): "
                               "choose a writable path") from None
        report["saved"] = str(save_logits)
    if json_out:
        print(json.dumps(report))
        return
    out.print(f"logits {report['logits_shape']}  argmax {report['argmax']}", markup=False)
    if compare_to is not None:
        out.print(f"vs {compare_to}: max_abs_error {report['max_abs_error']:.3e}  rel_error "
                  f"{report['rel_error']:.3e}  top1_agreement {report['top1_agreement']:.3f}",
                  markup=False)


@app.command()
def compile(
    model: ModelArg,
    target: Annotated[str, typer.Option("--target", "-t", help="cuda, ascend or kunlun.")],
    quant: QuantOpt = None,
    mode: Annotated[str, typer.Option("--mode", help="inference or training.")] = "inference",
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_adapter: LoraAdapterOpt = None,
    quant_config: QuantConfigOpt = None,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    pipeline: PipelineOpt = None,
    cuda_arch: Annotated[
        int | None, typer.Option("--cuda-arch", help="--target cuda only: 70, 75, 80, 86, 89 or 90 "
                                 "(default 80).")
    ] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Artifact folder to write.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing artifact folder.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    meta: MetaOpt = False,
    trust_pickle: TrustOpt = False,
    onnx_numerics: Annotated[
        str, typer.Option("--onnx-numerics", help="cuda inference ONNX model: exact (float32 weight-only "
                          "matmuls, equal to the interpreter in any onnxruntime session) or fast (int8 "
                          "activations, faster).")
    ] = "exact",
) -> None:
    """Compile a model for a target into an artifact folder (written atomically)."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ernie_ir.targets import compile_model
    from ernie_ir.targets.cuda.packing import DEFAULT_CUDA_ARCH

    if cuda_arch is not None and target.strip().lower() != "cuda":
        raise ErnieIRError(f"--cuda-arch applies to --target cuda only, not {target}: drop it")
    arch = DEFAULT_CUDA_ARCH if cuda_arch is None else cuda_arch
    targets = [t.strip() for t in lora_targets.split(",") if t.strip()] if lora_targets else None
    # Progress goes to stderr, so --json output stays one clean object on stdout.
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=json_out,
                  disable=not err.is_terminal) as bar:
        tasks: dict[str, object] = {}

        def progress(stage: str, done: int, total: int) -> None:
            key = stage.split(" ")[0]
            if key not in tasks:
                tasks[key] = bar.add_task(stage, total=total)
            bar.update(tasks[key], completed=done, total=total, description=stage)  # type: ignore[arg-type]

        report = compile_model(model, target, quant=quant, mode=mode, pipeline=pipeline,
                               lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=targets,
                               lora_adapter=lora_adapter, quant_config=quant_config,
                               cuda_arch=arch, tp=tp, ep=ep, out=out_dir, force=force,
                               trust_pickle=trust_pickle, meta=meta, progress=progress,
                               onnx_numerics=onnx_numerics)
    data = report.as_dict()
    if json_out:
        print(json.dumps(data, default=str))
        return
    for w in report.warnings:
        err.print(f"warning: {w}", markup=False)
    out.print(f"compiled {model} for {target} ({mode}) -> {report.out}", markup=False)
    if report.parallel:
        out.print(f"layout: {report.parallel}", markup=False)
    out.print(f"pipeline: {report.pipeline}", markup=False)
    if report.onnx_numerics is not None:
        out.print(f"onnx numerics: {report.onnx_numerics}", markup=False)
    t = Table(title="params by dtype")
    t.add_column("dtype")
    t.add_column("before", justify="right")
    t.add_column("after", justify="right")
    for dtype in sorted(set(report.params_before) | set(report.params_after)):
        b = report.params_before.get(dtype, {})
        a = report.params_after.get(dtype, {})
        t.add_row(dtype, f"{b.get('count', 0)} / {b.get('bytes', 0):,} B",
                  f"{a.get('count', 0)} / {a.get('bytes', 0):,} B")
    out.print(t)
    plan = Table(title="kernel plan")
    plan.add_column("kernel")
    plan.add_column("nodes", justify="right")
    counts: dict[str, int] = {}
    for k in report.kernel_plan:
        counts[k["kernel"]] = counts.get(k["kernel"], 0) + 1
    for kernel, n in sorted(counts.items()):
        plan.add_row(kernel, str(n))
    out.print(plan)
    seen: dict[str, int] = {}
    for f in report.fallbacks:  # one line per distinct fallback (experts: up_gate and down alike)
        line = f"fallback: {f.get('scope')} {f.get('op')} -> {f.get('kernel')}: {f.get('reason')}"
        seen[line] = seen.get(line, 0) + 1
    for line, n in seen.items():
        out.print(line + (f" (x{n})" if n > 1 else ""), markup=False)


@app.command()
def train(
    artifact: Annotated[Path, typer.Argument(help="An artifact compiled with --mode training.")],
    steps: Annotated[int, typer.Option("--steps", "--max-steps", min=1, help="Optimizer steps.")],
    data: Annotated[
        Path | None, typer.Option("--data", help='JSON lines {"input_ids": [...]}; default: a fixed batch.')
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="YAML or JSON of training options (these names or ERNIEKit's: "
                     "learning_rate, per_device_train_batch_size, gradient_accumulation_steps, "
                     "max_grad_norm, weight_decay, adam_beta1/2, adam_epsilon, warmup_steps, "
                     "lr_scheduler_type, seed); flags given override it."),
    ] = None,
    lr: Annotated[float | None, typer.Option("--lr", "--learning-rate",
                                             help="AdamW peak learning rate (recipe: 1e-3).")] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", "--per-device-train-batch-size", help="Sequences per batch (recipe: 4).")] = None,
    grad_accum: Annotated[int | None, typer.Option(
        "--grad-accum", "--gradient-accumulation-steps",
        help="Batches per optimizer step, weighted by their token counts (recipe: 1).")] = None,
    clip_norm: Annotated[float | None, typer.Option(
        "--clip-norm", "--max-grad-norm", help="Global gradient-norm clip, 0 = none (recipe: 1.0).")] = None,
    weight_decay: Annotated[float | None, typer.Option(
        "--weight-decay", help="AdamW decoupled weight decay (recipe: 0).")] = None,
    beta1: Annotated[float | None, typer.Option(
        "--beta1", "--adam-beta1", help="AdamW beta1 (0.9).")] = None,
    beta2: Annotated[float | None, typer.Option(
        "--beta2", "--adam-beta2", help="AdamW beta2 (0.999).")] = None,
    eps: Annotated[float | None, typer.Option(
        "--eps", "--adam-epsilon", help="AdamW epsilon (1e-8).")] = None,
    warmup_steps: Annotated[int | None, typer.Option(
        "--warmup-steps", help="Steps of linear warmup from 0 (recipe: 0).")] = None,
    schedule: Annotated[str | None, typer.Option(
        "--schedule", "--lr-scheduler-type",
        help="After warmup: constant, linear or cosine (decay to 0 at --steps; recipe: constant).")] = None,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Seed of dropout and the synthetic batch (recipe: 0).")] = None,
    pad_id: Annotated[int | None, typer.Option(
        "--pad-id", help="Token that fills input_ids past a sequence's end (recipe: 0).")] = None,
    ignore_index: Annotated[int | None, typer.Option(
        "--ignore-index", help="Label of padded positions, skipped by the loss (recipe: -100).")] = None,
    progress: Annotated[bool | None, typer.Option(
        "--progress/--no-progress", help="Draw a progress bar on stderr (default: when it is a terminal).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the losses as JSON.")] = False,
    timeout: TimeoutOpt = None,
) -> None:
    """Train the trainable params (LoRA, QAT) of a training artifact with AdamW on CPU
    (a multi-rank artifact: one paddle.distributed gloo process per rank). Every option
    defaults to the artifact's recipe (training/train.json), then --config, then the flag."""
    import json

    from ernie_ir.runtime.training import read_config, resolve_options, train_artifact

    flags = {"lr": lr, "batch_size": batch_size, "grad_accum": grad_accum, "clip_norm": clip_norm,
             "weight_decay": weight_decay, "beta1": beta1, "beta2": beta2, "eps": eps,
             "warmup_steps": warmup_steps, "schedule": schedule, "seed": seed, "pad_id": pad_id,
             "ignore_index": ignore_index}
    options = {**(read_config(config) if config is not None else {}),
               **{k: v for k, v in flags.items() if v is not None}}
    resolve_options({}, options)  # a bad value is refused before the artifact is read
    draw = err.is_terminal if progress is None else progress
    with _rank_log_on_error(), _train_progress(draw, steps) as on_progress:
        losses = train_artifact(artifact, steps, data, options=options, on_progress=on_progress,
                                timeout_s=timeout)
    if json_out:
        from ernie_ir.runtime.training import read_training_artifact

        used = resolve_options(read_training_artifact(artifact)[1], options).model_dump()
        print(json.dumps({"artifact": str(artifact), "steps": steps, "losses": losses, "options": used}))
        return
    for i, loss in enumerate(losses, 1):
        out.print(f"step {i:4d}  loss {loss:.6f}", markup=False)


@contextmanager
def _train_progress(draw: bool, steps: int) -> Iterator[object]:
    """A rich progress bar on stderr (loss, tokens/s, ETA) fed by train_artifact's on_progress."""
    if not draw:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ernie_ir.runtime.training import StepProgress

    bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TextColumn("ETA"), TimeRemainingColumn(),
                   console=err, transient=False)
    task = bar.add_task("train", total=steps, status="")

    def on_progress(p: StepProgress) -> None:
        bar.update(task, completed=p.step,
                   status=f"loss {p.loss:.4f}  lr {p.lr:.2e}  {p.tokens_per_s:,.0f} tok/s  "
                          f"eta {p.eta_s:.0f}s")

    with bar:
        yield on_progress


@app.command("verify")
def verify_cmd(artifact: Annotated[Path, typer.Argument(help="An artifact folder.")]) -> None:
    """Re-check the sha256 of every file of an artifact against its manifest."""
    from ernie_ir.targets import verify_artifact

    manifest = verify_artifact(artifact)
    files = manifest.get("files", {})
    out.print(f"ok: {artifact} ({len(files)} files match the manifest)", markup=False)


@app.command()
def passes() -> None:
    """List the passes and presets (built-in and plugins), with their options."""
    from ernie_ir.passes import all_passes, all_presets
    from ernie_ir.passes.registry import REGISTRY

    t = Table(title="passes")
    t.add_column("name")
    t.add_column("description")
    t.add_column("options")
    t.add_column("origin")
    for name, cls in all_passes().items():
        opts = []
        for key, fld in cls.Options.model_fields.items():
            default = "required" if fld.is_required() else repr(fld.get_default(call_default_factory=True))
            opts.append(f"{key}={default}")
        props = []
        if cls.requires:
            props.append("requires " + ",".join(sorted(cls.requires)))
        if cls.produces:
            props.append("produces " + ",".join(sorted(cls.produces)))
        desc = cls.description + (f" ({'; '.join(props)})" if props else "")
        t.add_row(name, desc, ", ".join(opts), REGISTRY.origins.get(name, ""))
    out.print(t)
    p = Table(title="presets")
    p.add_column("name")
    p.add_column("pipeline")
    p.add_column("description")
    for preset in all_presets().values():
        p.add_row(preset.name, preset.pipeline, preset.description)
    out.print(p)
    if REGISTRY.broken:
        for b in REGISTRY.broken:
            err.print(f"error: plugin {b.name!r} ({b.target}) failed to load: {b.error}", markup=False)
        raise typer.Exit(2)


@app.command()
def explain(
    rule: Annotated[str, typer.Argument(help="A rewrite rule name (or a rewrite pass with one rule).")],
    model: ModelArg,
    pipeline: PipelineOpt = None,
    trust_pickle: TrustOpt = False,
) -> None:
    """Say where a rewrite rule matches in a model, or why it does not."""
    from ernie_ir.passes import all_passes
    from ernie_ir.passes.rewrite import RuleSet, find_rule

    r = find_rule(rule, all_passes())
    graph = _load_rewritten(model, pipeline, trust_pickle=trust_pickle)
    (trace,) = RuleSet([r]).explain(graph)
    out.print(trace.summary(), markup=False)
    for m in RuleSet([r]).find(graph)[:20]:
        root = m.nodes[0]
        out.print(f"  match: {root.op} at {root.scope or '<root>'} ({len(m.nodes)} nodes)", markup=False)


@app.command()
def plan(
    model: ModelArg,
    target: Annotated[str, typer.Option("--target", "-t", help="cuda, ascend or kunlun.")],
    quant: QuantOpt = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel degree (default 1).")] = None,
    ep: Annotated[int | None, typer.Option("--ep", help="Expert-parallel degree (default 1).")] = None,
    mode: Annotated[str, typer.Option("--mode", help="inference or training.")] = "inference",
    lora_rank: LoraRankOpt = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 4096,
    batch: Annotated[int, typer.Option("--batch", help="Sequences (KV cache; per training step).")] = 1,
    offload_optimizer: Annotated[
        bool, typer.Option("--offload-optimizer", help="Optimizer states in host memory.")
    ] = False,
    recompute: Annotated[bool, typer.Option("--recompute", help="Full recompute per decoder layer.")] = False,
    device_memory: Annotated[str | None, typer.Option(
        "--device-memory", help="Per device: 80GiB, 80G or 80GB (all binary). Without --tp/--ep: "
        "search the smallest device count that fits.")] = None,
    moment_dtype: Annotated[str, typer.Option("--moment-dtype", help="AdamW moments: fp32, bf16.")] = "fp32",
    kv_cache_dtype: Annotated[
        str | None, typer.Option("--kv-cache-dtype", help="bf16, f16, fp8 or int8 (default: bf16).")
    ] = None,
    reserve: Annotated[str, typer.Option("--reserve", help="Runtime reserve per device.")] = "2GiB",
    cuda_arch: Annotated[
        int | None, typer.Option("--cuda-arch", help="--target cuda only: 70-90 (default 80).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON object.")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write per-rank memory as an SVG file.")] = None,
) -> None:
    """Per-rank device memory of MODEL compiled for a target: does it fit, and on how many devices?"""
    import json

    from ernie_ir.planning import plan_memory
    from ernie_ir.targets.cuda.packing import DEFAULT_CUDA_ARCH

    from .plan_view import plan_lines, plan_table, search_table

    if cuda_arch is not None and target.strip().lower() != "cuda":
        raise ErnieIRError(f"--cuda-arch applies to --target cuda only, not {target}: drop it")
    if plot is not None and (plot.suffix.lower() != ".svg" or not plot.parent.is_dir()):
        raise ErnieIRError(f"--plot {plot}: give a .svg file in an existing folder")
    result = plan_memory(model, target, quant=quant, tp=tp, ep=ep, mode=mode, lora_rank=lora_rank,
                         seq_len=seq_len, batch=batch, offload_optimizer=offload_optimizer,
                         recompute=recompute, device_memory=device_memory,
                         cuda_arch=DEFAULT_CUDA_ARCH if cuda_arch is None else cuda_arch,
                         moment_dtype=moment_dtype, kv_cache_dtype=kv_cache_dtype, reserve=reserve)
    if plot is not None:
        from ernie_ir.planning.svg import plan_svg

        try:
            plot.write_text(plan_svg(result), encoding="utf-8")
        except OSError as e:
            raise ErnieIRError(f"--plot {plot}: cannot write it ({e.strerror or e})") from None
    if json_out:
        print(json.dumps(result.model_dump(mode="json")))
        return
    for line in plan_lines(result):
        out.print(line, markup=False)
    out.print(plan_table(result))
    if result.searched:
        out.print(search_table(result))
    for note in result.notes:
        out.print(f"note: {note}", markup=False)
    if plot is not None:
        out.print(f"plot: {plot}", markup=False)


def _golden(paths: list[str] | None, update: bool) -> None:
    from ernie_ir.testing.golden import check_goldens

    if not paths:
        default = Path("tests/golden")
        if not default.is_dir():
            raise ErnieIRError("no PATHS given and ./tests/golden does not exist: name golden files "
                               "or folders, or run from the project root")
        paths = [str(default)]
    results = check_goldens(paths, update=update)
    if not results:
        raise ErnieIRError(f"no golden files (*.ir starting with '// golden case') under "
                           f"{', '.join(paths)}: check the paths")
    failed = 0
    for r in results:
        if r.ok:
            out.print(f"ok       {r.case.path}", markup=False)
        elif r.updated:
            out.print(f"updated  {r.case.path} ({r.reason})", markup=False)
        else:
            failed += 1
            out.print(f"FAIL     {r.case.path}: {r.reason}", markup=False)
            if r.diff:
                out.print(r.diff, markup=False)
    out.print(f"{len(results)} golden file(s), {failed} failed"
              + (f", {sum(r.updated for r in results)} updated" if update else ""), markup=False)
    if failed:
        raise typer.Exit(1)


@golden_app.command("check")
def golden_check(paths: Annotated[list[str] | None, typer.Argument(help="Golden files or folders.")] = None
                 ) -> None:
    """Check golden files (default: ./tests/golden); exit 1 and show diffs on mismatch."""
    _golden(paths, update=False)


@golden_app.command("update")
def golden_update(paths: Annotated[list[str] | None, typer.Argument(help="Golden files or folders.")] = None
                  ) -> None:
    """Rewrite the golden files that fail (and only those)."""
    _golden(paths, update=True)


def _usage_error(e: Exception) -> tuple[str, int] | None:
    """(message, exit code) of a command-line usage error raised by typer's click layer.

    Recognised by shape (`format_message()` and an int `exit_code`), because typer
    vendors click privately; anything else is not a usage error.
    """
    fmt = getattr(e, "format_message", None)
    code = getattr(e, "exit_code", None)
    if not callable(fmt) or not isinstance(code, int):
        return None
    ctx = getattr(e, "ctx", None)
    where = getattr(ctx, "command_path", None) or "ernie-ir"
    return f"{fmt()} (see `{where} --help`)", code


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user and usage errors become one line and exit code 2."""
    try:
        code = app(args=argv, standalone_mode=False)
    except ErnieIRError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", markup=True)
        sys.exit(2)
    except BrokenPipeError:
        sys.exit(0)
    except KeyboardInterrupt:
        err.print("aborted", markup=False)
        sys.exit(130)
    except Exception as e:
        usage = _usage_error(e)
        if usage is None:
            if type(e).__name__ == "Abort":
                err.print("aborted", markup=False)
                sys.exit(130)
            raise
        message, status = usage
        if not message.startswith(" (see"):  # bare `ernie-ir`: the help was the answer
            err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
        sys.exit(status)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()

__all__ = ["app", "main"]
