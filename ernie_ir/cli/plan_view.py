"""Rich tables of a memory plan (`ernie-ir plan`): one column per group of identical ranks."""

from __future__ import annotations

from rich.table import Table

from ernie_ir.planning import CATEGORIES, MemoryPlan, RankMemory, format_bytes
from ernie_ir.planning.plan import SHARDED

from .numbers import count


def _groups(plan: MemoryPlan) -> list[tuple[str, int]]:
    """(label, index of a representative rank) for runs of ranks with the same figures."""
    out: list[tuple[str, int]] = []
    start = 0
    ranks = plan.per_rank
    for i in range(1, len(ranks) + 1):
        if i == len(ranks) or (ranks[i].by_category, ranks[i].host_by_category, ranks[i].stage) != (
                ranks[start].by_category, ranks[start].host_by_category, ranks[start].stage):
            label = f"rank {start}" if i - 1 == start else f"ranks {start}-{i - 1}"
            if plan.pp > 1:
                label += f" (stage {ranks[start].stage})"
            out.append((label, start))
            start = i
    return out


def _serves_fastdeploy(target: str) -> bool:
    """Whether FastDeploy could serve `target`'s inference artifacts (the engine plan applied)."""
    from ernie_ir.targets.registry import find_target

    tgt = find_target(target)
    return tgt is not None and "fastdeploy" in tgt.executables


def serve_lines(plan: MemoryPlan) -> list[str]:
    """How FastDeploy serves what a cuda inference plan models, with the plan's engine flags (the
    layout it chose): an artifact with a FastDeploy folder, the command for it; an ERNIE 4.5
    model, the command for the folder `compile --emit fastdeploy` would write, or why FastDeploy
    could not load one. Nothing for other models, artifacts without the folder, or engine none."""
    from pathlib import Path

    from ernie_ir.artifacts import read_manifest
    from ernie_ir.backends.fastdeploy import fastdeploy_refusal_for
    from ernie_ir.formats.fastdeploy import LoadableCell, ServeLimits, is_ernie45, serve_command
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.load import load_input

    eng = plan.engine_settings
    if eng is None:
        return []
    limits = ServeLimits(eng.max_model_len, eng.max_num_seqs, eng.gpu_memory_utilization,
                         eng.max_num_batched_tokens)
    if (Path(plan.model) / "manifest.json").is_file():  # an artifact: its own folder, if it has one
        if "fastdeploy" not in (read_manifest(plan.model).formats or []):
            return []
        return [f"serve with FastDeploy: {serve_command(plan.model, plan.tp, limits)}"] if plan.fits else []
    folder = Path(plan.model)
    try:  # the model as the planner reads it: a checkpoint folder's config.json alone
        graph = load_input(plan.model, meta=folder.is_dir() and not (folder / "graph.ir").is_file())
    except ErnieIRError:
        return []
    if not is_ernie45(graph):
        return []
    if plan.quant is None and plan.lora_rank is None and plan.ep == 1 and (folder / "config.json").is_file():
        # what this plan models: FastDeploy serving the bf16 checkpoint folder itself
        return [f"serve with FastDeploy: {serve_command(plan.model, plan.tp, limits, ours=False)}"
                ] if plan.fits else []
    cell = LoadableCell(plan.quant, False, plan.tp, plan.ep, plan.lora_rank is not None)  # moe: the graph's
    why = fastdeploy_refusal_for(graph, cell)
    if why is not None:
        return [f"serve with FastDeploy: no folder FastDeploy loads from this compile: {why}"]
    return [f"serve with FastDeploy (compile with --emit fastdeploy --tp {plan.tp} --out ART): "
            + serve_command("ART", plan.tp, limits)] if plan.fits else []


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The plan's headline: model, layout, engine, verdict, search result."""
    eng = plan.engine_settings
    lines = [f"{plan.model} on {plan.target}"
             + (f" (sm{plan.cuda_arch})" if plan.cuda_arch else "")
             + f", {plan.mode}, quant {plan.quant or 'none'}"
             + (f", LoRA rank {plan.lora_rank}" if plan.lora_rank else "")
             + (f", seq_len {plan.seq_len} x batch {plan.batch}" if eng is None else ""),
             f"pipeline: {plan.pipeline}",
             f"layout: {plan.devices} device(s), tp {plan.tp}, ep {plan.ep}"
             + (f", dp {plan.dp}, sharding {plan.sharding}" if plan.mode == "training" else "")
             + (f", pp {plan.pp}" if plan.pp > 1 else "") + (", sp" if plan.sequence_parallel else "")
             + (f", {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else "")
             + (f" (per rank: replica 0's {_ranks(len(plan.per_rank))}; every replica holds the same)"
                if plan.dp > 1 else "")]
    if eng is not None:
        lines.insert(1, f"engine: fastdeploy, --max-model-len {eng.max_model_len} --max-num-seqs "
                     f"{eng.max_num_seqs} --gpu-memory-utilization {eng.gpu_memory_utilization:g} "
                     f"--max-num-batched-tokens {eng.max_num_batched_tokens} (--engine none: the bare model)")
    elif plan.mode == "inference" and _serves_fastdeploy(plan.target):
        lines.insert(1, "engine: none (the bare model: all of the device, one prefill of seq_len tokens)")
    verdict = "fits" if plan.fits else "does NOT fit"
    where = (format_bytes(plan.device_memory_bytes) if eng is None else
             f"{format_bytes(eng.usable_bytes)} of {format_bytes(plan.device_memory_bytes)} "
             f"(gpu_memory_utilization {eng.gpu_memory_utilization:g})")
    lines.append(f"{verdict} in {where} per device"
                 + ("" if plan.device_memory_given else " (default; set --device-memory)")
                 + f": largest rank {format_bytes(plan.max_rank_bytes)}, headroom "
                 + f"{format_bytes(plan.headroom_bytes)}")
    if eng is not None:
        kv = min((r.kv_detail for r in plan.per_rank), key=lambda d: d["blocks"])
        need = "one sequence" if eng.required_sequences == 1 else f"{eng.required_sequences} sequences"
        lines.append(f"KV cache: {count(kv['blocks'])} blocks of {eng.block_size} tokens after the profile "
                     f"run (the engine needs {count(kv['blocks_needed'])}: {need} of max_model_len "
                     f"{eng.max_model_len} + 2 blocks); they hold {count(kv['sequences'])} sequences of "
                     f"max_model_len, --max-num-seqs {eng.max_num_seqs}")
    if plan.searched and plan.search_devices is not None:
        lines.append(f"layout search over {plan.search_devices} devices: "
                     + (f"tp {plan.tp}, ep {plan.ep}, dp {plan.dp} fits (smallest model-parallel group "
                        "first)" if plan.fits else "none of the layouts tried fits"))
    elif plan.searched:
        lines.append(f"min_devices: {plan.min_devices}" if plan.min_devices is not None
                     else "min_devices: none of the layouts tried fits")
    if plan.stages:
        lines.append("pipeline stages (1F1B, worst stage is the largest rank): " + "; ".join(
            f"stage {st.stage}: layers {st.layers[0]}-{st.layers[1]}"
            + (" + embedding" if st.embedding else "") + (" + head/loss" if st.head else "")
            + f", {st.in_flight} micro-batch(es) in flight" for st in plan.stages)
            + f"; bubble {plan.bubble_fraction:.1%}")
    if plan.mode == "training":
        d = max(plan.per_rank, key=lambda r: r.total_bytes).activation_detail
        lines.append(f"activations (largest rank): {format_bytes(int(d['peak_with_recompute_bytes']))} with "
                     f"--recompute, {format_bytes(int(d['peak_without_recompute_bytes']))} without")
        lines.append(f"trainable: {plan.trainable} ({count(plan.trainable_params)} params per rank)"
                     + (f"; host memory (offloaded optimizer states): {format_bytes(plan.host_total_bytes)} "
                        "over all ranks" if plan.host_total_bytes else ""))
        if plan.sharding != "none":
            lines.append(sharding_line(plan))
    calibration = calibration_line(plan.model, plan.pipeline)
    if calibration is not None:
        lines.append(calibration)
    return lines


def calibration_line(model: str, pipeline: str, samples: int | None = None,
                     seq_len: int | None = None) -> str | None:
    """For a pipeline that calibrates weights (method=gptq's `calibrated-quant`): the calibration's
    CPU time and peak memory, estimated from MODEL's config (`planning.calib_cost`); else None."""
    from ernie_ir.planning.calib_cost import DEFAULT_WINDOWS, calibration_note

    if "calibrated-quant" not in pipeline:
        return None
    note = calibration_note(model, samples or DEFAULT_WINDOWS, seq_len)
    return None if note is None else f"calibration: {note}"


def _sharded(rank: RankMemory, cat: str) -> int:
    """A category's bytes on this rank after the sharding division, device and host together."""
    return rank.by_category[cat] + rank.host_by_category.get(cat, 0)


def _ranks(n: int) -> str:
    return "rank 0" if n == 1 else f"ranks 0-{n - 1}"


def sharding_line(plan: MemoryPlan) -> str:
    """What ZeRO sharding divides on the largest rank: each category before -> after."""
    r = max(plan.per_rank, key=lambda m: m.total_bytes)
    divided = SHARDED[plan.sharding]
    parts = [f"{c} {format_bytes(r.unsharded_bytes[c])} -> {format_bytes(_sharded(r, c))}"
             for c in divided if r.unsharded_bytes.get(c)]
    kept = [f"{c} {format_bytes(r.unsharded_bytes[c])} not divided (stage2 divides them)"
            for c in ("gradients",) if c not in divided and r.unsharded_bytes.get(c)]
    where = " (offloaded: host memory)" if plan.host_total_bytes else ""
    return (f"sharding {plan.sharding} over dp {plan.dp}, largest rank: " + ", ".join([*parts, *kept])
            + f"; saves {format_bytes(r.sharding_saved_bytes)} per rank{where}")


def plan_table(plan: MemoryPlan) -> Table:
    """Categories (rows) by rank group (columns), device total and headroom last."""
    groups = _groups(plan)
    t = Table(title="device memory per rank")
    t.add_column("category")
    for label, _ in groups:
        t.add_column(label, justify="right")
    ranks = plan.per_rank
    divided = SHARDED[plan.sharding] if plan.dp > 1 else ()
    for cat in CATEGORIES:
        if any(ranks[i].by_category.get(cat, 0) for _, i in groups):
            label = "kv_cache (to start)" if cat == "kv_cache" and plan.engine_settings else cat
            label += f" (/{plan.dp} {plan.sharding})" if cat in divided else ""
            t.add_row(label, *(format_bytes(ranks[i].by_category[cat]) for _, i in groups))
    t.add_row("total", *(format_bytes(ranks[i].total_bytes) for _, i in groups), style="bold")
    t.add_row("headroom", *(format_bytes(ranks[i].headroom_bytes) for _, i in groups))
    if divided and any(_without_sharding(ranks[i], divided, False) != ranks[i].total_bytes
                       for _, i in groups):
        t.add_row("total without sharding",
                  *(format_bytes(_without_sharding(ranks[i], divided, False)) for _, i in groups))
    if any(ranks[i].host_bytes for _, i in groups):
        t.add_row("host (offloaded)", *(format_bytes(ranks[i].host_bytes) for _, i in groups))
        if divided:
            t.add_row("host without sharding",
                      *(format_bytes(_without_sharding(ranks[i], divided, True)) for _, i in groups))
    return t


def _without_sharding(r: RankMemory, divided: tuple[str, ...], host: bool) -> int:
    """Rank r's device total (host: its host bytes) without the sharding division."""
    extra = sum(r.unsharded_bytes[c] - _sharded(r, c) for c in divided
                if (r.host_by_category.get(c, 0) > 0) == host)
    return (r.host_bytes if host else r.total_bytes) + extra


def search_table(plan: MemoryPlan) -> Table:
    t = Table(title="layouts tried (search order)")
    t.add_column("devices", justify="right")
    t.add_column("tp", justify="right")
    t.add_column("ep", justify="right")
    t.add_column("dp", justify="right")
    modelled = any(s.pp > 1 or s.sp for s in plan.search)  # pp / sp columns only where tried
    if modelled:
        t.add_column("pp", justify="right")
        t.add_column("sp")
    t.add_column("largest rank", justify="right")
    t.add_column("fits")
    for s in plan.search:
        t.add_row(str(s.devices), str(s.tp), str(s.ep), str(s.dp),
                  *((str(s.pp), "on" if s.sp else "off") if modelled else ()),
                  format_bytes(s.max_rank_bytes) if s.max_rank_bytes is not None else "-",
                  "yes" if s.fits else ("no" if s.fits is False else f"cannot build: {s.error}"))
    return t
