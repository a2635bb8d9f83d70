"""`ernie-ir plan`: per-rank device memory of a model compiled for a target (the tables are
plan_view.py, the figures ernie_ir.planning)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import LoraRankOpt, ModelArg, QuantOpt, out

PlanTargetOpt = Annotated[str | None, typer.Option(
    "--target", "-t", help="cuda, ascend, kunlun or a plugin's target; an artifact: the one it was compiled "
    "for (the default).")]
PlanTpOpt = Annotated[int | None, typer.Option(
    "--tp", "--tensor-parallel-size", help="Tensor-parallel degree (default 1); --tensor-parallel-size is "
    "FastDeploy's name for it.")]
PlanDpOpt = Annotated[int | None, typer.Option(
    "--dp", help="Training: data-parallel replicas (default 1); --batch stays per replica.")]
PlanShardingOpt = Annotated[str | None, typer.Option(
    "--sharding", help="Training, with --dp > 1 or --devices: ZeRO stage1 (optimizer states / dp) or "
    "stage2 (gradients too); ERNIEKit's `sharding:`.")]
PlanDevicesOpt = Annotated[int | None, typer.Option(
    "--devices", help="Training: lay out this many devices (max(tp, ep) x dp), smallest model-parallel "
    "group that fits first, dp filling the rest.")]

MomentDtypeOpt = Annotated[str | None, typer.Option(
    "--moment-dtype", help="AdamW moments: float32 (fp32, default) or bf16 (an artifact: as it records).")]


def plan(
    model: ModelArg,
    target: PlanTargetOpt = None,
    quant: QuantOpt = None,
    tp: PlanTpOpt = None,
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
    dp: PlanDpOpt = None,
    sharding: PlanShardingOpt = None,
    devices: PlanDevicesOpt = None,
    sp: Annotated[bool, typer.Option(
        "--sp", help="Training, tp > 1: sequence parallelism (modelled): the residual stream and norms on "
        "token shards.")] = False,
    pp: Annotated[int | None, typer.Option(
        "--pp", help="Training: pipeline stages at layer boundaries (modelled); devices = max(tp, ep) x pp "
        "x dp.")] = None,
    micro_batches: Annotated[int | None, typer.Option(
        "--micro-batches", help="Training: micro-batches per step (1F1B), each --batch / M sequences "
        "(default 1).")] = None,
    device_memory: Annotated[str | None, typer.Option(
        "--device-memory", help="Per device: 80GiB, 80G or 80GB (all binary). Without --tp/--ep: "
        "search the smallest device count that fits.")] = None,
    moment_dtype: MomentDtypeOpt = None,
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
    from ernie_ir.planning import PlanRequest, plan_memory, plan_target
    from ernie_ir.planning.request import check_replica_flags, plan_sharding
    from ernie_ir.targets import CompileOptions
    from ernie_ir.targets.compile import check_arch_flag

    from .plan_view import plan_lines, plan_table, search_table, serve_lines

    target = plan_target(model, target)
    check_arch_flag(target, cuda_arch)
    if plot is not None and (plot.suffix.lower() != ".svg" or not plot.parent.is_dir()):
        raise ErnieIRError(f"--plot {plot}: give a .svg file in an existing folder")
    stage = plan_sharding(sharding)  # the planner's words for dp/sharding/devices, before compile's
    check_replica_flags(mode, dp, stage, devices)
    options = CompileOptions(mode=mode, quant=quant, lora_rank=lora_rank, cuda_arch=cuda_arch, tp=tp, ep=ep,
                             dp=dp, sharding=stage, sp=sp or None, pp=pp, micro_batches=micro_batches)
    request = PlanRequest(seq_len=seq_len, batch=batch, offload_optimizer=offload_optimizer or None,
                          recompute=recompute, device_memory=device_memory, moment_dtype=moment_dtype,
                          kv_cache_dtype=kv_cache_dtype, reserve=reserve, engine=engine,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          gpu_memory_utilization=gpu_memory_utilization,
                          max_num_batched_tokens=max_num_batched_tokens, devices=devices)
    result = plan_memory(model, target, options, request)
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
    for line in [*(f"note: {note}" for note in result.notes), *serve_lines(result)]:
        out.print(line, markup=False)
    if plot is not None:
        out.print(f"plot: {plot}", markup=False)
