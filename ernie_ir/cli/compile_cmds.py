"""`ernie-ir compile` (a model into an artifact folder), `ernie-ir export` (a model, its LoRA adapter
merged, into a published float checkpoint folder) and `ernie-ir verify` (an artifact's files
against its manifest). The report's fallback lines are compile_view.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .common import (
    CalibDataOpt,
    CalibSamplesOpt,
    CalibSeqLenOpt,
    CheckpointOpt,
    DisablePassOpt,
    DpOpt,
    EpOpt,
    LoraAdapterOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    MergeLoraOpt,
    MetaOpt,
    ModelArg,
    PipelineOpt,
    QuantConfigOpt,
    QuantOpt,
    ShardingOpt,
    TpOpt,
    TrustOpt,
    err,
    out,
    progress_bar,
    split_names,
)

if TYPE_CHECKING:
    from ernie_ir.targets import CompileOptions


def compile(
    model: ModelArg,
    target: Annotated[str, typer.Option("--target", "-t", help="cuda, ascend, kunlun or a plugin's target.")],
    quant: QuantOpt = None,
    mode: Annotated[str, typer.Option("--mode", help="inference or training.")] = "inference",
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_adapter: LoraAdapterOpt = None,
    merge_lora: MergeLoraOpt = False,
    quant_config: QuantConfigOpt = None,
    calib_data: CalibDataOpt = None,
    calib_samples: CalibSamplesOpt = None,
    calib_seq_len: CalibSeqLenOpt = None,
    tp: TpOpt = 1,
    ep: EpOpt = 1,
    sp: Annotated[bool, typer.Option(
        "--sp", help="Sequence parallelism (needs --tp 2+): the residual stream and norms on token "
        "shards of the B*S tokens, reduce-scatter / all-gather around the parallel blocks.")] = False,
    pp: Annotated[int, typer.Option(
        "--pp", help="Pipeline parallelism: cut every rank graph into N stages at decoder-layer boundaries "
        "(pp x tp processes; run / train on paddle.distributed).")] = 1,
    micro_batches: Annotated[int | None, typer.Option(
        "--micro-batches", help="With --pp: micro-batches each batch is cut into by the schedule (training: "
        "must divide the batch size; train --micro-batches overrides).")] = None,
    dp: DpOpt = None,
    sharding: ShardingOpt = None,
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
    checkpoint: CheckpointOpt = None,
    freeze: Annotated[list[str] | None, typer.Option(
        "--freeze", help="--mode training without LoRA or QAT trains every float param; keep params whose "
        "name or module a REGEX fully matches fixed, e.g. '.*embed_tokens' (repeatable).")] = None,
    moment_dtype: Annotated[str | None, typer.Option(
        "--moment-dtype", help="--mode training: AdamW's moments, float32 (default) or bf16; the params "
        "train in bf16 with f32 master weights (recorded in training/train.json).")] = None,
    offload_optimizer: Annotated[bool, typer.Option(
        "--offload-optimizer", help="--mode training: keep the optimizer states (moments, f32 masters) in "
        "host memory (recorded in training/train.json; `plan` sizes it).")] = False,
    onnx_numerics: Annotated[
        str | None, typer.Option("--onnx-numerics", help="With --emit onnx: weight-only (default: "
                          "float32 activations, weights dequantized in float32), exact (equal to the "
                          "interpreter in any onnxruntime session) or fast (int8 activations).")
    ] = None,
    emit: Annotated[
        str | None, typer.Option("--emit", help="Executables to write, comma-separated: paddle, "
                                 "fastdeploy, onnx, paddle-inference (default: those that read the rank "
                                 "weights: paddle, plus fastdeploy for cuda inference).")
    ] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(
        "--kv-cache-dtype", help="Inference: the dtype the decoders keep their KV cache in (f32, bf16, "
        "f16; default: the attention's).")] = None,
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

    from ernie_ir.cli.compile_view import report_lines
    from ernie_ir.targets import CompileOptions, compile_model
    from ernie_ir.targets.compile import check_arch_flag

    check_arch_flag(target, cuda_arch)
    targets = [t.strip() for t in lora_targets.split(",") if t.strip()] if lora_targets else None
    flags = dict(
        mode=mode, pipeline=pipeline, quant=quant, quant_config=quant_config, calib_data=calib_data,
        calib_samples=calib_samples, calib_seq_len=calib_seq_len, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_targets=targets, lora_adapter=lora_adapter,
        merge_lora=merge_lora, tp=tp, ep=ep, sp=sp, pp=pp, micro_batches=micro_batches, dp=dp,
        sharding=sharding, cuda_arch=cuda_arch, emit=emit, onnx_numerics=onnx_numerics,
        kv_cache_dtype=kv_cache_dtype, out=out_dir, force=force, trust_pickle=trust_pickle, meta=meta,
        disabled_passes=split_names(disable_pass), stop_after=stop_after, checkpoint=checkpoint,
        freeze=tuple(freeze or ()), moment_dtype=moment_dtype, offload_optimizer=offload_optimizer)
    options = _tokenized_calibration(model, flags, CompileOptions.from_flags(**flags))
    # Progress goes to stderr, so --json output stays one clean object on stdout.
    with progress_bar(transient=json_out) as progress:
        report = compile_model(model, target, options, progress=progress)
    if json_out:
        print(json.dumps(report.as_dict(), default=str))
        return
    for w in report.warnings:
        err.print(f"warning: {w}", markup=False)
    for item in report_lines(report, verbose=verbose):
        out.print(item, markup=False)
    if meta or model.endswith("@meta"):  # no data is read at @meta: say what calibrating would cost
        _print_calibration_estimate(model, report.pipeline, calib_samples, calib_seq_len)


def _tokenized_calibration(model: str, flags: dict[str, Any], options: CompileOptions) -> CompileOptions:
    """`options` (checked as the user gave them) with a text --calib-data tokenized once with MODEL's
    tokenizer into the .npy of ids the passes read (`finetune.calib_text`)."""
    from ernie_ir.finetune.calib_text import calibration_ids
    from ernie_ir.targets import CompileOptions

    given = options.quant.calib_data if options.quant is not None else None
    if given is None:
        return options
    ids = calibration_ids(given, model)
    return options if ids == given else CompileOptions.from_flags(**{**flags, "calib_data": ids})


def _print_calibration_estimate(model: str, pipeline: str, samples: int | None, seq_len: int | None) -> None:
    from .plan_view import calibration_line

    line = calibration_line(model, pipeline, samples, seq_len)
    if line is not None:
        out.print(line, markup=False)


def export_cmd(
    model: Annotated[str, typer.Argument(
        help="An .ir file, a graph folder, a model folder, a built-in name, a full-parameter training "
        "artifact, or an ERNIEKit export config (CONFIG.yaml), as erniekit export takes it.")],
    overrides: Annotated[list[str] | None, typer.Argument(
        help="After CONFIG.yaml: key=value overrides of its keys, read as erniekit's command line reads them "
        "(output_dir=out/lora model_name_or_path=/path/to/folder).", show_default=False)] = None,
    out_dir: Annotated[Path | None, typer.Option(
        "--out", help="Checkpoint folder to write (a new one, or one export wrote with --force); with "
        "CONFIG.yaml: default OUTPUT_DIR-export beside an artifact, else OUTPUT_DIR/export.")] = None,
    lora_adapter: LoraAdapterOpt = None,
    pipeline: PipelineOpt = None,
    layout: Annotated[str, typer.Option(
        "--layout", help="paddle (default): the published -Paddle layout (ernie. keys, fused qkv and "
        "up_gate, [in, out]) that FastDeploy serves and paddleformers loads; pt: the -PT layout "
        "transformers loads (model. keys, separate q/k/v and gate/up projections, [out, in]; ERNIE 4.5 "
        "only). Both keep the model's dtype.")] = "paddle",
    checkpoint: Annotated[str | None, typer.Option(
        "--checkpoint", help="MODEL a full-parameter training artifact: export this checkpoint of it: "
        "latest (the default), a run name (run-002-step-30) or its path.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a checkpoint folder export wrote.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    trust_pickle: TrustOpt = False,
) -> None:
    """Write a model as a published float checkpoint folder (config.json + model.safetensors in
    ERNIE 4.5's Paddle layout, or with --layout pt the -PT layout, tokenizer files), its LoRA
    adapter merged (W + scale * A @ B, rounded once to the weight's dtype): what FastDeploy
    serves, paddleformers / transformers load and `ernie-ir compile` reads (written atomically).
    MODEL may be a full-parameter training artifact: its trained weights (newest checkpoint, or
    --checkpoint), rounded once to the model's dtype. MODEL may be an ERNIEKit export config
    (`erniekit export CONFIG.yaml key=value ...`): the run in its output_dir is exported."""
    import json

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ernie_ir.ir import ErnieIRError
    from ernie_ir.targets.export import erniekit_export_plan, export_checkpoint
    from ernie_ir.training.erniekit_config import erniekit_export

    if Path(model).suffix.lower() in (".yaml", ".yml", ".json") and Path(model).is_file():
        if lora_adapter is not None:
            raise ErnieIRError(f"--lora-adapter: {model} is an ERNIEKit export config, whose output_dir "
                               "names the run to merge: drop --lora-adapter (or give output_dir=DIR)")
        plan = erniekit_export_plan(erniekit_export(Path(model), overrides or []), out_dir)
        for note in plan.notes:  # stderr: stdout stays the report (or the JSON)
            err.print(f"note: {note}", markup=False, highlight=False)
        model, out_dir, lora_adapter = plan.model, plan.out, plan.lora_adapter
    elif overrides:
        raise ErnieIRError(f"{overrides[0]}: key=value overrides follow an ERNIEKit export config "
                           "(ernie-ir export CONFIG.yaml key=value ...); for a model give flags (--out, "
                           "--lora-adapter)")
    if out_dir is None:
        raise ErnieIRError("--out: not given: name the checkpoint folder to write (--out exported/model)")

    with Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err.get(), transient=json_out,
                  disable=not err.is_terminal) as bar:
        task = bar.add_task("weights", total=None)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=stage)

        report = export_checkpoint(model, out_dir, lora_adapter=lora_adapter, pipeline=pipeline,
                                   layout=layout, checkpoint=checkpoint, force=force,
                                   trust_pickle=trust_pickle, progress=progress)
    if json_out:
        print(json.dumps(report.as_dict(), default=str))
        return
    merged = (f", {report.merged} adapted layer(s) of {report.lora_adapter} merged" if report.lora_adapter
              else f", {report.merged} adapted layer(s) merged" if report.merged else "")
    layout_note = ", -PT layout" if report.layout == "pt" else ""
    out.print(f"exported {model} -> {report.out} ({report.tensors} tensors{merged}{layout_note})",
              markup=False)
    if report.checkpoint:
        out.print(f"trained weights: {report.checkpoint}", markup=False)
    if report.pipeline:
        out.print(f"pipeline: {report.pipeline}", markup=False)
    sizes = ", ".join(f"{d} {v['count']} / {v['bytes']:,} B" for d, v in report.params.items())
    out.print(f"params by dtype: {sizes}", markup=False)


def verify_cmd(artifact: Annotated[Path, typer.Argument(help="An artifact folder.")]) -> None:
    """Re-check the sha256 of every file of an artifact against its manifest, and load every rank
    graph's IR (one per rank graph of its layout) with each attribute and type checked."""
    from ernie_ir.artifacts import check_rank_graphs
    from ernie_ir.targets import verify_artifact

    manifest = verify_artifact(artifact)
    files = manifest.files
    graphs = check_rank_graphs(artifact, manifest)
    layout = f"{graphs} rank graphs: {manifest.mapping.describe()}" if graphs > 1 else "1 rank graph"
    out.print(f"ok: {artifact} ({len(files)} files match the manifest; {layout})", markup=False)
