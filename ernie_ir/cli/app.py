"""The typer application behind the `ernie-ir` console script.

Every command parses its options, calls the library and prints. User errors
(`ErnieIRError`) and usage errors (unknown command or option, missing argument)
become one line on stderr and exit code 2; see `main`.

Importing this module loads typer and nothing of the library: each command
imports what it uses, so `--version` and `--help` start in about the time
typer and rich take (benchmarks/cli_startup.py; tests/test_cli_startup.py
keeps numpy, pydantic, networkx, onnx and paddle out of them). Annotations
that typer reads stay builtins and `Path`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    import numpy as np

    from ernie_ir.ir import Graph

# Plain (click) help: typer's rich help imports markdown-it, pygments and most of rich, which
# alone doubles the startup of `--help` (benchmarks/cli_startup.py).
app = typer.Typer(
    name="ernie-ir",
    help="A declarative graph compiler for ERNIE and GPT models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
golden_app = typer.Typer(help="Check or update golden-graph files.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(golden_app, name="golden")


class _LazyConsole:
    """A rich Console made on first use (importing rich.console is a fifth of `--version`);
    attributes read and written go to that Console (`get()` hands it to rich itself)."""

    def __init__(self, **options: Any) -> None:
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_console", None)

    def get(self) -> Any:
        if self._console is None:
            from rich.console import Console

            object.__setattr__(self, "_console", Console(**self._options))
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.get(), name, value)


err = _LazyConsole(stderr=True, highlight=False, soft_wrap=True)
out = _LazyConsole(highlight=False, soft_wrap=True)

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
        from ernie_ir import __version__

        print(f"ernie-ir {__version__}")
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
    from ernie_ir.ir import ErnieIRError
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


DisablePassOpt = Annotated[
    list[str] | None,
    typer.Option("--disable-pass", help="Skip pass NAME wherever the pipeline has it (repeatable, or "
                 "comma-separated): for bisecting."),
]
StopAfterOpt = Annotated[
    str | None,
    typer.Option("--stop-after", help="End the pipeline after pass NAME (its first occurrence) or after "
                 "the N-th pass: for bisecting."),
]


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def _load_rewritten(model: str, pipeline: str | None, *, trust_pickle: bool, meta: bool = False,
                    print_before: Sequence[str] = (), print_after: Sequence[str] = (),
                    dump_dir: Path | None = None, timing: bool = False,
                    disable_pass: list[str] | None = None, stop_after: str | None = None) -> Graph:
    """MODEL loaded, verified, and rewritten by `pipeline` under the requested instruments."""
    from ernie_ir.ir.verifier import verify
    from ernie_ir.load import load_input

    graph = load_input(model, trust_pickle=trust_pickle, meta=meta)
    verify(graph)
    _run_pipeline(graph, pipeline, print_before=list(print_before), print_after=list(print_after),
                  dump_dir=dump_dir, timing=timing, disabled=_split(disable_pass), stop_after=stop_after)
    return graph


def _run_pipeline(graph: Graph, pipeline: str | None, *, print_before: list[str],
                  print_after: list[str], dump_dir: Path | None, timing: bool,
                  disabled: list[str] | None = None, stop_after: str | None = None) -> None:
    from rich.table import Table

    from ernie_ir.ir import ErnieIRError
    from ernie_ir.passes import (
        DumpInstrument,
        PrintIRInstrument,
        TimingInstrument,
        load_pipeline,
        run_pipeline,
    )
    from ernie_ir.passes.base import graph_properties
    from ernie_ir.passes.pipeline import describe_restriction

    disabled = disabled or []
    if not pipeline:
        if print_before or print_after or dump_dir or timing or disabled or stop_after is not None:
            raise ErnieIRError("--print-before/--print-after/--dump-dir/--timing/--disable-pass/"
                               "--stop-after need --pipeline")
        return
    pl = load_pipeline(pipeline, initial=graph_properties(graph))
    if disabled or stop_after is not None:
        full, pl = pl, pl.restricted(disabled, stop_after)
        pl.check_order(graph_properties(graph))
        err.print("note: " + describe_restriction(full, pl, stopped=stop_after is not None),
                  markup=False)
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
        instruments.append(DumpInstrument(dump_dir))  # refuses a non-empty folder
    from ernie_ir.runtime import Interpreter

    result = run_pipeline(graph, pl, instruments=instruments, evaluator=Interpreter)
    for w in result.warnings:
        err.print(f"warning: {w}", markup=False)
    if timing:
        t = Table(title=f"pipeline {pl}")
        t.add_column("#", justify="right")
        t.add_column("pass")
        t.add_column("pass ms", justify="right")
        t.add_column("verify ms", justify="right")
        t.add_column("print ms", justify="right")
        t.add_column("changed")
        t.add_column("rewrites")
        for r in tim.rows:
            counts = result.stats.get(f"{r.index}:{r.spec.split('{')[0]}", {})
            t.add_row(str(r.index), r.spec, f"{r.seconds * 1e3:.2f}", f"{r.verify_seconds * 1e3:.2f}",
                      f"{r.instrument_seconds * 1e3:.2f}", "yes" if r.changed else "no",
                      ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        t.add_row("", "total", f"{tim.total * 1e3:.2f}", f"{tim.total_verify * 1e3:.2f}",
                  f"{tim.total_instruments * 1e3:.2f}", "", "", style="bold")
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
        list[str] | None, typer.Option("--print-after", help="Print the IR after PASS (or say that it "
                                       "left the IR unchanged).")
    ] = None,
    dump_dir: Annotated[
        Path | None, typer.Option("--dump-dir", help="Write every step to numbered .ir files in a new "
                                  "or empty folder.")
    ] = None,
    timing: Annotated[bool, typer.Option("--timing", help="Print a timing table of the passes (each "
                                         "pass alone; verification and printing apart).")] = False,
    disable_pass: DisablePassOpt = None,
    stop_after: StopAfterOpt = None,
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
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.ir.printer import print_graph

    from .summary import summary_tables

    pipeline = _full_pipeline(pipeline, quant, quant_config, lora_rank, lora_alpha, lora_targets,
                              lora_adapter)
    if tp != 1 or ep != 1:
        pipeline = ",".join(x for x in (pipeline, f"split{{tp={tp},ep={ep},rank={rank}}}") if x)
    elif rank:
        raise ErnieIRError("--rank needs --tp and/or --ep (a one-rank graph has rank 0 only)")
    graph = _load_rewritten(model, pipeline, trust_pickle=trust_pickle, meta=meta,
                            print_before=_split(print_before), print_after=_split(print_after),
                            dump_dir=dump_dir, timing=timing, disable_pass=disable_pass,
                            stop_after=stop_after)
    if summary:
        for table in summary_tables(graph):
            out.print(table)
        return
    sys.stdout.write(print_graph(graph, with_hashes=hashes))


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
    from rich.markup import escape

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
    import numpy as np

    from ernie_ir.ir import ErnieIRError

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
    disable_pass: DisablePassOpt = None,
    stop_after: StopAfterOpt = None,
    trust_pickle: TrustOpt = False,
) -> None:
    """Run a model or an artifact on this machine's CPU (float32 where the CPU lacks bf16)."""
    import json

    import numpy as np

    from ernie_ir.ir import ErnieIRError
    from ernie_ir.ir.verifier import verify
    from ernie_ir.load import load_input
    from ernie_ir.runtime.compare import compare_logits

    pipeline = _full_pipeline(pipeline, quant, quant_config, lora_rank, lora_alpha, lora_targets,
                              lora_adapter)
    if (Path(model) / "manifest.json").is_file():
        from ernie_ir.targets import read_manifest, require_weights

        require_weights(Path(model), read_manifest(model))
    if backend not in ("interpreter", "onnxruntime", "paddle"):
        raise ErnieIRError(f"--backend {backend!r}: choose interpreter, onnxruntime or paddle")
    ids = _parse_tokens(tokens)
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
    if (disable_pass or stop_after is not None) and not pipeline:
        raise ErnieIRError("--disable-pass/--stop-after need a pipeline (--pipeline, --quant or --lora-*)")
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
        graph = _load_rewritten(model, pipeline, trust_pickle=trust_pickle, disable_pass=disable_pass,
                                stop_after=stop_after)
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
            with open(save_logits, "wb") as f:  # that path: np.save(path) would append .npy
                np.save(f, logits.astype(np.float32))
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
        str | None, typer.Option("--onnx-numerics", help="With --emit onnx: exact (float32 weight-only "
                          "matmuls, equal to the interpreter in any onnxruntime session) or fast (int8 "
                          "activations, faster).")
    ] = None,
    emit: Annotated[
        str | None, typer.Option("--emit", help="Executables to write, comma-separated: paddle, "
                                 "fastdeploy, onnx, paddle-inference (default: those that read the rank "
                                 "weights: paddle, plus fastdeploy for cuda inference).")
    ] = None,
    disable_pass: DisablePassOpt = None,
    stop_after: Annotated[str | None, typer.Option(
        "--stop-after", help="End the pipeline after pass NAME or the N-th pass and write the graph "
        "there to --out as a graph folder, not an artifact: for bisecting.")] = None,
    verbose: Annotated[bool, typer.Option(
        "--verbose", help="List every fallback's scope (without it: one line per reason, the "
        "first 3 scopes and how many more).")] = False,
) -> None:
    """Compile a model for a target into an artifact folder (written atomically)."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ernie_ir.ir import ErnieIRError
    from ernie_ir.targets import compile_model
    from ernie_ir.targets.cuda.packing import DEFAULT_CUDA_ARCH

    if cuda_arch is not None and target.strip().lower() != "cuda":
        raise ErnieIRError(f"--cuda-arch applies to --target cuda only, not {target}: drop it")
    arch = DEFAULT_CUDA_ARCH if cuda_arch is None else cuda_arch
    targets = [t.strip() for t in lora_targets.split(",") if t.strip()] if lora_targets else None
    # Progress goes to stderr, so --json output stays one clean object on stdout.
    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err.get(), transient=json_out,
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
                               onnx_numerics=onnx_numerics, emit=emit,
                               disabled_passes=_split(disable_pass), stop_after=stop_after)
    data = report.as_dict()
    if json_out:
        print(json.dumps(data, default=str))
        return
    for w in report.warnings:
        err.print(f"warning: {w}", markup=False)
    if report.stopped:
        out.print(f"{report.stopped}: wrote the graph folder {report.out} (not an artifact; "
                  f"`ernie-ir show {report.out}` prints it)", markup=False)
        return
    out.print(f"compiled {model} for {target} ({mode}) -> {report.out}", markup=False)
    if report.parallel:
        out.print(f"layout: {report.parallel}", markup=False)
    out.print(f"pipeline: {report.pipeline}", markup=False)
    out.print(f"executables: {', '.join(report.emit) or 'none (graph only)'}", markup=False)
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
    from ernie_ir.cli.compile_view import fallback_lines

    for line in fallback_lines(report.fallback_groups(), verbose=verbose):  # one line per reason
        out.print(line, markup=False)


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
                   console=err.get(), transient=False)
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
    """List the passes and presets (built-in and plugins), with their options' defaults."""
    from ernie_ir.passes.registry import REGISTRY, pass_listing

    for line in pass_listing(out.width):
        out.print(line, markup=False)
    if REGISTRY.broken:
        for b in REGISTRY.broken:
            err.print(f"error: plugin {b.name!r} ({b.target}) failed to load: {b.error}", markup=False)
        raise typer.Exit(2)


@app.command("ops")
def ops_cmd() -> None:
    """List the ops (built-in and plugins): inputs, attributes, lowerings and origin."""
    from rich.table import Table

    from ernie_ir.ir.registry import REGISTRY, all_ops
    from ernie_ir.targets.coverage import lowering_status

    t = Table(title="ops")
    for column in ("name", "inputs", "attrs", "onnx", "paddle", "origin"):
        t.add_column(column)
    for name, op in all_ops().items():
        ins = ", ".join(i.name + ("?" if i.optional else "") + ("..." if i.variadic else "")
                        for i in op.inputs)
        status = lowering_status(op)
        t.add_row(name, ins, ", ".join(op.Attrs.model_fields), status["onnx"], status["paddle"],
                  REGISTRY.origins.get(name, ""))
    out.print(t)
    for b in REGISTRY.broken:
        err.print(f"error: {b.describe()}", markup=False)
    if REGISTRY.broken:
        raise typer.Exit(2)


@app.command()
def explain(
    rule: Annotated[str, typer.Argument(help="A rewrite rule name (or a rewrite pass with one rule).")],
    model: ModelArg,
    pipeline: PipelineOpt = None,
    disable_pass: DisablePassOpt = None,
    stop_after: StopAfterOpt = None,
    trust_pickle: TrustOpt = False,
) -> None:
    """Say where a rewrite rule matches in a model, or why it does not."""
    from ernie_ir.passes import all_passes
    from ernie_ir.passes.rewrite import RuleSet, find_rule

    r = find_rule(rule, all_passes())
    graph = _load_rewritten(model, pipeline, trust_pickle=trust_pickle, disable_pass=disable_pass,
                            stop_after=stop_after)
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
    seq_len: Annotated[int | None, typer.Option(
        "--seq-len", help="Tokens per sequence (default 4096; the engine's --max-model-len).")] = None,
    batch: Annotated[int | None, typer.Option(
        "--batch", help="Sequences of full length in the KV cache; per training step (default 1).")] = None,
    engine: Annotated[str | None, typer.Option(
        "--engine", help="Serving engine modelled: fastdeploy (default for cuda inference) or none "
        "(the bare model).")] = None,
    max_model_len: Annotated[int | None, typer.Option(
        "--max-model-len", help="FastDeploy's flag: longest sequence (default: --seq-len).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        "--max-num-seqs", help="FastDeploy's flag: sequences scheduled at once (default 8).")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        "--gpu-memory-utilization", help="FastDeploy's flag: share of each device it uses (default 0.9).")
    ] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        "--max-num-batched-tokens", help="FastDeploy's flag: tokens of its profile run (default 8192).")
    ] = None,
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

    from ernie_ir.ir import ErnieIRError
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
                         moment_dtype=moment_dtype, kv_cache_dtype=kv_cache_dtype, reserve=reserve,
                         engine=engine, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         gpu_memory_utilization=gpu_memory_utilization,
                         max_num_batched_tokens=max_num_batched_tokens)
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


StructureOnlyOpt = Annotated[bool, typer.Option(
    "--structure-only", help="Compare structure only, not param values (goldens record a content "
    "hash per param).")]


def _golden(paths: list[str] | None, update: bool, structure_only: bool = False) -> None:
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.testing.golden import check_goldens

    if not paths:
        default = Path("tests/golden")
        if not default.is_dir():
            raise ErnieIRError("no PATHS given and ./tests/golden does not exist: name golden files "
                               "or folders, or run from the project root")
        paths = [str(default)]
    results = check_goldens(paths, update=update, structure_only=structure_only)
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
def golden_check(paths: Annotated[list[str] | None, typer.Argument(help="Golden files or folders.")] = None,
                 structure_only: StructureOnlyOpt = False) -> None:
    """Check golden files (default: ./tests/golden): structure and param values; exit 1 and
    show diffs on mismatch."""
    _golden(paths, update=False, structure_only=structure_only)


@golden_app.command("update")
def golden_update(paths: Annotated[list[str] | None, typer.Argument(help="Golden files or folders.")] = None,
                  structure_only: StructureOnlyOpt = False) -> None:
    """Rewrite the golden files that fail (and only those), with a hash per param."""
    _golden(paths, update=True, structure_only=structure_only)


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


def _is_user_error(e: BaseException) -> bool:
    """An ErnieIRError; looked up, not imported: if the library's errors were never loaded, no
    command got as far as raising one (and `--bogus` should not pay for importing them)."""
    errors = sys.modules.get("ernie_ir.ir.errors")
    return errors is not None and isinstance(e, errors.ErnieIRError)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is so that it cleans up as on Ctrl-C (temp folders)."""


_signalled: list[int] = []


def _on_sigterm(signum: int, _frame: object) -> None:
    import signal

    signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
    _signalled.append(signum)
    raise Terminated()


def _interrupted() -> int:
    """128 + the signal: 130 for Ctrl-C (SIGINT), 143 for SIGTERM."""
    return 128 + (_signalled[0] if _signalled else 2)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: user and usage errors become one line and exit code 2;
    Ctrl-C and SIGTERM clean up and exit 130 and 143."""
    import signal
    import threading
    import warnings

    _signalled.clear()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        _run(argv)
    finally:  # main() called in-process (tests) leaves the caller's handlers
        warnings.showwarning = shown
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """A Python warning (ours or a library's) as one `warning:` line, never a multi-line dump."""
    err.print(f"warning: {' '.join(str(message).split())}", markup=False)


def _run(argv: list[str] | None) -> None:
    try:
        code = app(args=argv, standalone_mode=False)  # typer returns 130 for a KeyboardInterrupt
        if _signalled:
            err.print("aborted", markup=False)
            sys.exit(_interrupted())
    except BrokenPipeError:
        sys.exit(0)
    except KeyboardInterrupt:
        err.print("aborted", markup=False)
        sys.exit(_interrupted())
    except MemoryError:  # numpy or Paddle could not allocate: one line, not a traceback
        err.print("[bold red]error:[/] out of memory: the model or the input is too large for this "
                  "machine; try --meta, a smaller model, fewer tokens or a smaller batch", markup=True)
        sys.exit(2)
    except RecursionError:  # a reader without its own depth check met a deeply nested input
        err.print("[bold red]error:[/] an input nests too deeply to read (thousands of brackets or "
                  "indents): check the files and options given", markup=True)
        sys.exit(2)
    except Exception as e:
        from rich.markup import escape

        if _is_user_error(e):
            one_line = " ".join(str(e).splitlines())  # a name holding a newline must not split the line
            err.print(f"[bold red]error:[/] {escape(one_line)}", markup=True)
            sys.exit(2)
        usage = _usage_error(e)
        if usage is None:
            if type(e).__name__ == "Abort":
                if isinstance(e.__cause__, EOFError):  # click turns any EOFError into Abort
                    why = escape(str(e.__cause__) or "end of file")
                    err.print(f"[bold red]error:[/] an input ended early ({why}): a file given is empty "
                              "or truncated", markup=True)
                    sys.exit(2)
                err.print("aborted", markup=False)
                sys.exit(_interrupted())
            raise
        message, status = usage
        if not message.startswith(" (see"):  # bare `ernie-ir`: the help was the answer
            err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
        sys.exit(status)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()

__all__ = ["app", "main"]
