"""qat-convert: a QAT graph's fake-quantized weights become int8 weights (PaddleSlim's convert step).

For every `fake_quant(W)` whose input is a weight param (what `qat-insert`
puts on linears and expert stacks), with b = 2^(bits-1) - 1 and s the
abs-max that the fake quantizer computes from W (per tensor, or per index of
its channel `axes`):

    q  = the integers fake_quant rounds to     (int8; Paddle's round_type 0 or 1, as the op)
    fake_quant(W) = f32(f32(q * s) / b)         (the op's arithmetic: the product, then a division)

The converted weight is `<module>.quant_weight` (i8 [..., K, N], q) and
`<module>.weight_scale` (f32 [..., N]: s broadcast per output channel / per
expert; the scale Paddle's frozen program gives `fake_dequantize_max_abs`,
with max_range b), the float weight is dropped, and

    x  = dequantize(q, s) : f32                 = f32(q * s), the same product
    y0 = x * r                                  r = f32(1 / b)
    e  = (x + y0 * -(b + 1)) + y0               = x - b * y0, exactly (power-of-two product, Sterbenz)
    y  = y0 + e * r                             = f32(x / b), correctly rounded

The reference op set has no division; y0 alone (a multiply by the
reciprocal) is off by one ulp for 4.7% of the float32 significands with
b = 127, and the one-op form `dequantize(q, s / b)` (`exact=false`) for
about a third of the weights (<= 2 ulp). The correction gives f32(x / b) bit
for bit for every scale that Paddle does not zero (s > 1e-30; a smaller one
rounds every q to 0) up to 2^120 (tests/quant/test_qat_convert.py checks every
float32 significand), so the converted graph computes what the QAT graph
does (the sign of a zero weight aside: int8 has no -0). The constants r and
-(b + 1) are shared f32[] params `qat_convert.max_range_<b>.{reciprocal,neg_pow2}`.

y is f32: the reference interpreter computes fake_quant's result in float32
whatever its declared type, so the converted graph matches the QAT graph
there exactly, bf16 models included. `cast=true` casts y to the weight's
dtype (bf16) as fake_quant's declared type says and a bf16 device computes;
the interpreter then matches the QAT graph under `emulate=bf16` (which
rounds fake_quant's result too), not without it.

Everything else stays: activation fake quantization (its scale is a state
param, constant in the inference form) and PACT. The graph must be the
inference form (`qat-insert{is_test=true}`): a training-form moving average
still updates its state, and frozen int8 weights would not train.

Weights with bits > 8, a scale per input row (axis -2), or (exact) a scale
above 2^120 keep their fake_quant (a warning names them). The int values
are computed lazily when read; the scales when the pass runs (a NaN/Inf
weight is an error naming it). Meta graphs get typed params without data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, Node, Param, TensorType, Value
from ernie_ir.ir.weights import ArraySource, WeightSource, release_mapped_pages
from ernie_ir.ops.quant_numerics import abs_max, nonfinite_weight_error, paddle_inverse, round_half_away

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from .annotate import ANNOTATION
from .config import module_path

MAX_EXACT_SCALE = np.float32(2.0 ** 120)
"""Above this scale -(b + 1) * y0 could overflow: such a weight keeps its fake_quant."""


class QatConvertError(ErnieIRError):
    """A QAT graph that qat-convert cannot convert."""


class QatConvertOptions(PassOptions):
    exact: bool = True
    """Reproduce fake_quant(W) bit for bit (dequantize + 3 mul + 3 add); false: one
    dequantize(q, s / b), within 2 ulp of it."""
    cast: bool = False
    """Cast the dequantized weight to the float weight's dtype (bf16) instead of keeping f32."""


def max_range(bits: int) -> int:
    """b = 2^(bits-1) - 1, the fake quantizer's bound."""
    return 2 ** (bits - 1) - 1


def keep_axes(rank: int, axes: tuple[int, ...]) -> tuple[int, ...]:
    """The fake_quant node's channel axes, non-negative."""
    return tuple(a % rank for a in axes) if rank else ()


def weight_absmax(w: np.ndarray, keep: tuple[int, ...]) -> np.ndarray:
    """The fake quantizer's s: abs-max over the axes not kept, shaped to broadcast against w."""
    w = np.asarray(w, dtype=np.float32)
    s = abs_max(w, keep)
    return s.reshape([w.shape[i] if i in keep else 1 for i in range(w.ndim)])


def fake_quant_ints(x: np.ndarray, s: np.ndarray, bits: int, round_type: int) -> np.ndarray:
    """The integers q of `fake_quant_dequant(x, s, bits, round_type)` (= f32(f32(q * s) / b)), as
    float32; the same arithmetic as ernie_ir.ops.quant_numerics.fake_quant_dequant, before its
    product and division. In [-b - 1, b] (round_type 0) or [-b, b] (1)."""
    x = np.asarray(x, dtype=np.float32)
    s = np.asarray(s, dtype=np.float32)
    b = np.float32(max_range(bits))
    k = b * paddle_inverse(s)
    if round_type == 0:
        return np.clip(np.rint(k * x), -b - np.float32(1), b)
    return round_half_away(k * np.clip(x, -s, s))


class QatIntSource(WeightSource):
    """q of fake_quant(base) (tensor-wise or per channel `keep`), int8, computed on read."""

    def __init__(self, base: WeightSource, bits: int, round_type: int, keep: tuple[int, ...]) -> None:
        self.base = base
        self.bits = bits
        self.round_type = round_type
        self.keep = keep
        self.dtype = DType.I8
        self.shape = tuple(base.shape)

    def read(self) -> np.ndarray:
        w = np.asarray(self.base.read(), dtype=np.float32)
        return fake_quant_ints(w, weight_absmax(w, self.keep), self.bits, self.round_type).astype(np.int8)

    def describe(self) -> str:
        return f"qat_int<{self.bits} bits, round_type {self.round_type}, axes {list(self.keep)}>" \
               f"({self.base.describe()})"

    def sliced(self, axis: int, start: int, stop: int) -> WeightSource:
        # A slice of the kept (channel) axes quantizes exactly as that slice of the whole: each
        # channel has its own abs-max. Any other slice needs the whole tensor's abs-max.
        axis %= len(self.shape)
        if axis in self.keep:
            return QatIntSource(self.base.sliced(axis, start, stop), self.bits, self.round_type, self.keep)
        return super().sliced(axis, start, stop)


def _scale_per_channel(s: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """s (broadcastable against W [..., K, N], constant along K) as dequantize's [..., N]."""
    return np.ascontiguousarray(np.broadcast_to(s[..., 0, :], (*shape[:-2], shape[-1])), dtype=np.float32)


def _skip_reason(node: Node) -> str | None:
    """Why this weight fake_quant stays (None: it converts)."""
    w = node.inputs[0]
    if not isinstance(w, Param):
        return "its input is not a param"
    rank = w.type.rank
    if rank < 2:
        return f"{w.name} has rank {rank} (dequantize needs [..., in, out])"
    if node.attrs.bits > 8:
        return f"{w.name} is fake-quantized to {node.attrs.bits} bits (more than int8 holds)"
    if rank - 2 in keep_axes(rank, node.attrs.axes):
        return f"{w.name} has a scale per input row (axis {rank - 2}), which dequantize has no form for"
    return None


@register_pass
class QatConvert(Pass):
    """Replace the weight fake quantization of an inference-form QAT graph by int8 weights."""

    name = "qat-convert"
    description = ("QAT graph -> int8 weights + scales (dequantize, bit-exact with fake_quant); "
                   "activation fake-quant stays.")
    Options = QatConvertOptions
    requires = frozenset({"qat"})
    produces = frozenset({"quantized"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: QatConvertOptions = self.options  # type: ignore[assignment]
        training = next((n for n in graph if n.op == "fake_quant_moving_average" and not n.attrs.is_test),
                        None)
        if training is not None:
            raise QatConvertError(
                f"qat-convert converts the inference form of a QAT graph, but the activation "
                f"quantizer at {training.scope or '<root>'} is the training form (it updates its "
                "moving-average state): run qat-insert{is_test=true}")
        work: list[tuple[Node, Param]] = []
        for node in graph:
            if node.op != "fake_quant":
                continue
            reason = _skip_reason(node)
            if reason is not None:
                ctx.warn(f"fake_quant at {node.scope or '<root>'} stays: {reason}")
                ctx.count("kept")
                continue
            w = node.inputs[0]
            assert isinstance(w, Param)
            work.append((node, w))
        # Every scale first: a NaN/Inf weight fails the pass before the graph is touched.
        scales: dict[tuple[Any, ...], np.ndarray | None] = {}
        for node, w in work:
            key = _key(node, w)
            if key in scales:
                continue
            if w.source is None:
                scales[key] = None
                continue
            arr = np.asarray(w.read(), dtype=np.float32)
            if not np.isfinite(arr).all():
                raise nonfinite_weight_error(arr, w.name)
            s = weight_absmax(arr, keep_axes(w.type.rank, node.attrs.axes))
            del arr
            release_mapped_pages()  # resident memory stays one weight, not the checkpoint
            scales[key] = _scale_per_channel(s, tuple(w.type.shape))  # type: ignore[arg-type]
        placer = ParamPlacer(graph)
        done: dict[tuple[Any, ...], Value] = {}
        names: dict[str, int] = {}
        converted: set[str] = set()
        for node, w in work:
            key = _key(node, w)
            scale = scales[key]
            if opts.exact and scale is not None and scale.size and scale.max() > MAX_EXACT_SCALE:
                ctx.warn(f"fake_quant at {node.scope or '<root>'} stays: {w.name} has a scale above "
                         "2^120, where the exact division could overflow")
                ctx.count("kept")
                continue
            y = done.get(key)
            if y is None:
                q, s = _params(placer, w, node, scale, opts.exact, names)
                y = done[key] = _dequantized(graph, placer, node, w, q, s, opts)
            graph.replace_all_uses_with(node.output, y)
            graph.erase(node)
            converted.add(w.name)
        placer.finish(removed=converted)
        ctx.count("converted", len(done))
        return bool(done)


def _key(node: Node, w: Param) -> tuple[Any, ...]:
    a = node.attrs
    return (w.name, a.bits, a.round_type, keep_axes(w.type.rank, a.axes))


def _params(placer: ParamPlacer, w: Param, node: Node, scale: np.ndarray | None, exact: bool,
            names: dict[str, int]) -> tuple[Param, Param]:
    """New (quant_weight, weight_scale) params of weight `w` for this fake_quant's settings."""
    graph = placer.graph
    a = node.attrs
    keep = keep_axes(w.type.rank, a.axes)
    b = max_range(a.bits)
    base = module_path(w.name)
    n = names.get(base, 0)
    names[base] = n + 1
    base = base if n == 0 else f"{base}.qat{n}"  # a second setting of one weight (unusual)
    qname, sname = f"{base}.quant_weight", f"{base}.weight_scale"
    for name in (qname, sname):
        if name in graph.params:
            raise QatConvertError(f"qat-convert: the graph already has a param {name} (converted "
                                  f"or weight-only quantized twice?)")
    shape = w.type.shape
    sshape = (*shape[:-2], shape[-1])
    qsrc = QatIntSource(w.source, a.bits, a.round_type, keep) if w.source is not None else None
    ssrc = None
    if scale is not None:
        ssrc = ArraySource(scale if exact else (scale / np.float32(b)).astype(np.float32))
    ann: dict[str, Any] = {**w.annotations.get(ANNOTATION, {}), "source_dtype": w.type.dtype.value}
    q = Param(qname, TensorType(DType.I8, shape), qsrc, annotations={ANNOTATION: ann})
    s = Param(sname, TensorType(DType.F32, sshape), ssrc,
              annotations={"qat_convert": {"max_range": b}} if exact else {})
    return placer.add(w.name, q), placer.add(w.name, s)


def _constant(placer: ParamPlacer, anchor: str, name: str, value: np.float32) -> Param:
    graph = placer.graph
    if name in graph.params:
        return graph.params[name]
    p = Param(name, TensorType(DType.F32, ()), ArraySource(np.array(value, np.float32)))
    return placer.add(anchor, p)


def _dequantized(graph: Graph, placer: ParamPlacer, node: Node, w: Param, q: Param, s: Param,
                 opts: QatConvertOptions) -> Value:
    """The value replacing fake_quant(w): dequantize and (exact) the correctly rounded division."""
    bld = GraphBuilder(graph)
    bld.insert_point = node
    dtype = w.type.dtype if opts.cast else DType.F32
    with bld.at_scope(node.scope):
        if not opts.exact:
            return bld.dequantize(q, s, dtype=dtype)
        b = max_range(node.attrs.bits)
        # shared by every weight: listed after the first weight's own params
        r = _constant(placer, w.name, f"qat_convert.max_range_{b}.reciprocal", np.float32(1) / np.float32(b))
        m = _constant(placer, w.name, f"qat_convert.max_range_{b}.neg_pow2", np.float32(-(b + 1)))
        x = bld.dequantize(q, s, dtype=DType.F32)
        y0 = bld.mul(x, r)
        e = bld.add(bld.add(x, bld.mul(y0, m)), y0)
        y = bld.add(y0, bld.mul(e, r))
        return y if dtype == DType.F32 else bld.cast(y, dtype=dtype)
