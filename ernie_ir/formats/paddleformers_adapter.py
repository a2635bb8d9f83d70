"""The paddleformers LoRA adapter folder: one implementation of the format, read and written.

An adapter folder is what paddleformers' `LoRAModel.save_pretrained` writes
and `LoRAModel.from_pretrained(model, folder)` reads (paddleformers 1.2.0,
see shared/REFERENCE.md 11):

- `lora_config.json`: the `LoRAConfig` fields (`r`, `lora_alpha`,
  `target_modules` regexes that `re.fullmatch` module names, `lora_dropout`,
  `rslora`, `dtype`, `tensor_model_parallel_size`, ...) plus `scaling`;
- `peft_model-00001-of-00001.safetensors` and `peft_model.safetensors.index.json`
  (`{"metadata": {"total_size"}, "weight_map"}`; from_pretrained takes the
  safetensors path only when the index exists);
- `config.json`: the base model's config (from_pretrained does not read it;
  `lora-import` takes the head counts from it).

Keys are paddleformers' in-memory module paths with `lora_A` / `lora_B`
appended (no `.weight`): `model.layers.{l}.self_attn.qkv_proj.lora_A` [in, r],
`.lora_B` [r, out]. Our graphs name the same modules with the checkpoint's
`ernie.` prefix (`PREFIX_MAP`). Two layouts differ from our graphs':

- a GQA `qkv_proj` (kv heads < heads): paddleformers fuses it per KV group,
  `[q heads of group g | k_g | v_g]` for each g, our graphs plain
  `[all q | all k | all v]`; lora_B's columns are reordered
  (`kv_group_to_plain` on import, `plain_to_kv_group` here on export, both in
  ernie_ir.passes.lora.adapter). MHA needs none (our fused qkv
  is per head there, as paddleformers' per group is);
- routed experts: one key pair per expert
  (`model.layers.{l}.mlp.experts.{e}.up_gate_proj.lora_A`), our graphs one
  stacked [E, ...] pair (`ernie.layers.{l}.mlp.experts.up_gate_proj.lora_A`).

`up_gate_proj` lora_B is `[gate | up]` in both, as are `o_proj` / `down_proj`.

Reading: `read_adapter(folder)` is the adapter reader the callers of pipelines
hand `lora-import` (`run_pipeline(..., adapter_reader=read_adapter)`; the pass
reads no file): it returns a `LoraAdapter` (ernie_ir.passes.lora.adapter) with
the settings of lora_config.json (`adapter_settings`), each tensor under its
module name, the head counts of config.json and the per-KV-group qkv order.
The pass renames the names (`PREFIX_MAP` is its default `prefix_map`), stacks
per-expert ones and reorders the qkv columns. Writing: `write_adapter(folder,
graph, params)` writes the adapters of a LoRA graph (a whole graph or one rank
graph of a split) with trained values given at global shape, so that
`lora-import` of the folder gives the same values bit for bit.

Errors are LoraError, one line.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import DType, Graph, Node, Param
from ernie_ir.ir.errors import WeightError
from ernie_ir.ir.inputs import read_json
from ernie_ir.ir.mapping import shard_of
from ernie_ir.ir.weights import SafetensorsFile, count_nonfinite, write_safetensors
from ernie_ir.passes.lora.adapter import (
    DEFAULT_PREFIX_MAP,
    KV_GROUPED,
    AdapterTensor,
    Heads,
    LoraAdapter,
    config_heads,
    global_shape,
    head_counts,
    kv_grouped,
    plain_to_kv_group,
    qkv_width,
    rename,
)
from ernie_ir.passes.lora.insert import MAX_LORA_RANK, LoraError
from ernie_ir.passes.quant.cli_flags import adapter_folder
from ernie_ir.passes.quant.config import expert_paths, find_targets

CONFIG_FILE = "lora_config.json"
WEIGHTS_FILE = "peft_model-00001-of-00001.safetensors"
INDEX_FILE = "peft_model.safetensors.index.json"
BASE_CONFIG_FILE = "config.json"

PREFIX_MAP: dict[str, str] = dict(DEFAULT_PREFIX_MAP)
"""Key prefixes of an adapter file -> our graphs' (paddleformers' in-memory `model.` -> `ernie.`):
`lora-import`'s default `prefix_map`."""

WRITE_PREFIX_MAP: dict[str, str] = {new: old for old, new in PREFIX_MAP.items()}

PADDLE_DTYPES: dict[DType, str] = {DType.F32: "float32", DType.BF16: "bfloat16", DType.F16: "float16"}

# paddleformers' class names of the ERNIE 4.5 architectures (our graphs may carry the Paddle
# checkpoints' `Ernie4_5_ForCausalLM`).
_PF_CLASSES = {"Ernie4_5_ForCausalLM": ("Ernie4_5ForCausalLM", "ernie4_5"),
               "Ernie4_5ForCausalLM": ("Ernie4_5ForCausalLM", "ernie4_5"),
               "Ernie4_5_MoeForCausalLM": ("Ernie4_5_MoeForCausalLM", "ernie4_5_moe")}

_KEY = re.compile(r"(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.weight)?$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# -- reading ----------------------------------------------------------------------------------


def read_adapter(path: Path) -> LoraAdapter:
    """The adapter of folder `path` (or of `path/adapter`, a training checkpoint folder's), as
    `lora-import` attaches it: the reader to pass as `adapter_reader=` to a pipeline."""
    folder = adapter_folder(path)
    cfg, tensors, base = read_files(folder)
    settings = adapter_settings(cfg, folder / CONFIG_FILE)
    read: list[AdapterTensor] = []
    for key, arr in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f"{folder}: tensor {key!r} is not a lora_A / lora_B adapter weight")
        read.append(AdapterTensor(key, m["module"], m["which"], arr))  # type: ignore[arg-type]
    return LoraAdapter(str(folder), settings.rank, settings.scale, settings.dropout, tuple(read),
                       heads=config_heads(base), qkv_order=KV_GROUPED)


def read_files(folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """(lora_config, tensors by key, base config or {}) of an adapter folder."""
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter folder {folder} does not exist")
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise LoraError(f"{folder} is not a LoRA adapter folder (no {CONFIG_FILE})")
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
    if (folder / BASE_CONFIG_FILE).exists():  # optional: its head counts, else the graph's, are used
        loaded = read_json(folder / BASE_CONFIG_FILE, "base model config", LoraError, "re-export the adapter")
        base = loaded if isinstance(loaded, dict) else {}
    return cfg, tensors, base


@dataclass(frozen=True)
class AdapterSettings:
    """What lora_config.json says about every adapter of the folder."""

    rank: int
    scale: float
    dropout: float


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


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


def adapter_settings(cfg: dict[str, Any], source: Path) -> AdapterSettings:
    """Rank, scale (`scaling`, else alpha / r or alpha / sqrt(r) with rslora) and dropout of a
    lora_config.json; malformed fields are refused."""
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
    return AdapterSettings(rank, scale, dropout)


# -- writing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphAdapter:
    """One adapter of a graph: a linear's (A, B) or a grouped expert projection's stacked pair."""

    path: str  # the module path in the graph (the stacked path for experts)
    a: Param
    b: Param
    scale: float
    dropout: float
    experts: int  # > 0: stacked over this many experts (global count)


def _adapter(node: Node, a: Any, b: Any, experts: bool) -> GraphAdapter:
    if not isinstance(a, Param) or not isinstance(b, Param):
        raise LoraError(f"{node.scope or node.op}: its LoRA A and B are not params (computed by other "
                        "ops), so they cannot be written as an adapter")
    if not a.name.endswith(".lora_A") or b.name != a.name[: -len("lora_A")] + "lora_B":
        raise LoraError(f"LoRA params {a.name} and {b.name} are not named <module>.lora_A / "
                        "<module>.lora_B, so the module they adapt is unknown")
    count = global_shape(a)[0] if experts else 0
    return GraphAdapter(a.name[: -len(".lora_A")], a, b, float(node.attrs.scale),  # type: ignore[attr-defined]
                        float(node.attrs.dropout), count)  # type: ignore[attr-defined]


def graph_adapters(graph: Graph) -> list[GraphAdapter]:
    """The graph's adapters in graph order (ops `lora` and `moe_experts_lora`)."""
    out: list[GraphAdapter] = []
    for node in graph:
        if node.op == "lora":
            out.append(_adapter(node, node.inputs[2], node.inputs[3], False))
        elif node.op == "moe_experts_lora":
            for slot in (5, 7):
                if slot + 1 < len(node.inputs) and node.inputs[slot] is not None:
                    out.append(_adapter(node, node.inputs[slot], node.inputs[slot + 1], True))
    return out


def adapter_params(graph: Graph) -> dict[str, np.ndarray]:
    """The LoRA values a whole (unsplit) graph holds, by param name: what to pass to
    `write_adapter` to write the graph's own adapters (a rank graph holds slices: refused)."""
    out: dict[str, np.ndarray] = {}
    for ad in graph_adapters(graph):
        for p in (ad.a, ad.b):
            if shard_of(p.annotations) is not None or p.source is None:
                raise LoraError(f"{p.name} holds {'a slice' if p.source is not None else 'no values'} "
                                "of the adapter: pass the trained values (a merged checkpoint)")
            out[p.name] = np.asarray(p.source.read())
    return out


def _value(p: Param, params: Mapping[str, np.ndarray]) -> np.ndarray:
    arr = params.get(p.name)
    if arr is None:  # a frozen adapter param (never trained): its own values, if the graph has them
        if shard_of(p.annotations) is not None or p.source is None:
            raise LoraError(f"{p.name} is not in the trained values and the graph holds only "
                            f"{'a slice of it' if p.source is not None else 'its type'}")
        arr = p.source.read()
    arr = np.asarray(arr)
    want = global_shape(p)
    if tuple(arr.shape) != want:
        raise LoraError(f"trained value of {p.name} has shape {list(arr.shape)}, the graph's adapter "
                        f"{list(want)} (global): the checkpoint belongs to another model or LoRA rank")
    dtype = p.type.dtype.numpy
    if arr.dtype != dtype:
        if arr.dtype.kind != "f" and str(arr.dtype) != "bfloat16":
            raise LoraError(f"trained value of {p.name} is {arr.dtype}, not a float array")
        arr = arr.astype(dtype)
    if bad := count_nonfinite(arr):
        raise LoraError(f"trained value of {p.name} holds {bad} NaN/Inf value(s): training diverged; "
                        "write an earlier checkpoint")
    return np.ascontiguousarray(arr)


def _alpha(scale: float, rank: int) -> float:
    """A lora_alpha with alpha / rank == scale (paddleformers recomputes the scaling from it):
    exact where a float alpha gives it (it may not: 0.1 x 3 has none), else scale x rank, whose
    quotient is within an ulp (`scaling` in lora_config.json keeps the exact value)."""
    alpha = scale * rank
    below = above = alpha
    for _ in range(4):
        for cand in (below, above):
            if cand / rank == scale:
                return cand
        below, above = float(np.nextafter(below, -math.inf)), float(np.nextafter(above, math.inf))
    return alpha


def _one(values: Iterable[Any], what: str) -> Any:
    seen = list(dict.fromkeys(values))
    if len(seen) != 1:
        raise LoraError(f"the graph's adapters have different {what} ({', '.join(map(str, seen[:4]))}); "
                        "a paddleformers adapter folder holds one")
    return seen[0]


def _pattern(name: str) -> str:
    """`model.layers.3.mlp.experts.7.up_gate_proj` -> the same with each index `\\d+` (escaped)."""
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


def _module_names(graph: Graph) -> list[str]:
    """Every linear's paddleformers module name (one per expert for a stack)."""
    names: list[str] = []
    for t in find_targets(graph):
        path = rename(t.path, WRITE_PREFIX_MAP)
        if t.experts:
            count = global_shape(t.param)[0] if t.param is not None else t.experts
            names.extend(expert_paths(path, count))
        else:
            names.append(path)
    return names


def target_modules(adapted: list[str], graph: Graph) -> list[str]:
    """Regexes that fullmatch exactly the adapted module names among the graph's linears: each
    name with its indices generalised (`\\d+`) where that matches no other linear, else as is."""
    chosen = set(adapted)
    others = [n for n in _module_names(graph) if n not in chosen]
    out: dict[str, None] = {}
    for name in adapted:
        general = _pattern(name)
        rx = re.compile(general)
        out[general if not any(rx.fullmatch(o) for o in others) else re.escape(name)] = None
    return list(out)


def _layer_of(scope: str) -> int | None:
    m = _LAYER.search(scope + ".")
    return int(m.group(1)) if m else None


def graph_config(graph: Graph, tp: int, heads: Heads | None) -> dict[str, Any]:
    """The base model's config.json in paddleformers' form: the graph's metadata config (class
    names as paddleformers spells them), completed from the graph's ops and params."""
    derived: dict[str, Any] = {}
    moe_layers: list[int] = []
    linears = {t.path: t for t in find_targets(graph)}
    for node in graph:
        if (node.op in ("embedding", "vocab_parallel_embedding") and "vocab_size" not in derived
                and isinstance(node.inputs[1], Param)):
            emb = node.inputs[1]
            derived["vocab_size"], derived["hidden_size"] = global_shape(emb)[:2]
            derived["tie_word_embeddings"] = len(emb.uses) > 1
            if emb.type.dtype in PADDLE_DTYPES:
                derived["torch_dtype"] = PADDLE_DTYPES[emb.type.dtype]
        elif node.op == "rms_norm" and "rms_norm_eps" not in derived:
            derived["rms_norm_eps"] = float(node.attrs.eps)  # type: ignore[attr-defined]
        elif node.op == "rope" and "rope_theta" not in derived:
            derived["rope_theta"] = float(node.attrs.theta)  # type: ignore[attr-defined]
        elif node.op == "moe_gate":
            if isinstance(node.inputs[1], Param):
                derived["moe_num_experts"] = global_shape(node.inputs[1])[-1]
            derived["moe_k"] = int(node.attrs.top_k)  # type: ignore[attr-defined]
            derived["moe_use_aux_free"] = len(node.inputs) > 2 and node.inputs[2] is not None
            if (layer := _layer_of(node.scope)) is not None:
                moe_layers.append(layer)
        elif node.op in ("moe_experts", "moe_experts_lora") and isinstance(node.inputs[4], Param):
            derived.setdefault("moe_intermediate_size", global_shape(node.inputs[4])[-2])
    derived["num_hidden_layers"] = sum(1 for n in graph if n.op == "attention")
    for path, t in linears.items():
        if t.param is None or not t.param.type.dtype.is_float:
            continue
        if path.endswith("mlp.down_proj") and ".experts" not in path:
            derived.setdefault("intermediate_size", global_shape(t.param)[0])
        if path.endswith("shared_experts.down_proj") and derived.get("moe_intermediate_size"):
            derived.setdefault("moe_num_shared_experts",
                               global_shape(t.param)[0] // derived["moe_intermediate_size"])
    if moe_layers:
        derived.setdefault("moe_num_shared_experts", 0)
        steps = {b - a for a, b in itertools.pairwise(moe_layers)}
        derived.update(moe_layer_start_index=min(moe_layers), moe_layer_end_index=max(moe_layers),
                       moe_layer_interval=steps.pop() if len(steps) == 1 else 1)
    if heads is not None:
        derived.update(num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2])
    meta = graph.metadata.get("config")
    cfg: dict[str, Any] = {**derived, **(dict(meta) if isinstance(meta, Mapping) else {})}
    if heads is not None:  # the counts the weights were written with
        cfg.update(num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2])
    arch = str(graph.metadata.get("architecture") or (cfg.get("architectures") or [""])[0])
    if not arch and "ernie." in next(iter(graph.params), "") and heads is not None:
        arch = "Ernie4_5_MoeForCausalLM" if moe_layers else "Ernie4_5_ForCausalLM"
    if arch in _PF_CLASSES:
        cfg["architectures"], cfg["model_type"] = [_PF_CLASSES[arch][0]], _PF_CLASSES[arch][1]
    elif arch:
        cfg["architectures"] = [arch]
    if "rope_theta" in cfg and "rope_parameters" not in cfg:
        cfg["rope_parameters"] = {"rope_theta": cfg["rope_theta"], "rope_type": "default"}
    return cfg


def write_adapter(folder: Path, graph: Graph, params: Mapping[str, np.ndarray], *, tp: int = 1,
                  base_config: Mapping[str, Any] | None = None) -> list[Path]:
    """Write the LoRA adapters of `graph` into `folder` as a paddleformers adapter folder.

    `graph`: a graph with LoRA (ops `lora`, `moe_experts_lora`), whole or one rank graph of a
    split with tensor-parallel degree `tp`. `params`: the trained values by param name at
    global shape (a merged training checkpoint; other entries are ignored). An adapter param
    missing from `params` is refused if it is trainable (the checkpoint would not be this
    graph's); a frozen one is written with the graph's own values. Values are written in the
    graph's adapter dtype. `base_config`: the base model's config.json (written as it is,
    head counts completed); else one is built from the graph. Returns the files written:
    lora_config.json, the weights, their index and config.json.
    """
    adapters = graph_adapters(graph)
    if not adapters:
        raise LoraError("the graph has no LoRA adapters (no lora / moe_experts_lora op): add them with "
                        "--lora-rank (the lora pass) or lora-import before writing an adapter")
    parallel = graph.metadata.get("parallel")
    if isinstance(parallel, Mapping) and type(parallel.get("tp")) is int and parallel["tp"] != tp:
        raise LoraError(f"the graph is a rank graph of a tp={parallel['tp']} split, but tp={tp} was given: "
                        f"pass tp={parallel['tp']}")
    missing = [p.name for ad in adapters for p in (ad.a, ad.b) if p.name not in params and p.trainable]
    if missing:
        raise LoraError(f"the trained values lack {len(missing)} of the graph's trainable LoRA params "
                        f"(e.g. {missing[0]}): the checkpoint belongs to another graph")
    rank = _one((global_shape(ad.a)[-1] for ad in adapters), "ranks")
    scale = _one((ad.scale for ad in adapters), "scales")
    dropout = _one((ad.dropout for ad in adapters), "dropouts")
    dtype: DType = _one((p.type.dtype for ad in adapters for p in (ad.a, ad.b)), "dtypes")
    if dtype not in PADDLE_DTYPES:
        raise LoraError(f"adapter dtype {dtype} has no paddleformers name (float32, bfloat16, float16)")

    base = dict(base_config) if base_config is not None else {}
    graph_heads = head_counts({}, graph, tp)
    heads = head_counts(base, graph, tp)
    if base and graph_heads is not None and heads is not None and heads != graph_heads:
        raise LoraError(f"base_config gives heads/kv heads/head_dim {list(heads)}, the graph "
                        f"{list(graph_heads)}: pass the config of this graph's base model")
    tensors: list[tuple[str, np.ndarray]] = []
    names: list[str] = []
    for ad in adapters:
        a, b = _value(ad.a, params), _value(ad.b, params)
        if ad.path.endswith("qkv_proj") and heads is None:
            raise LoraError(f"{ad.path}: the head counts are unknown (no config in the graph): pass "
                            "base_config")
        if kv_grouped(ad.path, heads):
            assert heads is not None
            if b.shape[-1] != qkv_width(heads):
                raise LoraError(f"{ad.path} has {b.shape[-1]} output columns, not (heads + 2 kv heads) x "
                                f"head_dim = {qkv_width(heads)}")
            b = plain_to_kv_group(b, *heads)
        module = rename(ad.path, WRITE_PREFIX_MAP)
        if ad.experts:
            for e, name in enumerate(expert_paths(module, ad.experts)):
                names.append(name)
                tensors += [(f"{name}.lora_A", np.ascontiguousarray(a[e])),
                            (f"{name}.lora_B", np.ascontiguousarray(b[e]))]
        else:
            names.append(module)
            tensors += [(f"{module}.lora_A", a), (f"{module}.lora_B", np.ascontiguousarray(b))]

    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise LoraError(f"{folder} is not empty: write an adapter into a new folder")
    weights = folder / WEIGHTS_FILE
    write_safetensors(weights, tensors)
    index = {"metadata": {"total_size": sum(int(t.nbytes) for _, t in tensors)},
             "weight_map": {k: WEIGHTS_FILE for k, _ in tensors}, "type": "lora"}
    alpha = _alpha(scale, rank)
    lora_config = {
        "base_model_name_or_path": None, "do_qat": False, "dtype": PADDLE_DTYPES[dtype],
        "enable_lora_list": None, "head_dim": None,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha, "lora_dropout": dropout,
        "lora_plus_scale": 1.0, "loraga": False, "merge_weights": False, "r": rank, "rslora": False,
        "scaling": scale, "target_modules": target_modules(names, graph),
        # the adapter is written TP-merged; paddleformers 1.2 reads the first name, PaddleNLP the second
        "tensor_model_parallel_size": 1, "tensor_parallel_degree": 1,
        "trainable_bias": None, "trainable_modules": None,
    }
    if base:
        if heads is not None:
            for key, value in zip(("num_attention_heads", "num_key_value_heads", "head_dim"), heads,
                                  strict=True):
                base.setdefault(key, value)
        config = base
    else:
        config = graph_config(graph, tp, heads)
    files = [folder / CONFIG_FILE, weights, folder / INDEX_FILE, folder / BASE_CONFIG_FILE]
    for path, data in ((files[0], lora_config), (files[2], index), (files[3], config)):
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return files
