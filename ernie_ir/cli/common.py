"""What the commands share: the consoles, the option types and the pipeline flags.

`out` and `err` are rich Consoles made on first use. The option types (`ModelArg`,
`QuantOpt`, `LoraRankOpt`, `TrustOpt`, ...) are typer annotations, so a flag reads the
same in every command that takes it. `full_pipeline` and `load_rewritten` turn
--pipeline, --quant, --lora-* and the bisecting and printing flags into a rewritten graph.

Like every module of the CLI, this one imports nothing of the library at module level
(see app.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ernie_ir.ir import Graph


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


@contextmanager
def progress_bar(*, transient: bool = False,
                 show: bool | None = None) -> Iterator[Callable[[str, int, int], None]]:
    """A `progress(stage, done, total)` callback drawing one bar per stage on stderr (`show`
    None: a terminal only): one bar per first word of the stage ("pass", "weights", ...)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err.get(), transient=transient,
                  disable=not (err.is_terminal if show is None else show)) as bar:
        tasks: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            key = stage.split(" ")[0]
            if key not in tasks:
                tasks[key] = bar.add_task(stage, total=total)
            bar.update(tasks[key], completed=done, total=total, description=stage)

        yield progress


BUILTIN_TARGETS = ("cuda", "ascend", "kunlun")
"""The built-in targets (`ernie_ir.targets.registry.BUILTIN`, which a test keeps equal): the help
must not import the library."""
TARGET_ENTRY_POINTS = "ernie_ir.targets"


def target_names() -> list[str]:
    """The built-in targets, then those the installed `ernie_ir.targets` entry points name (read
    from the package metadata, not loaded)."""
    from importlib.metadata import entry_points

    names = list(BUILTIN_TARGETS)
    for ep in entry_points(group=TARGET_ENTRY_POINTS):
        if ep.name not in names:
            names.append(ep.name)
    return names


class TargetsInHelp(typer.core.TyperCommand):
    """A command whose `--target` help lists the targets installed now, plugins' included: filled
    in when the help is shown, so starting the CLI reads no package metadata."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        names = target_names()
        for param in self.params:
            if param.name == "target":
                param.help = f"{', '.join(names[:-1])} or {names[-1]} (built in, or added by a plugin)."
        super().format_help(ctx, formatter)


ModelArg = Annotated[
    str, typer.Argument(help="An .ir file, a graph folder, a model folder or a built-in name.")
]
PipelineOpt = Annotated[
    str | None,
    typer.Option("--pipeline", "-p", help="Passes to run: 'canonicalize,cse,dce' or a YAML file."),
]
QuantOpt = Annotated[
    str | None,
    typer.Option("--quant", "--quantization",
                 help="Quantization preset: none, wint8, wint4, wint8mix, qat-int8, fp8, w4a8c8, wint2 (or "
                 "an ERNIEKit/FastDeploy alias); w4a8c8 and wint2 take their pass's options: "
                 "'wint2{w4_end_layer=6}'. --quantization is FastDeploy's name for it."),
]
CalibDataOpt = Annotated[
    Path | None, typer.Option("--calib-data", help="A .npy of token ids [batch, seq], or a .jsonl of "
                              "text or ERNIEKit SFT chats (tokenized with the model's tokenizer), to "
                              "calibrate on: the "
                              "weights of method=gptq ('wint4{method=gptq}', required), or the static "
                              "activation scales of --quant w4a8c8 or fp8 (default: seeded random ids).")
]
CalibSamplesOpt = Annotated[
    int | None, typer.Option("--calib-samples", help="method=gptq: calibration windows to use (default 128, "
                             "or what --calib-data holds).")
]
CalibSeqLenOpt = Annotated[
    int | None, typer.Option("--calib-seq-len", help="method=gptq: tokens per calibration window (default "
                             "min(512, the model's max positions), or the length --calib-data holds).")
]
QuantConfigOpt = Annotated[
    Path | None, typer.Option("--quant-config", help="A YAML quantization config (rules by scope).")
]
LoraRankOpt = Annotated[int | None, typer.Option("--lora-rank", help="Insert LoRA adapters of rank R.")]
LoraAlphaOpt = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA alpha (default 2*rank).")]
LoraTargetsOpt = Annotated[
    str | None,
    typer.Option("--lora-targets", "--target-modules",
                 help="Comma-separated regexes, each matching a whole module name (e.g. '.*qkv_proj'); "
                 "--target-modules is peft's name for it."),
]
LoraAdapterOpt = Annotated[
    Path | None, typer.Option("--lora-adapter", help="Import a paddleformers LoRA adapter folder (or a "
                              "training checkpoint folder holding one in adapter/).")
]
MergeLoraOpt = Annotated[
    bool, typer.Option("--merge-lora", help="Fold the LoRA adapter (--lora-adapter DIR, or the model's "
                       "own) into the float base weights, W + scale * A @ B rounded once to the weight's "
                       "dtype, before --quant quantizes them.")
]
TrustOpt = Annotated[
    bool, typer.Option("--trust-pickle", help="Allow loading pickle-based .pdparams checkpoints.")
]
MetaOpt = Annotated[bool, typer.Option("--meta", help="Read a checkpoint folder's config.json only: "
                                       "the full-size graph without weights.")]
CheckpointOpt = Annotated[
    str | None,
    typer.Option("--checkpoint", help="MODEL a training artifact: compile this checkpoint of it: latest "
                 "(the default), a run name (run-002-step-30) or its path."),
]
TpOpt = Annotated[int, typer.Option(
    "--tp", "--tensor-parallel-size", help="Tensor-parallel degree (attention heads, FFN, vocab); "
    "--tensor-parallel-size is FastDeploy's name for it.")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel degree (whole routed experts per group).")]
DpOpt = Annotated[int | None, typer.Option(
    "--dp", help="Training: data-parallel replicas of the tp x ep ranks (dp x tp processes; each takes "
    "batch_size / dp rows of every batch).")]
ShardingOpt = Annotated[str | None, typer.Option(
    "--sharding", help="Training with --dp N: stage1 (optimizer states split over the replicas) or stage2 "
    "(also the gradients); none: off.")]
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


def full_pipeline(pipeline: str | None, quant: str | None, quant_config: Path | None,
                   lora_rank: int | None, lora_alpha: float | None, lora_targets: str | None,
                   lora_adapter: Path | None, merge_lora: bool = False,
                   calib_data: Path | None = None) -> str | None:
    """The user's --pipeline, then what the quantization and LoRA flags expand to."""
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.passes.quant.cli_flags import pipeline_for

    if pipeline and pipeline.endswith((".yaml", ".yml")) and (quant or quant_config or lora_rank
                                                              or lora_adapter or merge_lora):
        raise ErnieIRError("--pipeline FILE.yaml cannot be combined with --quant/--lora-* flags: "
                           "put those passes in the YAML file")
    targets = [t.strip() for t in lora_targets.split(",") if t.strip()] if lora_targets else None
    extra = pipeline_for(quant, quant_config, lora_rank, lora_alpha, targets, lora_adapter, merge_lora,
                         calib_data)
    parts = [p for p in (pipeline, extra) if p]
    return ",".join(parts) or None


def split_names(values: list[str] | None) -> list[str]:
    return [v.strip() for item in values or [] for v in item.split(",") if v.strip()]


def load_rewritten(model: str, pipeline: str | None, *, trust_pickle: bool, meta: bool = False,
                    print_before: Sequence[str] = (), print_after: Sequence[str] = (),
                    dump_dir: Path | None = None, timing: bool = False,
                    disable_pass: list[str] | None = None, stop_after: str | None = None) -> Graph:
    """MODEL loaded, verified, and rewritten by `pipeline` under the requested instruments."""
    from ernie_ir.ir.verifier import verify
    from ernie_ir.load import load_input

    graph = load_input(model, trust_pickle=trust_pickle, meta=meta)
    verify(graph)
    _run_pipeline(graph, pipeline, print_before=list(print_before), print_after=list(print_after),
                  dump_dir=dump_dir, timing=timing, disabled=split_names(disable_pass), stop_after=stop_after)
    return graph


def rewrite(graph: Graph, pipeline: str | None, *, disable_pass: list[str] | None = None,
            stop_after: str | None = None) -> Graph:
    """A loaded, verified graph rewritten by `pipeline` (what `load_rewritten` does after loading),
    for a command that checks its input against the model in between, before any pass runs or warns."""
    _run_pipeline(graph, pipeline, print_before=[], print_after=[], dump_dir=None, timing=False,
                  disabled=split_names(disable_pass), stop_after=stop_after)
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
    from ernie_ir.passes.infra.base import graph_properties
    from ernie_ir.passes.infra.pipeline import describe_restriction

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
    from ernie_ir.formats.paddleformers_adapter import read_adapter
    from ernie_ir.runtime import Interpreter

    result = run_pipeline(graph, pl, instruments=instruments, evaluator=Interpreter,
                          adapter_reader=read_adapter)
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


BackendOpt = Annotated[str, typer.Option(
    "--backend", help="auto (the fastest the artifact offers; a model: the interpreter), interpreter, "
    "or for an artifact: onnxruntime, paddle (several ranks: one paddle.distributed process per rank) "
    "or paddle-inference (the --emit paddle-inference decoder).")]


def chosen_backend(model: str, backend: str, *, as_compiled: bool = True) -> tuple[str, str | None]:
    """`--backend` as a backend name, and for `auto` the one line saying which and why (None for a
    named backend). The command prints it once its input has passed every check, so that a
    refusal stays the one line on stderr."""
    from ernie_ir.backends import resolve_backend

    choice = resolve_backend(model, backend, as_compiled=as_compiled)
    return (backend, None) if choice is None else (choice.name, choice.line())


def say_backend(note: str | None) -> None:
    """The line `chosen_backend` returned, on stderr (nothing for a backend the user named)."""
    if note is not None:
        err.print(note, markup=False)
