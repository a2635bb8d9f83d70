"""A projection: one linear-like layer as the graph holds it, with its quantization and adapter.

    linear(x, W, b?)                         float
    linear(x, fake_quant(W), b?)             QAT: the weight fake-quantized (abs_max / per channel)
    weight_only_linear(x, Wq, scale, b?)     int8 / int4 values, per-channel or grouped scales
      [ -> lora(y, x, A, B) ]                its LoRA adapter, the only reader of y

`projection_at(node)` reads one from its linear node, `projection_of(value)`
from the value its readers see (the adapter's output when there is one).
Both refuse (`Refusal`) with the reason a fusion pass reports: an fp8
linear (one tensor-wise scale), a computed weight or bias, an adapter that
reads another input.
"""

from __future__ import annotations

from dataclasses import dataclass

from ernie_ir.ir import Node, Param, Value

from ..infra.dataflow_rule import Refusal
from ..parallel.split import SHARD
from ..quant.config import module_path

LINEAR_LIKE = ("linear", "weight_only_linear")


@dataclass
class Adapter:
    """lora(y, x, A, B): y + ((x @ A) @ B) * scale."""

    node: Node
    a: Param
    b: Param

    @property
    def key(self) -> tuple[float, float]:
        return (self.node.attrs.scale, self.node.attrs.dropout)


@dataclass
class Projection:
    node: Node
    weight: Param
    """The float weight [K, N] (QAT: the param under fake_quant) or the int values of Wq."""
    scale: Param | None
    bias: Param | None
    fake_quant: Node | None
    adapter: Adapter | None

    @property
    def x(self) -> Value:
        x = self.node.inputs[0]
        assert x is not None
        return x

    @property
    def base(self) -> Value:
        return self.node.outputs[0]

    @property
    def out(self) -> Value:
        """The value the layer's readers see."""
        return self.adapter.node.outputs[0] if self.adapter is not None else self.base

    @property
    def kind(self) -> str:
        if self.node.op == "weight_only_linear":
            return "weight_only"
        return "qat" if self.fake_quant is not None else "float"

    @property
    def group_size(self) -> int:
        return self.node.attrs.group_size if self.node.op == "weight_only_linear" else -1

    @property
    def module(self) -> str:
        return module_path(self.weight.name)

    @property
    def in_features(self) -> int:
        return _static(self.weight.type.shape[0], self.weight)

    @property
    def out_features(self) -> int:
        return _static(self.weight.type.shape[1], self.weight)

    @property
    def nodes(self) -> list[Node]:
        """Its nodes in graph order: [fake_quant], the linear, [lora]."""
        out = [self.fake_quant] if self.fake_quant is not None else []
        out.append(self.node)
        if self.adapter is not None:
            out.append(self.adapter.node)
        return out

    @property
    def params(self) -> list[Param]:
        ps = [self.weight, self.scale, self.bias]
        if self.adapter is not None:
            ps += [self.adapter.a, self.adapter.b]
        return [p for p in ps if p is not None]

    def describe(self) -> str:
        if self.kind == "weight_only":
            g = "per channel" if self.group_size == -1 else f"group {self.group_size}"
            what = f"weight-only {self.weight.type.dtype} ({g})"
        elif self.kind == "qat":
            what = "fake-quant"
        else:
            what = f"{self.weight.type.dtype} linear"
        return f"{self.module} ({what})"


def _static(d: int | str, p: Param) -> int:
    if not isinstance(d, int):
        raise Refusal(f"@{p.name} has a symbolic dim ({p.type})")
    return d


def _where(node: Node) -> str:
    return f"{node.op} at {node.scope or '<root>'}"


def projection_at(node: Node, *, adapter: bool = True) -> Projection:
    """The projection whose linear node is `node` (Refusal says why it is not one).

    `adapter=False`: leave a LoRA reader of the output alone (a caller that reads adapters
    chained after a fused row layer, which take other inputs)."""
    if node.op == "fp8_linear":
        raise Refusal(f"{_where(node)} has one tensor-wise weight scale, which does not split into or "
                      "join from per-part scales")
    if node.op not in LINEAR_LIKE:
        raise Refusal(f"expected a linear, found {_where(node)}")
    quant = node.op == "weight_only_linear"
    w = node.inputs[1]
    scale = node.inputs[2] if quant else None
    bias_at = 3 if quant else 2
    bias = node.inputs[bias_at] if len(node.inputs) > bias_at else None
    fq: Node | None = None
    if not quant and w is not None and not isinstance(w, Param):
        prod = w.producer
        if prod is None or prod.op != "fake_quant" or not isinstance(prod.inputs[0], Param):
            what = _where(prod) if prod is not None else "a graph input"
            raise Refusal(f"the weight of {_where(node)} is computed by {what}, not a param")
        if w.num_uses() != 1:
            raise Refusal(f"the fake-quantized weight of {_where(node)} has other readers")
        fq, w = prod, prod.inputs[0]
    if not isinstance(w, Param) or (quant and not isinstance(scale, Param)):
        raise Refusal(f"the weight of {_where(node)} is computed, not a param")
    if bias is not None and not isinstance(bias, Param):
        raise Refusal(f"the bias of {_where(node)} is computed, not a param")
    if w.type.rank != 2:
        raise Refusal(f"the weight of {_where(node)} is not a matrix ({w.type})")
    return Projection(node, w, scale if isinstance(scale, Param) else None, bias, fq,
                      _adapter(node) if adapter else None)


def _adapter(node: Node) -> Adapter | None:
    y = node.outputs[0]
    loras = [u for u, i in y.uses if u.op == "lora" and i == 0]
    if not loras:
        return None
    lora = loras[0]
    if len(y.uses) != 1:
        raise Refusal(f"{_where(node)} is read both by its LoRA adapter and directly")
    if lora.inputs[1] is not node.inputs[0]:
        raise Refusal(f"the LoRA adapter on {_where(node)} reads another input than the layer")
    a, b = lora.inputs[2], lora.inputs[3]
    if not isinstance(a, Param) or not isinstance(b, Param):
        raise Refusal(f"the LoRA weights on {_where(node)} are computed, not params")
    return Adapter(lora, a, b)


def projection_of(v: Value, what: str) -> Projection:
    """The projection whose output readers see as `v` (`what` names it in refusals)."""
    node = v.producer
    if node is None:
        raise Refusal(f"{what} is {'param @' + str(v.name) if isinstance(v, Param) else 'a graph input'}"
                      ", not a projection")
    if node.op == "lora":
        base = node.inputs[0]
        if base is None or base.producer is None or base.producer.op not in (*LINEAR_LIKE, "fp8_linear"):
            raise Refusal(f"{what} is a LoRA adapter on something other than a linear")
        p = projection_at(base.producer)
        if p.adapter is None or p.adapter.node is not node:
            raise Refusal(f"{what}: the LoRA adapter is not its linear's only reader")
        return p
    if node.op not in LINEAR_LIKE and node.op != "fp8_linear":
        raise Refusal(f"{what} comes from {_where(node)}, not from a linear")
    p = projection_at(node)
    if p.adapter is not None:
        raise Refusal(f"{what} is read before its LoRA adapter")
    return p


def shard_free(p: Param) -> bool:
    return SHARD not in p.annotations
