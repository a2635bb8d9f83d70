"""A trained LoRA adapter as data, whatever file it came from, and the layout facts its readers
and writers share.

`lora-import` attaches a `LoraAdapter`; it never reads a file. Its caller hands the pass
context an adapter reader (`PassContext.adapter_reader`: folder -> `LoraAdapter`, refusing a
missing or malformed folder with a one-line `LoraError`), as it hands an evaluator to the
passes that run the graph: `compile_model`, the CLI, the planner, `export` and the golden
harness pass `ernie_ir.formats.paddleformers_adapter.read_adapter` (paddleformers' folder).

A `LoraAdapter` holds the settings every adapter of the file shares (rank, scale, dropout),
each lora_A [in, r] / lora_B [r, out] tensor under the name of the module it adapts as the file
spells it (`lora-import` renames it with its `prefix_map` and matches it to the graph's linears;
per-expert names `....experts.{e}.<proj>` are stacked into the grouped expert adapter), the
base model's head counts when the file states them, and the column order of a fused qkv
projection's lora_B: `PLAIN` (`[all q | all k | all v]`, our graphs') or `KV_GROUPED`
(`[q heads of group g | k_g | v_g]` for each KV group g, paddleformers' in-memory order).

The layout helpers here (`kv_group_to_plain` and its inverse, `head_counts`, `global_shape`,
`rename`) are pure: the pass uses them on import, the paddleformers writer on export.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ernie_ir.ir import Graph, Param
from ernie_ir.ir.mapping import shard_of
from ernie_ir.passes.quant.config import find_targets

Heads = tuple[int, int, int]
"""(heads, kv heads, head_dim), global."""

QkvOrder = Literal["plain", "kv_grouped"]
PLAIN: QkvOrder = "plain"
KV_GROUPED: QkvOrder = "kv_grouped"


@dataclass(frozen=True, eq=False)
class AdapterTensor:
    """One tensor of an adapter file: lora_A [in, r] or lora_B [r, out] of one module."""

    key: str  # its name in the file (for messages)
    module: str  # the module it adapts, as the file names it
    which: Literal["lora_A", "lora_B"]
    value: np.ndarray


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A trained adapter, read: what an adapter reader returns and `lora-import` attaches."""

    source: str  # where it was read from (the folder), the prefix of every message about it
    rank: int
    scale: float
    dropout: float
    tensors: tuple[AdapterTensor, ...]  # in file order
    heads: Heads | None = None  # the base model's head counts as the file states them
    qkv_order: QkvOrder = PLAIN  # column order of a fused qkv_proj's lora_B


DEFAULT_PREFIX_MAP: dict[str, str] = {"model.": "ernie."}
"""`lora-import`'s default renaming of an adapter's module names to our graphs': paddleformers'
in-memory `model.` -> the checkpoint's `ernie.` (the prefix our graphs' params carry)."""


def rename(key: str, prefix_map: Mapping[str, str]) -> str:
    """`key` with the first matching prefix of `prefix_map` replaced."""
    for old, new in prefix_map.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


# -- the qkv column order ---------------------------------------------------------------------


def kv_group_to_plain(b: np.ndarray, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """Columns [q of group g | k_g | v_g] for each KV group g -> [all q | all k | all v] (last axis)."""
    group = heads // kv_heads
    lead = b.shape[:-1]
    per = b.reshape(*lead, kv_heads, (group + 2) * head_dim)
    q = per[..., : group * head_dim].reshape(*lead, heads * head_dim)
    k = per[..., group * head_dim: (group + 1) * head_dim].reshape(*lead, kv_heads * head_dim)
    v = per[..., (group + 1) * head_dim:].reshape(*lead, kv_heads * head_dim)
    return np.concatenate([q, k, v], axis=-1)


def plain_to_kv_group(b: np.ndarray, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """Columns [all q | all k | all v] -> [q of group g | k_g | v_g] for each KV group g (last axis);
    the inverse of `kv_group_to_plain`."""
    group = heads // kv_heads
    lead = b.shape[:-1]
    q = b[..., : heads * head_dim].reshape(*lead, kv_heads, group * head_dim)
    k = b[..., heads * head_dim: (heads + kv_heads) * head_dim].reshape(*lead, kv_heads, head_dim)
    v = b[..., (heads + kv_heads) * head_dim:].reshape(*lead, kv_heads, head_dim)
    return np.concatenate([q, k, v], axis=-1).reshape(*lead, (heads + 2 * kv_heads) * head_dim)


def kv_grouped(path: str, heads: Heads | None) -> bool:
    """Whether a per-KV-group lora_B of module `path` differs from our plain one (a fused
    qkv_proj with fewer KV heads than heads; with as many, per group is per head, ours too)."""
    return path.endswith("qkv_proj") and heads is not None and heads[1] < heads[0]


def qkv_width(heads: Heads) -> int:
    nh, nkv, hd = heads
    return (nh + 2 * nkv) * hd


# -- head counts ------------------------------------------------------------------------------


def _count(value: Any) -> int | None:
    """A positive int, else unknown."""
    return value if type(value) is int and 0 < value <= 1 << 20 else None


def config_heads(cfg: Mapping[str, Any]) -> Heads | None:
    """Head counts of a model config (`num_attention_heads`, `num_key_value_heads`,
    `head_dim` or `hidden_size`), else None."""
    nh, nkv = _count(cfg.get("num_attention_heads")), _count(cfg.get("num_key_value_heads"))
    hidden = _count(cfg.get("hidden_size"))
    hd = _count(cfg.get("head_dim")) or (hidden // nh if nh and hidden else None)
    return (nh, nkv or nh, hd) if nh and hd else None


def global_shape(p: Param) -> tuple[int, ...]:
    """The shape of the whole tensor a param holds (a rank graph's param may be a slice of it)."""
    shard = shard_of(p.annotations)
    shape = shard.get("global_shape") if shard is not None else None
    if isinstance(shape, list) and all(type(d) is int for d in shape):
        return tuple(shape)
    return tuple(d if isinstance(d, int) else -1 for d in p.type.shape)


def _ops_heads(graph: Graph, tp: int) -> Heads | None:
    """Head counts read from the graph's ops: the first attention's q and k ([B, S, heads, hd],
    per rank: x tp) and, for the KV heads, the global width of a fused qkv projection."""
    attn = next((n for n in graph if n.op == "attention"), None)
    if attn is None or len(attn.inputs) < 2 or attn.inputs[0] is None or attn.inputs[1] is None:
        return None
    q, k = attn.inputs[0].type.shape, attn.inputs[1].type.shape
    if len(q) != 4 or len(k) != 4 or not all(isinstance(d, int) for d in (q[2], q[3], k[2])):
        return None
    nh, hd = int(q[2]) * tp, int(q[3])
    nkv = int(k[2]) * tp  # KV heads replicated over ranks (tp > kv heads) overcount: use the width
    for t in find_targets(graph):
        if t.path.endswith("qkv_proj") and t.param is not None and t.param.type.dtype.is_float:
            width = global_shape(t.param)[-1]
            if width > 0 and width % hd == 0 and (width // hd - nh) > 0 and (width // hd - nh) % 2 == 0:
                nkv = (width // hd - nh) // 2
            break
    return (nh, nkv, hd) if 0 < nkv <= nh else None


def head_counts(base: Mapping[str, Any], graph: Graph, tp: int = 1) -> Heads | None:
    """Global (heads, kv heads, head_dim): from `base` (an adapter's base model config), else the
    graph's metadata config, else its ops (`tp`: the tensor-parallel degree of a rank graph)."""
    for cfg in (base, graph.metadata.get("config") or {}):
        if isinstance(cfg, Mapping) and (heads := config_heads(cfg)) is not None:
            return heads
    return _ops_heads(graph, tp)
