"""calibrated-quant: weight-only weights annotated with a calibrated method, quantized on data.

The weights `quant-annotate` marked `method=gptq` (`wint4{method=gptq}`, or `method:` in a
`--quant-config` rule) are quantized here, sequentially, one decoder layer at a time
(llm-compressor's sequential pipeline):

1. the calibration windows (`calib_data.read_windows`) are held as the inputs of the current
   decoder layer (the values that cross into it: the residual stream, the rope tables, ...);
   the layer alone (its stage graph, `pipeline_stages.cut_stages` with one layer per stage)
   runs on them, a few windows at a time, with the pipeline's evaluator, and each calibrated
   linear's input rows are added to its Hessian X^T X as they pass (the product of a chunk in
   float32, as llm-compressor computes it; the sum over chunks in float64);
2. each weight of the layer is quantized by its method (`gptq.gptq_quantize`) and converted in
   place, exactly as `weight-only-quant` converts (`weight_only.convert_site`);
3. the layer, now quantized, runs once more on the held inputs, and its outputs become the next
   layer's inputs: errors propagate as they will at inference.

Within one layer every linear sees the inputs of the float layer (the previous layers
quantized). Routed experts: each expert's Hessians come from the tokens routed to it (up_gate:
its rows of the MoE input; down: silu(gate) * up of them through the float up_gate); an expert
that gets fewer than `min_expert_tokens` tokens is rounded to nearest and named in a warning
and in `graph.metadata["calibration"]["rtn_experts"]`.

Two runs of each layer, as llm-compressor's pipeline; memory is the held inputs of one layer
(all windows) plus one layer's Hessians. A graph that cannot be cut at its layers (calibrated
weights outside `layers.N`) calibrates them all in one run of the whole graph.
`graph.metadata["calibration"]` records the method, the data's sha256 and the
settings; the manifest carries it. A graph without weight data (meta) is left to
`weight-only-quant`, which makes typed params without data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import Field

from ernie_ir.ir import ErnieIRError, Graph, Node, Param, Value
from ernie_ir.ir.weights import release_mapped_pages
from ernie_ir.ops.moe import swiglu
from ernie_ir.ops.quant_numerics import weight_quantize

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from ..parallel.pipeline_stages import StageError, cut_stages, decoder_layer, layer_count
from ..parallel.split import row_cut
from .annotate import ANNOTATION
from .calib_data import DEFAULT_SAMPLES, FLAG, CalibrationDataError, read_windows
from .config import Method, QuantSpec
from .gptq import BLOCK_SIZE, DAMP, gptq_quantize
from .weight_only import convert_site

RECORD = "calibration"
"""`graph.metadata[RECORD]`: method, data digest and settings of the calibrated weights."""
_SLOTS = {"linear": (1,), "moe_experts": (3, 4)}


class CalibratedQuantOptions(PassOptions):
    calibration_file: str | None = None
    """The calibration data (`--calib-data`): a .npy of token ids [batch, seq]."""
    samples: int = Field(DEFAULT_SAMPLES, ge=1)
    """Windows calibrated on (`--calib-samples`)."""
    seq_len: int | None = Field(None, ge=1)
    """Tokens per window (`--calib-seq-len`); None: min(512, the model's max positions)."""
    damp: float = Field(DAMP, ge=0.0)
    """GPTQ dampening, a fraction of the mean Hessian diagonal."""
    block_size: int = Field(BLOCK_SIZE, ge=1)
    actorder: bool = False
    """GPTQ: visit input channels by decreasing Hessian diagonal."""
    min_expert_tokens: int = Field(16, ge=1)
    """A routed expert calibrated on fewer tokens than this is rounded to nearest."""
    chunk: int = Field(8, ge=1)
    """Windows per forward run (memory: one chunk's activations)."""


class CalibratedQuantError(ErnieIRError):
    """A calibrated quantization that cannot run here."""


@dataclass
class _Site:
    node: Node
    idx: int
    weight: Param
    spec: QuantSpec


@dataclass
class _Stats:
    """One layer's Hessian sums (X^T X, float64 [experts or 1, K, K]) and row counts, by weight name."""

    h: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)


class _Stop(Exception):
    """Raised by the observer after the layer's last calibrated node: the rest of the run is skipped."""


def _sites(graph: Graph) -> list[_Site]:
    out: list[_Site] = []
    for node in graph:
        for idx in _SLOTS.get(node.op, ()):
            w = node.inputs[idx]
            if not isinstance(w, Param) or w.type.dtype.is_int:
                continue
            ann = w.annotations.get(ANNOTATION) or {}
            if ann.get("method", Method.RTN.value) == Method.RTN.value or not ann.get("algo", "").startswith(
                    "weight_only"):
                continue
            if node.op == "linear" and w.type.rank != 2:
                continue
            out.append(_Site(node, idx, w, QuantSpec.from_annotation(ann)))
    return out


def _config(graph: Graph) -> dict[str, Any]:
    cfg = graph.metadata.get("config")
    return cfg if isinstance(cfg, dict) else {}


def _vocab(graph: Graph) -> int:
    tables = [n.inputs[1] for n in graph if n.op == "embedding"]
    if tables:
        return int(tables[0].type.shape[0])  # type: ignore[union-attr]
    return int(_config(graph).get("vocab_size", 2))


class _Windows:
    """The calibration windows, held as the inputs of one decoder layer at a time (one dict of
    arrays per chunk of windows); `layers` is None for a graph that cannot be cut at its layers."""

    def __init__(self, graph: Graph, ids: np.ndarray, input_name: str, opts: CalibratedQuantOptions,
                 ctx: PassContext, sites: list[_Site]) -> None:
        self.graph, self.ctx = graph, ctx
        self.held: list[Mapping[str, np.ndarray]] = [{input_name: ids[i:i + opts.chunk]}
                                                     for i in range(0, ids.shape[0], opts.chunk)]
        self.layer = 0
        n = layer_count(graph)
        self.bounds: tuple[tuple[int, int], ...] | None = tuple((i, i + 1) for i in range(n))
        try:
            if not n or any(decoder_layer(s.node) is None for s in sites):
                raise StageError("calibrated weights outside the decoder layers")
            cut_stages(graph, self.bounds)
        except StageError:
            self.bounds = None

    def groups(self, sites: list[_Site]) -> list[tuple[int | None, list[_Site]]]:
        """(layer, its sites) in order; one group of every site when the graph is not cut."""
        if self.bounds is None:
            return [(None, sites)]
        out: dict[int, list[_Site]] = {}
        for s in sites:
            out.setdefault(decoder_layer(s.node), []).append(s)  # type: ignore[arg-type]
        return sorted(out.items())

    def stage(self, layer: int | None) -> Graph:
        """Layer `layer` alone as a graph (its inputs: what `held` holds), as the graph now is."""
        if layer is None or self.bounds is None:
            return self.graph
        self.advance(layer)
        return cut_stages(self.graph, self.bounds)[layer]

    def advance(self, layer: int) -> None:
        """Run the held windows through the layers before `layer`, as the graph now is (the
        calibrated ones quantized)."""
        while self.layer < layer:
            runner = self.ctx.evaluator(cut_stages(self.graph, self.bounds)[self.layer])  # type: ignore[misc,arg-type]
            self.held = [runner.run(h) for h in self.held]
            self.layer += 1


@register_pass
class CalibratedQuant(Pass):
    """Quantize the weights annotated with a calibrated method (gptq) on data, layer by layer."""

    name = "calibrated-quant"
    description = ("Weight-only weights annotated method=gptq: GPTQ on calibration data, one decoder layer "
                   "at a time, written on weight-only-quant's grid.")
    Options = CalibratedQuantOptions
    requires = frozenset({"quant-annotated"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: CalibratedQuantOptions = self.options  # type: ignore[assignment]
        sites = _sites(graph)
        if not sites or any(s.weight.source is None for s in sites):
            return False  # nothing calibrated, or a meta graph: weight-only-quant types the params
        cut = next((s.weight.name for s in sites if row_cut(s.weight)), None)
        if cut is not None:
            raise CalibratedQuantError(f"calibrated-quant after split: {cut} is row-parallel on this rank, "
                                       "so its Hessian would cover 1/tp of its inputs: calibrate before "
                                       "splitting (put calibrated-quant before split in --pipeline)")
        if opts.calibration_file is None:
            raise CalibrationDataError(
                f"{sites[0].weight.name} is annotated method={sites[0].spec.method}, which calibrates on "
                f"data: give {FLAG} FILE.npy (token ids [batch, seq]); it never calibrates on random ids")
        ints = [v for v in graph.inputs if v.type.dtype.is_int]
        if len(graph.inputs) != 1 or len(ints) != 1 or ints[0].type.rank != 2:
            raise CalibratedQuantError("calibrated-quant: calibration runs a graph whose only input is token "
                                       "ids [batch, seq]")
        if ctx.evaluator is None:
            raise CalibratedQuantError("calibrated-quant: calibrating needs a graph evaluator: pass "
                                       "evaluator=ernie_ir.runtime.Interpreter to run_pipeline "
                                       "(compile_model and the CLI do)")
        data = read_windows(opts.calibration_file, vocab=_vocab(graph), samples=opts.samples,
                            seq_len=opts.seq_len, max_positions=_config(graph).get("max_position_embeddings"),
                            warn=ctx.warn)
        placer = ParamPlacer(graph)
        windows = _Windows(graph, data.ids, ints[0].name, opts, ctx, sites)
        rtn_experts: list[str] = []
        for layer, group in windows.groups(sites):
            stats = _collect(windows.stage(layer), windows.held, group, ctx)
            for site in group:
                codes, scale = _quantize(site, stats, opts, rtn_experts)
                convert_site(placer, site.node, site.idx, site.weight, site.spec, scale, codes)
            release_mapped_pages()
        placer.finish(removed={s.weight.name for s in sites})
        if rtn_experts:
            ctx.warn(f"calibrated-quant: {len(rtn_experts)} routed expert(s) got fewer than "
                     f"{opts.min_expert_tokens} calibration tokens and were rounded to nearest: "
                     f"{', '.join(rtn_experts[:8])}{' ...' if len(rtn_experts) > 8 else ''}")
        graph.metadata[RECORD] = {
            "methods": sorted({s.spec.method.value for s in sites}), "data": data.record(),
            "settings": {"damp": opts.damp, "block_size": opts.block_size, "actorder": opts.actorder,
                         "min_expert_tokens": opts.min_expert_tokens, "scale": "abs_max"},
            "weights": len(sites), "rtn_experts": rtn_experts}
        ctx.count("calibrated", len(sites))
        return True


def _collect(stage: Graph, held: list[Mapping[str, np.ndarray]], layer: list[_Site],
             ctx: PassContext) -> _Stats:
    """Hessian sums of `layer`'s sites over the held windows, running `stage` (the layer's graph,
    or the whole graph) up to its last calibrated node."""
    names = {s.weight.name: s for s in layer}
    stats = _Stats()
    watch: dict[Value, list[str]] = {}
    experts: dict[Node, list[str]] = {}
    last: Node | None = None
    for node in stage:
        mine = [w.name for i in _SLOTS.get(node.op, ()) if isinstance(w := node.inputs[i], Param)
                and w.name in names]
        if not mine:
            continue
        last = node
        for name in mine:
            shape = names[name].weight.type.shape
            e = shape[0] if node.op == "moe_experts" else 1
            stats.h[name] = np.zeros((e, shape[-2], shape[-2]), np.float64)
            stats.rows[name] = np.zeros(e, np.int64)
        if node.op == "linear":
            watch.setdefault(node.inputs[0], []).extend(mine)  # type: ignore[arg-type]
        else:
            experts[node] = mine
    held_x: dict[Value, np.ndarray] = {}
    wanted = {v for n in experts for v in (n.inputs[0], n.inputs[2])}

    def add(names: list[str], arr: np.ndarray) -> None:
        if names:  # one product per value, however many linears read it
            rows = np.asarray(arr, np.float32).reshape(-1, arr.shape[-1])
            xtx = rows.T @ rows
            for name in names:
                stats.h[name][0] += xtx
                stats.rows[name][0] += rows.shape[0]

    def observe(node: Node, results: list[np.ndarray]) -> None:
        for v, arr in zip(node.outputs, results, strict=True):
            add(watch.get(v, []), arr)
            if v in wanted:
                held_x[v] = arr
        if node in experts:
            _expert_stats(node, held_x[node.inputs[0]], held_x[node.inputs[2]], experts[node],  # type: ignore[index]
                          stats)
        if node is last:
            raise _Stop

    runner = ctx.evaluator(stage)  # type: ignore[misc]
    for inputs in held:
        for v in stage.inputs:  # a watched value the stage takes as an input
            add(watch.get(v, []), inputs[v.name])
        with contextlib.suppress(_Stop):
            runner.run(inputs, observer=observe)
    return stats


def _quantize(site: _Site, stats: _Stats, opts: CalibratedQuantOptions,
              rtn_experts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(site.weight.read())
    bits = site.spec.algo.bits
    name = site.weight.name
    h, rows = stats.h[name], stats.rows[name]
    if site.node.op == "linear":
        return gptq_quantize(w, 2 * h[0] / max(int(rows[0]), 1), bits, damp=opts.damp,
                             block_size=opts.block_size, actorder=opts.actorder, name=name)
    codes = np.empty(w.shape, np.int8)
    scales = []
    for e in range(w.shape[0]):
        which = f"{name}[expert {e}]"
        if rows[e] < opts.min_expert_tokens:
            q, s = weight_quantize(w[e], bits, -1, name=which)
            if site.idx == 3:  # one name per expert (up_gate and down see the same tokens)
                rtn_experts.append(f"{site.node.scope}.{e}")
        else:
            q, s = gptq_quantize(w[e], 2 * h[e] / int(rows[e]), bits, damp=opts.damp,
                                 block_size=opts.block_size, actorder=opts.actorder, name=which)
        codes[e] = q
        scales.append(s)
    return codes, np.stack(scales)


def _expert_stats(node: Node, x: np.ndarray, idx: np.ndarray, names: list[str], stats: _Stats) -> None:
    """Per expert: X^T X of the rows routed to it (up_gate's input) and of silu(gate) * up of them
    through the float up_gate (down's input)."""
    up_gate = np.asarray(node.inputs[3].read()).astype(np.float32)  # type: ignore[union-attr]
    inter = up_gate.shape[2] // 2
    rows_x = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    flat = np.asarray(idx).reshape(rows_x.shape[0], -1)
    for e in np.unique(flat):
        rows, _ = np.nonzero(flat == e)
        v = rows_x[rows]
        for slot in (3, 4):
            w = node.inputs[slot]
            if not isinstance(w, Param) or w.name not in names:
                continue  # only one of the two projections is calibrated
            a = v if slot == 3 else swiglu(v @ up_gate[e], inter)
            stats.h[w.name][e] += a.T @ a  # float32 product per chunk, summed in float64
            stats.rows[w.name][e] += len(rows)
