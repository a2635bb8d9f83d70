"""lora-import: attach a trained paddleformers LoRA adapter folder to the graph.

The folder is what `LoRAModel.save_pretrained` writes: `lora_config.json`
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

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from ernie_ir.ir import DType, Graph
from ernie_ir.ir.errors import WeightError
from ernie_ir.ir.inputs import read_json
from ernie_ir.ir.weights import ArraySource, SafetensorsFile, count_nonfinite

from ..infra.base import Pass, PassContext, PassOptions
from ..infra.param_placer import ParamPlacer
from ..infra.registry import register_pass
from ..quant.config import WeightSite, find_targets
from .insert import MAX_LORA_RANK, AdapterValues, LoraError, attach_adapters, freeze_all_but

_KEY = re.compile(r"(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.weight)?$")
_EXPERT = re.compile(r"(?P<head>.+\.experts)\.(?P<e>\d+)\.(?P<tail>[^.]+)$")


class LoraImportOptions(PassOptions):
    path: str
    """The adapter folder (lora_config.json + safetensors)."""
    prefix_map: dict[str, str] = Field(default_factory=lambda: {"model.": "ernie."})
    """Key prefixes to rename (paddleformers' in-memory `model.` -> the checkpoint's `ernie.`)."""
    freeze_base: bool = True


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """(lora_config, tensors by key, base config or {}) of an adapter folder."""
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter folder {folder} does not exist")
    cfg_path = folder / "lora_config.json"
    if not cfg_path.is_file():
        raise LoraError(f"{folder} is not a LoRA adapter folder (no lora_config.json)")
    cfg = read_json(cfg_path, "LoRA adapter config", LoraError, "re-export the adapter")
    if not isinstance(cfg, dict):
        raise LoraError(f"{cfg_path}: expected a JSON object (r, lora_alpha, target_modules, ...), got "
                        f"{type(cfg).__name__}: re-export the adapter")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoraError(f"{folder}: no adapter weights (*.safetensors)")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        try:
            st = SafetensorsFile(f)
            tensors.update({k: np.asarray(st.read(k)) for k in st})
        except WeightError as e:
            raise LoraError(f"LoRA adapter: {e}") from None
    for key, arr in tensors.items():
        if bad := count_nonfinite(arr):
            raise LoraError(f"{folder}: adapter tensor {key!r} holds {bad} NaN/Inf value(s): the adapter "
                            "diverged in training or is corrupt; re-export a finite one")
    base: dict[str, Any] = {}
    if (folder / "config.json").exists():  # optional: its head counts, else the graph's, are used
        loaded = read_json(folder / "config.json", "base model config", LoraError, "re-export the adapter")
        base = loaded if isinstance(loaded, dict) else {}
    return cfg, tensors, base


def _number(cfg: dict[str, Any], key: str, source: Path, *, default: float | None = None,
            high: float = math.inf, probability: bool = False) -> float | None:
    """A finite number of the adapter config in (0, high] (a probability: [0, 1)), or default."""
    value = cfg.get(key)
    if value is None:
        return default
    finite = type(value) in (int, float) and math.isfinite(value)
    ok = finite and ((0 <= value < 1) if probability else (0 < value <= high))
    if not ok:
        span = "[0, 1)" if probability else f"(0, {high:g}]"
        raise LoraError(f"{source}: '{key}' must be a finite number in {span}, got {_shown(value)}: fix "
                        "it or re-export the adapter")
    return float(value)


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def kv_group_to_plain(b: np.ndarray, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """Columns [q of group g | k_g | v_g] for each KV group g -> [all q | all k | all v] (last axis)."""
    group = heads // kv_heads
    lead = b.shape[:-1]
    per = b.reshape(*lead, kv_heads, (group + 2) * head_dim)
    q = per[..., : group * head_dim].reshape(*lead, heads * head_dim)
    k = per[..., group * head_dim: (group + 1) * head_dim].reshape(*lead, kv_heads * head_dim)
    v = per[..., (group + 1) * head_dim:].reshape(*lead, kv_heads * head_dim)
    return np.concatenate([q, k, v], axis=-1)


def _heads(base: dict[str, Any], graph: Graph) -> tuple[int, int, int] | None:
    def count(value: Any) -> int | None:  # a positive int, else unknown (a base config is optional)
        return value if type(value) is int and 0 < value <= 1 << 20 else None

    for cfg in (base, graph.metadata.get("config") or {}):
        nh, nkv = count(cfg.get("num_attention_heads")), count(cfg.get("num_key_value_heads"))
        hidden = count(cfg.get("hidden_size"))
        hd = count(cfg.get("head_dim")) or (hidden // nh if nh and hidden else None)
        if nh and hd:
            return nh, nkv or nh, hd
    return None


def _rename(key: str, prefix_map: dict[str, str]) -> str:
    for old, new in prefix_map.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


@register_pass
class LoraImport(Pass):
    """Attach a paddleformers LoRA adapter (lora_config.json + safetensors) to the graph."""

    name = "lora-import"
    description = "Import a paddleformers LoRA adapter folder (qkv columns reordered to plain q|k|v)."
    Options = LoraImportOptions
    produces = frozenset({"lora"})

    def run(self, graph: Graph, ctx: PassContext) -> bool:
        opts: LoraImportOptions = self.options  # type: ignore[assignment]
        folder = Path(opts.path)
        cfg, tensors, base_cfg = read_adapter(folder)
        source = folder / "lora_config.json"
        rank = cfg.get("r")
        if type(rank) is not int or not 1 <= rank <= MAX_LORA_RANK:
            raise LoraError(f"{source}: 'r' must be an integer rank in [1, {MAX_LORA_RANK}], got "
                            f"{_shown(rank)}: fix it or re-export the adapter")
        alpha = _number(cfg, "lora_alpha", source, default=2.0 * rank, high=1e6)
        assert alpha is not None
        rslora = cfg.get("rslora", False)
        if type(rslora) is not bool:
            raise LoraError(f"{source}: 'rslora' must be true or false, got {_shown(rslora)}")
        modules = cfg.get("target_modules")
        if modules is not None and not isinstance(modules, str) and not (
                isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
            raise LoraError(f"{source}: 'target_modules' must be a name pattern or a list of them, got "
                            f"{_shown(modules)}")
        scaling = _number(cfg, "scaling", source, high=1e6)
        scale = scaling if scaling is not None else (alpha / math.sqrt(rank) if rslora else alpha / rank)
        dropout = _number(cfg, "lora_dropout", source, default=0.0, probability=True)
        assert dropout is not None

        targets: dict[str, WeightSite] = {t.path: t for t in find_targets(graph)}
        pairs: dict[str, dict[str, np.ndarray]] = {}
        experts: dict[str, dict[int, dict[str, np.ndarray]]] = {}
        for key, arr in tensors.items():
            m = _KEY.match(key)
            if m is None:
                raise LoraError(f"{folder}: tensor {key!r} is not a lora_A / lora_B adapter weight")
            module = _rename(m["module"], opts.prefix_map)
            if module not in targets and m["module"] in targets:
                module = m["module"]
            em = _EXPERT.match(module)
            if module not in targets and em is not None and f"{em['head']}.{em['tail']}" in targets:
                experts.setdefault(f"{em['head']}.{em['tail']}", {}).setdefault(int(em["e"]), {})[
                    m["which"]] = arr
                continue
            if module not in targets:
                close = [p for p in targets if p.endswith(module.split(".", 1)[-1])][:2]
                hint = f" (the model has e.g. {', '.join(close)})" if close else ""
                raise LoraError(f"{folder}: adapter {key!r} targets {module}, which is not a linear of "
                                f"the model{hint}")
            pairs.setdefault(module, {})[m["which"]] = arr
        for path, per in experts.items():
            t = targets[path]
            if sorted(per) != list(range(t.experts)):
                raise LoraError(f"{folder}: {path} has adapters for experts {sorted(per)}, the model has "
                                f"{t.experts} experts")
            pairs[path] = {w: np.stack([per[e][w] for e in range(t.experts)]) for w in ("lora_A", "lora_B")
                           if all(w in per[e] for e in per)}

        heads = _heads(base_cfg, graph)
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
            if path.endswith("qkv_proj") and heads is not None and heads[1] < heads[0]:
                nh, nkv, hd = heads
                if n != (nh + 2 * nkv) * hd:
                    raise LoraError(f"{folder}: {path} has {n} output columns, not (heads + 2 kv heads) x "
                                    f"head_dim = {(nh + 2 * nkv) * hd}")
                b = kv_group_to_plain(b, nh, nkv, hd)
            values[path] = AdapterValues(ArraySource(np.ascontiguousarray(a)),
                                         ArraySource(np.ascontiguousarray(b)))
            dtypes.add(DType.from_numpy(a.dtype))
            chosen.append(t)
        if not chosen:
            raise LoraError(f"{folder}: the adapter holds no lora_A / lora_B weights")
        order = {t.path: i for i, t in enumerate(find_targets(graph))}
        chosen.sort(key=lambda t: order[t.path])
        placer = ParamPlacer(graph)
        created = attach_adapters(graph, placer, chosen, rank=rank, scale=scale, dropout=dropout,
                                  dtype=next(iter(dtypes)), seed=0, values=values)
        placer.finish()
        if opts.freeze_base:
            freeze_all_but(graph, set(created))
        ctx.count("adapters", len(chosen))
        return True
