"""weight-only-quant: linears annotated weight_only_int8/int4 become weight_only_linear.

For every weight param annotated by `quant-annotate` with a weight-only algo:

- a dense `linear(x, W, b)` becomes `weight_only_linear(x, Wq, scale, b)`;
- a stacked expert weight W [E, K, N] of `moe_experts` is replaced by
  `dequantize(Wq, scale)` feeding the same input: each expert has its own
  scales ([E, N], or [E, ceil(K/g), N] grouped).

New params (names as FastDeploy's, layout ours: logical [in, out] values):
`<module>.quant_weight` (i8, or i4 stored as packed int4) and
`<module>.weight_scale` (the weight's dtype, as Paddle returns it). Numerics
are `ernie_ir.ops.quant_numerics.weight_quantize` (= Paddle's
`weight_quantize` CPU kernel). Scales are computed when the pass runs (so a
NaN/Inf weight is an error naming the param); the int values are computed
lazily when read (saving a graph streams them one tensor at a time). Meta
graphs (no weight data) get typed params without data.

Weights annotated with a calibrated method (`method=gptq`) are converted earlier, by
`calibrated-quant`, into the same params with the codes it chose (`convert_site`); one that
reaches this pass with data is refused (it would silently be rounded to nearest).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, Node, Param, TensorType
from ernie_ir.ir.weights import ArraySource, WeightSource, release_mapped_pages
from ernie_ir.ops.quant_numerics import num_groups, scale_dtype_for, weight_quantize, weight_scales

from ..infra.base import Pass, PassContext
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from ..parallel.split import row_cut
from .annotate import ANNOTATION
from .config import Algo, QuantSpec, module_path

_WEIGHT_ONLY = (Algo.WEIGHT_ONLY_INT8.value, Algo.WEIGHT_ONLY_INT4.value)


class WeightOnlyError(ErnieIRError):
    """Weight-only quantization that would not be sound here."""
_SLOTS = {"linear": (1,), "moe_experts": (3, 4), "moe_experts_lora": (3, 4)}


class QuantizedWeightSource(WeightSource):
    """The int values of `weight_quantize(base, bits, group_size)`, computed on read.

    `scale`: the base's `weight_scales`, when the pass has computed them already (the read then
    skips the absmax, one pass over the weight's bytes); views of a slice recompute their own."""

    def __init__(self, base: WeightSource, bits: int, group_size: int, name: str,
                 scale: np.ndarray | None = None) -> None:
        self.base = base
        self.bits = bits
        self.group_size = group_size
        self.name = name
        self.scale = scale
        self.dtype = DType.I8 if bits == 8 else DType.I4
        self.shape = tuple(base.shape)

    def read(self) -> np.ndarray:
        q, _ = weight_quantize(np.asarray(self.base.read()), self.bits, self.group_size, name=self.name,
                               scale=self.scale)
        return q if self.bits == 8 else q.view(DType.I4.numpy)

    def describe(self) -> str:
        return f"weight_quantize<int{self.bits}, group {self.group_size}>({self.base.describe()})"

    def sliced(self, axis: int, start: int, stop: int) -> WeightSource:
        # Scales run over the input axis (-2) per output column (and per expert): quantizing a
        # slice of the columns or experts gives exactly that slice of the quantized tensor, so
        # a rank shard quantizes only its own part. A slice of the rows needs the whole columns.
        if axis % len(self.shape) != len(self.shape) - 2:
            return QuantizedWeightSource(self.base.sliced(axis, start, stop), self.bits,
                                         self.group_size, self.name)
        return super().sliced(axis, start, stop)


def quantized_params(placer: ParamPlacer, w: Param, spec: QuantSpec, scale: np.ndarray | None = None,
                     codes: np.ndarray | None = None) -> tuple[Param, Param]:
    """(quant_weight, weight_scale) params for weight `w` (created once, reused if present).

    `scale`: the weight's scales if already computed (`weight_scales`). `codes`: the int values
    a calibrated method chose on that scale's grid (int8, `w`'s shape); None: round to nearest."""
    graph = placer.graph
    base = module_path(w.name)
    qname, sname = f"{base}.quant_weight", f"{base}.weight_scale"
    if qname in graph.params and sname in graph.params:
        return graph.params[qname], graph.params[sname]
    bits = spec.algo.bits
    shape = w.type.shape
    k, n = shape[-2], shape[-1]
    groups = num_groups(k, spec.group_size) if isinstance(k, int) else 1
    scale_shape = (*shape[:-2], n) if spec.group_size == -1 else (*shape[:-2], groups, n)
    sdtype = DType.from_numpy(scale_dtype_for(w.type.dtype.numpy))
    qsrc: WeightSource | None = None
    ssrc: WeightSource | None = None
    if w.source is not None:
        if scale is None:
            scale = weight_scales(np.asarray(w.read()), bits, spec.group_size, name=w.name)
            release_mapped_pages()
        ssrc = ArraySource(scale)
        qsrc = (QuantizedWeightSource(w.source, bits, spec.group_size, w.name, scale) if codes is None
                else ArraySource(codes if bits == 8 else codes.view(DType.I4.numpy)))
    ann: dict[str, Any] = {**w.annotations.get(ANNOTATION, {}), "source_dtype": w.type.dtype.value}
    q = Param(qname, TensorType(DType.I8 if bits == 8 else DType.I4, shape), qsrc,
              annotations={ANNOTATION: ann})
    s = Param(sname, TensorType(sdtype, scale_shape), ssrc)
    return placer.add(w.name, q), placer.add(w.name, s)


def _spec(p: Param | None) -> QuantSpec | None:
    if p is None:
        return None
    ann = p.annotations.get(ANNOTATION)
    if not ann or ann.get("algo") not in _WEIGHT_ONLY or p.type.dtype.is_int:
        return None
    return QuantSpec.from_annotation(ann)


def convert_site(placer: ParamPlacer, node: Node, idx: int, w: Param, spec: QuantSpec,
                 scale: np.ndarray | None = None, codes: np.ndarray | None = None) -> None:
    """Rewrite one annotated weight input: a linear becomes weight_only_linear, a stacked expert
    weight is fed through dequantize(int, scale). `scale`/`codes` as `quantized_params`."""
    q, s = quantized_params(placer, w, spec, scale, codes)
    if node.op == "linear":
        _replace_linear(placer.graph, node, q, s, spec.group_size)
        return
    b = GraphBuilder(placer.graph)
    b.insert_point = node
    with b.at_scope(node.scope):
        deq = b.dequantize(q, s, dtype=w.type.dtype, group_size=spec.group_size)
    node.set_input(idx, deq)


def _replace_linear(graph: Graph, node: Node, q: Param, s: Param, group_size: int) -> None:
    b = GraphBuilder(graph)
    b.insert_point = node
    x, bias = node.inputs[0], node.inputs[2] if len(node.inputs) > 2 else None
    with b.at_scope(node.scope):
        y = b.weight_only_linear(x, q, s, bias, group_size=group_size)
    y.name = node.output.name
    graph.replace_all_uses_with(node.output, y)
    graph.erase(node)


@register_pass
class WeightOnlyQuant(Pass):
    """Replace linears (and stacked expert weights) annotated weight_only_int8/int4 by quantized ones."""

    name = "weight-only-quant"
    description = "linear -> weight_only_linear, expert stacks -> dequantize(int, scale), per annotation."
    requires = frozenset({"quant-annotated"})
    produces = frozenset({"quantized"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        # Decide everything and compute every scale first: a bad weight (NaN/Inf) fails the pass
        # before the graph is touched.
        work: list[tuple[Node, int, Param, QuantSpec]] = []
        for node in graph:
            slots = _SLOTS.get(node.op, ())
            for idx in slots:
                w = node.inputs[idx]
                spec = _spec(w) if isinstance(w, Param) else None
                if spec is not None and isinstance(w, Param) and (node.op != "linear" or w.type.rank == 2):
                    work.append((node, idx, w, spec))
        for _, _, w, spec in work:
            if spec.method.calibrated and w.source is not None:
                raise WeightOnlyError(
                    f"weight-only-quant: {w.name} is annotated method={spec.method}, which calibrates on "
                    "data, but no calibrated-quant pass ran before: give --calib-data (or put "
                    "calibrated-quant{calibration_file=...} before weight-only-quant in --pipeline)")
            if row_cut(w):
                raise WeightOnlyError(
                    f"weight-only-quant after split: {w.name} is row-parallel on this rank (its "
                    f"input rows are cut), so its per-channel scales would cover 1/tp of the input "
                    "axis and differ from the unsplit model's: quantize before splitting (--quant "
                    "with --tp/--ep, or put the quant passes before split in --pipeline)")
        scales: dict[str, np.ndarray] = {}
        for _, _, w, spec in work:
            if w.source is not None and w.name not in scales:
                scales[w.name] = weight_scales(np.asarray(w.read()), spec.algo.bits, spec.group_size,
                                               name=w.name)
                release_mapped_pages()  # resident memory stays one weight, not the checkpoint
        placer = ParamPlacer(graph)
        for node, idx, w, spec in work:
            convert_site(placer, node, idx, w, spec, scales.get(w.name))
        placer.finish(removed={w.name for _, _, w, _ in work})
        ctx.count("quantized", len(work))
        return bool(work)
