"""`load_model`: a model folder or a built-in name in, a graph out.

Spec resolution, in order:
1. an existing folder: `config.json` + weights (see `checkpoint.py`);
2. `NAME`, `NAME@meta`, `NAME@tiny` for a built-in NAME (`builtin_models()`; MoE ones
   also `NAME@small`, builtins.SMALL);
   the bare NAME means `@meta` (full size, no weights);
3. anything else: `UnknownModelError` listing the built-ins.

Building reads config.json and the checkpoint's headers only: params get
lazy sources and no weight bytes are read until someone calls `read()`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ernie_ir.ir import DType, Graph
from ernie_ir.ir.suggest import close_names, did_you_mean

from .builtins import (
    GENERATED_VARIANTS,
    PUBLISHED,
    SMALL,
    TINY_SEED,
    VARIANTS,
    builtin_config,
    builtin_models,
)
from .checkpoint import TensorStore, open_checkpoint
from .config import (
    ArchConfig,
    Ernie35SEConfig,
    Ernie45Config,
    Ernie45MoeConfig,
    GPTConfig,
    parse_config,
    read_config,
)
from .ernie3_5_se import build_ernie35_se
from .ernie4_5 import build_ernie45
from .ernie4_5_moe import build_ernie45_moe
from .ernie_layouts import detect_ernie_layout
from .errors import CheckpointError, UnknownModelError
from .gpt import build_gpt
from .params import (
    CheckpointWeights,
    GeneratedWeights,
    IgnoreRule,
    Layout,
    MetaWeights,
    NativeLayout,
    WeightProvider,
)

_DTYPES = {"bfloat16": DType.BF16, "float16": DType.F16, "float32": DType.F32}

MTP_RULE = IgnoreRule(
    re.compile(r"^.*?\bmtp_[a-z_]+(\.\d+)?"),
    "multi-token prediction (MTP) head: not used for next-token logits",
)


def _tied_head_rule(why: str) -> IgnoreRule:
    return IgnoreRule(re.compile(r"^lm_head\.weight$"), why)


@dataclass
class CheckpointPlan:
    """How one architecture reads a checkpoint: layout, tolerated extras, builder options."""

    layout: Layout
    ignore: list[IgnoreRule]
    options: dict[str, Any]
    hint: str


def _plan_ernie45(store: TensorStore, cfg: ArchConfig) -> CheckpointPlan:
    assert isinstance(cfg, Ernie45Config)
    ignore = [MTP_RULE]
    if cfg.tie_word_embeddings:
        ignore.append(_tied_head_rule("the config ties the head to embed_tokens (tie_word_embeddings)"))
    hint = "check num_hidden_layers, the head counts, head_dim and tie_word_embeddings"
    if isinstance(cfg, Ernie45MoeConfig):
        hint += " and the moe_* keys"
    return CheckpointPlan(detect_ernie_layout(store, cfg), ignore, {}, hint + " in config.json")


def _plan_se(store: TensorStore, cfg: ArchConfig) -> CheckpointPlan:
    assert isinstance(cfg, Ernie35SEConfig)
    ignore = [_tied_head_rule("the config ties the head to embed_tokens")] if cfg.tie_word_embeddings else []
    return CheckpointPlan(NativeLayout(), ignore, {},
                          "check num_hidden_layers, use_bias and parallel_attn_hatf in config.json")


def _plan_gpt(store: TensorStore, cfg: ArchConfig) -> CheckpointPlan:
    assert isinstance(cfg, GPTConfig)
    marker = "embeddings.word_embeddings.weight"
    found = next((k for k in store if k.endswith(marker)), None)
    if found is None:
        raise CheckpointError(f"{store.folder}: no '*{marker}' tensor: is this a PaddleNLP GPT checkpoint?")
    prefix = found[: -len(marker)]
    fused = f"{prefix}decoder.layers.0.self_attn.qkv_proj.weight" in store
    split = f"{prefix}decoder.layers.0.self_attn.q_proj.weight" in store
    if fused and split:
        raise CheckpointError(
            f"{store.folder}: the checkpoint has both a fused qkv_proj and split q_proj/k_proj/v_proj: "
            "re-export it with one of them"
        )
    return CheckpointPlan(
        NativeLayout(),
        [_tied_head_rule("PaddleNLP's GPT ties the head to the word embeddings; lm_head.weight is a copy")],
        {"prefix": prefix, "fused_qkv": fused},
        "check num_hidden_layers, hidden_size, intermediate_size and max_position_embeddings in config.json",
    )


@dataclass(frozen=True)
class Family:
    build: Callable[..., Graph]
    plan: Callable[[TensorStore, ArchConfig], CheckpointPlan]
    default_dtype: DType


FAMILIES: dict[type[ArchConfig], Family] = {
    Ernie45Config: Family(build_ernie45, _plan_ernie45, DType.BF16),
    Ernie45MoeConfig: Family(build_ernie45_moe, _plan_ernie45, DType.BF16),
    Ernie35SEConfig: Family(build_ernie35_se, _plan_se, DType.BF16),
    GPTConfig: Family(build_gpt, _plan_gpt, DType.F32),
}


def _config_dtype(cfg: ArchConfig, default: DType) -> DType:
    name = getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None)
    return _DTYPES.get(str(name), default)


def _finish(graph: Graph, cfg: ArchConfig, facts: dict[str, Any]) -> Graph:
    embedding = graph.nodes_by_op("embedding")[0]
    graph.metadata.update({
        "architecture": cfg.architecture,
        "config": cfg.to_json(),
        "activation_dtype": embedding.output.dtype.value,
        **facts,
    })
    return graph


def build_graph(cfg: ArchConfig, weights: WeightProvider, *, name: str, dtype: DType | None = None,
                **options: Any) -> Graph:
    """The graph of a parsed config with params from `weights` (lower level than `load_model`)."""
    family = FAMILIES[type(cfg)]
    return family.build(cfg, weights, name=name, dtype=dtype or _config_dtype(cfg, family.default_dtype),
                        **options)


_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_layer_count(store: TensorStore, cfg: ArchConfig) -> None:
    """Refuse a config that claims more decoder layers than the checkpoint holds, before the
    graph builder creates a node and a param per layer (a config can claim 1024 layers over
    a two-layer checkpoint)."""
    want = int(getattr(cfg, "num_hidden_layers", 0))
    found = {int(m.group(1)) for k in store if (m := _LAYER_KEY.search(k))}
    if found and max(found) + 1 < want:
        raise CheckpointError(
            f"{store.folder}: config.json says num_hidden_layers {want}, but the checkpoint holds "
            f"layers 0..{max(found)} only ({max(found) + 1} layers): fix num_hidden_layers or copy "
            "the missing shards")


def load_folder(folder: str | os.PathLike[str], *, trust_pickle: bool = False, meta: bool = False) -> Graph:
    """The graph of a checkpoint folder (config.json + safetensors or trusted .pdparams).

    `meta`: from config.json alone, full size with no weights (no weight file is opened), for
    planning and review before the weights are downloaded."""
    root = Path(folder)
    cfg = read_config(root)
    if meta:
        graph = build_graph(cfg, MetaWeights(), name=root.resolve().name)
        return _finish(graph, cfg, {"source": str(folder), "weights": "meta"})
    store = open_checkpoint(root, trust_pickle=trust_pickle)
    _check_layer_count(store, cfg)
    plan = FAMILIES[type(cfg)].plan(store, cfg)
    weights = CheckpointWeights(store, plan.layout, plan.ignore, plan.hint)
    graph = build_graph(cfg, weights, name=root.resolve().name, **plan.options)
    facts = weights.finish()
    return _finish(graph, cfg, {
        "source": str(folder),
        "weights": "checkpoint",
        "format": store.format,
        "layout": plan.layout.name,
        **facts,
    })


def load_builtin(name: str, variant: str = "meta") -> Graph:
    """A built-in model: `meta` (full size, no data) or `tiny` (shrunk, generated weights)."""
    if name not in PUBLISHED:
        raise UnknownModelError(f"no built-in model {name!r}{did_you_mean(name, builtin_models())} "
                                f"(built-ins: {', '.join(builtin_models())})")
    if variant not in VARIANTS or (variant == "small" and name not in SMALL):
        small = f", {name}@small" if name in SMALL else ""
        hint = did_you_mean(f"{name}@{variant}", [f"{name}@{v}" for v in _variants(name)])
        raise UnknownModelError(
            f"unknown variant '@{variant}' of {name}{hint}: use {name}@tiny{small} or {name}@meta")
    cfg = parse_config(builtin_config(name, variant), f"built-in {name}@{variant}")
    weights: WeightProvider = GeneratedWeights(TINY_SEED) if variant in GENERATED_VARIANTS else MetaWeights()
    graph = build_graph(cfg, weights, name=name)
    return _finish(graph, cfg, {"source": f"{name}@{variant}", "weights": weights.kind})


def load_model(spec: str, *, trust_pickle: bool = False, meta: bool = False) -> Graph:
    """The graph of a model folder or a built-in model name (`NAME`, `NAME@tiny`, `NAME@meta`).

    Graphs have one input `input_ids: i64[B,S]` and one output
    `logits: f32[B,S,V]`; params are named after the checkpoint's keys in the
    Paddle layout; metadata holds the architecture, the resolved config and
    where the weights came from. Errors are `ErnieIRError`s with a one-line
    message. `meta`: a folder's full-size graph from config.json alone, no weights.
    """
    path = Path(spec)
    if path.is_dir():
        return load_folder(path, trust_pickle=trust_pickle, meta=meta)
    name, _, variant = str(spec).partition("@")
    if name in PUBLISHED:
        if meta and variant not in ("", "meta"):
            raise UnknownModelError(f"--meta with {spec}: use {name}@meta (or drop --meta)")
        return load_builtin(name, variant or "meta")
    if path.exists():
        raise UnknownModelError(
            f"{spec} is a file: give the model folder (config.json next to the weights) or a built-in name"
        )
    raise UnknownModelError(
        f"{spec!r} is neither a model folder nor a built-in model{_nearest_builtin(name, variant)} "
        f"(built-ins: {', '.join(builtin_models())}; add @tiny for a small random model or @meta for the "
        "full size without weights)"
    )


def _nearest_builtin(name: str, variant: str) -> str:
    """` (did you mean ernie-4.5-0.3b@tiny?)` for a mistyped built-in name (its variant kept, or
    the nearest one it has); "" when no built-in is near."""
    close = close_names(name, builtin_models())
    if not close:
        return ""
    if variant and variant not in _variants(close[0]):
        variant = next(iter(close_names(variant, _variants(close[0]))), "")
    return f" (did you mean {close[0]}{'@' + variant if variant else ''}?)"


def _variants(name: str) -> list[str]:
    """The variants built-in model `name` comes in (what `NAME@VARIANT` may say after the @)."""
    return [v for v in VARIANTS if v != "small" or name in SMALL]

