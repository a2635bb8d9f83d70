"""lora-import: attach a trained LoRA adapter (a paddleformers adapter folder) to the graph.

The pass reads no file: the pipeline's adapter reader (`PassContext.adapter_reader`, given by
the caller as the evaluator is; `compile_model`, the CLI, the planner, `export` and the golden
harness pass `ernie_ir.formats.paddleformers_adapter.read_adapter`) turns the folder into a
`LoraAdapter` (ernie_ir.passes.lora.adapter): rank, scale, dropout and each lora_A [in, r] /
lora_B [r, out] under the module name the file gives it. Without a reader the pass stops with
one line that names the fix. Each adapter is attached as `lora` does it (same op, same param
names with the graph's `ernie.` prefix), with the file's values.

Names: keys are renamed with `prefix_map` (paddleformers' in-memory `model.` -> the
checkpoint's `ernie.`), or taken as they are when the graph has that name; per-expert names
(`...mlp.experts.{e}.up_gate_proj`) are stacked into the grouped expert adapter.

Layout fix-up: an adapter whose fused qkv lora_B is ordered per KV group
(`[q heads of group g | k_g | v_g]` for each g, paddleformers' in-memory order: `KV_GROUPED`)
has a GQA `qkv_proj.lora_B`'s columns reordered to the published plain
`[all q | all k | all v]` order our graphs use (head counts from the adapter's base config,
else the graph's). MHA needs no reorder (both are per head).

Errors (LoraError, one line): no adapter reader, a missing or malformed folder (the reader's),
an adapter module the model does not have, shapes that do not fit the model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from pydantic import Field

from ernie_ir.ir import DType, Graph
from ernie_ir.ir.weights import ArraySource
from ernie_ir.passes.infra.base import Pass, PassContext, PassOptions
from ernie_ir.passes.infra.param_placer import ParamPlacer
from ernie_ir.passes.infra.registry import register_pass
from ernie_ir.passes.lora.adapter import (
    DEFAULT_PREFIX_MAP,
    KV_GROUPED,
    AdapterTensor,
    LoraAdapter,
    head_counts,
    kv_group_to_plain,
    kv_grouped,
    qkv_width,
    rename,
)
from ernie_ir.passes.lora.insert import AdapterValues, LoraError, attach_adapters, freeze_all_but
from ernie_ir.passes.quant.config import WeightSite, find_targets

__all__ = ["NO_READER", "LoraImport", "LoraImportOptions", "group_by_module", "kv_group_to_plain"]

NO_READER = ("lora-import: reading an adapter folder needs an adapter reader: pass adapter_reader="
             "ernie_ir.formats.paddleformers_adapter.read_adapter to run_pipeline (compile_model and the "
             "CLI do)")
"""The one line `lora-import` stops with when its caller gave no adapter reader."""

_EXPERT = re.compile(r"(?P<head>.+\.experts)\.(?P<e>\d+)\.(?P<tail>[^.]+)$")


class LoraImportOptions(PassOptions):
    path: str
    """The adapter folder (lora_config.json + safetensors), or a training checkpoint folder that
    holds one in `adapter/` (that one is read)."""
    prefix_map: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_PREFIX_MAP))
    """Key prefixes to rename (paddleformers' in-memory `model.` -> the checkpoint's `ernie.`)."""
    freeze_base: bool = True


@register_pass
class LoraImport(Pass):
    """Attach a paddleformers LoRA adapter (lora_config.json + safetensors) to the graph."""

    name = "lora-import"
    description = "Import a paddleformers LoRA adapter folder (qkv columns reordered to plain q|k|v)."
    Options = LoraImportOptions
    produces = frozenset({"lora"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: LoraImportOptions = self.options  # type: ignore[assignment]
        if ctx.adapter_reader is None:
            raise LoraError(NO_READER)
        adapter = ctx.adapter_reader(Path(opts.path))
        if not isinstance(adapter, LoraAdapter):
            raise LoraError(f"lora-import: the adapter reader returned {type(adapter).__name__}, not a "
                            "LoraAdapter (ernie_ir.passes.lora.adapter)")
        source, rank = adapter.source, adapter.rank
        targets: dict[str, WeightSite] = {t.path: t for t in find_targets(graph)}
        pairs = group_by_module(adapter.tensors, targets, opts.prefix_map, source)

        heads = adapter.heads if adapter.heads is not None else head_counts({}, graph)
        values: dict[str, AdapterValues] = {}
        chosen: list[WeightSite] = []
        dtypes: set[DType] = set()
        for path, ab in pairs.items():
            if set(ab) != {"lora_A", "lora_B"}:
                raise LoraError(f"{source}: {path} has {sorted(ab)} but needs lora_A and lora_B")
            t = targets[path]
            v = t.node.inputs[t.index]
            assert v is not None
            k, n = v.type.shape[-2], v.type.shape[-1]
            lead = (t.experts,) if t.experts else ()
            a, b = ab["lora_A"], ab["lora_B"]
            want_a, want_b = (*lead, k, rank), (*lead, rank, n)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise LoraError(
                    f"{source}: adapter for {path} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                    f"but the model's weight {v.type} with r={rank} needs {list(want_a)} and {list(want_b)}")
            if adapter.qkv_order == KV_GROUPED and kv_grouped(path, heads):
                assert heads is not None
                if n != qkv_width(heads):
                    raise LoraError(f"{source}: {path} has {n} output columns, not (heads + 2 kv heads) x "
                                    f"head_dim = {qkv_width(heads)}")
                # looked up here, in this module, so a test can take the reorder out
                b = kv_group_to_plain(b, *heads)
            values[path] = AdapterValues(ArraySource(np.ascontiguousarray(a)),
                                         ArraySource(np.ascontiguousarray(b)))
            dtypes.add(DType.from_numpy(a.dtype))
            chosen.append(t)
        if not chosen:
            raise LoraError(f"{source}: the adapter holds no lora_A / lora_B weights")
        order = {t.path: i for i, t in enumerate(find_targets(graph))}
        chosen.sort(key=lambda t: order[t.path])
        placer = ParamPlacer(graph)
        created = attach_adapters(graph, placer, chosen, rank=rank, scale=adapter.scale,
                                  dropout=adapter.dropout, dtype=next(iter(dtypes)), seed=0, values=values)
        placer.finish()
        if opts.freeze_base:
            freeze_all_but(graph, set(created))
        ctx.count("adapters", len(chosen))
        return True


def group_by_module(tensors: tuple[AdapterTensor, ...], targets: Mapping[str, WeightSite],
                    prefix_map: Mapping[str, str], source: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """Adapter tensors by the graph module they adapt: {path: {"lora_A": a, "lora_B": b}}.

    Module names are renamed with `prefix_map` (or taken as they are when the graph has that
    name); per-expert names are stacked in expert order into the grouped expert adapter. Values
    keep the file's layout (a per-KV-group qkv lora_B is still per KV group)."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    experts: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for t in tensors:
        module = rename(t.module, prefix_map)
        if module not in targets and t.module in targets:
            module = t.module
        em = _EXPERT.match(module)
        if module not in targets and em is not None and f"{em['head']}.{em['tail']}" in targets:
            experts.setdefault(f"{em['head']}.{em['tail']}", {}).setdefault(int(em["e"]), {})[
                t.which] = t.value
            continue
        if module not in targets:
            close = [p for p in targets if p.endswith(module.split(".", 1)[-1])][:2]
            hint = f" (the model has e.g. {', '.join(close)})" if close else ""
            raise LoraError(f"{source}: adapter {t.key!r} targets {module}, which is not a linear of "
                            f"the model{hint}")
        pairs.setdefault(module, {})[t.which] = t.value
    for path, per in experts.items():
        site = targets[path]
        if sorted(per) != list(range(site.experts)):
            raise LoraError(f"{source}: {path} has adapters for experts {sorted(per)}, the model has "
                            f"{site.experts} experts")
        pairs[path] = {w: np.stack([per[e][w] for e in range(site.experts)]) for w in ("lora_A", "lora_B")
                       if all(w in per[e] for e in per)}
    return pairs
