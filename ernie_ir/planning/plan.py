"""`plan_memory`: per-rank device memory of a model compiled for a target, and the smallest layout that fits.

The plan is computed from the rank graphs `compile` would write (the same pipeline, built by
`ernie_ir.targets.compile.compile_pipeline`, run on the full-size graph without weights), never
from a parameter-count formula. Per rank, by category:

    weights            every param that is not a LoRA adapter, as stored (packed, scales included)
    lora               LoRA adapter params
    gradients          one per trainable param (param dtype; bf16 for FP8/int params)
    optimizer_moments  AdamW m and v per trainable param, in `moment_dtype`
    master_weights     float32 copies of trainable params not already float32
    activations        training: saved for backward + the largest backward working set;
                       inference: the peak live set of one prefill step
    kv_cache           inference: k and v of every attention op for `batch` x `seq_len` tokens
                       (with the serving engine: the KV blocks it needs to start)
    reserve            a stated constant: CUDA context, library workspaces, communication buffers

With `offload_optimizer`, moments and master weights move to host memory (`host_by_category`).
Training with data parallelism (`dp`): every replica holds the model-parallel ranks' weights,
gradients and activations unchanged (`batch` is per replica, ERNIEKit's
`per_device_train_batch_size`); ZeRO `sharding` stage1 divides the optimizer states (moments,
master weights) by dp, stage2 the gradients too (docs/planning.md section 5).
A cuda inference plan models the engine that serves it, FastDeploy, by default (`engine`): only
`gpu_memory_utilization` of the device is its to use, activations are those of its profile run
over `max_num_batched_tokens` tokens, and it starts only when the KV blocks left hold one
`max_model_len` sequence plus 2 blocks (REFERENCE.md section 13; docs/planning.md section 4).
The options are parsed once into typed objects: what compile would be asked is its
`CompileOptions` (quantization, LoRA, arch option, layout), the planner's own knobs a
`PlanRequest` (request.py). The model behind each figure is docs/planning.md; the JSON
(`MemoryPlan.model_dump`) is documented there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ernie_ir.formats.paddleformers_adapter import read_adapter
from ernie_ir.ir import DType, ErnieIRError, Graph, Node, Param
from ernie_ir.ir.mapping import check_degrees
from ernie_ir.ir.storage import GRAPH_FILE, load_graph
from ernie_ir.load import load_input
from ernie_ir.passes.infra.manager import run_pipeline, run_pipeline_ranks
from ernie_ir.passes.infra.pipeline import Pipeline, load_pipeline
from ernie_ir.passes.parallel.pipeline_stages import min_max_partition
from ernie_ir.passes.parallel.split import SplitError
from ernie_ir.passes.quant.cli_flags import QuantChoice
from ernie_ir.passes.quant.config import Algo, QuantConfig
from ernie_ir.runtime import Interpreter
from ernie_ir.targets.capabilities import HardwareTarget
from ernie_ir.targets.compile import check_target_options, compile_pipeline, legalize_spec
from ernie_ir.targets.options import CompileOptions, ParallelLayout
from ernie_ir.targets.registry import all_targets, find_target, get_target

from .graph_memory import (
    GraphFacts,
    PlanError,
    full_parameter_trainable,
    inference_peak,
    kv_cache_bytes,
    layer_of,
    lora_params,
    numel,
    tensor_bytes,
    training_activations,
)
from .request import MAX_DEVICES, MAX_WORLD, PlanRequest, check_replica_flags
from .units import parse_memory

FORMAT = "ernie-ir-memory-plan"
VERSION = 1
CATEGORIES = ("weights", "lora", "gradients", "optimizer_moments", "master_weights", "activations",
              "kv_cache", "reserve")
"""The keys of every `by_category`, in this order (0 where a category does not apply)."""
HOST_CATEGORIES = ("optimizer_moments", "master_weights")
ENGINES = ("fastdeploy", "none")
"""Serving engines a plan can model: FastDeploy (the default for cuda inference) or none (the bare
compiled model: all of the device, one prefill of `seq_len` tokens, `batch` sequences of KV)."""
FASTDEPLOY_BLOCK_SIZE = 64
FASTDEPLOY_MAX_BLOCKS = 40000
"""KV blocks: 64 tokens each, at most 40000 of them per rank."""
SHARDED = {"none": (), "stage1": ("optimizer_moments", "master_weights"),
           "stage2": ("optimizer_moments", "master_weights", "gradients")}
"""The categories each ZeRO stage (`request.SHARDING`) divides by dp."""
_MOMENT = {"fp32": DType.F32, "f32": DType.F32, "float32": DType.F32, "bf16": DType.BF16,
           "bfloat16": DType.BF16}
"""--moment-dtype spellings (compile's too: ernie_ir.training.precision.MOMENT_DTYPES)."""
_KV = {"bf16": DType.BF16, "f16": DType.F16, "fp16": DType.F16, "fp8": DType.F8E4M3,
       "f8e4m3": DType.F8E4M3, "int8": DType.I8, "i8": DType.I8}
_ENGINE_FLAGS = {"--max-model-len": "max_model_len", "--max-num-seqs": "max_num_seqs",
                 "--gpu-memory-utilization": "gpu_memory_utilization",
                 "--max-num-batched-tokens": "max_num_batched_tokens"}
"""FastDeploy's flags and the PlanRequest fields that carry them."""


class RankMemory(BaseModel):
    """Memory of one rank (one device)."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    total_bytes: int
    """Device bytes: the sum of `by_category`."""
    by_category: dict[str, int]
    weights_by_dtype: dict[str, int]
    """`weights` + `lora` split by stored dtype (i4 two per byte)."""
    host_bytes: int
    host_by_category: dict[str, int]
    unsharded_bytes: dict[str, int] = {}
    """Training: gradients, optimizer_moments and master_weights of this rank before the sharding
    division (wherever they live, device or host); equal to the planned ones without sharding or
    at dp 1. Empty in inference."""
    sharding_saved_bytes: int = 0
    """unsharded - sharded over those three categories (device and host together)."""
    headroom_bytes: int
    """device memory - total_bytes (negative: does not fit); with the serving engine, its usable
    memory (device x gpu_memory_utilization) - total_bytes."""
    fits: bool
    activation_detail: dict[str, int | bool]
    """training: saved_bytes, recomputed_bytes, transient_bytes, recompute, layers,
    peak_without_recompute_bytes, peak_with_recompute_bytes; inference: prefill_tokens."""
    stage: int = 0
    """The pipeline stage of this rank (0 without pipeline parallelism)."""
    kv_detail: dict[str, int] = {}
    """With the serving engine: block_bytes (one 64-token block on this rank), blocks_per_sequence
    (of max_model_len), blocks_needed (to start), blocks (what the memory left after the profile
    holds, capped at 40000), sequences (of max_model_len those blocks hold). Empty otherwise."""


class EngineSettings(BaseModel):
    """The serving engine a plan models, with the values of its flags (FastDeploy's names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["fastdeploy"] = "fastdeploy"
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    """Tokens of the profile run whose activation peak the engine sets aside."""
    block_size: int = FASTDEPLOY_BLOCK_SIZE
    max_blocks: int = FASTDEPLOY_MAX_BLOCKS
    required_sequences: int
    """Sequences of `max_model_len` the KV blocks must hold (+ 2 blocks) for the plan to fit: 1,
    FastDeploy's own start check, or `--batch` where given."""
    usable_bytes: int = 0
    """device memory x gpu_memory_utilization: the budget every rank's total is held to."""


class LayoutTry(BaseModel):
    """One layout the search compiled (or could not build)."""

    model_config = ConfigDict(extra="forbid")

    devices: int
    tp: int
    ep: int
    dp: int = 1
    pp: int = 1
    sp: bool = False
    fits: bool | None
    max_rank_bytes: int | None
    error: str | None = None


class StageInfo(BaseModel):
    """One pipeline stage: its decoder layers and what it holds besides them."""

    model_config = ConfigDict(extra="forbid")

    stage: int
    layers: list[int]
    """[first, last] decoder layer indices (inclusive)."""
    embedding: bool
    head: bool
    """The final norm, lm_head and the loss (the last stage)."""
    in_flight: int
    """Micro-batches whose activations this stage keeps at once under 1F1B: min(pp - stage, M)."""
    balance_bytes: int
    """The figure the partition balanced (rank 0): params, gradients and device optimizer states of
    its layers (+ embedding / head) + in_flight x their kept activations."""


class MemoryPlan(BaseModel):
    """The answer of `plan_memory`; its JSON (`model_dump(mode="json")`) is docs/planning.md section 6."""

    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT
    version: int = VERSION
    model: str
    target: str
    cuda_arch: int | None
    quant: str | None
    mode: str
    lora_rank: int | None
    seq_len: int
    batch: int
    engine: Literal["fastdeploy", "none"] = "none"
    engine_settings: EngineSettings | None = None
    """The engine's flags and usable memory (None: `engine` none)."""
    pipeline: str
    tp: int
    ep: int
    dp: int = 1
    """Data-parallel replicas (training): devices = max(tp, ep) x dp; `per_rank` lists the ranks of
    one replica (ranks 0 .. max(tp, ep) - 1), every other replica repeats them."""
    sharding: Literal["none", "stage1", "stage2"] = "none"
    pp: int = 1
    """Pipeline stages (training): devices = max(tp, ep) x pp x dp; `per_rank` lists every stage's
    ranks (rank = stage x max(tp, ep) + tensor-parallel rank)."""
    sequence_parallel: bool = False
    micro_batches: int = 1
    """Micro-batches per step (training): each is batch / micro_batches sequences."""
    stages: list[StageInfo] = []
    """With pp > 1: the layer partition."""
    bubble_fraction: float = 0.0
    """1F1B's idle share, (pp - 1) / (micro_batches + pp - 1) (0 at pp 1)."""
    devices: int
    search_devices: int | None = None
    """The device count a `devices` search laid out (None: no such search)."""
    device_memory_bytes: int
    device_memory_given: bool
    fits: bool
    headroom_bytes: int
    """The smallest headroom over the ranks."""
    max_rank_bytes: int
    min_devices: int | None
    """With device memory given and no tp/ep: the smallest device count that fits (None: none up
    to `max_devices`). Without a search, and in a `devices` search: None."""
    searched: bool
    search: list[LayoutTry]
    trainable: Literal["none", "graph", "full"]
    """Which params train: none (inference), the ones the graph marks (LoRA, QAT) or all float
    params (full-parameter fine-tuning, when the graph marks none)."""
    trainable_params: int
    assumptions: dict[str, Any]
    per_rank: list[RankMemory]
    host_total_bytes: int
    """Host memory of every rank together, all dp replicas (offloaded optimizer states)."""
    notes: list[str]


def plan_memory(model: str, target: str | None, options: CompileOptions | None = None,
                request: PlanRequest | None = None) -> MemoryPlan:
    """Plan the per-rank memory of `model` compiled for `target` (see the module docstring;
    None: a compiled artifact's own, `plan_target`):
    `options` is what `compile_model` would be asked (`CompileOptions`: mode, quantization, LoRA,
    the arch option, the layout; None: the defaults), `request` the planner's own knobs
    (`PlanRequest`: the step, the device, the serving engine; None: its defaults). Options that
    change no figure (emit, out, ...) are not read; `options.pipeline` runs first, as in compile.

    model: a checkpoint folder (config.json only is read), a built-in name (`NAME`, `NAME@meta`,
    `NAME@tiny`), an .ir file / graph folder, or a compiled artifact (its rank graphs; then
    quantization, LoRA and tp/ep come from the artifact and must not be given; so do dp and
    sharding where its layout records them). `request.device_memory`: bytes or a string
    (`80GiB`); given, with neither tp nor ep given (`ParallelLayout.given`), layouts are searched
    from 1 device up (docs/planning.md section 5) and the plan is that of the smallest one that
    fits (or of the largest tried, with min_devices None). Errors are ErnieIRError subclasses (one
    line).

    engine: "fastdeploy" (the default for cuda inference) or "none" (the default elsewhere; the
    bare model). Under FastDeploy, max_model_len (default: seq_len, 4096), max_num_seqs (8),
    gpu_memory_utilization (0.9) and max_num_batched_tokens (8192) are its flags; batch, where
    given, is the number of max_model_len sequences the KV blocks must hold (default 1, the
    engine's own start check). seq_len and batch default to 4096 and 1.

    Training only (docs/planning.md section 5): the layout's dp, data-parallel replicas (default
    1; batch is per replica), and sharding, ZeRO stage1 (optimizer states / dp) or stage2
    (gradients too), which needs dp > 1 or devices; `request.devices`, a device count to lay out:
    layouts with max(tp, ep) x dp = devices are tried, the smallest model-parallel group first, dp
    filling the rest (tp, ep, dp where given fix that degree), and the plan is the first that fits.

    Modelled, not compiled (docs/planning.md section 3): the layout's sp, sequence parallelism
    (needs tp > 1; not given: off, and both ways in a `devices` search); pp, pipeline stages at
    layer boundaries (devices = max(tp, ep) x pp x dp; a `devices` search tries 1, 2, 4, ...
    dividing the layers); micro_batches, M micro-batches of batch / M under 1F1B.
    """
    o = options if options is not None else CompileOptions()
    req = request if request is not None else PlanRequest()
    target = plan_target(model, target)
    fixed = _Fixed.of(o.layout)
    opts = _with_pipeline(_Options.make(o, req), fixed)
    memory = _device_memory(req)
    if req.max_devices < 1:
        raise PlanError(f"max_devices must be >= 1, not {req.max_devices}")
    for flag, degree in (("--tp", fixed.tp), ("--ep", fixed.ep)):
        if degree is not None and degree < 1:
            raise PlanError(f"{flag} {degree}: a parallel degree is a positive integer")
    if _is_artifact(model):
        if o.quant is not None or o.lora is not None or fixed.tp is not None or fixed.ep is not None:
            raise PlanError(f"{model} is a compiled artifact: its quantization, LoRA and layout are fixed; "
                            "drop --quant/--lora-rank/--tp/--ep (or plan its source model)")
        return _plan_artifact(model, opts, memory, req, fixed.dp)
    _check_data_parallel(opts, fixed.dp, req.devices, fixed.tp, fixed.ep, fixed.pp)
    tgt = get_target(target)
    check_degrees(o.layout.tp, o.layout.ep, num_experts=None if o.layout.ep == 1 else 0)
    arch = check_target_options(tgt, o)
    planner = _Planner(model, tgt, arch, o, _with_engine(opts, tgt.name, req), memory,
                       req.given("device_memory"))
    if req.devices is None and not (planner.given and fixed.tp is None and fixed.ep is None):
        return planner.plan(o.layout.tp, o.layout.ep, 1 if fixed.dp is None else fixed.dp)
    return planner.search(fixed, req)


def plan_target(model: str, target: str | None) -> str:
    """The target a plan of `model` is for: a compiled artifact's is the one its manifest records
    (`target`, where given, must name it), a model's is `target`, which must be given."""
    if _is_artifact(model):
        from ernie_ir.artifacts import read_manifest

        recorded = str(read_manifest(model).target)
        if target is not None and target.strip().lower() != recorded:
            raise PlanError(f"{model} was compiled for --target {recorded}, not {target}: drop --target (an "
                            "artifact's plan reads the target from its manifest)")
        return recorded
    if target is None:
        raise PlanError(f"{model} is a model, not a compiled artifact: give --target (one of "
                        f"{', '.join(all_targets())}); only an artifact records its own")
    return target


@dataclass(frozen=True)
class _Fixed:
    """The layout degrees the caller gave (`ParallelLayout.given`); None where not given: searched
    (tp, ep, dp over `devices`, sp both ways) or the default (1, off)."""

    tp: int | None
    ep: int | None
    dp: int | None
    pp: int | None
    sp: bool | None
    micro_batches: int | None

    @classmethod
    def of(cls, layout: ParallelLayout) -> _Fixed:
        def given(name: str) -> Any:
            return getattr(layout, name) if layout.given(name) else None

        return cls(tp=given("tp"), ep=given("ep"), dp=given("dp"), pp=given("pp"), sp=given("sp"),
                   micro_batches=layout.micro_batches)


def _device_memory(req: PlanRequest) -> int:
    """Bytes per device of `req.device_memory` (bytes or a string: `80GiB`)."""
    value = req.device_memory
    memory = parse_memory(value) if isinstance(value, str) else int(value)
    if memory < 1:
        raise PlanError(f"--device-memory {value}: must be at least one byte")
    return memory


@dataclass
class _Planner:
    """The plans of one model for one target and CompileOptions: the rank graphs of each (tp, ep)
    layout built once (`build`), planned at one layout (`plan`) or over a search (`search`)."""

    model: str
    tgt: HardwareTarget
    arch: int | None
    options: CompileOptions
    opts: _Options
    memory: int
    given: bool
    """Whether the device memory was given (`PlanRequest.given`)."""
    built: dict[tuple[int, int], tuple[list[Graph], str, list[str]] | ErnieIRError] = field(
        default_factory=dict)

    @property
    def head(self) -> dict[str, Any]:
        """The plan's fields that name what was planned."""
        o = self.options
        return dict(model=self.model, target=self.tgt.name, cuda_arch=self.arch,
                    quant=o.quant.preset if o.quant is not None else None, mode=o.mode,
                    lora_rank=o.lora.rank if o.lora is not None else None)

    def build(self, t: int, e: int) -> tuple[list[Graph], str, list[str]]:
        """The rank graphs, pipeline text and notes of layout (t, e) (`_compile_ranks`), once."""
        if (t, e) not in self.built:
            try:
                self.built[t, e] = _compile_ranks(self.model, self.tgt, self.arch, self.options, t, e)
            except ErnieIRError as err:
                self.built[t, e] = err
        got = self.built[t, e]
        if isinstance(got, ErnieIRError):
            raise got
        return got

    def plan(self, t: int, e: int, dp: int, opts: _Options | None = None) -> MemoryPlan:
        """The plan of layout (t, e) with `dp` replicas (`opts`: a search's pp/sp variant)."""
        ranks, pipeline, notes = self.build(t, e)
        return _assemble(self.head, ranks, pipeline, notes, t, e, opts or self.opts, self.memory, self.given,
                         dp=dp)

    def layouts(self, fixed: _Fixed, req: PlanRequest) -> list[tuple[int, int, int, int, int, bool]]:
        """(devices, tp, ep, dp, pp, sp) to try, in order: over `req.devices` (`search_layouts`),
        else the device counts up to `req.max_devices` (`candidate_layouts`)."""
        probe = _load(self.model)
        layers = _layer_count(probe)
        opts, devices = self.opts, req.devices
        if opts.pp > layers:
            raise _too_many_stages(opts.pp, layers)
        if devices is None:
            replicas = 1 if fixed.dp is None else fixed.dp
            return [(w * replicas * opts.pp, t, e, replicas, opts.pp, opts.sp)
                    for w, t, e in candidate_layouts(probe, opts.mode, req.max_devices)
                    if t > 1 or not opts.sp]
        layouts = search_layouts(probe, opts.mode, devices, fixed.tp, fixed.ep, fixed.dp, req.max_devices,
                                 pp=fixed.pp, sp=fixed.sp)
        if not layouts:
            raise PlanError(f"--devices {devices}: no layout max(tp, ep) x pp x dp = {devices} with "
                            + ", ".join(f"{f} {v}" for f, v in (("--tp", fixed.tp), ("--ep", fixed.ep),
                                                                ("--dp", fixed.dp), ("--pp", fixed.pp),
                                                                ("--sp", fixed.sp or None))
                                        if v is not None)
                            + f" (model-parallel groups of at most {req.max_devices}): change one of them")
        return layouts

    def search(self, fixed: _Fixed, req: PlanRequest) -> MemoryPlan:
        """The first layout that fits (`layouts`), or the one nearest to fitting over a fixed
        device count, else the largest tried, with a note."""
        devices = req.devices
        tries: list[LayoutTry] = []
        last: MemoryPlan | None = None
        for count, t, e, d, q, on in self.layouts(fixed, req):
            try:
                self.build(t, e)
            except ErnieIRError as err:
                tries.append(LayoutTry(devices=count, tp=t, ep=e, dp=d, pp=q, sp=on, fits=None,
                                       max_rank_bytes=None, error=str(err)))
                continue
            plan = self.plan(t, e, d, self.opts.model_copy(update={"pp": q, "sp": on}))
            tries.append(LayoutTry(devices=count, tp=t, ep=e, dp=d, pp=q, sp=on, fits=plan.fits,
                                   max_rank_bytes=plan.max_rank_bytes))
            # over a fixed device count, keep the layout nearest to fitting; else the largest tried
            if last is None or devices is None or plan.max_rank_bytes < last.max_rank_bytes:
                last = plan
            if plan.fits:
                return plan.model_copy(update={"min_devices": None if devices is not None else count,
                                               "searched": True, "search": tries, "search_devices": devices})
        where = f"of {devices} devices" if devices is not None else f"up to {req.max_devices} devices"
        if last is None:
            raise PlanError(f"no layout of {self.model} {where} could be compiled: "
                            f"{tries[-1].error if tries else 'no candidate layouts'}")
        why = (f"nothing fits on {where.removeprefix('of ')} of {self.memory} bytes; this is the plan of the "
               + ("layout with the smallest largest rank" if devices is not None else "largest layout tried"))
        return last.model_copy(update={"min_devices": None, "searched": True, "search": tries,
                                       "search_devices": devices, "notes": [*last.notes, why]})


def search_layouts(graph: Graph, mode: str, devices: int, tp: int | None = None, ep: int | None = None,
                   dp: int | None = None, max_devices: int = MAX_DEVICES, *, pp: int | None = None,
                   sp: bool | None = None) -> list[tuple[int, int, int, int, int, bool]]:
    """(devices, tp, ep, dp, pp, sp) of a `--devices` search, in order: first the layouts compile
    builds today (pp 1, no sequence parallelism; `device_layouts`' order), then the modelled ones:
    by model-parallel group max(tp, ep) x pp from the smallest up, pp 1, 2, 4, ... (powers of two
    dividing the layer count, and `devices`), sp off then on (sp only at tp > 1). pp and sp where
    given fix them (sp True: only sp layouts; None: both)."""
    layers = _layer_count(graph)
    pps = [pp] if pp is not None else [q for q in (1 << k for k in range(16)) if q <= layers
                                       and layers % q == 0 and devices % q == 0]
    sps = [True] if sp else [False] if sp is False else [False, True]
    out: list[tuple[int, int, int, int, int, bool]] = []
    for q in pps:
        if devices % q:
            continue
        for _, t, e, d in device_layouts(graph, mode, devices // q, tp, ep, dp, max_devices):
            out.extend((devices, t, e, d, q, on) for on in sps if t > 1 or not on)
    compiled = [x for x in out if x[4] == 1 and not x[5]]
    modelled = sorted((x for x in out if x[4] > 1 or x[5]),
                      key=lambda x: (max(x[1], x[2]) * x[4], x[4], x[5]))
    return compiled + modelled


def candidate_layouts(graph: Graph, mode: str, max_devices: int = MAX_DEVICES) -> list[tuple[int, int, int]]:
    """(devices, tp, ep) in search order: device counts 1, 2, 4, ... (powers of two); within one
    count W, dense models try tp=W; MoE models try the engines' defaults first: inference
    FastDeploy's (tp=W, ep=1: every rank holds every expert, cut W ways), then (tp=W, ep=W);
    training ERNIEKit's `moe_group: mp` (tp=W, ep=W) first, then (tp=W, ep=1); then tp=W with
    the other ep dividing W (largest first), then ep=W alone (tp=1)."""
    experts = _num_experts(graph)
    out: list[tuple[int, int, int]] = []
    w = 1
    while w <= max_devices:
        out.extend((w, t, e) for t, e in _layouts_of(w, experts is not None, mode))
        w *= 2
    return out


def device_layouts(graph: Graph, mode: str, devices: int, tp: int | None = None, ep: int | None = None,
                   dp: int | None = None, max_devices: int = MAX_DEVICES) -> list[tuple[int, int, int, int]]:
    """(devices, tp, ep, dp) with max(tp, ep) x dp = `devices`, in search order (`plan --devices`):
    the model-parallel group W = max(tp, ep) runs over the divisors of `devices` from the smallest
    up (at most `max_devices`), dp = devices / W fills the rest; within one W, the order of
    `candidate_layouts`. The first that fits wins: the smallest model-parallel group that fits,
    because tensor parallelism communicates activations in every layer while data parallelism
    reduces gradients once a step (and ZeRO sharding then divides by the largest dp). tp, ep, dp
    where given fix that degree."""
    moe = _num_experts(graph) is not None
    out: list[tuple[int, int, int, int]] = []
    for w in range(1, min(devices, max_devices) + 1):
        if devices % w or (dp is not None and devices // w != dp):
            continue
        out.extend((devices, t, e, devices // w) for t, e in _layouts_of(w, moe, mode)
                   if (tp is None or t == tp) and (ep is None or e == ep))
    return out


def _layouts_of(w: int, moe: bool, mode: str) -> list[tuple[int, int]]:
    """(tp, ep) over a model-parallel group of `w` ranks, in `candidate_layouts`' order."""
    if w == 1 or not moe:
        return [(w, 1)]
    first = [(w, w), (w, 1)] if mode == "training" else [(w, 1), (w, w)]
    middle = [(w, d) for d in range(w - 1, 1, -1) if w % d == 0]
    return list(dict.fromkeys([*first, *middle, (1, w)]))


def _check_data_parallel(opts: _Options, dp: int | None, devices: int | None, tp: int | None,
                         ep: int | None, pp: int | None = None) -> None:
    """dp, sharding and devices: training only, consistent with each other and with tp/ep."""
    check_replica_flags(opts.mode, dp, opts.sharding, devices)
    if opts.mode != "training":
        return
    if opts.sharding != "none" and devices is None and (dp is None or dp == 1):
        raise PlanError(f"--sharding {opts.sharding} divides optimizer states over data-parallel ranks: give "
                        "--dp 2 or more (or --devices N to search layouts with data parallelism)")
    if devices is None:
        return
    for flag, degree in (("--dp", dp), ("--tp", tp), ("--ep", ep), ("--pp", pp)):
        if degree is not None and devices % degree:
            raise PlanError(f"{flag} {degree} does not divide --devices {devices}: devices = max(tp, ep) "
                            "x pp x dp")
    group = max(tp or 1, ep or 1) if (tp is not None and tp > 1) or (tp and ep) else None
    if group is not None and dp is not None and group * dp * (pp or 1) != devices:
        total = group * dp * (pp or 1)
        raise PlanError(f"max(tp, ep) {group} x --pp {pp or 1} x --dp {dp} = {total} devices, "
                        f"not --devices {devices}: drop --dp or --devices")


# -- internals ----------------------------------------------------------------------------------------


class _Options(BaseModel):
    """A plan's options resolved: CompileOptions' mode and ZeRO stage, PlanRequest's values checked
    and in their units (dtypes, bytes), the engine and the modelled layout filled in."""

    model_config = ConfigDict(frozen=True)

    mode: str
    seq_len: int
    batch: int
    offload_optimizer: bool
    recompute: bool
    moment: DType
    master_weights: bool
    kv_dtype: DType | None
    prefill_tokens: int
    reserve: int
    capacity_factor: float
    sharding: str = "none"
    engine: EngineSettings | None = None
    sp: bool = False
    pp: int = 1
    micro_batches: int = 1

    @classmethod
    def make(cls, o: CompileOptions, req: PlanRequest) -> _Options:
        """`req`'s values checked against `o.mode` (one line each); the KV cache dtype is
        `req.kv_cache_dtype`, else compile's (`o.kv_cache_dtype`)."""
        mode, seq_len, batch = o.mode, req.seq_len, req.batch
        if mode not in ("inference", "training"):
            raise PlanError(f"unknown --mode {mode!r}: choose inference or training")
        if seq_len < 1 or batch < 1:
            raise PlanError(f"--seq-len {seq_len} --batch {batch}: both must be positive integers")
        if seq_len > 1 << 24 or batch > 1 << 20:  # the config cap on positions; a batch of 1M sequences
            raise PlanError(f"--seq-len {seq_len} --batch {batch}: at most {1 << 24} tokens per sequence and "
                            f"{1 << 20} sequences")
        if mode == "inference" and (req.offload_optimizer or req.recompute):
            flag = "--offload-optimizer" if req.offload_optimizer else "--recompute"
            raise PlanError(f"{flag} applies to --mode training (inference keeps no optimizer states or "
                            "saved activations)")
        moment = _MOMENT.get(req.moment_dtype.strip().lower())
        if moment is None:
            raise PlanError(f"--moment-dtype {req.moment_dtype!r}: choose float32 (fp32) or bf16")
        kv_text = req.kv_cache_dtype if req.kv_cache_dtype is not None else o.kv_cache_dtype
        kv = None
        if kv_text is not None:
            kv = _KV.get(kv_text.strip().lower())
            if kv is None:
                raise PlanError(f"--kv-cache-dtype {kv_text!r}: choose bf16, f16, fp8 or int8")
        if req.prefill_tokens is not None and req.prefill_tokens < 1:
            raise PlanError(f"--prefill-tokens must be a positive integer, not {req.prefill_tokens}")
        if not req.capacity_factor >= 1.0:
            raise PlanError(f"capacity_factor must be >= 1 (1 = balanced routing), not {req.capacity_factor}")
        reserve = req.reserve
        res = parse_memory(reserve, option="--reserve") if isinstance(reserve, str) else int(reserve)
        if res < 0:
            raise PlanError(f"--reserve must not be negative, not {reserve}")
        return cls(mode=mode, seq_len=seq_len, batch=batch, offload_optimizer=req.offload_optimizer,
                   recompute=req.recompute, moment=moment, master_weights=req.master_weights, kv_dtype=kv,
                   prefill_tokens=req.prefill_tokens or seq_len, reserve=res,
                   capacity_factor=req.capacity_factor, sharding=o.layout.sharding or "none")


def _with_pipeline(opts: _Options, fixed: _Fixed) -> _Options:
    """`opts` with sequence/pipeline parallelism and micro-batches checked (training only)."""
    tp, sp, pp, micro_batches = fixed.tp, fixed.sp, fixed.pp, fixed.micro_batches
    flag = ("--sp" if sp else f"--pp {pp}" if pp is not None and pp != 1 else
            f"--micro-batches {micro_batches}" if micro_batches is not None and micro_batches != 1 else None)
    if opts.mode != "training" and flag is not None:
        raise PlanError(f"{flag} applies to --mode training (the planner models sequence and pipeline "
                        "parallelism for training steps)")
    if sp and tp is not None and tp < 2:
        raise PlanError(f"--sp shards the residual stream over the tensor-parallel ranks: it needs --tp 2 or "
                        f"more, not --tp {tp}")
    if pp is not None and not 1 <= pp <= MAX_WORLD:
        raise PlanError(f"--pp {pp}: a parallel degree is a positive integer (at most {MAX_WORLD})")
    m = 1 if micro_batches is None else micro_batches
    if m < 1 or opts.batch % m:
        raise PlanError(f"--micro-batches {m} does not divide --batch {opts.batch}: each micro-batch is "
                        "batch / micro-batches sequences")
    return opts.model_copy(update={"sp": bool(sp), "pp": pp or 1, "micro_batches": m})


def _layer_count(graph: Graph) -> int:
    return len({x for x in (layer_of(n) for n in graph) if x is not None})


def _too_many_stages(pp: int, layers: int) -> PlanError:
    return PlanError(f"--pp {pp}: the model has {layers} decoder layer(s) and every stage needs at least "
                     f"one: give --pp {layers} or less")


def _with_engine(opts: _Options, target: str, req: PlanRequest) -> _Options:
    """`opts` with the serving engine resolved: FastDeploy by default for cuda inference (its flags
    checked and defaulted; `seq_len` becomes max_model_len, the prefill its profile run's tokens),
    none elsewhere, where the engine's flags are refused."""
    tgt = find_target(target)
    applies = tgt is not None and "fastdeploy" in tgt.executables and opts.mode == "inference"
    engine = req.engine
    name = ("fastdeploy" if applies else "none") if engine is None else engine.strip().lower()
    if name not in ENGINES:
        raise PlanError(f"--engine {engine!r}: choose fastdeploy (cuda inference) or none (the bare model)")
    if name == "none":
        flag = next((f for f, key in _ENGINE_FLAGS.items() if req.given(key)), None)
        if flag is not None:
            why = "--engine none" if applies else ("--mode training" if opts.mode == "training"
                                                   else f"--target {target}")
            raise PlanError(f"{flag} is FastDeploy's flag and does not apply with {why}: drop it "
                            "(the bare model is sized by --seq-len and --batch)")
        return opts
    if not applies:
        where = "--mode training" if opts.mode == "training" else f"--target {target}"
        raise PlanError(f"--engine fastdeploy models FastDeploy serving on cuda, not {where}: drop --engine "
                        "(or give --engine none)")
    if req.prefill_tokens is not None:
        raise PlanError("prefill_tokens does not apply under --engine fastdeploy: its profile run's "
                        "max_num_batched_tokens sets the activations; give that instead")
    max_model_len = req.max_model_len
    if max_model_len is not None and req.given("seq_len") and max_model_len != req.seq_len:
        raise PlanError(f"--seq-len {req.seq_len} and --max-model-len {max_model_len} disagree: under "
                        "--engine fastdeploy they are one number; give one of them")
    mml = opts.seq_len if max_model_len is None else max_model_len
    seqs, util, tokens = req.max_num_seqs, req.gpu_memory_utilization, req.max_num_batched_tokens
    for flag, value, cap in (("--max-model-len", mml, 1 << 24), ("--max-num-seqs", seqs, 1 << 20),
                             ("--max-num-batched-tokens", tokens, 1 << 24)):
        if not 1 <= value <= cap:
            raise PlanError(f"{flag} {value}: must be a positive integer of at most {cap}")
    if not 0 < util <= 1:  # also refuses nan
        raise PlanError(f"--gpu-memory-utilization {util}: the fraction of each device the engine may use, "
                        "in (0, 1], e.g. 0.9")
    settings = EngineSettings(max_model_len=mml, max_num_seqs=seqs, gpu_memory_utilization=util,
                              max_num_batched_tokens=tokens, required_sequences=opts.batch)
    return opts.model_copy(update={"seq_len": mml, "prefill_tokens": tokens, "engine": settings})


def _is_artifact(model: str) -> bool:
    return (Path(model) / "manifest.json").is_file()


def _load(model: str) -> Graph:
    """The model's graph; a checkpoint folder is read from config.json alone (no weights)."""
    path = Path(model)
    meta = path.is_dir() and not (path / GRAPH_FILE).is_file()
    return load_input(model, meta=meta)


def _num_experts(graph: Graph) -> int | None:
    for node in graph:
        if node.op == "moe_gate":
            w = node.inputs[1]
            if w is not None and isinstance(w.shape[-1], int):
                return w.shape[-1]
    return None


def _compile_ranks(model: str, tgt: HardwareTarget, arch: int | None, options: CompileOptions, tp: int,
                   ep: int) -> tuple[list[Graph], str, list[str]]:
    """The rank graphs compile would write for this layout, the pipeline text, and notes."""
    graph = _load(model)
    notes: list[str] = []
    quant_text = options.quant_text
    try:
        layout = ParallelLayout(tp=tp, ep=ep)
        resolved, _ = compile_pipeline(graph, tgt, arch, quant_text, options.pipeline, layout)
        ranks = run_ranks(graph, resolved)
    except SplitError as e:
        # FP8's tensor-wise scales span the whole weight, so the split refuses an FP8 graph and
        # compile cannot build this layout today. Each rank quantizing its own slice has the same
        # param types and shapes (one f32 scale per tensor), so plan that order and say so.
        if not _quantizes_fp8(options.quant):
            raise
        graph = _load(model)
        user = str(load_pipeline(options.pipeline)) if options.pipeline else ""
        legal = legalize_spec(tgt, arch)
        text = ",".join(x for x in (user, f"split{{tp={tp},ep={ep}}}", quant_text, legal) if x)
        resolved = load_pipeline(text)
        ranks = run_ranks(graph, resolved)
        notes.append(f"compile cannot split an FP8 graph today ({e}); planned as {text}: each rank "
                     "quantizes its own slice (same param types and shapes, per-rank scales)")
    return ranks, str(resolved), notes


def _quantizes_fp8(quant: QuantChoice | None) -> bool:
    """Whether `quant` makes FP8 weights: an FP8 preset (`QuantChoice.fp8`), or a quant-config
    file with an FP8 rule."""
    if quant is None:
        return False
    return quant.fp8 or (quant.config is not None and Algo.FP8 in QuantConfig.from_yaml(quant.config).algos)


def run_ranks(graph: Graph, pipeline: Pipeline) -> list[Graph]:
    """`run_pipeline_ranks(graph, pipeline).ranks`, with the passes after the split run once per
    class of type-identical rank graphs (same param types, same ops with the same output types, in
    order: every tensor-parallel rank of the built-in models). Such ranks get the same graph
    object, because every figure of the plan is a function of those types alone. Passes run
    without per-pass verification (`debug=False`): the same passes, faster at full size."""
    passes = pipeline.passes
    cut = next((i for i, p in enumerate(passes) if p.fans_out), None)
    if cut is None:
        return run_pipeline_ranks(graph, pipeline, debug=False, evaluator=Interpreter,
                                  adapter_reader=read_adapter).ranks
    split = run_pipeline_ranks(graph, Pipeline(passes[: cut + 1]), debug=False, evaluator=Interpreter,
                               adapter_reader=read_adapter).ranks
    rest = Pipeline(passes[cut + 1:])
    done: dict[Any, Graph] = {}
    out: list[Graph] = []
    for g in split:
        key = _type_key(g)
        if key not in done:
            if rest.passes:
                run_pipeline(g, rest, debug=False, evaluator=Interpreter, adapter_reader=read_adapter)
            done[key] = g
        out.append(done[key])
    return out


def _type_key(g: Graph) -> tuple[Any, ...]:
    return (tuple((p.type, p.trainable) for p in g.params.values()),
            tuple((n.op, n.scope, tuple(o.type for o in n.outputs)) for n in g))


def _plan_artifact(model: str, opts: _Options, memory: int, req: PlanRequest, dp: int | None) -> MemoryPlan:
    from ernie_ir.artifacts import artifact_mapping, verify_artifact

    devices = req.devices
    manifest = verify_artifact(model)
    mapping = artifact_mapping(manifest)
    if mapping.pp > 1:
        raise PlanError(f"{model} is pipelined (--pp {mapping.pp}): plan its source model with the same "
                        f"--tp/--ep/--sp and --pp {mapping.pp} (the planner cuts and weighs the stages "
                        "itself)")
    if manifest.mode != opts.mode:
        raise PlanError(f"{model} is a {manifest.mode} artifact: plan it with --mode "
                        f"{manifest.mode} (or plan its source model)")
    # the rank graphs are one replica's (rank0 .. world_size-1, stored once: ir/mapping.py); dp and
    # sharding as the layout records them, or, for a layout without dp, as the caller gives them
    recorded, stage = mapping.dp, mapping.sharding or "none"
    replicas = (dp if dp is not None else devices // mapping.world_size
                if recorded == 1 and devices is not None and devices % mapping.world_size == 0 else recorded)
    if recorded > 1 and (replicas != recorded or opts.sharding not in ("none", stage)):
        raise PlanError(f"{model} is laid out for dp {recorded}, sharding {stage}: drop --dp/--devices/"
                        "--sharding or give those (or plan its source model)")
    if recorded > 1:
        opts = opts.model_copy(update={"sharding": stage})
    if opts.mode == "training":
        opts = _recorded_precision(model, opts, req)
    if devices is not None and devices % mapping.world_size:
        raise PlanError(f"{model} has {mapping.world_size} model-parallel rank(s): --devices {devices} is "
                        "not a multiple of that (devices = ranks x dp)")
    _check_data_parallel(opts, replicas, devices, mapping.tp, mapping.ep)
    ranks = [load_graph(Path(model) / f"rank{r}") for r in range(mapping.world_size)]
    opts = _with_engine(opts, str(manifest.target), req)
    plan_meta = ranks[0].metadata.get("kernel_plan", {}) or {}
    head = dict(model=model, target=str(manifest.target), cuda_arch=plan_meta.get("cuda_arch"),
                quant=(ranks[0].metadata.get("quantization") or {}).get("name"), mode=opts.mode,
                lora_rank=None)
    return _assemble(head, ranks, manifest.pipeline or "", [], mapping.tp, mapping.ep, opts,
                     memory, req.given("device_memory"), dp=replicas)


def _recorded_precision(model: str, opts: _Options, req: PlanRequest) -> _Options:
    """`opts` with a training artifact's recorded moment dtype and offload (train.json's
    `precision`, or the manifest's `training_precision` for a graph-only artifact:
    ernie_ir.training.precision); PlanError (one line) where --moment-dtype or
    --offload-optimizer is given and differs. An artifact without the record: `opts` as given."""
    import json

    from ernie_ir.training.precision import Precision

    recorded = None
    for path, key in ((Path(model) / "training" / "train.json", "precision"),
                      (Path(model) / "manifest.json", "training_precision")):
        try:
            recorded = recorded or Precision.from_recipe({"precision": json.loads(
                path.read_text(encoding="utf-8")).get(key)})
        except (OSError, ValueError, AttributeError):
            continue
    if recorded is None:
        return opts
    moment = _MOMENT[recorded.moments]
    if req.given("moment_dtype") and opts.moment != moment:
        raise PlanError(f"--moment-dtype {req.moment_dtype}: {model} records AdamW moments in {moment} "
                        f"(compile --moment-dtype): drop --moment-dtype (or plan its source model)")
    if req.given("offload_optimizer") and opts.offload_optimizer != recorded.offload_optimizer:
        raise PlanError(f"--offload-optimizer: {model} was compiled without it (its optimizer states stay "
                        "on the device): drop it, or compile with --offload-optimizer")
    return opts.model_copy(update={"moment": moment, "offload_optimizer": recorded.offload_optimizer})


def _assemble(head: dict[str, Any], ranks: list[Graph], pipeline: str, notes: list[str], tp: int, ep: int,
              opts: _Options, memory: int, given: bool, *, dp: int = 1) -> MemoryPlan:
    """The plan of one layout, `ranks` being one data-parallel replica's (no search: `min_devices`
    None; the search fills it in)."""
    if opts.sp and tp < 2:
        raise PlanError("--sp shards the residual stream over the tensor-parallel ranks: it needs --tp 2 or "
                        "more, not --tp 1")
    if opts.pp > 1 and opts.pp > _layer_count(ranks[0]):
        raise _too_many_stages(opts.pp, _layer_count(ranks[0]))
    per_rank, infos, kind, trainable_count = _measure(ranks, opts, memory, tp, dp)
    worst = max(per_rank, key=lambda m: m.total_bytes)
    notes = [*notes, *_plan_notes(ranks, per_rank, kind, opts, dp)]
    engine = (opts.engine.model_copy(update={"usable_bytes": _usable(opts, memory)})
              if opts.engine is not None else None)
    return MemoryPlan(
        **head, seq_len=opts.seq_len, batch=opts.batch, engine="fastdeploy" if engine else "none",
        engine_settings=engine, pipeline=pipeline, tp=tp, ep=ep, dp=dp, sharding=opts.sharding, pp=opts.pp,
        sequence_parallel=opts.sp, micro_batches=opts.micro_batches, stages=infos,
        bubble_fraction=(opts.pp - 1) / (opts.micro_batches + opts.pp - 1),
        devices=len(ranks) * dp * opts.pp, device_memory_bytes=memory, device_memory_given=given,
        fits=all(m.fits for m in per_rank), headroom_bytes=min(m.headroom_bytes for m in per_rank),
        max_rank_bytes=worst.total_bytes, min_devices=None, searched=False, search=[],
        trainable=kind, trainable_params=trainable_count, assumptions=_assumptions(opts, tp, dp),
        per_rank=per_rank, host_total_bytes=sum(m.host_bytes for m in per_rank) * dp, notes=notes,
    )


Trainable = Literal["none", "graph", "full"]


def _trainable_of(g: Graph, opts: _Options) -> tuple[set[str], Trainable]:
    """The params of `g` a training step updates, and which rule chose them (`MemoryPlan.trainable`)."""
    if opts.mode != "training":
        return set(), "none"
    names = {p.name for p in g.params.values() if p.trainable}
    return (names, "graph") if names else (full_parameter_trainable(g), "full")


def _measure(ranks: list[Graph], opts: _Options, memory: int, tp: int,
             dp: int) -> tuple[list[RankMemory], list[StageInfo], Trainable, int]:
    """Every rank's memory (stage by stage with pipeline parallelism), the stages, which params
    train and how many of rank 0's do."""
    per_rank: list[RankMemory] = []
    kind: Trainable = "none"
    trainable_count = 0
    measured: dict[tuple[int, int], RankMemory] = {}
    specs: list[_Stage | None] = [None]
    infos: list[StageInfo] = []
    if opts.mode == "training" and opts.pp > 1:
        parts, infos = _partition(ranks[0], _trainable_of(ranks[0], opts)[0], opts, tp, dp)
        specs = list(parts)
    for st, spec in enumerate(specs):
        for r, g in enumerate(ranks):
            trainable, kind = _trainable_of(g, opts)
            if r == 0 and st == 0:
                trainable_count = len(trainable)
            if (id(g), st) not in measured:  # type-identical ranks share one graph (see run_ranks)
                measured[id(g), st] = _rank_memory(r, g, trainable, opts, memory, dp, tp=tp, stage=spec)
            per_rank.append(measured[id(g), st].model_copy(update={"rank": st * len(ranks) + r, "stage": st}))
    return per_rank, infos, kind, trainable_count


def _assumptions(opts: _Options, tp: int, dp: int) -> dict[str, Any]:
    """What the plan assumes (`MemoryPlan.assumptions`)."""
    assumptions: dict[str, Any] = {
        "reserve_bytes": opts.reserve,
        "attention": "memory-efficient (flash): no [S, S] scores kept",
        "moe_routing": f"balanced over experts, capacity factor {opts.capacity_factor:g}",
    }
    if opts.mode == "training":
        assumptions.update(_training_assumptions(opts, tp, dp))
        return assumptions
    kv = opts.kv_dtype
    assumptions.update({
        "kv_cache_dtype": str(kv) if kv is not None else "the attention inputs' dtype",
        "kv_cache_tokens": opts.batch * opts.seq_len, "prefill_tokens": opts.prefill_tokens,
        "logits": "last position of each sequence only",
    })
    if opts.engine is not None:
        assumptions.update({
            "engine": "FastDeploy: usable = device x gpu_memory_utilization; the reserve, weights and "
                      "the activation peak of a profile run over max_num_batched_tokens tokens come "
                      "first; the KV blocks left must hold required_sequences of max_model_len + 2 "
                      "blocks (at most 40000 blocks)",
        })
    return assumptions


def _training_assumptions(opts: _Options, tp: int, dp: int) -> dict[str, Any]:
    """The training step's assumptions (optimizer, recompute, layout)."""
    return {
        "optimizer": "AdamW (2 moments per trainable param)",
        "moment_dtype": str(opts.moment), "master_weights": "f32 for trainable params not in f32"
        if opts.master_weights else "none", "gradients": "param dtype (bf16 for fp8/int params)",
        "offload_optimizer": opts.offload_optimizer, "recompute": "full, per decoder layer"
        if opts.recompute else "none",
        "loss": "cross-entropy over the graph's f32 logits; at tp > 1 over each rank's vocabulary "
                "shard (the vocabulary-parallel loss, never gathered)",
        "sequence_parallel": (
            f"on (modelled, not compiled): the residual stream, the norms and their outputs are kept as "
            f"token shards (/ tp {tp}); each column-parallel linear keeps its all-gathered input whole"
            if opts.sp else "none: activations between tensor-parallel ops are whole on every rank"),
        "pipeline_parallel": (
            f"pp {opts.pp} (modelled, not compiled), 1F1B over {opts.micro_batches} micro-batch(es): "
            "stage s keeps min(pp - s, M) micro-batches' saved activations; layers partitioned to "
            "balance each stage's params, gradients, device optimizer states and in-flight kept "
            "activations (rank 0)"
            if opts.pp > 1 else "none"),
        "micro_batches": opts.micro_batches,
        "micro_batch_sequences": opts.batch // opts.micro_batches,
        "tokens_per_step": opts.batch * opts.seq_len,
        "data_parallel": f"dp {dp}: every replica holds these ranks' weights, gradients and "
                         "activations; --batch is per replica (ERNIEKit's per_device_train_batch_size)",
        "sharding": {"none": "none", "stage1": f"stage1: AdamW moments and f32 master weights / dp {dp}",
                     "stage2": f"stage2: AdamW moments, f32 master weights and gradients / dp {dp}"
                     }[opts.sharding] + ("" if opts.sharding == "none" else
                                         " (even split, rounded up; no bucket buffers)"),
        "global_tokens_per_step": opts.batch * opts.seq_len * dp,
    }


def _plan_notes(ranks: list[Graph], per_rank: list[RankMemory], kind: Trainable, opts: _Options,
                dp: int) -> list[str]:
    """What the plan says beside its figures: sharding that divides nothing, FP8 params trained,
    a max_model_len FastDeploy cannot start with."""
    notes: list[str] = []
    if opts.mode == "training":
        if opts.sharding != "none" and dp == 1:
            notes.append(f"--sharding {opts.sharding} over dp 1 divides nothing: every rank keeps all "
                         "of its optimizer states")
        if kind == "full" and any(p.type.dtype in (DType.F8E4M3, DType.F8E5M2)
                                  for p in ranks[0].params.values()):
            notes.append("full-parameter training of FP8 params as ERNIEKit's FP8 QAT stores them "
                         "(FP8 on the device, gradients bf16, f32 masters with the optimizer states); this "
                         "toolchain's own FP8 QAT graph (fp8-quant{form=fake}) keeps bf16 weights")
    elif opts.engine is not None and any(r.kv_detail["blocks_needed"] > opts.engine.max_blocks
                                         for r in per_rank):
        notes.append(f"max_model_len {opts.seq_len} needs more than FastDeploy's "
                     f"{opts.engine.max_blocks} KV blocks per rank: it cannot start on any memory")
    return notes


@dataclass(frozen=True)
class _Stage:
    """One pipeline stage: the owners (decoder layer names, "<pre>", "<post>") of its nodes and
    params, whether it holds the loss, and its micro-batches in flight."""

    index: int
    owners: frozenset[str]
    loss: bool
    in_flight: int


def _owners(g: Graph) -> tuple[dict[int, str], dict[str, set[str]]]:
    """Each node's owner (its decoder layer; "<pre>"/"<post>" outside the layers, before/after
    them) and each param's owners (those of the nodes reading it; a tied embedding has two)."""
    nodes = list(g)
    lay = [layer_of(n) for n in nodes]
    first = next((i for i, x in enumerate(lay) if x is not None), len(nodes))
    node_owner = {id(n): lay[i] or ("<pre>" if i < first else "<post>") for i, n in enumerate(nodes)}
    params: dict[str, set[str]] = {}
    for n in nodes:
        for v in n.inputs:
            if isinstance(v, Param):
                params.setdefault(v.name, set()).add(node_owner[id(n)])
    return node_owner, params


def _param_train_bytes(p: Param, trainable: set[str], opts: _Options, dp: int) -> dict[str, int]:
    """Device bytes of one param by category (the rules of `_rank_memory`)."""
    cats = {"weights": tensor_bytes(p.type)}
    if opts.mode == "training" and p.name in trainable:
        n = numel(p.type)
        grad = p.type.dtype if p.type.dtype in (DType.F32, DType.BF16, DType.F16) else DType.BF16
        cats["gradients"] = n * grad.bits // 8
        cats["optimizer_moments"] = 2 * n * opts.moment.bits // 8
        cats["master_weights"] = n * 4 if opts.master_weights and p.type.dtype != DType.F32 else 0
        for c in SHARDED[opts.sharding]:
            cats[c] = -(-cats[c] // dp)
        if opts.offload_optimizer:
            for c in HOST_CATEGORIES:
                cats[c] = 0
    return cats


def _partition(g: Graph, trainable: set[str], opts: _Options, tp: int,
               dp: int) -> tuple[list[_Stage], list[StageInfo]]:
    """Contiguous layer ranges for `opts.pp` stages (each at least one layer; the embedding on the
    first, the final norm, lm_head and loss on the last) minimising the largest stage's balance
    figure: its params' device bytes (weights, gradients, device optimizer states) + in_flight x
    the activations its ops keep at the end of forward (one micro-batch, `saved_by_layer`)."""
    pp, m = opts.pp, opts.micro_batches
    node_owner, param_owners = _owners(g)
    order = list(dict.fromkeys(o for o in node_owner.values() if o not in ("<pre>", "<post>")))
    static: dict[str, int] = {}
    for p in g.params.values():
        b = sum(_param_train_bytes(p, trainable, opts, dp).values())
        for o in param_owners.get(p.name, {"<pre>"}):
            static[o] = static.get(o, 0) + b
    env = {"B": opts.batch // m, "S": opts.seq_len}
    acts = training_activations(g, GraphFacts(g, trainable), env, recompute=opts.recompute,
                                capacity_factor=opts.capacity_factor, sp=tp if opts.sp else 1).saved_by_layer
    n = len(order)
    cs = [0] * (n + 1)
    ca = [0] * (n + 1)
    for i, name in enumerate(order):
        cs[i + 1] = cs[i] + static.get(name, 0)
        ca[i + 1] = ca[i] + acts.get(name, 0)

    def cost(st: int, i: int, j: int) -> int:
        k = min(pp - st, m)
        c = cs[j] - cs[i] + k * (ca[j] - ca[i])
        if st == 0:
            c += static.get("<pre>", 0) + k * acts.get("<pre>", 0)
        if st == pp - 1:
            c += static.get("<post>", 0) + k * acts.get("<post>", 0)
        return c

    bounds = [i for i, _ in min_max_partition(n, pp, cost)] + [n]
    specs: list[_Stage] = []
    infos: list[StageInfo] = []
    for st in range(pp):
        i, j = bounds[st], bounds[st + 1]
        owners = set(order[i:j]) | ({"<pre>"} if st == 0 else set()) | ({"<post>"} if st == pp - 1 else set())
        specs.append(_Stage(st, frozenset(owners), st == pp - 1, min(pp - st, m)))
        infos.append(StageInfo(stage=st, layers=[i, j - 1], embedding=st == 0, head=st == pp - 1,
                               in_flight=min(pp - st, m), balance_bytes=cost(st, i, j)))
    return specs, infos


def _rank_memory(rank: int, g: Graph, trainable: set[str], opts: _Options, memory: int,
                 dp: int = 1, *, tp: int = 1, stage: _Stage | None = None) -> RankMemory:
    lora = lora_params(g)
    cats = dict.fromkeys(CATEGORIES, 0)
    by_dtype: dict[str, int] = {}
    include = None
    held = list(g.params.values())
    if stage is not None:
        node_owner, param_owners = _owners(g)
        owners = stage.owners
        held = [p for p in held if param_owners.get(p.name, {"<pre>"}) & owners]
        trainable = trainable & {p.name for p in held}

        def include(n: Node) -> bool:
            return node_owner[id(n)] in owners

    for p in held:
        b = tensor_bytes(p.type)
        cats["lora" if p.name in lora else "weights"] += b
        by_dtype[str(p.type.dtype)] = by_dtype.get(str(p.type.dtype), 0) + b
    detail: dict[str, int | bool] = {}
    kv_detail: dict[str, int] = {}
    unsharded: dict[str, int] = {}
    facts = GraphFacts(g, trainable)
    if opts.mode == "training":
        for name in trainable:
            p = g.params[name]
            n = numel(p.type)
            grad = p.type.dtype if p.type.dtype in (DType.F32, DType.BF16, DType.F16) else DType.BF16
            cats["gradients"] += n * grad.bits // 8
            cats["optimizer_moments"] += 2 * n * opts.moment.bits // 8
            if opts.master_weights and p.type.dtype != DType.F32:
                cats["master_weights"] += n * 4
        unsharded = {c: cats[c] for c in ("gradients", "optimizer_moments", "master_weights")}
        for c in SHARDED[opts.sharding]:  # ZeRO: each data-parallel rank keeps 1/dp (even split)
            cats[c] = -(-cats[c] // dp)
        env = {"B": opts.batch // opts.micro_batches, "S": opts.seq_len}
        k = stage.in_flight if stage is not None else 1
        both = {rc: training_activations(g, facts, env, recompute=rc, capacity_factor=opts.capacity_factor,
                                         sp=tp if opts.sp else 1, include=include,
                                         loss=stage is None or stage.loss)
                for rc in (False, True)}
        acts = both[opts.recompute]
        # 1F1B: the other micro-batches in flight keep their saved sets while one runs backward
        peak = {rc: a.peak_bytes + (k - 1) * a.saved_bytes for rc, a in both.items()}
        cats["activations"] = peak[opts.recompute]
        detail = {"saved_bytes": acts.saved_bytes, "recomputed_bytes": acts.recomputed_bytes,
                  "transient_bytes": acts.transient_bytes, "recompute": acts.recompute, "layers": acts.layers,
                  "peak_without_recompute_bytes": peak[False],
                  "peak_with_recompute_bytes": peak[True], "in_flight_micro_batches": k}
    else:
        eng = opts.engine
        # the engine's profile run computes logits for up to max_num_seqs sequences
        rows = eng.max_num_seqs if eng is not None else opts.batch
        cats["activations"] = inference_peak(g, facts, opts.prefill_tokens, rows, opts.capacity_factor)
        if eng is None:
            cats["kv_cache"] = kv_cache_bytes(g, opts.seq_len, opts.batch, opts.kv_dtype)
        else:
            block = kv_cache_bytes(g, eng.block_size, 1, opts.kv_dtype)
            per_sequence = -(-eng.max_model_len // eng.block_size)
            needed = eng.required_sequences * per_sequence + 2
            cats["kv_cache"] = needed * block
            kv_detail = {"block_bytes": block, "blocks_per_sequence": per_sequence, "blocks_needed": needed}
        detail = {"prefill_tokens": opts.prefill_tokens}
    cats["reserve"] = opts.reserve
    host = dict.fromkeys(HOST_CATEGORIES, 0)
    if opts.offload_optimizer:
        for c in HOST_CATEGORIES:
            host[c], cats[c] = cats[c], 0
    total = sum(cats.values())
    budget = _usable(opts, memory)
    fits = total <= budget
    if opts.engine is not None:
        # what the engine allocates: every block the memory left after the profile holds
        left = budget - (total - cats["kv_cache"])
        block = kv_detail["block_bytes"]
        blocks = min(max(left, 0) // block if block else opts.engine.max_blocks, opts.engine.max_blocks)
        kv_detail.update(blocks=blocks, sequences=blocks // kv_detail["blocks_per_sequence"])
        fits = fits and kv_detail["blocks_needed"] <= opts.engine.max_blocks
    return RankMemory(rank=rank, total_bytes=total, by_category=cats,
                      weights_by_dtype=dict(sorted(by_dtype.items())), host_bytes=sum(host.values()),
                      host_by_category=host, unsharded_bytes=unsharded,
                      sharding_saved_bytes=sum(unsharded.values()) - sum(
                          cats[c] + host.get(c, 0) for c in unsharded),
                      headroom_bytes=budget - total, fits=fits,
                      activation_detail=detail, kv_detail=kv_detail)


def _usable(opts: _Options, memory: int) -> int:
    """The bytes each rank's total is held to: the device, or the engine's share of it."""
    return int(memory * opts.engine.gpu_memory_utilization) if opts.engine is not None else memory
