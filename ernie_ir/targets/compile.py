"""`compile_model`: a MODEL into an artifact for one target (the library behind `ernie-ir compile`)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ernie_ir.artifacts.manifest import Manifest
from ernie_ir.artifacts.publish import artifact_lock
from ernie_ir.artifacts.source_digests import source_sha256
from ernie_ir.artifacts.writer import ArtifactContents, check_out, write_artifact
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import Mapping
from ernie_ir.load import load_input, load_trained
from ernie_ir.passes import Pass, PassContext, PassInstrument
from ernie_ir.passes.infra.base import graph_properties
from ernie_ir.passes.infra.manager import run_pipeline_ranks
from ernie_ir.passes.infra.pipeline import Pipeline, describe_restriction, load_pipeline
from ernie_ir.passes.parallel.pipeline_stages import (
    PipelineStagesPass,
    check_pipeline,
    layer_count,
    pipeline_bounds,
)
from ernie_ir.passes.parallel.split import mapping_for
from ernie_ir.passes.quant.cli_flags import NO_QUANT, adapter_folder
from ernie_ir.targets.artifact import launch_recipe, launch_script
from ernie_ir.targets.capabilities import HardwareTarget
from ernie_ir.targets.coverage import check_coverage
from ernie_ir.targets.executables import (
    EmitSettings,
    backend_of,
    check_emit,
    default_emit,
    select_emitters,
    with_default_onnx,
)
from ernie_ir.targets.options import (
    DEFAULT_ONNX_NUMERICS,
    MODES,
    ONNX_NUMERICS,
    CompileOptions,
    ParallelLayout,
)
from ernie_ir.targets.registry import TargetError, all_targets, get_target

__all__ = ["DEFAULT_ONNX_NUMERICS", "MODES", "ONNX_NUMERICS", "CompileOptions", "CompileReport",
           "compile_model"]

@dataclass
class CompileReport:
    """What `compile_model` did. `params_before/after`: dtype -> {"count", "bytes"}."""

    model: str
    target: str
    mode: str
    pipeline: str
    out: str
    passes_run: list[str]
    params_before: dict[str, dict[str, int]]
    params_after: dict[str, dict[str, int]]
    kernel_plan: list[dict[str, Any]]
    fallbacks: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    cuda_arch: int | None = None
    parallel: str = ""
    """The layout (e.g. "world 2, tp 2"); empty for one rank."""
    onnx_numerics: str | None = None
    """"weight-only", "exact" or "fast" where an ONNX model was written, else None."""
    emit: list[str] = field(default_factory=list)
    """The executables written (see `executables.EXECUTABLES`)."""
    serve: str = ""
    """The command that serves the FastDeploy folder, where one was written (else empty): what its
    serve.sh runs with the default ports (`formats.fastdeploy.serve_command`: the tp, the limits
    `plan` models, the loader choice)."""
    stopped: str = ""
    """With `stop_after`: "stopped after P (pass i of N); not run: ..." and `out` is a graph
    folder (one `rank{r}/` per rank after a split), not an artifact; else empty."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def fallback_groups(self) -> list[FallbackGroup]:
        """`fallbacks` grouped by what fell back and why (see `group_fallbacks`)."""
        return group_fallbacks(self.fallbacks)


@dataclass(frozen=True)
class FallbackGroup:
    """The fallbacks that share an op, a kernel and a reason: one line of `compile`'s output."""

    op: str
    kernel: str
    reason: str
    scopes: tuple[str, ...]
    """One per fallback node, in plan order; a scope repeats where several nodes of one layer
    fall back alike (routed experts: up_gate and down)."""

    @property
    def count(self) -> int:
        """How many nodes fell back."""
        return len(self.scopes)

    def scope_counts(self) -> list[tuple[str, int]]:
        """(scope, nodes there) per distinct scope, in plan order."""
        counts: dict[str, int] = {}
        for s in self.scopes:
            counts[s] = counts.get(s, 0) + 1
        return list(counts.items())


_SHAPE = re.compile(r"\[\d+(?:, \d+)*\]")


def group_fallbacks(fallbacks: Sequence[dict[str, Any]]) -> list[FallbackGroup]:
    """The kernel plan's fallbacks (`{scope, op, kernel, reason}` each) grouped by (op, kernel,
    reason), groups in the order of their first fallback: a model whose every linear falls back
    for one reason is one group, not one entry per layer. A weight's shape in a reason
    ("no sm80 layout for [80, 112]: in_features 80 ...") is not part of it: weights of several
    shapes refused for the same cause are one group, whose reason names each distinct shape
    there, in plan order ("no sm80 layout for [80, 112], [80, 80]: ...")."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    shapes: dict[tuple[str, str, str], list[str]] = {}
    for f in fallbacks:
        raw = str(f.get("reason", ""))
        key = (str(f.get("op", "")), str(f.get("kernel", "")), _SHAPE.sub("[...]", raw))
        groups.setdefault(key, []).append(str(f.get("scope", "")))
        seen = shapes.setdefault(key, [])
        seen.extend(s for s in dict.fromkeys(_SHAPE.findall(raw)) if s not in seen)
    return [FallbackGroup(op, kernel, reason.replace("[...]", ", ".join(shapes[op, kernel, reason])),
                          scopes=tuple(scopes)) for (op, kernel, reason), scopes in groups.items()]


def params_by_dtype(graph: Graph) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for p in graph.params.values():
        d = out.setdefault(str(p.type.dtype), {"count": 0, "bytes": 0})
        numel = math.prod(int(x) for x in p.type.shape if isinstance(x, int))
        d["count"] += 1
        d["bytes"] += math.ceil(numel * p.type.dtype.bits / 8)
    return dict(sorted(out.items()))


def source_info(model: str, graph: Graph, *, meta: bool = False) -> dict[str, Any]:
    """The source model and sha256 of its files (a built-in: its name and a hash of its config;
    a folder read with `meta`: its config.json, the only file read). A file hashed by an earlier
    compile and unchanged since is not read again (`source_digests`)."""
    path = Path(model)
    trained = graph.metadata.get("trained")
    if isinstance(trained, dict) and (path / "manifest.json").is_file():  # ernie_ir.load.load_trained
        from ernie_ir.targets.artifact import read_manifest

        done = read_manifest(path)
        return {"model": model, "kind": "training-artifact", **trained,
                "trained_from": done.source, "trained_pipeline": done.pipeline}
    if path.is_file():
        return {"model": model, "kind": "file", "files": {path.name: source_sha256(path)}}
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and (not meta or p.name == "config.json"))
        return {"model": model, "kind": "folder",
                "files": {p.relative_to(path).as_posix(): source_sha256(p) for p in files}}
    config = graph.metadata.get("config", {})
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return {"model": model, "kind": "builtin", "config_sha256": digest,
            "weights": graph.metadata.get("weights", "")}


def default_out(model: str, target: str, quant: str | None) -> Path:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model.rstrip("/")).name or model).strip("-")
    q = "" if quant is None or quant.strip().lower() in NO_QUANT else f"-{quant.strip().lower()}"
    return Path("artifacts") / f"{stem}-{target}{re.sub(r'[^a-z0-9_.-]+', '-', q)}"


def target_arch(tgt: HardwareTarget, arch: int | None) -> int | None:
    """The value of `tgt`'s arch option (`HardwareTarget.arch_option`; cuda: --cuda-arch): `arch`,
    or the option's default for None; None for a target without one (`arch` is ignored there)."""
    opt = tgt.arch_option
    if opt is None:
        return None
    value = opt.default if arch is None else arch
    if value not in opt.choices:
        raise TargetError(f"unknown {opt.flag} {value}: choose one of {', '.join(map(str, opt.choices))}")
    return value


def check_arch_flag(target: str, arch: int | None, flag: str = "--cuda-arch") -> None:
    """Refuse `flag` (given: `arch` not None) for a target that has no such arch option (the CLI)."""
    tgt = get_target(target)
    if arch is None or (tgt.arch_option is not None and tgt.arch_option.flag == flag):
        return
    having = "/".join(t.name for t in all_targets().values()
                      if t.arch_option is not None and t.arch_option.flag == flag)
    raise TargetError(f"{flag} applies to --target {having or 'none'} only, not {target}: drop it")


def legalize_spec(tgt: HardwareTarget, arch: int | None) -> str:
    """The target's legalization pass in pipeline syntax: `legalize-cuda{cuda_arch=80}`, `legalize-ascend`."""
    opt = tgt.arch_option
    if opt is None or arch is None:
        return f"legalize-{tgt.name}"
    return f"legalize-{tgt.name}{{{opt.name}={arch}}}"


def check_target_options(tgt: HardwareTarget, options: CompileOptions) -> int | None:
    """The value of the target's arch option for `options` (None for a target without one);
    refuses, in one line, FP8 where the target or that arch has no FP8 kernels."""
    arch = target_arch(tgt, options.cuda_arch)
    quant = options.quant
    if quant is not None and quant.fp8:
        if not tgt.fp8:
            raise TargetError(f"--quant {quant.spelled} needs FP8 kernels, which {tgt.name} lacks: use "
                              "--target cuda --cuda-arch 89/90, or --quant wint8 / wint8mix")
        opt = tgt.arch_option
        if opt is not None and arch not in opt.fp8:
            hint = opt.fp8_hint or "another arch"
            raise TargetError(f"--quant {quant.spelled} needs FP8 kernels ({hint}): "
                              f"use {opt.flag} {' or '.join(map(str, opt.fp8))}")
    return arch


def compile_pipeline(graph: Graph, tgt: HardwareTarget, arch: int | None, quant_text: str,
                     pipeline: str | None, layout: ParallelLayout,
                     full_param: str = "") -> tuple[Pipeline, Mapping]:
    """The pipeline compile runs on `graph` and the layout it makes: the user's `pipeline`, then
    `quant_text` (quantization and LoRA: `CompileOptions.quant_text`), then `full_param`
    (`CompileOptions.full_param`: full-parameter training; left out when the model or the user's
    pipeline already trains LoRA or QAT), then `split{tp,ep,sp}`
    when the layout splits, then the target's legalization, then `pipeline-stages{pp}` when the
    layout pipelines (the cut of the legalized rank graphs; the Mapping returned is the tensor
    layout: the stages reach it from the stage graphs, `_final_layout`). Shared by
    `compile_model` and the memory planner."""
    parts: list[str] = []
    user_split = None
    user: Pipeline | None = None
    if pipeline:
        user = load_pipeline(pipeline, initial=graph_properties(graph))
        legalize = [p.name for p in user if p.name.startswith("legalize-")]
        if legalize:
            raise TargetError(f"--pipeline holds {legalize[0]}: compile appends legalize-{tgt.name} for "
                              f"--target {tgt.name} itself; drop it from --pipeline (or change --target)")
        cut = next((p for p in user if isinstance(p, PipelineStagesPass)), None)
        if cut is not None:
            raise TargetError(f"--pipeline holds {cut.spec()}: compile cuts the legalized rank graphs into "
                              "pipeline stages itself; drop it from --pipeline and give --pp")
        user_split = next((p for p in user if p.fans_out), None)
        if user_split is not None and layout.split:
            raise ErnieIRError(f"--tp/--ep and {user_split.spec()} in --pipeline both set the layout: "
                               "give one of them")
        parts.append(str(user))
    if quant_text:
        if user_split is not None:
            raise ErnieIRError(f"--pipeline splits the model ({user_split.spec()}) but --quant/--lora-* "
                               "passes run after it: quantize and add LoRA before splitting (put "
                               "them in --pipeline before split, or use --tp/--ep)")
        parts.append(quant_text)
    if full_param:
        parts.extend(_full_param_part(graph, user, user_split, full_param))
    if layout.split:
        mapping_for(graph, layout.tp, layout.ep)  # refuse an impossible layout before any pass runs
        parts.append(f"split{{tp={layout.tp},ep={layout.ep}{',sp=true' if layout.sp else ''}}}")
    parts.append(legalize_spec(tgt, arch))
    if layout.pp > 1:
        parts.append(f"{PipelineStagesPass.name}{{pp={layout.pp}}}")
    resolved = load_pipeline(",".join(parts), initial=graph_properties(graph))
    split = next((p for p in resolved if p.fans_out and not isinstance(p, PipelineStagesPass)), None)
    mapping = Mapping.create()
    if split is not None:
        opts = split.options
        mapping = mapping_for(graph, getattr(opts, "tp", 1), getattr(opts, "ep", 1))
        if getattr(opts, "sp", False):
            mapping = mapping.model_copy(update={"sp": True})
    return resolved, mapping


def _full_param_part(graph: Graph, user: Pipeline | None, user_split: Pass | None,
                     full_param: str) -> list[str]:
    """`full_param` as pipeline elements: none when the model or the user's pipeline already
    chooses the trainable params (LoRA, QAT, its own full-param); refused with --freeze then, and
    after a split in --pipeline (full-param runs before the split, as LoRA does)."""
    from ernie_ir.passes.finetune.full_param import TRAINS_ITS_OWN, FullParamError

    made = (graph_properties(graph) | {prop for p in (user or ()) for prop in p.produces}) \
        & (TRAINS_ITS_OWN | {"full-param"})
    if made:
        if full_param != "full-param":
            raise FullParamError(f"--freeze applies to compile's full-parameter training, and "
                                 f"{'--pipeline' if user else 'the model'} has {sorted(made)[0]}, which "
                                 "chooses the trainable params itself: drop --freeze")
        return []
    if user_split is not None:
        raise ErnieIRError(f"--pipeline splits the model ({user_split.spec()}) but full-param (--mode "
                           "training) runs after it: put full-param in --pipeline before split, or use "
                           "--tp/--ep")
    return [full_param]


class _ProgressInstrument(PassInstrument):
    """Reports each finished pass as compile progress."""

    def __init__(self, progress: Callable[[str, int, int], None], total: int) -> None:
        self.progress = progress
        self.total = total

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        self.progress(f"pass {p.name}", index, self.total)


def compile_model(model: str, target: str, options: CompileOptions | None = None, *,
                  progress: Callable[[str, int, int], None] | None = None) -> CompileReport:
    """Load `model`, run the user's pipeline + quant/LoRA + split + `legalize-<target>`, pack, and
    write the artifact `options` ask for (`CompileOptions`; None: the defaults).

    Every bad input raises an ErnieIRError subclass with one line, before any file is written.
    `progress(stage, done, total)` is called as passes run, weights are written and
    executables are emitted (the CLI draws it). What each option does: `CompileOptions` and
    docs/targets.md. In short: `emit` None writes the target's default executables (those that
    read the rank bytes, so every weight is stored once); `disabled_passes` / `stop_after` cut
    the pipeline for bisecting, and stopping before the target's legalization writes the graph
    at that point as a graph folder (as `llc -stop-after`); a checkpoint folder's tokenizer
    files are copied into the artifact; `model` may be a training artifact (its `checkpoint`,
    None: the newest run), compiled for inference, a QAT one converted to int8 weights with
    its learned scales (`qat-convert`, run first); the layout's `pp` > 1 cuts every rank graph
    into stages at decoder-layer boundaries, `dp` / `sharding` (training) replicate the
    model-parallel world (docs/parallel.md).
    """
    o = options if options is not None else CompileOptions()
    tgt = get_target(target)
    o.layout.check_buildable()
    arch = check_target_options(tgt, o)
    o.check_full_param()
    emit_names = _executables(tgt, o)
    dest = check_out(o.out if o.out is not None else default_out(model, tgt.name, o.quant_name), o.force)
    trained = _trained_artifact(model, o)
    if o.pipeline and o.pipeline.strip().endswith((".yaml", ".yml")) and o.quant_text:
        raise ErnieIRError("--pipeline FILE.yaml cannot be combined with --quant/--quant-config/--lora-* "
                           "flags: put those passes in the YAML file")
    if trained is None:
        graph, quant_text = load_input(model, trust_pickle=o.trust_pickle, meta=o.meta), o.quant_text
    else:
        graph = load_trained(model, o.checkpoint)
        quant_text = _trained_pipeline(model, graph, o)
    check_pipeline(o.layout.pp, layer_count(graph), graph.name or str(model))  # before any pass runs
    early: list[str] = []  # what compile says before any pass runs
    if trained is not None and graph.metadata["trained"].get("synthetic"):
        early.append(f"{graph.metadata['trained']['checkpoint']} was trained on the synthetic batch (`train` "
                     "without --data), not on data: train with --data FILE first")
    if trained is None and "fastdeploy" in emit_names:
        emit_names = _fastdeploy_first(graph, o, emit_names, early)
    # Hashing the source (every file of a checkpoint folder) runs on the other core while the
    # passes run and the rank weights are written; the manifest, written last, waits for it.
    hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ernie-ir-source-sha256")
    source = hashing.submit(source_info, model, graph, meta=o.meta)
    hashing.shutdown(wait=False)
    before = params_by_dtype(graph)
    full_param = o.full_param if trained is None else ""
    if full_param and not o.pipeline:
        _check_full_param(graph, o)  # before any pass runs
    full, _ = compile_pipeline(graph, tgt, arch, quant_text, o.pipeline, o.layout, full_param)
    resolved, stopped = _restricted(graph, full, o)
    instruments = [] if progress is None else [_ProgressInstrument(progress, len(resolved))]
    from ernie_ir.formats.paddleformers_adapter import read_adapter  # lora-import's reader
    from ernie_ir.runtime import Interpreter  # the calibration evaluator (fp8-quant)

    ranked = run_pipeline_ranks(graph, resolved, instruments=instruments, evaluator=Interpreter,
                                adapter_reader=read_adapter)
    ranks, result = ranked.ranks, ranked.result
    common = {"model": model, "target": tgt.name, "mode": o.mode, "pipeline": str(resolved),
              "passes_run": [p.spec() for p in resolved.passes], "params_before": before, "cuda_arch": arch}
    if stopped:
        with artifact_lock(dest, parents=True):  # like an artifact: one writer at a time
            _save_graphs(ranks, dest)
        after = params_by_dtype(ranks[0]) if len(ranks) == 1 else _rank_params(ranks)
        return CompileReport(**common, out=str(dest), kernel_plan=[], fallbacks=[], stopped=stopped,
                             params_after=after, warnings=list(result.warnings))
    # the layout as the split made it, carried by the pass context (None: one rank)
    ranks, mapping = _final_layout(ranks, ranked.mapping or Mapping.create(), o)
    if o.mode == "training":
        from ernie_ir.training.recipe import check_trainable

        check_trainable(ranks[0])
    warnings = [*early, *result.warnings]
    emitters, emit_names = _emitters(model, ranks, mapping, tgt, arch, o, emit_names, warnings)
    numerics = (o.onnx_numerics or DEFAULT_ONNX_NUMERICS) if "onnxruntime" in emitters else None
    written = [n for n in emit_names if backend_of(n) in emitters]
    after = params_by_dtype(ranks[0]) if len(ranks) == 1 else _rank_params(ranks)
    extra = _manifest_extra(before, after, written, numerics, o)
    if "calibration" in ranks[0].metadata:  # calibrated-quant: method, data sha256, settings
        extra["calibration"] = ranks[0].metadata["calibration"]
    if o.mode == "training":  # the mixed-precision recipe train.json records, for `plan` and readers
        from ernie_ir.training.precision import precision_of

        extra["training_precision"] = precision_of(ranks[0], o.moment_dtype, o.offload_optimizer).record()
    tokenizer = (_tokenizer_writer(_tokenizer_source(model, trained), "onnxruntime" in emitters,
                                   "fastdeploy" in written, warnings) if emit_names else None)
    recipe = launch_recipe(tgt, o.mode, mapping.processes)  # dp replicas: dp x world processes
    contents = ArtifactContents(target=tgt.name, mode=o.mode, launch_recipe=recipe,
                                launch_script=launch_script(recipe), pipeline=str(resolved),
                                source=source.result, ranks=ranks, mapping=mapping, emitters=emitters,
                                tokenizer=tokenizer, extra=extra)
    path = write_artifact(ranked.global_graph if len(ranks) > 1 else ranks[0], dest, contents, force=o.force,
                          progress=progress)
    plan = ranks[0].metadata.get("kernel_plan", {})
    return CompileReport(**common, out=str(path), params_after=after,
                         kernel_plan=list(plan.get("kernels", [])), fallbacks=list(plan.get("fallbacks", [])),
                         warnings=warnings, parallel=mapping.describe() if mapping.processes > 1 else "",
                         onnx_numerics=numerics, emit=written,
                         serve=_serve_line(path, len(ranks)) if "fastdeploy" in written else "")


def _check_full_param(graph: Graph, o: CompileOptions) -> None:
    """Refuse, before any pass runs, --freeze patterns the model does not fit (a tied embedding
    trained with --pp is fine: the pipeline sums its two stages' gradients)."""
    from ernie_ir.passes.finetune.full_param import select

    select(graph, o.freeze)


def _serve_line(path: Path, tp: int) -> str:
    from ernie_ir.formats.fastdeploy import serve_command

    return serve_command(str(path), tp)


def _fastdeploy_first(graph: Graph, o: CompileOptions, emit_names: tuple[str, ...],
                      warnings: list[str]) -> tuple[str, ...]:
    """The executables, decided before any pass runs for FastDeploy: a folder FastDeploy could not
    load (`fastdeploy_refusal_for`) is an error with `--emit fastdeploy`, and left out of the
    default executables, with a warning for a preset FastDeploy serves (`SERVED_PRESETS`; not
    quantized, FP8 or QAT: silently). A --quant-config file is decided with the rank graphs."""
    from ernie_ir.backends.fastdeploy import NOT_A_CHECKPOINT, fastdeploy_refusal_for
    from ernie_ir.formats.fastdeploy.loadable import SERVED_PRESETS, LoadableCell

    if o.quant is not None and o.quant.preset is None:
        return emit_names
    lora = o.lora is not None and (o.lora.rank is not None
                                   or (o.lora.adapter is not None and not o.lora.merge))
    cell = LoadableCell(o.quant.preset if o.quant is not None else None, False, o.layout.tp, o.layout.ep,
                        lora)
    why = fastdeploy_refusal_for(graph, cell)
    if why is None:
        return emit_names
    if o.emit is not None:
        raise TargetError(f"--emit fastdeploy: {why}")
    if cell.preset in SERVED_PRESETS:
        warnings.append(f"{NOT_A_CHECKPOINT}{why}")
    return tuple(n for n in emit_names if n != "fastdeploy")


def _executables(tgt: HardwareTarget, o: CompileOptions) -> tuple[str, ...]:
    """The executables to write: --emit, or the target's default for the mode (a pipelined
    artifact's default leaves FastDeploy out: its checkpoint is tensor-parallel only)."""
    names = o.emit if o.emit is not None else default_emit(tgt, o.mode)
    if o.layout.pp > 1 and o.emit is None:
        names = tuple(n for n in names if n != "fastdeploy")
    if o.onnx_numerics is not None and "onnx" not in names and o.emit is None:
        names = (*names, "onnx")  # asking for the ONNX decoder's numerics asks for it
    if o.onnx_numerics is not None and "onnx" not in names:
        raise TargetError(f"--onnx-numerics {o.onnx_numerics} applies to the ONNX model, which this "
                          f"compile does not write: add onnx to --emit (e.g. --emit "
                          f"{','.join((*names, 'onnx'))})")
    check_emit(names, tgt, o.mode, o.layout.world * o.layout.pp)
    return names


def _restricted(graph: Graph, full: Pipeline, o: CompileOptions) -> tuple[Pipeline, str]:
    """The pipeline cut by --disable-pass / --stop-after, and where it stopped ("" if it runs
    to the end)."""
    if not o.disabled_passes and o.stop_after is None:
        return full, ""
    resolved = full.restricted(o.disabled_passes, o.stop_after)
    if any(p.name.startswith("legalize-") for p in full if p.name in o.disabled_passes):
        raise TargetError(f"cannot disable {full.passes[-1].name}: compile needs it to write an "
                          "artifact; use --stop-after to keep the graph before it")
    resolved.check_order(graph_properties(graph))
    if o.stop_after is not None and resolved.passes[-1] is not full.passes[-1]:
        return resolved, describe_restriction(full, resolved, stopped=True)
    return resolved, ""


def _final_layout(ranks: list[Graph], mapping: Mapping, o: CompileOptions) -> tuple[list[Graph], Mapping]:
    """The rank graphs and the Mapping the artifact records: the pipeline stages the cut
    (`pipeline-stages`) recorded in the stage graphs, data-parallel replicas added."""
    bounds = pipeline_bounds(ranks[0]) if o.layout.pp > 1 else None  # None: the cut was disabled
    if bounds:
        mapping = mapping.with_pipeline(bounds, o.layout.micro_batches or 1)
    if o.layout.dp > 1:
        mapping = mapping.with_data_parallel(o.layout.dp, o.layout.sharding)
    return ranks, mapping


def _emitters(model: str, ranks: list[Graph], mapping: Mapping, tgt: HardwareTarget, arch: int | None,
              o: CompileOptions, emit_names: tuple[str, ...],
              warnings: list[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The executable writers for the rank graphs, and the executables they write (none for a
    meta model: executables need weights)."""
    if any(p.source is None for g in ranks for p in g.params.values()):
        warnings.append(f"graph-only artifact: {model} has no weights (a meta model), so no weights or "
                        "executables were written; `ernie-ir show` and `ernie-ir plan` read it")
        return {}, ()
    implied: tuple[str, ...] = ()
    if o.emit is None:  # the fastest backend too, where it costs little (executables.py)
        with_onnx = with_default_onnx(emit_names, ranks, tgt, o.mode, warnings)
        implied, emit_names = with_onnx[len(emit_names):], with_onnx
    emit_names = tuple(check_coverage(ranks, emit_names, target=tgt.name, mode=o.mode,
                                      explicit=emit_names if o.emit is not None else (), warnings=warnings))
    settings = EmitSettings(explicit=o.emit is not None, mode=o.mode,
                            onnx_numerics=o.onnx_numerics or DEFAULT_ONNX_NUMERICS,
                            kv_cache_dtype=o.kv_cache_dtype, moment_dtype=o.moment_dtype,
                            offload_optimizer=o.offload_optimizer, implied=implied)
    emitters = select_emitters(emit_names, settings, target=tgt, model=model, ranks=ranks, mapping=mapping,
                               arch=arch, warnings=warnings)
    return emitters, emit_names


def _manifest_extra(before: dict[str, Any], after: dict[str, Any], written: list[str], numerics: str | None,
                    o: CompileOptions) -> dict[str, Any]:
    """What the manifest records of this compile beyond the artifact writer's own fields."""
    extra: dict[str, Any] = {"params_before": before, "params_after": after, "emit": written}
    if numerics is not None:
        extra["onnx_numerics"] = numerics
    if o.kv_cache_dtype is not None:
        extra["kv_cache_dtype"] = o.kv_cache_dtype
    if o.lora is not None and o.lora.adapter is not None:
        extra["lora_adapter"] = adapter_provenance(o.lora.adapter, merged=o.lora.merge)
    return extra


def _trained_artifact(model: str, o: CompileOptions) -> Manifest | None:
    """The manifest of MODEL when it is a training artifact to compile from a checkpoint, else
    None; refuses (one line) any other artifact and the options that do not apply."""
    if not (Path(model) / "manifest.json").is_file():
        if o.checkpoint is not None:
            raise TargetError(f"--checkpoint picks a checkpoint of a training artifact, and {model} is not "
                              "one: drop --checkpoint")
        return None
    from ernie_ir.targets.artifact import read_manifest

    done = read_manifest(model)
    if done.mode != "training":
        raise TargetError(f"{model} is a compiled artifact (already legalized for --target "
                          f"{done.target}): compile its source model "
                          f"{(done.source or {}).get('model', '')!s} instead")
    if o.mode != "inference":
        raise TargetError(f"{model} is a training artifact: compile it with --mode inference (the default) "
                          f"to serve what it learned, or train it further with `ernie-ir train {model}`")
    if o.meta:
        raise TargetError(f"--meta reads a checkpoint folder's config.json; {model} is a training "
                          "artifact: drop --meta")
    return done


def _trained_pipeline(model: str, graph: Graph, o: CompileOptions) -> str:
    """The quant/LoRA pipeline text for a trained graph: a QAT one is converted to int8 first
    (`qat-convert`, PaddleSlim's convert step: the learned scales), and takes no --quant."""
    if "qat" not in graph_properties(graph):
        return o.quant_text
    if o.quant is not None:
        raise TargetError(f"{model} was trained with QAT: compile converts it to int8 weights with its "
                          "learned scales by itself (qat-convert); drop --quant/--quant-config "
                          "(--disable-pass qat-convert keeps the fake-quantized graph)")
    return ",".join(["qat-convert", *([o.quant_text] if o.quant_text else [])])


def _tokenizer_source(model: str, trained: Manifest | None) -> str:
    """Where the model's tokenizer files are: MODEL itself, or a training artifact's copy."""
    folder = trained.tokenizer if trained is not None else None
    if folder is None:
        return model
    return str(Path(model) / folder)


def adapter_provenance(adapter: str | Path, *, merged: bool) -> dict[str, Any]:
    """What a manifest records of an imported LoRA adapter: its folder (a training checkpoint
    folder's `adapter/`), the sha256 of each of its files (as of the source model's) and whether
    it was merged into the base weights."""
    folder = adapter_folder(adapter)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {"path": str(folder), "merged": merged,
            "files": {p.relative_to(folder).as_posix(): source_sha256(p) for p in files}}


def _tokenizer_writer(model: str, onnx: bool, fastdeploy: bool,
                      warnings: list[str]) -> Callable[[Path], str | None]:
    """Writes the checkpoint's tokenizer into an artifact (see compile_model): beside the ONNX
    decoder (where onnxruntime-genai looks) when there is one; else the artifact's root when the
    FastDeploy checkpoint already copied the files there (each executable reads its own folder;
    the same bytes are not written twice for one reader); else tokenizer/. Files the tokenizer
    libraries cannot read are a warning, not an error: compile still writes the model."""
    from ernie_ir.load import copy_tokenizer, read_tokenizer

    def write(root: Path) -> str | None:
        try:
            if fastdeploy and not onnx and (root / "tokenizer_config.json").is_file():
                return "." if read_tokenizer(root) is not None else None
            folder = Path("inference") / "onnx" if onnx else Path("tokenizer")
            return folder.as_posix() if copy_tokenizer(model, root / folder, tokenizer_json=onnx) else None
        except ErnieIRError as e:
            warnings.append(f"the model's tokenizer was not copied into the artifact ({e}); `ernie-ir "
                            "generate` needs --prompt-ids with it")
            return None

    return write


def _save_graphs(ranks: Sequence[Graph], dest: Path) -> None:
    """The graphs where compile stopped: `dest` as one graph folder, or `dest/rank{r}` each."""
    from ernie_ir.ir.storage import replace_folder, save_graph

    if len(ranks) == 1:
        save_graph(ranks[0], dest, overwrite=True)
        return

    def fill(tmp: Path) -> None:
        for r, g in enumerate(ranks):
            save_graph(g, tmp / f"rank{r}")

    replace_folder(dest, fill)


def _rank_params(ranks: Sequence[Graph]) -> dict[str, dict[str, int]]:
    """params_by_dtype summed over the ranks (what every device holds together)."""
    total: dict[str, dict[str, int]] = {}
    for g in ranks:
        for dtype, entry in params_by_dtype(g).items():
            t = total.setdefault(dtype, {"count": 0, "bytes": 0})
            t["count"] += entry["count"]
            t["bytes"] += entry["bytes"]
    return dict(sorted(total.items()))
