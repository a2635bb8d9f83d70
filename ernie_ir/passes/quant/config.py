"""Quantization config in the graph: which linears are candidates, and the config's decision for each.

The config itself (`QuantConfig`, `QuantSpec`, `QuantRule`, `Algo`, the presets and aliases) is
plain data in `ernie_ir.ir.quant_spec`, below every layer that reads it; this module re-exports
each of its names, so `from ernie_ir.passes.quant.config import QuantConfig` keeps working.

Only `linear` nodes and the stacked expert weights of `moe_experts` are
candidates: embeddings, the MoE router (`moe_gate`) and `lm_head` are other
ops and stay float whatever the rules say. Routed experts are grouped in the
IR (one stacked [E, ...] weight per projection); they match through their
stacked path (`ernie.layers.1.mlp.experts.up_gate_proj`) and the per-expert
paths ERNIEKit sees (`ernie.layers.1.mlp.experts.7.up_gate_proj`); all
experts of a stack must get the same decision.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ernie_ir.ir import Graph, Node, Param
from ernie_ir.ir.quant_spec import (
    ALIASES,
    ERNIEKIT_WINT8MIX_INT8,
    PASS_PRESET_DESCRIPTIONS,
    PASS_PRESETS,
    PRESET_DESCRIPTIONS,
    PRESETS,
    ROUTED_EXPERTS,
    Algo,
    Decision,
    Method,
    QuantConfig,
    QuantConfigError,
    QuantRule,
    QuantSpec,
    compile_pattern,
    match_path,
    preset_method,
    resolve_quant_name,
    split_quant_options,
)

__all__ = [
    "ALIASES",
    "ALREADY_QUANTIZED",
    "ERNIEKIT_WINT8MIX_INT8",
    "EXPERT_OPS",
    "LINEAR_OPS",
    "PASS_PRESETS",
    "PASS_PRESET_DESCRIPTIONS",
    "PRESETS",
    "PRESET_DESCRIPTIONS",
    "ROUTED_EXPERTS",
    "Algo",
    "Decision",
    "Method",
    "QuantConfig",
    "QuantConfigError",
    "QuantRule",
    "QuantSpec",
    "WeightSite",
    "compile_pattern",
    "decide_target",
    "expert_paths",
    "find_targets",
    "match_path",
    "module_path",
    "preset_method",
    "resolve_quant_name",
    "split_quant_options",
]

# -- the candidates of a graph ---------------------------------------------------------------------

_WEIGHT_SUFFIXES = (".quant_weight", ".weight")
LINEAR_OPS = {"linear": 1, "weight_only_linear": 1, "fp8_linear": 1}
"""Linear-like ops and the input index of their weight."""
EXPERT_OPS = {"moe_experts": (3, 4), "moe_experts_lora": (3, 4)}
"""Grouped expert ops and the input indices of their stacked up_gate / down weights."""
ALREADY_QUANTIZED = ("wint2_dequantize",)
"""Producers of expert weights that are quantized in a form no rule can change (not candidates)."""


def module_path(param_name: str) -> str:
    """`ernie.layers.3.mlp.down_proj.weight` -> `ernie.layers.3.mlp.down_proj`."""
    for suffix in _WEIGHT_SUFFIXES:
        if param_name.endswith(suffix):
            return param_name[: -len(suffix)]
    return param_name


@dataclass
class WeightSite:
    """Where a quantizable (or LoRA-able) weight enters the graph: the weight input of one
    linear, or one stacked expert projection of a grouped-expert op (what quantization rules
    and `--lora-targets` select by module path)."""

    node: Node
    index: int  # input index of the weight on `node`
    param: Param | None  # the weight if it is a param (else produced by another node)
    path: str  # module path (weight name without .weight, or the node scope)
    paths: list[str] = field(default_factory=list)  # every name a pattern may match
    experts: int = 0  # > 0: a stacked expert weight with this many experts

    @property
    def kind(self) -> str:
        return "experts" if self.experts else "linear"


def _weight_param(node: Node, index: int) -> Param | None:
    v = node.inputs[index] if index < len(node.inputs) else None
    if isinstance(v, Param):
        return v
    if v is not None and v.producer is not None and v.producer.op == "dequantize":
        q = v.producer.inputs[0]
        return q if isinstance(q, Param) else None
    return None


def find_targets(graph: Graph) -> list[WeightSite]:
    """Linears and stacked expert projections, in graph order."""
    out: list[WeightSite] = []
    for node in graph:
        if node.op in LINEAR_OPS:
            idx = LINEAR_OPS[node.op]
            p = _weight_param(node, idx)
            path = module_path(p.name) if p is not None else node.scope
            paths = list(dict.fromkeys(x for x in (path, node.scope) if x))
            out.append(WeightSite(node, idx, p, path, paths))
        elif node.op in EXPERT_OPS:
            for idx in EXPERT_OPS[node.op]:
                p = _weight_param(node, idx)
                v = node.inputs[idx]
                assert v is not None
                if v.producer is not None and v.producer.op in ALREADY_QUANTIZED:
                    continue  # 2-bit experts (the wint2 pass): no candidate for another quantization
                experts = v.type.shape[0]
                stacked = module_path(p.name) if p is not None else f"{node.scope}.{idx}"
                out.append(WeightSite(node, idx, p, stacked, [stacked],
                                      experts=experts if isinstance(experts, int) else 0))
    return out


def expert_paths(stacked: str, experts: int) -> Iterator[str]:
    """ERNIEKit's per-expert names: `....mlp.experts.up_gate_proj` -> `....mlp.experts.{e}.up_gate_proj`."""
    head, _, tail = stacked.rpartition(".")
    for e in range(experts):
        yield f"{head}.{e}.{tail}" if head else f"{e}.{tail}"


def decide_target(config: QuantConfig, target: WeightSite) -> Decision:
    """The config's decision for a target; for a stack, every expert must agree."""
    if not target.experts:
        return config.decide(target.paths)
    first: Decision | None = None
    for e, path in enumerate(expert_paths(target.path, target.experts)):
        d = config.decide([path, *target.paths])
        if first is None:
            first = d
        elif (d.spec, d.rule) != (first.spec, first.rule):
            raise QuantConfigError(
                f"{target.path}: the rules give expert 0 {first.reason} but expert {e} {d.reason}; "
                "routed experts are grouped in one stacked weight and must share one quantization"
            )
    assert first is not None
    return first
