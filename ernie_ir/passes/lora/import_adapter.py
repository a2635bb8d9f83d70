"""lora-import: attach a trained paddleformers LoRA adapter folder to the graph.

The folder is what `LoRAModel.save_pretrained` writes (and `write_adapter`
of `paddleformers_adapter`, the module that holds the format): `lora_config.json`
(r, lora_alpha, scaling, rslora, lora_dropout, target_modules), the adapter
weights in `*.safetensors` (keys `model.layers.{l}.<module>.lora_A|lora_B`,
no `.weight` suffix, lora_A [in, r], lora_B [r, out]) and the base model's
`config.json`. Each adapter is attached as `lora` does it (same op, same
param names with the graph's `ernie.` prefix), with the file's values.

Layout fix-up: paddleformers fuses `qkv_proj` per KV group in memory
(`[q heads of group g | k_g | v_g]` for each g), so a GQA adapter's
`qkv_proj.lora_B` columns are reordered to the published plain
`[all q | all k | all v]` order our graphs use (head counts from the
adapter's config.json, else the graph's). MHA needs no reorder (both are
per head). Per-expert keys (`...mlp.experts.{e}.up_gate_proj.lora_A`) are
stacked into the grouped expert adapter.

Errors (LoraError, one line): a missing or malformed folder, an adapter
module the model does not have, shapes that do not fit the model.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ernie_ir.ir import DType, Graph
from ernie_ir.ir.weights import ArraySource
from ernie_ir.passes.infra.base import Pass, PassContext, PassOptions
from ernie_ir.passes.infra.param_placer import ParamPlacer
from ernie_ir.passes.infra.registry import register_pass
from ernie_ir.passes.lora.insert import AdapterValues, LoraError, attach_adapters, freeze_all_but
from ernie_ir.passes.lora.paddleformers_adapter import (
    CONFIG_FILE,
    PREFIX_MAP,
    adapter_settings,
    group_by_module,
    head_counts,
    kv_group_to_plain,
    kv_grouped,
    qkv_width,
    read_adapter,
)
from ernie_ir.passes.quant.cli_flags import adapter_folder
from ernie_ir.passes.quant.config import WeightSite, find_targets

__all__ = ["LoraImport", "LoraImportOptions", "kv_group_to_plain", "read_adapter"]


class LoraImportOptions(PassOptions):
    path: str
    """The adapter folder (lora_config.json + safetensors), or a training checkpoint folder that
    holds one in `adapter/` (that one is read)."""
    prefix_map: dict[str, str] = Field(default_factory=lambda: dict(PREFIX_MAP))
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
        folder = adapter_folder(opts.path)
        cfg, tensors, base_cfg = read_adapter(folder)
        settings = adapter_settings(cfg, folder / CONFIG_FILE)
        rank = settings.rank
        targets: dict[str, WeightSite] = {t.path: t for t in find_targets(graph)}
        pairs = group_by_module(tensors, targets, opts.prefix_map, folder)

        heads = head_counts(base_cfg, graph)
        values: dict[str, AdapterValues] = {}
        chosen: list[WeightSite] = []
        dtypes: set[DType] = set()
        for path, ab in pairs.items():
            if set(ab) != {"lora_A", "lora_B"}:
                raise LoraError(f"{folder}: {path} has {sorted(ab)} but needs lora_A and lora_B")
            t = targets[path]
            v = t.node.inputs[t.index]
            assert v is not None
            k, n = v.type.shape[-2], v.type.shape[-1]
            lead = (t.experts,) if t.experts else ()
            a, b = ab["lora_A"], ab["lora_B"]
            want_a, want_b = (*lead, k, rank), (*lead, rank, n)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise LoraError(
                    f"{folder}: adapter for {path} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                    f"but the model's weight {v.type} with r={rank} needs {list(want_a)} and {list(want_b)}")
            if kv_grouped(path, heads):
                assert heads is not None
                if n != qkv_width(heads):
                    raise LoraError(f"{folder}: {path} has {n} output columns, not (heads + 2 kv heads) x "
                                    f"head_dim = {qkv_width(heads)}")
                # looked up here, in this module, so a test can take the reorder out
                b = kv_group_to_plain(b, *heads)
            values[path] = AdapterValues(ArraySource(np.ascontiguousarray(a)),
                                         ArraySource(np.ascontiguousarray(b)))
            dtypes.add(DType.from_numpy(a.dtype))
            chosen.append(t)
        if not chosen:
            raise LoraError(f"{folder}: the adapter holds no lora_A / lora_B weights")
        order = {t.path: i for i, t in enumerate(find_targets(graph))}
        chosen.sort(key=lambda t: order[t.path])
        placer = ParamPlacer(graph)
        created = attach_adapters(graph, placer, chosen, rank=rank, scale=settings.scale,
                                  dropout=settings.dropout, dtype=next(iter(dtypes)), seed=0, values=values)
        placer.finish()
        if opts.freeze_base:
            freeze_all_but(graph, set(created))
        ctx.count("adapters", len(chosen))
        return True
