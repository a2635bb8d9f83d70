"""fp8-quant: linears annotated `fp8` become tensor-wise FP8 (e4m3), static W8A8.

Inference form (default), per dense linear:

    linear(x, W, b)  ->  fp8_linear(x, Wq, w_scale, x_scale, b)
    w_scale = max|W| / 448;  Wq = e4m3(W / w_scale)   (ml_dtypes, round to nearest even)
    x_scale = max|x| / 448 over a calibration run   (static, as FP8 serving uses)

Params: `<module>.quant_weight` (f8e4m3 [in, out]), `<module>.weight_scale`
and `<module>.input_scale` (f32[]). The calibration runs the graph on
`calibration_tokens` seeded random token ids (or the ids in
`calibration_file`, a .npy of [batch, seq] ints) and records each FP8
linear's input abs-max. It runs the graph with the pipeline's evaluator
(`PassContext.evaluator`: passes sit below `runtime`, so the caller supplies
it; `compile_model` and the CLI give the reference interpreter); without one,
calibrating is an error. A graph without weight data (meta) gets typed
params without data.

Routed experts: each expert's weight is FP8 with its own scale (f32[E]) and
feeds the grouped op through `dequantize`; their activations stay in the
model's dtype (there is no FP8 grouped-expert op in the reference set).

Fake form (`form=fake`, for FP8 QAT): W -> fake_quant_fp8(W), x ->
fake_quant_fp8(x), both dynamic tensor-wise (per expert for stacks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, Node, Param, Value, f32, tensor
from ernie_ir.ir.inputs import read_token_ids
from ernie_ir.ir.weights import ArraySource, WeightSource, release_mapped_pages
from ernie_ir.ops.quant_numerics import FP8_MAX, NonFiniteWeightError, abs_max, fp8_quantize, fp8_scale

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from .annotate import ANNOTATION
from .config import Algo, module_path

FMT = DType.F8E4M3


class Fp8Options(PassOptions):
    form: Literal["inference", "fake"] = "inference"
    calibration_tokens: int = Field(32, ge=1, le=1 << 16)
    """Length of the seeded random token sequence used to calibrate activation scales."""
    calibration_seed: int = 0
    calibration_file: str | None = None
    """A .npy file of token ids [batch, seq] to calibrate with instead."""


class Fp8WeightSource(WeightSource):
    """e4m3(W / scale) of a base weight, computed on read; scale per tensor or per leading index."""

    def __init__(self, base: WeightSource, scale: np.ndarray) -> None:
        self.base = base
        self.scale = scale
        self.dtype = FMT
        self.shape = tuple(base.shape)

    def read(self) -> np.ndarray:
        s = self.scale.reshape(self.scale.shape + (1,) * (len(self.shape) - self.scale.ndim))
        return fp8_quantize(np.asarray(self.base.read()), s, FMT)

    def describe(self) -> str:
        return f"fp8_quantize<e4m3>({self.base.describe()})"


def _annotated(v: Value | None) -> bool:
    return isinstance(v, Param) and (v.annotations.get(ANNOTATION) or {}).get("algo") == Algo.FP8.value \
        and v.type.dtype.is_float


def _weight_scale(w: Param, per_leading: bool) -> np.ndarray | None:
    if w.source is None:
        return None
    release_mapped_pages()  # the previous weight's pages: resident memory stays one weight
    arr = np.asarray(w.read())
    try:
        if not per_leading:
            return np.array(fp8_scale(arr, FMT), np.float32)
        m = abs_max(arr, (0,))
        if not np.isfinite(m).all():
            raise NonFiniteWeightError("")
        return np.where(m == 0, np.float32(1), m / np.float32(FP8_MAX[FMT])).astype(np.float32)
    except NonFiniteWeightError:
        raise NonFiniteWeightError(
            f"param {w.name} holds NaN or Inf: it cannot be quantized to FP8") from None


def _vocab(graph: Graph) -> int:
    tables = [n.inputs[1] for n in graph if n.op == "embedding"]
    return int(tables[0].type.shape[0]) if tables else 2  # type: ignore[union-attr]


def _calibrate(graph: Graph, watch: dict[Value, list[Node]], opts: Fp8Options,
               ctx: PassContext) -> dict[Node, float] | None:
    """Input abs-max of each watched linear over one run of `ctx.evaluator` (None if not possible)."""
    if not watch:
        return {}
    if any(p.source is None for p in graph.params.values()):
        return None
    ints = [v for v in graph.inputs if v.type.dtype.is_int]
    if len(graph.inputs) != 1 or len(ints) != 1 or ints[0].type.rank != 2:
        ctx.warn("fp8-quant: cannot calibrate (the graph does not take one [batch, seq] token input); "
                 "activation scales have no data")
        return None
    if ctx.evaluator is None:
        raise ErnieIRError("fp8-quant: calibrating activation scales needs a graph evaluator: pass "
                           "evaluator=ernie_ir.runtime.Interpreter to run_pipeline (compile_model and the "
                           "CLI do), or give the graph without weights")
    if opts.calibration_file is not None:
        path = Path(opts.calibration_file)
        if not path.exists():
            raise ErnieIRError(f"fp8-quant: calibration file {path} does not exist")
        ids = read_token_ids(path, "fp8-quant calibration file")
        vocab = _vocab(graph)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ErnieIRError(f"fp8-quant: calibration file {path}: token ids must be in [0, {vocab}), got "
                               f"{int(ids.min())}..{int(ids.max())}")
    else:
        vocab = _vocab(graph)
        rng = np.random.default_rng(opts.calibration_seed)
        ids = rng.integers(0, vocab, size=(1, opts.calibration_tokens))
    seen: dict[Node, float] = {}

    def observe(value: Value, arr: np.ndarray) -> None:
        for n in watch.get(value, ()):
            seen[n] = max(seen.get(n, 0.0), float(np.abs(arr).max()) if arr.size else 0.0)

    runner = ctx.evaluator(graph)
    for v in graph.inputs:
        if v in watch:
            observe(v, ids)
    runner.run({ints[0].name: ids}, observer=lambda node, res: [observe(v, a) for v, a in
                                                                zip(node.outputs, res, strict=True)])
    return seen


@register_pass
class Fp8Quant(Pass):
    """Replace linears annotated fp8 by tensor-wise FP8 (inference: fp8_linear; fake: fake_quant_fp8)."""

    name = "fp8-quant"
    description = "Tensor-wise e4m3 FP8: static W8A8 fp8_linear (calibrated) or fake-quant for FP8 QAT."
    Options = Fp8Options
    requires = frozenset({"quant-annotated"})
    produces = frozenset({"quantized"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: Fp8Options = self.options  # type: ignore[assignment]
        dense = [n for n in graph if n.op == "linear" and _annotated(n.inputs[1])
                 and n.inputs[1].type.rank == 2]  # type: ignore[union-attr]
        experts = [(n, i) for n in graph if n.op in ("moe_experts", "moe_experts_lora")
                   for i in (3, 4) if _annotated(n.inputs[i])]
        if opts.form == "fake":
            return self._fake(graph, dense, experts, ctx)
        # weight scales first: a NaN/Inf weight fails before calibration runs or the graph changes
        self._scales = {w.name: _weight_scale(w, per_leading) for w, per_leading in
                        [(n.inputs[1], False) for n in dense] + [(n.inputs[i], True) for n, i in experts]}
        placer = ParamPlacer(graph)
        watch: dict[Value, list[Node]] = {}
        for n in dense:
            watch.setdefault(n.inputs[0], []).append(n)  # type: ignore[arg-type]
        scales = _calibrate(graph, watch, opts, ctx) if dense else {}
        touched: set[str] = set()
        for n in dense:
            w = n.inputs[1]
            assert isinstance(w, Param)
            q, ws = self._weight(placer, w, per_leading=False)
            xs_src = None
            if scales is not None and n in scales:
                m = np.float32(scales[n])
                xs_src = ArraySource(np.array(m / np.float32(FP8_MAX[FMT]) if m > 0 else np.float32(1),
                                              np.float32))
            xs = placer.add(w.name, Param(f"{module_path(w.name)}.input_scale", tensor(f32), xs_src))
            b = GraphBuilder(graph)
            b.insert_point = n
            bias = n.inputs[2] if len(n.inputs) > 2 else None
            with b.at_scope(n.scope):
                y = b.fp8_linear(n.inputs[0], q, ws, xs, bias, format=FMT)
            y.name = n.output.name
            graph.replace_all_uses_with(n.output, y)
            graph.erase(n)
            touched.add(w.name)
        for n, i in experts:
            w = n.inputs[i]
            assert isinstance(w, Param)
            q, ws = self._weight(placer, w, per_leading=True)
            b = GraphBuilder(graph)
            b.insert_point = n
            with b.at_scope(n.scope):
                n.set_input(i, b.dequantize(q, ws, dtype=w.type.dtype))
            touched.add(w.name)
        placer.finish(removed=touched)
        ctx.count("fp8", len(dense) + len(experts))
        return bool(dense or experts)

    def _weight(self, placer: ParamPlacer, w: Param, per_leading: bool) -> tuple[Param, Param]:
        module = module_path(w.name)
        qname, sname = f"{module}.quant_weight", f"{module}.weight_scale"
        g = placer.graph
        if qname in g.params:
            return g.params[qname], g.params[sname]
        scale = self._scales[w.name]
        sshape = (w.type.shape[0],) if per_leading else ()
        q = Param(qname, w.type.with_dtype(FMT),
                  Fp8WeightSource(w.source, scale) if w.source is not None and scale is not None else None,
                  annotations={ANNOTATION: {**w.annotations.get(ANNOTATION, {}),
                                            "source_dtype": w.type.dtype.value}})
        s = Param(sname, tensor(f32, *sshape), ArraySource(scale) if scale is not None else None)
        return placer.add(w.name, q), placer.add(w.name, s)

    @staticmethod
    def _fake(graph: Graph, dense: list[Node], experts: list[tuple[Node, int]], ctx: PassContext) -> bool:
        for n in dense:
            b = GraphBuilder(graph)
            b.insert_point = n
            with b.at_scope(n.scope):
                x = b.fake_quant_fp8(n.inputs[0], format=FMT)
                w = b.fake_quant_fp8(n.inputs[1], format=FMT)
            n.set_input(0, x)
            n.set_input(1, w)
        for n, i in experts:
            b = GraphBuilder(graph)
            b.insert_point = n
            with b.at_scope(n.scope):
                n.set_input(i, b.fake_quant_fp8(n.inputs[i], format=FMT, axes=(0,)))
        ctx.count("fp8-fake", len(dense) + len(experts))
        return bool(dense or experts)
