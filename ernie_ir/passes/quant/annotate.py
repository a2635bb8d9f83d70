"""quant-annotate: decide which linears get which quantization, and record it on their weights.

The decision step of quantization (torch PT2E's "annotate"), kept apart
from graph surgery: this pass only writes a `quant` annotation on each
selected weight param, e.g.

    param @ernie.layers.1.mlp.experts.up_gate_proj.weight : bf16[16,80,64]
        {quant = {algo = "weight_only_int4", group_size = -1, rule = 1}}

and records the config in `graph.metadata["quantization"]` (the keys and their readers:
`ernie_ir.ir.quant_spec`, where the config is plain data). The convert
passes (`weight-only-quant`, `qat-insert`, `fp8-quant`) read those
annotations and rewrite the graph. Rules are described in
`ernie_ir.ir.quant_spec`.

Warnings (through the pass context): a rule or ignore pattern that matched
nothing, and a mix preset on a model without routed experts.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import field_validator

from ernie_ir.ir import Graph
from ernie_ir.ir.quant_spec import ANNOTATION_KEY, RECORD_KEY, Method

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.pipeline_syntax import PipelineError
from ..infra.registry import register_pass
from .config import Algo, QuantConfig, QuantConfigError, decide_target, find_targets, match_path

ANNOTATION = ANNOTATION_KEY


class QuantAnnotateOptions(PassOptions):
    preset: str | None = None
    """A preset or alias: wint8, wint4, wint8mix, wint8mix-erniekit, qat-int8, fp8 (or wint4/8, ...)."""
    config: str | QuantConfig | None = None
    """A YAML quant-config file (our rules, ERNIEKit compute_type, FastDeploy mix_quant or
    PaddleSlim), or the config itself: a `QuantConfig`, or in pipeline text its mapping
    (`config={name=mine,rules=[{match=".*q_proj",algo=weight_only_int4}]}`)."""
    method: Method | None = None
    """How the weight-only rules' weights reach their grid: rtn or gptq (`QuantConfig.with_method`);
    None: as the preset or config says."""

    @field_validator("config", mode="before")
    @classmethod
    def _config(cls, v: Any) -> Any:
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        if isinstance(v, dict):  # a config written inline (what the pipeline text of an object is)
            try:
                return QuantConfig.from_dict(v, "inline quant config")
            except QuantConfigError as e:
                raise ValueError(str(e)) from None
        return v


def load_config(options: QuantAnnotateOptions) -> QuantConfig:
    if (options.preset is None) == (options.config is None):
        raise PipelineError("quant-annotate: give exactly one of preset=NAME or config=FILE.yaml "
                            "(or config=a QuantConfig)")
    if options.preset is not None:
        cfg = QuantConfig.preset(options.preset)
    elif isinstance(options.config, QuantConfig):
        cfg = options.config
    else:
        assert options.config is not None
        cfg = QuantConfig.from_yaml(options.config)
    return cfg if options.method is None else cfg.with_method(options.method)


@register_pass
class QuantAnnotate(Pass):
    """Record a quantization decision (`quant` annotation) on every selected weight param."""

    name = "quant-annotate"
    description = "Decide per linear (rules: ignore first, last match wins) and annotate the weights."
    Options = QuantAnnotateOptions
    produces = frozenset({"quant-annotated"})

    def __init__(self, options: QuantAnnotateOptions | dict | None = None) -> None:
        super().__init__(options)
        self.config = load_config(self.options)  # type: ignore[arg-type]

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        cfg = self.config
        targets = find_targets(graph)
        hits = [0] * len(cfg.rules)
        ignored = dict.fromkeys(cfg.ignore, 0)
        decided: dict[str, dict] = {}
        for t in targets:
            d = decide_target(cfg, t)
            if d.ignored_by is not None:
                ignored[d.ignored_by] += 1
            if d.rule is not None:
                hits[d.rule] += 1
            if d.spec is None:
                continue
            if t.param is None:
                ctx.warn(f"{t.path}: selected by {d.reason} but its weight is not a param "
                         f"(computed by {t.node.inputs[t.index].producer.op}); left as is")  # type: ignore[union-attr]
                continue
            if t.node.op not in ("linear", "moe_experts", "moe_experts_lora") or t.param.type.dtype.is_int:
                ctx.warn(f"{t.path}: already quantized ({t.node.op}); left as is")
                continue
            ann = {**d.spec.annotation(), "rule": d.rule}
            prev = decided.get(t.param.name)
            if prev is not None and prev != ann:
                raise QuantConfigError(f"param {t.param.name} is shared by linears that the rules "
                                       f"quantize differently ({prev} vs {ann})")
            decided[t.param.name] = ann
        has_experts = any(t.experts for t in targets)
        for i, n in enumerate(hits):
            if n:
                continue
            rule = cfg.rules[i]
            shadowed = any(match_path(rule.match, p) for t in targets for p in t.paths)
            if "experts" in rule.match and not has_experts and graph.nodes_by_op("moe_experts"):
                continue  # every routed expert stack is already in a pass's own form (wint2's 2-bit)
            if "experts" in rule.match and not has_experts and rule.algo != Algo.NONE:
                ctx.warn(f"{cfg.name}: rule {i} ({rule.describe()}) matched nothing: the model has no "
                         "routed experts (no moe_experts node), so the other rules decide every linear"
                         + (" (wint8mix on a dense model is wint8)" if cfg.name.startswith("wint8mix")
                            else ""))
            elif shadowed:
                ctx.warn(f"{cfg.name}: rule {i} ({rule.describe()}) never decides: a later rule or an "
                         "ignore pattern overrides it everywhere it matches")
            else:
                ctx.warn(f"{cfg.name}: rule {i} ({rule.describe()}) matched no linear")
        for pattern, n in ignored.items():
            if not n and not any(match_path(pattern, p) for t in targets for p in t.paths):
                ctx.warn(f"{cfg.name}: ignore pattern {pattern!r} matched no linear")
        changed = False
        for name, ann in decided.items():
            p = graph.params[name]
            if p.annotations.get(ANNOTATION) != ann:
                p.annotations[ANNOTATION] = ann
                changed = True
        meta = cfg.to_dict()
        if graph.metadata.get(RECORD_KEY) != meta:
            graph.metadata[RECORD_KEY] = meta
            changed = True
        ctx.count("annotated", len(decided))
        return changed
