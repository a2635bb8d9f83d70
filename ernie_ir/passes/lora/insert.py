"""lora: insert LoRA adapters on target linears (ERNIEKit / paddleformers semantics).

For each linear whose module path matches a target pattern (regex full
match, ERNIEKit's defaults `.*qkv_proj.*`, `.*o_proj.*`, `.*up_gate_proj.*`,
`.*down_proj.*`; `glob:` patterns work too):

    y = base(x)    ->    y = lora(base(x), x, A, B) = base(x) + ((x @ A) @ B) * scale

where base is the layer as it is (`linear`, `weight_only_linear`,
`fp8_linear`: LoRA over a quantized base is WINT8MIX LoRA). A [in, r] is
Kaiming-uniform (bound 1 / sqrt(in), Paddle's KaimingUniform with
negative_slope sqrt(5), drawn from a seed derived from `seed` and the
param name), B [r, out] is zero, so the output at init equals the base
model exactly. scale = alpha / r (alpha defaults to 2 r), or alpha / sqrt(r)
with `rslora`. Routed experts matched by a pattern (their stacked or
per-expert names) get one adapter per expert: `moe_experts` becomes
`moe_experts_lora` with stacked A [E, in, r] and B [E, r, out].

Params `<module>.lora_A` / `<module>.lora_B` (paddleformers' names with our
`ernie.` prefix) are trainable; with `freeze_base` every other param is
frozen. Errors: no target matched (LoraError); a target already adapted.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import Field, model_validator

from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, Node, Param, TensorType
from ernie_ir.ir.weights import GeneratedSource, WeightSource
from ernie_ir.passes.infra.base import Pass, PassContext, PassOptions
from ernie_ir.passes.infra.param_placer import ParamPlacer
from ernie_ir.passes.infra.registry import register_pass
from ernie_ir.passes.parallel.split import shard_of
from ernie_ir.passes.quant.config import (
    EXPERT_OPS,
    LINEAR_OPS,
    WeightSite,
    compile_pattern,
    expert_paths,
    find_targets,
)

ERNIEKIT_TARGETS = (".*qkv_proj.*", ".*o_proj.*", ".*up_gate_proj.*", ".*down_proj.*")

# ERNIEKit's list names ERNIE 4.5 modules; the other families get the equivalent projections
# (attention in and out, FFN in and out), fused or split, so the defaults never match nothing.
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "GPTForCausalLM": (".*(qkv|q|k|v)_proj.*", ".*out_proj.*", ".*linear[12].*"),
    "Ernie35ForCausalLM": (".*(qkv_gate_up|q|k|v|o|gate|up|down)_proj.*",),
}


def default_targets(graph: Graph) -> tuple[str, ...]:
    """The target patterns for a model when the user gives none."""
    return DEFAULT_TARGETS.get(str(graph.metadata.get("architecture", "")), ERNIEKIT_TARGETS)


class LoraError(ErnieIRError):
    """LoRA targets, adapters or merges that cannot be applied."""


MAX_LORA_RANK = 65536
"""The cap on a LoRA rank; an adapter's rank is also at most min(in, out) of its linear."""


class LoraOptions(PassOptions):
    rank: int = Field(ge=1, le=MAX_LORA_RANK)
    """The adapter rank r (required, so every pipeline records it)."""
    alpha: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Defaults to 2 * rank (ERNIEKit)."""
    targets: tuple[str, ...] | None = None
    """Regexes (full match) or `glob:` patterns; None: the architecture's defaults
    (ERNIEKit's `.*qkv_proj.*`, `.*o_proj.*`, `.*up_gate_proj.*`, `.*down_proj.*` for ERNIE 4.5)."""
    rslora: bool = False
    """scale = alpha / sqrt(rank) instead of alpha / rank."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    seed: int = 0
    dtype: DType = DType.F32
    freeze_base: bool = True

    @model_validator(mode="after")
    def _check(self) -> LoraOptions:
        for p in self.targets or ():
            compile_pattern(p)
        if not self.dtype.is_float:
            raise ValueError(f"adapter dtype must be a float type, not {self.dtype}")
        if self.targets is not None and not self.targets:
            raise ValueError("give at least one target pattern")
        return self

    @property
    def scale(self) -> float:
        alpha = self.alpha if self.alpha is not None else 2.0 * self.rank
        return alpha / math.sqrt(self.rank) if self.rslora else alpha / self.rank


def param_seed(seed: int, name: str) -> int:
    """A seed for one param: independent of the order params are created in."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def kaiming_uniform(name: str, shape: Sequence[int], fan_in: int, dtype: DType, seed: int) -> GeneratedSource:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): Paddle's KaimingUniform(negative_slope=sqrt(5)) for A."""
    return GeneratedSource(dtype, shape, param_seed(seed, name), "uniform", std=1.0 / math.sqrt(fan_in))


@dataclass
class AdapterValues:
    """Sources for one adapter (None: initialise as a new adapter)."""

    a: WeightSource | None = None
    b: WeightSource | None = None


def _dims(target: WeightSite) -> tuple[int, int]:
    """(in, out) of a target's weight (per expert for a stack)."""
    v = target.node.inputs[target.index]
    assert v is not None
    k, n = v.type.shape[-2], v.type.shape[-1]
    if not (isinstance(k, int) and isinstance(n, int)):
        raise LoraError(f"{target.path}: LoRA needs static weight dims, got {v.type}")
    return k, n


def has_adapter(node: Node) -> bool:
    if node.op == "moe_experts_lora":
        return True
    return any(u.op == "lora" and i == 0 for u, i in node.outputs[0].uses) if node.outputs else False


def attach_adapters(graph: Graph, placer: ParamPlacer, chosen: list[WeightSite], *, rank: int, scale: float,
                    dropout: float, dtype: DType, seed: int,
                    values: dict[str, AdapterValues] | None = None) -> list[str]:
    """Insert adapters on `chosen` targets; returns the names of the new params."""
    values = values or {}
    created: list[str] = []
    for t in chosen:  # every target checked before the graph changes
        k, n = _dims(t)
        if rank > min(k, n):
            raise LoraError(f"LoRA rank {rank} exceeds min(in, out) = {min(k, n)} of {t.path} ({k} x {n}): "
                            f"an adapter of that linear cannot have a higher rank; choose --lora-rank <= "
                            f"{min(k, n)} or other --lora-targets")

    def make(t: WeightSite) -> tuple[Param, Param]:
        k, n = _dims(t)
        lead = (t.experts,) if t.experts else ()
        anchor = t.param.name if t.param is not None else next(iter(graph.params), "")
        vals = values.get(t.path, AdapterValues())
        a_name, b_name = f"{t.path}.lora_A", f"{t.path}.lora_B"
        a_type = TensorType(vals.a.dtype if vals.a else dtype, (*lead, k, rank))
        b_type = TensorType(vals.b.dtype if vals.b else dtype, (*lead, rank, n))
        a_src: WeightSource | None = vals.a
        b_src: WeightSource | None = vals.b
        # A meta graph (no weights) gets typed adapters without data, like its base weights.
        meta = t.param is not None and t.param.source is None and vals.a is None
        if a_src is None and not meta:
            a_src = kaiming_uniform(a_name, a_type.shape, k, dtype, seed)
        if b_src is None and not meta:
            b_src = GeneratedSource(dtype, b_type.shape, 0, "zeros")
        a = placer.add(anchor, Param(a_name, a_type, a_src, trainable=True))
        b = placer.add(anchor, Param(b_name, b_type, b_src, trainable=True))
        created.extend([a_name, b_name])
        return a, b

    by_node: dict[Node, list[WeightSite]] = {}
    for t in chosen:
        by_node.setdefault(t.node, []).append(t)
    for node, targets in by_node.items():
        if has_adapter(node):
            raise LoraError(f"{targets[0].path} already has a LoRA adapter (merge it first with lora-merge)")
        b = GraphBuilder(graph)
        if node.op in LINEAR_OPS:
            (t,) = targets
            a, bb = make(t)
            y = node.output
            b.insert_point = node.next
            with b.at_scope(node.scope):
                out = b.lora(y, node.inputs[0], a, bb, scale=scale, dropout=dropout)
            lora_node = out.producer
            graph.replace_all_uses_with(y, out)
            assert lora_node is not None
            lora_node.set_input(0, y)
            out.name, y.name = y.name, None
        else:
            ins: list = list(node.inputs[:5]) + [None] * 4
            for t in targets:
                a, bb = make(t)
                slot = 5 if t.index == 3 else 7
                ins[slot], ins[slot + 1] = a, bb
            b.insert_point = node
            with b.at_scope(node.scope):
                out = b.moe_experts_lora(*ins, scale=scale, dropout=dropout)
            out.name = node.output.name
            graph.replace_all_uses_with(node.output, out)
            graph.erase(node)
    return created


def select_targets(graph: Graph, patterns: Sequence[str], ctx: PassContext) -> list[WeightSite]:
    """Targets whose module path (or, for experts, any per-expert path) a pattern fully matches."""
    hits = dict.fromkeys(patterns, 0)
    chosen: list[WeightSite] = []
    for t in find_targets(graph):
        if t.node.op not in LINEAR_OPS and t.node.op not in EXPERT_OPS:
            continue
        paths = list(t.paths)
        if t.experts:
            paths += list(expert_paths(t.path, t.experts))
        matched = [p for p in patterns if any(compile_pattern(p).fullmatch(x) for x in paths)]
        for p in matched:
            hits[p] += 1
        if matched:
            chosen.append(t)
    if not chosen:
        linears = [t.path for t in find_targets(graph)][:4]
        raise LoraError(f"LoRA targets {list(patterns)} match no linear of the model (linears are named "
                        f"like {', '.join(linears) or 'nothing: the graph has none'}); "
                        "each target must match a whole name (re.fullmatch), e.g. '.*qkv_proj'")
    for p, n in hits.items():
        if not n:
            ctx.warn(f"LoRA target {p!r} matched no linear")
    return chosen


def freeze_all_but(graph: Graph, keep: set[str]) -> None:
    for p in graph.params.values():
        p.trainable = p.name in keep


@register_pass
class LoraInsert(Pass):
    """Insert LoRA adapters (A Kaiming-uniform, B zero) on the target linears and experts."""

    name = "lora"
    description = "Insert LoRA adapters on target linears (ERNIEKit targets, alpha 2r, rsLoRA, dropout)."
    Options = LoraOptions
    produces = frozenset({"lora"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: LoraOptions = self.options  # type: ignore[assignment]
        chosen = select_targets(graph, opts.targets or default_targets(graph), ctx)
        cut = next((t for t in chosen if t.param is not None and shard_of(t.param) is not None), None)
        if cut is not None:
            raise LoraError(f"lora after split: {cut.path} is cut across ranks, so each rank would draw "
                            "its own lora_A and the ranks would no longer form one model: add LoRA "
                            "before splitting (--lora-rank with --tp/--ep, or lora before split in "
                            "--pipeline)")
        placer = ParamPlacer(graph)
        created = attach_adapters(graph, placer, chosen, rank=opts.rank, scale=opts.scale,
                                  dropout=opts.dropout, dtype=opts.dtype, seed=opts.seed)
        placer.finish()
        if opts.freeze_base:
            freeze_all_but(graph, {n for n in graph.params if n.endswith((".lora_A", ".lora_B"))})
        ctx.count("adapters", len(created) // 2)
        return True

