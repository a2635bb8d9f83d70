"""lora-merge: fold LoRA adapters into the base weights (paddleformers `LoRALinear.merge`).

    W' = dtype(f32(W) + (f32(A) @ f32(B)) * scale)        (per expert for stacked weights)

`lora(linear(x, W), x, A, B)` becomes `linear(x, W')`; `moe_experts_lora`
becomes `moe_experts` over the merged stacks; the adapter params go away.
The merged weight keeps the base weight's name and dtype and is computed
lazily (when read).

Quantized bases (`weight_only_linear`, `fp8_linear`, `dequantize` feeding
experts) are refused: merging would have to re-quantize the sum, which
silently changes the base model. With `dequantize=true` the base is
dequantized to its source dtype first and the layer becomes a float
`linear` (`<module>.weight`), i.e. it is no longer quantized.
"""

from __future__ import annotations

import numpy as np

from ernie_ir.ir import DType, Graph, GraphBuilder, Node, Param, TensorType, Value
from ernie_ir.ir.weights import WeightSource
from ernie_ir.ops.quant_numerics import weight_dequantize
from ernie_ir.passes.infra.base import Pass, PassContext, PassOptions
from ernie_ir.passes.infra.param_placer import ParamPlacer
from ernie_ir.passes.infra.registry import register_pass
from ernie_ir.passes.lora.insert import LoraError
from ernie_ir.passes.quant.annotate import ANNOTATION
from ernie_ir.passes.quant.config import module_path


class LoraMergeOptions(PassOptions):
    dequantize: bool = False
    """Merge into quantized bases by dequantizing them first (they become float linears)."""
    require: bool = False
    """Refuse a graph with no adapter to merge (what `--merge-lora` without `--lora-adapter` asks
    for); without it such a graph is left as it is."""


class MergedSource(WeightSource):
    """dtype(f32(base) + (f32(A) @ f32(B)) * scale), computed on read (batched over leading dims)."""

    def __init__(self, base: WeightSource, a: WeightSource, b: WeightSource, scale: float,
                 dtype: DType) -> None:
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.dtype = dtype
        self.shape = tuple(base.shape)

    def read(self) -> np.ndarray:
        w = np.asarray(self.base.read()).astype(np.float32)
        delta = np.matmul(np.asarray(self.a.read()).astype(np.float32),
                          np.asarray(self.b.read()).astype(np.float32)) * np.float32(self.scale)
        return (w + delta).astype(self.dtype.numpy)

    def describe(self) -> str:
        return f"lora_merge(scale={self.scale}, {self.base.describe()})"


class DequantizedSource(WeightSource):
    """dtype(f32(q) * f32(scale)) of a quantized weight's params, computed on read."""

    def __init__(self, q: Param, s: Param, group_size: int, dtype: DType) -> None:
        assert q.source is not None and s.source is not None
        self.q, self.s, self.group_size = q.source, s.source, group_size
        self.dtype = dtype
        self.shape = tuple(q.source.shape)

    def read(self) -> np.ndarray:
        q = np.asarray(self.q.read())
        s = np.asarray(self.s.read()).astype(np.float32)
        if q.dtype.kind == "f":  # fp8: tensor-wise (or per leading index)
            w = q.astype(np.float32) * s.reshape(s.shape + (1,) * (q.ndim - s.ndim))
        else:
            w = weight_dequantize(q, s, self.group_size)
        return w.astype(self.dtype.numpy)

    def describe(self) -> str:
        return f"dequantize({self.q.describe()})"


def _source_dtype(q: Param) -> DType:
    name = (q.annotations.get(ANNOTATION) or {}).get("source_dtype", "bf16")
    return DType.parse(name)


def _quantized_weight(placer: ParamPlacer, q: Param, s: Param, group_size: int) -> tuple[Param, DType]:
    """A float param `<module>.weight` holding the dequantized values of (q, s)."""
    dtype = _source_dtype(q)
    name = f"{module_path(q.name)}.weight"
    g = placer.graph
    if name in g.params:
        return g.params[name], dtype
    has_data = q.source is not None and s.source is not None
    src = DequantizedSource(q, s, group_size, dtype) if has_data else None
    return placer.add(q.name, Param(name, TensorType(dtype, q.type.shape), src)), dtype


def _merge_into(placer: ParamPlacer, w: Param, a: Value, b: Value, scale: float, shared: bool) -> Param:
    """The merged weight: `w` itself (new source) unless other layers read it."""
    if not (isinstance(a, Param) and isinstance(b, Param)):
        raise LoraError(f"{module_path(w.name)}: the adapter matrices are computed, not params; cannot merge")
    src = None
    if w.source is not None and a.source is not None and b.source is not None:
        src = MergedSource(w.source, a.source, b.source, scale, w.type.dtype)
    if not shared:
        if src is not None:
            w.source = src
        return w
    merged = Param(f"{w.name}.lora_merged", w.type, src, annotations=dict(w.annotations))
    return placer.add(w.name, merged)


def _refuse(path: str, what: str) -> LoraError:
    return LoraError(
        f"lora-merge: {path} has a quantized base ({what}); merging would re-quantize W + scale*A@B and "
        "change the base model. Keep the adapter unmerged, or run lora-merge{dequantize=true} to merge "
        "into the dequantized weight (the layer becomes a float linear)"
    )


@register_pass
class LoraMerge(Pass):
    """Fold every LoRA adapter into its base weight (W + scale * A @ B)."""

    name = "lora-merge"
    description = "Fold LoRA adapters into the base weights; quantized bases only with dequantize=true."
    Options = LoraMergeOptions
    invalidates = frozenset({"lora"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: LoraMergeOptions = self.options  # type: ignore[assignment]
        if opts.require and not any(n.op in ("lora", "moe_experts_lora") for n in graph):
            raise LoraError("lora-merge: the model has no LoRA adapter to merge: give the trained adapter "
                            "with --lora-adapter DIR (or lora-import before lora-merge)")
        if not opts.dequantize:  # refuse before touching anything
            for node in graph:
                if node.op == "lora" and node.inputs[0] is not None and node.inputs[0].producer is not None \
                        and node.inputs[0].producer.op in ("weight_only_linear", "fp8_linear"):
                    raise _refuse(node.scope or "a layer", node.inputs[0].producer.op)
                if node.op == "moe_experts_lora":
                    for slot, a in ((3, 5), (4, 7)):
                        v = node.inputs[slot]
                        if len(node.inputs) > a and node.inputs[a] is not None and v is not None \
                                and v.producer is not None and v.producer.op == "dequantize":
                            raise _refuse(f"{node.scope} ({'up_gate' if slot == 3 else 'down'})",
                                          "dequantize of quantized expert weights")
        placer = ParamPlacer(graph)
        removed: set[str] = set()
        merged = 0
        for node in list(graph):
            if node.op == "lora":
                removed |= self._dense(graph, placer, node, opts)
                merged += 1
            elif node.op == "moe_experts_lora":
                removed |= self._experts(graph, placer, node, opts)
                merged += 1
        placer.finish(removed=removed)
        ctx.count("merged", merged)
        return merged > 0

    def _dense(self, graph: Graph, placer: ParamPlacer, node: Node, opts: LoraMergeOptions) -> set[str]:
        base_y, x, a, b = node.inputs
        assert base_y is not None and x is not None and a is not None and b is not None
        base = base_y.producer
        scale = node.attrs.scale  # type: ignore[attr-defined]
        path = node.scope or (a.name or "").removesuffix(".lora_A")
        if base is None or base.op not in ("linear", "weight_only_linear", "fp8_linear") \
                or base.inputs[0] is not x or base_y.num_uses() != 1:
            raise LoraError(f"lora-merge: the adapter at {path} does not sit on a linear layer of its own "
                            "input; cannot fold it into a weight")
        bias = base.inputs[-1] if base.op == "linear" and len(base.inputs) > 2 else \
            (base.inputs[3] if base.op == "weight_only_linear" and len(base.inputs) > 3 else
             (base.inputs[4] if base.op == "fp8_linear" and len(base.inputs) > 4 else None))
        removed = {v.name for v in (a, b) if isinstance(v, Param)}
        if base.op == "linear":
            w = base.inputs[1]
            if not isinstance(w, Param):
                raise LoraError(f"lora-merge: the base weight at {path} is computed, not a param")
            neww = _merge_into(placer, w, a, b, scale, shared=w.num_uses() > 1)
        else:
            if not opts.dequantize:
                raise _refuse(path, base.op)
            q, s = base.inputs[1], base.inputs[2]
            assert isinstance(q, Param) and isinstance(s, Param)
            group = base.attrs.group_size if base.op == "weight_only_linear" else -1  # type: ignore[attr-defined]
            wf, _ = _quantized_weight(placer, q, s, group)
            neww = _merge_into(placer, wf, a, b, scale, shared=False)
            removed |= {q.name, s.name} | ({base.inputs[3].name} if base.op == "fp8_linear" else set())  # type: ignore[union-attr]
        bld = GraphBuilder(graph)
        bld.insert_point = node
        with bld.at_scope(base.scope):
            y = bld.linear(x, neww, bias) if bias is not None else bld.linear(x, neww)
        y.name = node.output.name
        graph.replace_all_uses_with(node.output, y)
        graph.erase(node)
        graph.erase(base)
        return removed

    def _experts(self, graph: Graph, placer: ParamPlacer, node: Node, opts: LoraMergeOptions) -> set[str]:
        ins = list(node.inputs) + [None] * (9 - len(node.inputs))
        scale = node.attrs.scale  # type: ignore[attr-defined]
        removed: set[str] = set()
        dead: list[Node] = []
        new = list(ins[:5])
        for slot, (ai, bi) in ((3, (5, 6)), (4, (7, 8))):
            a, b = ins[ai], ins[bi]
            if a is None or b is None:
                continue
            v = ins[slot]
            assert v is not None
            removed |= {p.name for p in (a, b) if isinstance(p, Param)}
            if isinstance(v, Param):
                new[slot] = _merge_into(placer, v, a, b, scale, shared=v.num_uses() > 1)
                continue
            prod = v.producer
            if prod is None or prod.op != "dequantize":
                raise LoraError(f"lora-merge: expert weights of {node.scope} are computed by "
                                f"{prod.op if prod else '?'}; cannot merge")
            if not opts.dequantize:
                raise _refuse(f"{node.scope} ({'up_gate' if slot == 3 else 'down'})", "dequantize of "
                              "quantized expert weights")
            q, s = prod.inputs
            assert isinstance(q, Param) and isinstance(s, Param)
            wf, _ = _quantized_weight(placer, q, s, prod.attrs.group_size)  # type: ignore[attr-defined]
            new[slot] = _merge_into(placer, wf, a, b, scale, shared=False)
            removed |= {q.name, s.name}
            if v.num_uses() == 1:
                dead.append(prod)
        bld = GraphBuilder(graph)
        bld.insert_point = node
        with bld.at_scope(node.scope):
            y = bld.moe_experts(*new)
        y.name = node.output.name
        graph.replace_all_uses_with(node.output, y)
        graph.erase(node)
        for d in dead:
            if not d.output.num_uses():
                graph.erase(d)
        return removed
