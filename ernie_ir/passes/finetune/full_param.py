"""full-param: full-parameter fine-tuning (ERNIEKit's `fine_tuning: Full`): every float param trains.

    full-param                                   every float param trainable
    full-param{freeze=[".*embed_tokens", ".*mlp.gate"]}   those kept fixed (PaddleSlim's freeze_embedding)

The pass marks each candidate param `trainable` and every other param not trainable; it changes
no node and no annotation. Candidates are the f32 / bf16 / f16 params, less:

- those a `freeze` pattern matches: a regex (full match) or a `glob:` pattern, matched as
  `--lora-targets` is (`compile_pattern(p).fullmatch`) against every name of the param: its own
  (`ernie.layers.0.mlp.down_proj.weight`), its module's (the name less its last part:
  `ernie.layers.0.mlp.down_proj`), the scope of each node that reads it (a tied embedding is also
  `lm_head`) and, for routed experts (one stacked weight per projection), every per-expert
  module path ERNIEKit names (`....mlp.experts.7.up_gate_proj`);
- the MoE router's score-correction bias (`moe_gate`'s bias, ERNIE 4.5's
  `moe_statics.e_score_correction_bias`): it only chooses experts, so no gradient reaches it
  (ERNIE 4.5 keeps it `stop_gradient` too);
- QAT state (`qat_state` annotations).

Refused, one line each (FullParamError): a pattern that matches no param; patterns that freeze
every candidate (nothing would train); patterns that match some experts of a stacked expert
weight but not all (the stack is one tensor: freeze it whole or not at all); a graph with LoRA
or QAT (they choose their own trainable params); a graph with weight-only, FP8, W4A8 or 2-bit
quantized weights (their integer codes take no gradient step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import field_validator

from ernie_ir.ir import DType, ErnieIRError, Graph, Param

from ..infra.base import Pass, PassContext, PassOptions, graph_properties
from ..infra.registry import register_pass
from ..quant.config import compile_pattern, expert_paths, find_targets

TRAINABLE_DTYPES = frozenset({DType.F32, DType.BF16, DType.F16})
"""The dtypes a full-parameter fine-tune updates (quantized codes and FP8 never)."""
QUANTIZED_DTYPES = frozenset({DType.I8, DType.I4, DType.U8, DType.F8E4M3, DType.F8E5M2})
QUANTIZED_REFUSAL = ("full-parameter training cannot update quantized weights ({what}): use LoRA "
                     "(--lora-rank R), or train the float model first and quantize the trained artifact")
TRAINS_ITS_OWN = frozenset({"lora", "qat"})
"""Graph properties of passes that choose the trainable params themselves."""


class FullParamError(ErnieIRError):
    """A full-parameter fine-tune that cannot be set up as asked."""


class FullParamOptions(PassOptions):
    freeze: tuple[str, ...] = ()
    """Regexes (full match) or `glob:` patterns of params kept fixed; empty: every candidate trains."""

    @field_validator("freeze")
    @classmethod
    def _patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for p in value:
            if not p.strip():
                raise ValueError("a freeze pattern is empty")
            compile_pattern(p)
        return value


@dataclass(frozen=True)
class Selection:
    """What a full-parameter fine-tune of a graph updates."""

    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    """Candidates a freeze pattern matched."""
    fixed: tuple[str, ...]
    """Params that are never trainable: not float, quantizer state, the router's correction bias."""


def param_names(graph: Graph) -> dict[str, list[list[str]]]:
    """Per param: the groups of names a freeze pattern may match. The first group is the param's
    own names (its name, its module, the scopes of its readers); a stacked expert weight has one
    more group per expert (its per-expert module path), and a pattern must match all of them or
    none."""
    names: dict[str, list[list[str]]] = {}
    for name in graph.params:
        module = name.rpartition(".")[0]
        names[name] = [[name, *([module] if module else [])]]
    for node in graph:
        for v in node.inputs:
            if isinstance(v, Param) and node.scope and node.scope not in names[v.name][0]:
                names[v.name][0].append(node.scope)
    for site in find_targets(graph):
        if site.experts and site.param is not None and site.param.name in names:
            names[site.param.name].extend([p] for p in expert_paths(site.path, site.experts))
    return names


def never_trainable(graph: Graph) -> set[str]:
    """Params no full-parameter fine-tune updates: not float, QAT state, a router's correction bias."""
    fixed = {p.name for p in graph.params.values()
             if p.type.dtype not in TRAINABLE_DTYPES or "qat_state" in p.annotations}
    for node in graph:
        if node.op == "moe_gate" and len(node.inputs) > 2 and isinstance(node.inputs[2], Param):
            fixed.add(node.inputs[2].name)
    return fixed


def check_float(graph: Graph) -> None:
    """Refuse a graph with quantized weights or one that trains LoRA or QAT (FullParamError)."""
    props = graph_properties(graph)
    made = sorted(props & TRAINS_ITS_OWN)
    if made:
        raise FullParamError(f"the graph has {made[0].upper()} (it chooses its own trainable params): "
                             "full-parameter training is for a graph without LoRA or QAT; drop full-param "
                             "(or --freeze), or drop the LoRA/QAT passes")
    quantized = next((p for p in graph.params.values() if p.type.dtype in QUANTIZED_DTYPES), None)
    if quantized is not None or "quantized" in props:
        what = ("the graph is quantized" if quantized is None
                else f"{quantized.name} is {quantized.type.dtype}")
        raise FullParamError(QUANTIZED_REFUSAL.format(what=what))


def select(graph: Graph, freeze: Sequence[str] = ()) -> Selection:
    """The params a full-parameter fine-tune of `graph` updates with `freeze` patterns kept fixed;
    FullParamError (one line) for a graph it cannot train or patterns that do not fit it."""
    check_float(graph)
    fixed = never_trainable(graph)
    names = param_names(graph)
    compiled = [(p, compile_pattern(p)) for p in freeze]
    hits = dict.fromkeys(freeze, 0)
    frozen: list[str] = []
    for name, groups in names.items():
        matched = False
        for pattern, rx in compiled:
            per_group = [any(rx.fullmatch(x) for x in group) for group in groups]
            if per_group[0] or (len(per_group) > 1 and all(per_group[1:])):
                hits[pattern] += 1
                matched = True
            elif any(per_group[1:]):
                raise FullParamError(f"--freeze {pattern!r} matches some experts of {name} but not all: "
                                     "routed experts are one stacked weight, frozen whole or not at all; "
                                     f"match the stack ({groups[0][1]}) or none of its experts")
        if matched and name not in fixed:
            frozen.append(name)
    _check_hits(hits, names)
    trainable = tuple(n for n in graph.params if n not in fixed and n not in frozen)
    if not trainable:
        raise FullParamError(f"--freeze {' '.join(repr(p) for p in freeze)} freezes every param, so "
                             "nothing would train: freeze fewer (or use LoRA: --lora-rank R)")
    return Selection(trainable, tuple(frozen), tuple(n for n in graph.params if n in fixed))


def _check_hits(hits: dict[str, int], names: dict[str, list[list[str]]]) -> None:
    missed = next((p for p, n in hits.items() if not n), None)
    if missed is None:
        return
    examples = ", ".join(_examples(names))
    raise FullParamError(f"--freeze {missed!r} matches no param of the model (params are named like "
                         f"{examples}; modules and reading scopes count too); each pattern must match "
                         "a whole name (re.fullmatch), e.g. '.*embed_tokens'")


def _examples(names: dict[str, list[list[str]]]) -> Iterable[str]:
    modules = list(dict.fromkeys(groups[0][1] if len(groups[0]) > 1 else groups[0][0]
                                 for groups in names.values()))
    return modules[:3] + modules[-1:] if len(modules) > 4 else modules


@register_pass
class FullParam(Pass):
    """Mark every float param trainable, except those `freeze` matches (full-parameter fine-tuning)."""

    name = "full-param"
    description = ("Full-parameter fine-tuning: every float param trainable except those freeze "
                   "matches (ERNIEKit fine_tuning: Full).")
    Options = FullParamOptions
    produces = frozenset({"full-param"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: FullParamOptions = self.options  # type: ignore[assignment]
        chosen = select(graph, opts.freeze)
        keep = set(chosen.trainable)
        changed = False
        for p in graph.params.values():
            if p.trainable != (p.name in keep):
                p.trainable = p.name in keep
                changed = True
        ctx.count("trainable", len(chosen.trainable))
        ctx.count("frozen", len(chosen.frozen))
        return changed

