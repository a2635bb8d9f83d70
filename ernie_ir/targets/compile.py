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

from ernie_ir.artifacts.publish import artifact_lock
from ernie_ir.artifacts.source_digests import source_sha256
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.mapping import Mapping, check_data_parallel, check_degrees
from ernie_ir.load import load_input, load_trained
from ernie_ir.passes import Pass, PassContext, PassInstrument
from ernie_ir.passes.infra.base import graph_properties
from ernie_ir.passes.infra.manager import run_pipeline_ranks
from ernie_ir.passes.infra.pipeline import Pipeline, describe_restriction, load_pipeline
from ernie_ir.passes.parallel.pipeline_stages import check_pipeline, layer_count, pipeline_ranks
from ernie_ir.passes.parallel.split import mapping_for
from ernie_ir.passes.quant.cli_flags import NO_QUANT, QuantFlagError, adapter_folder, pipeline_for
from ernie_ir.passes.quant.config import resolve_quant_name
from ernie_ir.targets.artifact import check_out, write_artifact
from ernie_ir.targets.capabilities import HardwareTarget
from ernie_ir.targets.coverage import check_coverage
from ernie_ir.targets.executables import backend_of, check_emit, default_emit, parse_emit, select_emitters
from ernie_ir.targets.registry import TargetError, all_targets, get_target

MODES = ("inference", "training")
ONNX_NUMERICS = ("weight-only", "exact", "fast")
"""`onnx_numerics` choices (ernie_ir.backends.onnx.lower): float32 activations with every weight
dequantized in float32 (the default), the interpreter's numerics bit for bit (the bf16 rounding of
dequantized weights kept), or int8 activations; recorded in the model and the manifest."""
DEFAULT_ONNX_NUMERICS = "weight-only"


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
    shapes refused for the same cause are one group, whose reason reads `[...]` there."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for f in fallbacks:
        reason = _SHAPE.sub("[...]", str(f.get("reason", "")))
        key = (str(f.get("op", "")), str(f.get("kernel", "")), reason)
        groups.setdefault(key, []).append(str(f.get("scope", "")))
    return [FallbackGroup(*key, scopes=tuple(scopes)) for key, scopes in groups.items()]


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
                "trained_from": done.get("source"), "trained_pipeline": done.get("pipeline")}
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


def check_onnx_numerics(numerics: str) -> str:
    if numerics not in ONNX_NUMERICS:
        raise TargetError(f"unknown --onnx-numerics {numerics!r}: choose weight-only (the default: "
                          "float32 activations), exact (equal to the interpreter) or fast (int8 "
                          "activations)")
    return numerics


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


def check_compile_options(target: str, mode: str, quant: str | None, cuda_arch: int | None, tp: int,
                          ep: int) -> tuple[HardwareTarget, int | None]:
    """The target and the value of its arch option (cuda: --cuda-arch; None for a target without
    one; `cuda_arch` None: the option's default) of compile's options; refuses, in one line, an
    unknown target or mode, impossible degrees and FP8 where the target has no FP8 kernels."""
    tgt = get_target(target)
    if mode not in MODES:
        raise TargetError(f"unknown --mode {mode!r}: choose inference or training")
    check_degrees(tp, ep, num_experts=None if ep == 1 else 0)
    arch = target_arch(tgt, cuda_arch)
    if quant is not None and quant.strip().lower() not in NO_QUANT:
        canonical = resolve_quant_name(quant)
        if canonical.startswith("fp8") and not tgt.fp8:
            raise TargetError(f"--quant {quant} needs FP8 kernels, which {tgt.name} lacks: use "
                              "--target cuda --cuda-arch 89/90, or --quant wint8 / wint8mix")
        opt = tgt.arch_option
        if canonical.startswith("fp8") and opt is not None and arch not in opt.fp8:
            raise TargetError(f"--quant {quant} needs FP8 kernels ({opt.fp8_hint or 'another arch'}): use "
                              f"{opt.flag} {' or '.join(map(str, opt.fp8))}")
    return tgt, arch


def check_compile_dp(mode: str, dp: int, sharding: str | None, world: int = 1) -> None:
    """Refuse, in one line, data parallelism outside training and a layout that cannot run
    (`ernie_ir.ir.mapping.check_data_parallel`)."""
    if dp != 1 and mode != "training":
        raise TargetError(f"--dp {dp}: data parallelism is a training layout (--mode training); to serve "
                          "replicas, start several inference engines (drop --dp)")
    if sharding is not None and mode != "training":
        raise TargetError(f"--sharding {sharding} shards optimizer states: a training layout "
                          "(--mode training)")
    check_data_parallel(dp, sharding, world)


def check_compile_pp(pp: int, micro_batches: int | None, dp: int, emit: str | Sequence[str] | None) -> None:
    """Refuse, in one line, a pipeline layout compile cannot write (before any pass runs; the
    model's own limits, such as fewer layers than stages, are checked when it is cut)."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise TargetError(f"--pp {pp}: the number of pipeline stages must be an integer >= 1")
    if micro_batches is not None and micro_batches < 1:
        raise TargetError(f"--micro-batches {micro_batches}: give an integer >= 1")
    if pp == 1 and micro_batches not in (None, 1):
        raise TargetError(f"--micro-batches {micro_batches} cuts each batch for a pipeline's schedule: it "
                          "needs --pp 2 or more")
    if pp > 1 and dp > 1:
        raise TargetError(f"--pp {pp} with --dp {dp}: data parallelism of a pipelined model is not built; "
                          "drop one of them")
    chosen = parse_emit(emit) or ()
    if pp > 1 and "fastdeploy" in chosen:
        raise TargetError(f"--emit fastdeploy with --pp {pp}: a FastDeploy checkpoint is tensor-parallel "
                          "only; drop --pp (serve with --tp) or drop fastdeploy from --emit")


def compile_pipeline(graph: Graph, tgt: HardwareTarget, arch: int | None, quant_text: str,
                     pipeline: str | None = None, tp: int = 1, ep: int = 1,
                     sp: bool = False) -> tuple[Pipeline, Mapping]:
    """The pipeline compile runs on `graph` and the layout it makes: the user's `pipeline`, then
    `quant_text` (quantization and LoRA, from `pipeline_for`), then `split{tp,ep}` when a degree
    is > 1 (`sp`: with sequence parallelism), then the target's legalization. Shared by
    `compile_model` and the memory planner."""
    if sp and tp < 2:
        raise TargetError(f"--sp (sequence parallelism) shards the tokens over the tensor-parallel ranks: "
                          f"it needs --tp 2 or more, got --tp {tp}")
    parts: list[str] = []
    user_split = None
    if pipeline:
        user = load_pipeline(pipeline, initial=graph_properties(graph))
        legalize = [p.name for p in user if p.name.startswith("legalize-")]
        if legalize:
            raise TargetError(f"--pipeline holds {legalize[0]}: compile appends legalize-{tgt.name} for "
                              f"--target {tgt.name} itself; drop it from --pipeline (or change --target)")
        user_split = next((p for p in user if p.fans_out), None)
        if user_split is not None and (tp != 1 or ep != 1):
            raise ErnieIRError(f"--tp/--ep and {user_split.spec()} in --pipeline both set the layout: "
                               "give one of them")
        parts.append(str(user))
    if quant_text:
        if user_split is not None:
            raise ErnieIRError(f"--pipeline splits the model ({user_split.spec()}) but --quant/--lora-* "
                               "passes run after it: quantize and add LoRA before splitting (put "
                               "them in --pipeline before split, or use --tp/--ep)")
        parts.append(quant_text)
    if tp != 1 or ep != 1:
        mapping_for(graph, tp, ep)  # refuse an impossible layout before any pass runs
        parts.append(f"split{{tp={tp},ep={ep}{',sp=true' if sp else ''}}}")
    parts.append(legalize_spec(tgt, arch))
    resolved = load_pipeline(",".join(parts), initial=graph_properties(graph))
    split = next((p for p in resolved if p.fans_out), None)
    mapping = Mapping.create()
    if split is not None:
        opts = split.options
        mapping = mapping_for(graph, getattr(opts, "tp", 1), getattr(opts, "ep", 1))
    return resolved, mapping


class _ProgressInstrument(PassInstrument):
    """Reports each finished pass as compile progress."""

    def __init__(self, progress: Callable[[str, int, int], None], total: int) -> None:
        self.progress = progress
        self.total = total

    def after_pass(self, index: int, p: Pass, graph: Graph, changed: bool, ctx: PassContext) -> None:
        self.progress(f"pass {p.name}", index, self.total)


def compile_model(model: str, target: str, quant: str | None = None, mode: str = "inference",
                  pipeline: str | None = None, lora_rank: int | None = None,
                  lora_alpha: float | None = None, lora_targets: Sequence[str] | None = None,
                  lora_adapter: Path | None = None, quant_config: Path | None = None,
                  cuda_arch: int | None = None, tp: int = 1, ep: int = 1, dp: int = 1,
                  sharding: str | None = None, out: str | Path | None = None, force: bool = False,
                  trust_pickle: bool = False, meta: bool = False,
                  progress: Callable[[str, int, int], None] | None = None,
                  onnx_numerics: str | None = None,
                  emit: str | Sequence[str] | None = None, disabled_passes: Sequence[str] = (),
                  stop_after: str | int | None = None, kv_cache_dtype: str | None = None,
                  checkpoint: str | None = None, merge_lora: bool = False,
                  calib_data: str | Path | None = None, sp: bool = False, pp: int = 1,
                  micro_batches: int | None = None) -> CompileReport:
    """Load `model`, run `pipeline` + quant/LoRA + `legalize-<target>`, pack, write the artifact.

    Every bad input raises an ErnieIRError subclass with one line, before any file is written.
    `cuda_arch`: the value of the target's arch option (`HardwareTarget.arch_option`, cuda's
    --cuda-arch; None: its default, sm80); ignored for a target without one.
    `meta`: read a checkpoint folder's config.json alone (no weights): a graph-only artifact.
    `progress(stage, done, total)` is called as passes run, weights are written and
    executables are emitted (the CLI draws it).
    `onnx_numerics`: "weight-only" (the default), "exact" or "fast" matmuls in the ONNX model,
    recorded in the model and the manifest (`"onnx_numerics"`); only with "onnx" in `emit`.
    `emit`: the executables to write ("onnx,paddle", see `executables.EXECUTABLES`); None: the
    target's default (`executables.default_emit`: those that read the rank bytes, so every
    weight is stored once). The manifest records them (`"emit"`).
    `disabled_passes` / `stop_after` cut the pipeline for bisecting (`Pipeline.restricted`): the
    manifest records the pipeline that ran; stopping before the target's legalization writes
    the graph at that point as a graph folder instead of an artifact (as `llc -stop-after`).
    `kv_cache_dtype`: the element type of the KV cache the decoders of this artifact keep (the
    ONNX model's, and `ernie-ir generate`'s default); None: the attention's key dtype. Recorded
    in the manifest (`"kv_cache_dtype"`).
    A checkpoint folder's tokenizer files (and generation_config.json) are copied into the
    artifact: `inference/onnx/` beside the ONNX decoder (with a tokenizer.json that
    onnxruntime-genai reads), else `tokenizer/`; the manifest's `"tokenizer"` names the folder.
    `model` may be a training artifact (`--mode training`, trained by `ernie-ir train`): its
    `checkpoint` (None: the newest run; `ernie_ir.load.load_trained`) is compiled for inference,
    a QAT one converted to int8 weights with its learned scales (`qat-convert`, run first).
    `merge_lora`: fold the adapter (`lora_adapter`, or the model's own) into the float base
    weights before quantizing: `lora-import{path},lora-merge,<quant passes>` (inference only).
    `calib_data`: a .npy of token ids [batch, seq] the calibrated quantizations (w4a8c8, fp8)
    take their static activation scales from (`calibration_file` of their pass).
    An imported adapter is recorded in the manifest (`"lora_adapter"`: folder, sha256 of its
    files, merged or not).
    `dp` / `sharding` (training only): data-parallel replicas of the tp x ep world and ZeRO
    stage1/stage2 over them; no rank graph more (replicas share them), recorded in the
    manifest's mapping and the launch recipe (dp x world processes). docs/parallel.md.
    `pp` > 1: pipeline parallelism: every rank graph cut into `pp` stages at decoder-layer
    boundaries balanced by weight bytes (passes/parallel/pipeline_stages.py), pp x world rank
    graphs run by paddle.distributed (`run`/`train`); `micro_batches`: the schedule's default
    cut of each batch (training: it must divide the batch size).
    """
    tgt, arch = check_compile_options(target, mode, quant, cuda_arch, tp, ep)
    if sp and tp < 2:
        raise TargetError(f"--sp (sequence parallelism) shards the tokens over the tensor-parallel ranks: "
                          f"it needs --tp 2 or more, got --tp {tp}")
    check_compile_dp(mode, dp, sharding, max(tp, ep))
    check_compile_pp(pp, micro_batches, dp, emit)
    if kv_cache_dtype is not None:
        kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype, mode)
    chosen = parse_emit(emit)
    emit_names = chosen if chosen is not None else default_emit(tgt, mode)
    if pp > 1 and chosen is None:  # a FastDeploy checkpoint is tensor-parallel only
        emit_names = tuple(n for n in emit_names if n != "fastdeploy")
    if onnx_numerics is not None:
        check_onnx_numerics(onnx_numerics)
        if "onnx" not in emit_names:
            raise TargetError(f"--onnx-numerics {onnx_numerics} applies to the ONNX model, which this "
                              f"compile does not write: add onnx to --emit (e.g. --emit "
                              f"{','.join((*emit_names, 'onnx'))})")
    check_emit(emit_names, tgt, mode, max(tp, ep) * pp)
    dest = check_out(out if out is not None else default_out(model, tgt.name, quant), force)
    quant_text = pipeline_for(quant, quant_config, lora_rank, lora_alpha, lora_targets, lora_adapter,
                              merge_lora, Path(calib_data) if calib_data is not None else None)
    if merge_lora and mode != "inference":
        raise QuantFlagError(f"--merge-lora folds the adapter into the base weights, leaving nothing to "
                             f"train: --mode {mode} keeps the adapter apart (drop --merge-lora)")

    trained = _trained_artifact(model, mode, checkpoint, meta)
    if pipeline and pipeline.strip().endswith((".yaml", ".yml")) and quant_text:
        raise ErnieIRError("--pipeline FILE.yaml cannot be combined with --quant/--quant-config/--lora-* "
                           "flags: put those passes in the YAML file")

    if trained is None:
        graph = load_input(model, trust_pickle=trust_pickle, meta=meta)
    else:
        graph = load_trained(model, checkpoint)
        quant_text = _trained_pipeline(model, graph, quant, quant_config, quant_text)
    check_pipeline(pp, layer_count(graph), graph.name or str(model))  # before any pass runs
    # Hashing the source (every file of a checkpoint folder) runs on the other core while the
    # passes run and the rank weights are written; the manifest, written last, waits for it.
    hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ernie-ir-source-sha256")
    source = hashing.submit(source_info, model, graph, meta=meta)
    hashing.shutdown(wait=False)
    before = params_by_dtype(graph)
    resolved, mapping = compile_pipeline(graph, tgt, arch, quant_text, pipeline, tp, ep, sp)
    full = resolved
    if disabled_passes or stop_after is not None:
        resolved = resolved.restricted(disabled_passes, stop_after)
        if any(p.name.startswith("legalize-") for p in full if p.name in disabled_passes):
            raise TargetError(f"cannot disable {full.passes[-1].name}: compile needs it to write an "
                              "artifact; use --stop-after to keep the graph before it")
        resolved.check_order(graph_properties(graph))
    stopped = ""
    if stop_after is not None and resolved.passes[-1] is not full.passes[-1]:
        stopped = describe_restriction(full, resolved, stopped=True)
    instruments = [] if progress is None else [_ProgressInstrument(progress, len(resolved))]
    from ernie_ir.runtime import Interpreter  # the calibration evaluator (fp8-quant)

    ranked = run_pipeline_ranks(graph, resolved, instruments=instruments, evaluator=Interpreter)
    ranks, result = ranked.ranks, ranked.result
    if stopped:
        with artifact_lock(dest, parents=True):  # like an artifact: one writer at a time
            _save_graphs(ranks, dest)
        return CompileReport(
            model=model, target=tgt.name, mode=mode, pipeline=str(resolved), out=str(dest),
            passes_run=[p.spec() for p in resolved.passes], params_before=before,
            params_after=params_by_dtype(ranks[0]) if len(ranks) == 1 else _rank_params(ranks),
            kernel_plan=[], fallbacks=[], warnings=list(result.warnings), cuda_arch=arch,
            stopped=stopped)
    if len(ranks) != mapping.world_size:
        mapping = Mapping.create()  # the split left one rank (tp = ep = 1)
    if pp > 1:
        from ernie_ir.backends.paddle.layer import rank_varying

        ranks, bounds = pipeline_ranks(ranks, pp, rank_varying)
        mapping = mapping.with_pipeline(bounds, micro_batches or 1)
    if dp > 1:
        mapping = mapping.with_data_parallel(dp, sharding)
    first = ranks[0]
    if mode == "training":
        from ernie_ir.training.recipe import check_trainable

        check_trainable(first)
    warnings = list(result.warnings)
    plan = first.metadata.get("kernel_plan", {})
    after = params_by_dtype(first) if len(ranks) == 1 else _rank_params(ranks)
    if any(p.source is None for g in ranks for p in g.params.values()):
        emitters = {}  # executables need weights: a meta model compiles to its rank graphs only
        emit_names = ()
        warnings.append(f"graph-only artifact: {model} has no weights (a meta model), so no weights or "
                        "executables were written; `ernie-ir show` and `ernie-ir plan` read it")
    else:
        emit_names = tuple(check_coverage(ranks, emit_names, target=tgt.name, mode=mode,
                                          explicit=emit_names if chosen is not None else (),
                                          warnings=warnings))
        emitters = select_emitters(emit_names, explicit=chosen is not None, target=tgt, mode=mode,
                                   model=model, ranks=ranks, mapping=mapping, arch=arch,
                                   onnx_numerics=onnx_numerics or DEFAULT_ONNX_NUMERICS, warnings=warnings,
                                   kv_cache_dtype=kv_cache_dtype)
    numerics = (onnx_numerics or DEFAULT_ONNX_NUMERICS) if "onnxruntime" in emitters else None
    written = [n for n in emit_names if backend_of(n) in emitters]
    extra: dict[str, Any] = {"params_before": before, "params_after": after, "emit": written}
    if numerics is not None:
        extra["onnx_numerics"] = numerics
    if kv_cache_dtype is not None:
        extra["kv_cache_dtype"] = kv_cache_dtype
    if lora_adapter is not None:
        extra["lora_adapter"] = adapter_provenance(lora_adapter, merged=merge_lora)
    path = write_artifact(ranked.global_graph if len(ranks) > 1 else first, dest, target=tgt, mode=mode,
                          pipeline=str(resolved), source=source.result, force=force,
                          extra=extra,
                          emitters=emitters, progress=progress, ranks=ranks, mapping=mapping,
                          tokenizer=_tokenizer_writer(_tokenizer_source(model, trained),
                                                      "onnxruntime" in emitters,
                                                      "fastdeploy" in written, warnings)
                          if emit_names else None)
    return CompileReport(
        model=model, target=tgt.name, mode=mode, pipeline=str(resolved), out=str(path),
        passes_run=[p.spec() for p in resolved.passes], params_before=before, params_after=after,
        kernel_plan=list(plan.get("kernels", [])), fallbacks=list(plan.get("fallbacks", [])),
        warnings=warnings, cuda_arch=arch, parallel=mapping.describe() if mapping.processes > 1 else "",
        onnx_numerics=numerics, emit=written,
    )


def _trained_artifact(model: str, mode: str, checkpoint: str | None, meta: bool) -> dict[str, Any] | None:
    """The manifest of MODEL when it is a training artifact to compile from a checkpoint, else
    None; refuses (one line) any other artifact and the options that do not apply."""
    if not (Path(model) / "manifest.json").is_file():
        if checkpoint is not None:
            raise TargetError(f"--checkpoint picks a checkpoint of a training artifact, and {model} is not "
                              "one: drop --checkpoint")
        return None
    from ernie_ir.targets.artifact import read_manifest

    done = read_manifest(model)
    if done.get("mode") != "training":
        raise TargetError(f"{model} is a compiled artifact (already legalized for --target "
                          f"{done.get('target')}): compile its source model "
                          f"{(done.get('source') or {}).get('model', '')!s} instead")
    if mode != "inference":
        raise TargetError(f"{model} is a training artifact: compile it with --mode inference (the default) "
                          f"to serve what it learned, or train it further with `ernie-ir train {model}`")
    if meta:
        raise TargetError(f"--meta reads a checkpoint folder's config.json; {model} is a training "
                          "artifact: drop --meta")
    return done


def _trained_pipeline(model: str, graph: Graph, quant: str | None, quant_config: Path | None,
                      quant_text: str) -> str:
    """The quant/LoRA pipeline text for a trained graph: a QAT one is converted to int8 first
    (`qat-convert`, PaddleSlim's convert step: the learned scales), and takes no --quant."""
    if "qat" not in graph_properties(graph):
        return quant_text
    if quant is not None or quant_config is not None:
        raise TargetError(f"{model} was trained with QAT: compile converts it to int8 weights with its "
                          "learned scales by itself (qat-convert); drop --quant/--quant-config "
                          "(--disable-pass qat-convert keeps the fake-quantized graph)")
    return ",".join(["qat-convert", *([quant_text] if quant_text else [])])


def _tokenizer_source(model: str, trained: dict[str, Any] | None) -> str:
    """Where the model's tokenizer files are: MODEL itself, or a training artifact's copy."""
    folder = (trained or {}).get("tokenizer")
    if trained is None or not isinstance(folder, str):
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


def check_kv_cache_dtype(text: str, mode: str) -> str:
    """The canonical name of a --kv-cache-dtype (a float dtype), for an inference compile."""
    from ernie_ir.passes.decoding.kv_cache import CACHE_DTYPES

    name = text.strip().lower()
    if name not in CACHE_DTYPES:
        raise TargetError(f"unknown --kv-cache-dtype {text!r}: choose {', '.join(CACHE_DTYPES)}")
    if mode != "inference":
        raise TargetError(f"--kv-cache-dtype applies to inference artifacts (they decode); --mode {mode} "
                          "does not: drop it")
    return name


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
