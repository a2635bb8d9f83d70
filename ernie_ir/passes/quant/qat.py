"""qat-insert: fake-quantization nodes for quantization-aware training (PaddleSlim's QuantizedLinear).

For every linear whose weight `quant-annotate` marked `algo = "qat"`:

    x  ->  [pact(x, alpha)]  ->  fake_quant_moving_average(x, scale, accum, state)  ->  x_q
    W  ->  fake_quant(W)  (abs_max: axes (); channel_wise_abs_max: axes (1,), per output channel)
    y  =   linear(x_q, fake_quant(W), b)

as Paddle's `QuantizedLinear` computes it (activation preprocess, activation
fake quant, weight fake quant, linear). New params per linear, named after
its module: `<module>.activation_quant.{scale,accum,state}` (f32[1],
initialised as Paddle does: 0.001, 1, 1; not trainable: the training
runtime writes the op's out_* results back) and, with PACT,
`<module>.activation_quant.pact_alpha` (f32[1] = 20, trainable, learning
rate x1000 recorded as an annotation).

Routed experts (stacked weights) get weight fake quantization per expert
(axes (0,) or (0, 2)); their activations are not fake-quantized, because the
per-expert inputs exist only inside the grouped op.

With `trainable` (default) every float param becomes trainable except the
embedding tables when the config's `freeze_embedding` is set (PaddleFleetX's
recipe), and the quantizer state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ernie_ir.ir import Graph, GraphBuilder, Node, Param, Value, f32, tensor
from ernie_ir.ir.weights import ArraySource, release_mapped_pages
from ernie_ir.ops.quant_numerics import nonfinite_weight_error

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from .annotate import ANNOTATION
from .config import Algo, QuantSpec, module_path

PACT_INIT = 20.0
PACT_LR = 1000.0
STATE_INIT = {"scale": 0.001, "accum": 1.0, "state": 1.0}


class QatOptions(PassOptions):
    is_test: bool = False
    """Inference form: activation quantizers use their stored scale and leave the state alone."""
    trainable: bool = True
    """Mark float params trainable (full-parameter QAT), embeddings frozen per the config."""


def _spec(p: Any) -> QuantSpec | None:
    if not isinstance(p, Param):
        return None
    ann = p.annotations.get(ANNOTATION)
    if not ann or ann.get("algo") != Algo.QAT.value:
        return None
    return QuantSpec.from_annotation(ann)


def _state_param(placer: ParamPlacer, anchor: str, name: str, value: float, *, trainable: bool,
                 annotations: dict[str, Any]) -> Param:
    graph = placer.graph
    if name in graph.params:
        return graph.params[name]
    p = Param(name, tensor(f32, 1), ArraySource(np.array([value], np.float32)), trainable=trainable,
              annotations=annotations)
    return placer.add(anchor, p)


def _check_finite(w: Value | None) -> None:
    """NaN or Inf weights would make every fake-quant scale NaN: refuse them, naming the param."""
    if isinstance(w, Param) and w.has_data:
        values = np.asarray(w.read())
        if not np.isfinite(values).all():
            raise nonfinite_weight_error(values, w.name)
        del values
        release_mapped_pages()  # resident memory stays one weight, not the checkpoint


@register_pass
class QatInsert(Pass):
    """Insert PaddleSlim-style fake quantization around linears annotated for QAT."""

    name = "qat-insert"
    description = "Fake-quantize weights (abs_max / channel-wise) and activations (moving average, PACT)."
    Options = QatOptions
    requires = frozenset({"quant-annotated"})
    produces = frozenset({"qat"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: QatOptions = self.options  # type: ignore[assignment]
        placer = ParamPlacer(graph)
        count = 0
        for node in list(graph):
            if node.op == "linear":
                spec = _spec(node.inputs[1])
                if spec is not None:
                    _check_finite(node.inputs[1])
                    self._linear(graph, placer, node, spec, opts)
                    count += 1
            elif node.op in ("moe_experts", "moe_experts_lora"):
                for idx in (3, 4):
                    spec = _spec(node.inputs[idx])
                    if spec is None:
                        continue
                    _check_finite(node.inputs[idx])
                    axes = (0,) if spec.weight_quantize_type == "abs_max" else (0, 2)
                    b = GraphBuilder(graph)
                    b.insert_point = node
                    with b.at_scope(node.scope):
                        wq = b.fake_quant(node.inputs[idx], bits=spec.weight_bits, round_type=spec.round_type,
                                          axes=axes)
                    node.set_input(idx, wq)
                    count += 1
        placer.finish()
        changed = count > 0
        if changed and opts.trainable:
            freeze = bool(graph.metadata.get("quantization", {}).get("freeze_embedding", True))
            frozen = {n.inputs[1].name for n in graph
                      if n.op == "embedding" and isinstance(n.inputs[1], Param)}
            for p in graph.params.values():
                if "qat_state" in p.annotations or not p.type.dtype.is_float:
                    continue
                if freeze and p.name in frozen:
                    continue
                p.trainable = True
        ctx.count("fake-quantized", count)
        return changed

    def _linear(self, graph: Graph, placer: ParamPlacer, node: Node, spec: QuantSpec,
                opts: QatOptions) -> None:
        w = node.inputs[1]
        x = node.inputs[0]
        assert isinstance(w, Param) and x is not None
        module = module_path(w.name)
        b = GraphBuilder(graph)
        b.insert_point = node
        with b.at_scope(node.scope):
            if spec.activation_quantize_type != "none":
                if spec.activation_preprocess_type == "PACT":
                    alpha = _state_param(placer, w.name, f"{module}.activation_quant.pact_alpha", PACT_INIT,
                                         trainable=True, annotations={"learning_rate": PACT_LR})
                    x = b.pact(x, alpha)
                state = [_state_param(placer, w.name, f"{module}.activation_quant.{k}", STATE_INIT[k],
                                      trainable=False, annotations={"qat_state": k})
                         for k in ("scale", "accum", "state")]
                x = b.fake_quant_moving_average(
                    x, *state, bits=spec.activation_bits, round_type=spec.round_type,
                    moving_rate=spec.moving_rate, is_test=opts.is_test)[0]
            axes = () if spec.weight_quantize_type == "abs_max" else (1,)
            wq = b.fake_quant(w, bits=spec.weight_bits, round_type=spec.round_type, axes=axes)
        node.set_input(0, x)
        node.set_input(1, wq)
