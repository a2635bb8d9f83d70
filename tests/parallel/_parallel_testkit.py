"""Shared helpers of the parallel-split tests (imported as a plain module: tests/parallel has no package).

- `tiny(name, pipeline)`: a built-in @tiny model after a pipeline, with every
  LoRA B set to deterministic random values (the lora pass initialises B to
  zero, which would leave the LoRA cut untested).
- `build(name, **overrides)`: a built-in @tiny config with overrides, generated weights.
- `rel_err(a, b)`: relative Frobenius error.
- `collectives(graph)`: the collectives of a rank graph as (op, scope) pairs.
- `write_paddle_checkpoint(folder, cfg, seed)`: a random ERNIE 4.5 checkpoint in
  the published Paddle layout (REFERENCE 1.2), written here from the reference
  facts, independently of the frontend: `ernie.` prefix, weights [in, out],
  fused qkv_proj = plain [Q | K | V], up_gate_proj = [gate | up], experts one key
  per expert, router [H, E] and correction bias [1, E] in fp32, untied
  lm_head [H, V] without prefix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ernie_ir.frontends import GeneratedWeights, build_graph, parse_config
from ernie_ir.frontends.builtins import builtin_config
from ernie_ir.ir import Graph
from ernie_ir.ir.weights import write_safetensors
from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.testing.models import randomize_lora_b

BF16 = ml_dtypes.bfloat16
IDS = np.array([[1, 5, 900, 77, 3, 1000]], dtype=np.int64)
FAMILIES = ("ernie-4.5-0.3b", "ernie-4.5-21b-a3b", "ernie-4.5-300b-a47b", "ernie-3.5-se-3b", "gpt-345m")
COLLECTIVES = ("all_reduce", "all_gather")


def tiny_config(name: str) -> dict[str, Any]:
    return dict(builtin_config(name, "tiny"))


def tp_fits(name: str, tp: int) -> bool:
    """Whether the @tiny config's heads allow `tp` (whole Q heads; KV heads cut or replicated)."""
    cfg = tiny_config(name)
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    return nh % tp == 0 and (nkv % tp == 0 or tp % nkv == 0)


def tiny(name: str, pipeline: str = "") -> Graph:
    graph = load_input(f"{name}@tiny")
    if pipeline:
        run_pipeline(graph, pipeline)
    randomize_lora_b(graph)
    return graph


def build(name: str, **overrides: Any) -> Graph:
    """`name`@tiny with config overrides (e.g. num_attention_heads=4), generated weights."""
    cfg = {**builtin_config(name, "tiny"), **overrides}
    return build_graph(parse_config(cfg, f"{name}@tiny+{overrides}"), GeneratedWeights(0), name=name)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(out64 - ref64) / np.linalg.norm(ref64))


def collectives(graph: Graph) -> list[tuple[str, str]]:
    return [(n.op, n.scope) for n in graph if n.op in COLLECTIVES]


def layer_of(scope: str) -> int | None:
    """The decoder layer index a scope lies in (`...layers.3...`), None outside the layers."""
    parts = scope.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


# -- published-layout checkpoints -----------------------------------------------------------------


def is_moe_layer(cfg: Mapping[str, Any], i: int) -> bool:
    if "moe_num_experts" not in cfg:
        return False
    end = cfg.get("moe_layer_end_index", -1)
    end = cfg["num_hidden_layers"] - 1 if end == -1 else end
    return (i + 1) % cfg.get("moe_layer_interval", 1) == 0 and cfg.get("moe_layer_start_index", 1) <= i <= end


def paddle_tensors(cfg: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random ERNIE 4.5 tensors in the published Paddle layout (bf16; router fp32)."""
    rng = np.random.default_rng(seed)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    bias = cfg.get("use_bias", False)
    t: dict[str, np.ndarray] = {}

    def mat(name: str, rows: int, cols: int, std: float | None = None) -> None:
        t[name + ".weight"] = (rng.standard_normal((rows, cols)) * (std or rows ** -0.5)).astype(BF16)
        if bias:
            t[name + ".bias"] = (0.1 * rng.standard_normal(cols)).astype(BF16)

    def norm(name: str) -> None:
        t[name] = (1 + 0.1 * rng.standard_normal(hidden)).astype(BF16)

    def mlp(pre: str, width: int) -> None:
        mat(pre + "up_gate_proj", hidden, 2 * width)  # [H, 2I] = [gate | up]
        mat(pre + "down_proj", width, hidden)

    t["ernie.embed_tokens.weight"] = rng.standard_normal((vocab, hidden)).astype(BF16)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"ernie.layers.{i}."
        norm(pre + "input_layernorm.weight")
        norm(pre + "post_attention_layernorm.weight")
        mat(pre + "self_attn.qkv_proj", hidden, (nh + 2 * nkv) * hd)  # [H, (nh + 2 nkv) hd] = [Q | K | V]
        mat(pre + "self_attn.o_proj", nh * hd, hidden)
        if not is_moe_layer(cfg, i):
            mlp(pre + "mlp.", cfg["intermediate_size"])
            continue
        experts, inter = cfg["moe_num_experts"], cfg["moe_intermediate_size"]
        t[pre + "mlp.gate.weight"] = rng.standard_normal((hidden, experts)).astype(np.float32)
        t[pre + "mlp.moe_statics.e_score_correction_bias"] = (
            0.05 * rng.standard_normal((1, experts))).astype(np.float32)
        for e in range(experts):
            mlp(f"{pre}mlp.experts.{e}.", inter)
        shared = cfg.get("moe_num_shared_experts", 0)
        if shared:
            mlp(pre + "mlp.shared_experts.", inter * shared)
    norm("ernie.norm.weight")
    if not cfg.get("tie_word_embeddings", True):
        t["lm_head.weight"] = (rng.standard_normal((hidden, vocab)) * hidden ** -0.5).astype(BF16)
    return t


def write_paddle_checkpoint(folder: Path, cfg: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """config.json + model.safetensors in the Paddle layout; returns the tensors written."""
    tensors = paddle_tensors(cfg, seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(cfg), indent=1))
    write_safetensors(folder / "model.safetensors", sorted(tensors.items()))
    return tensors
