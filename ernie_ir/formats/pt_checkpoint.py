"""The `-PT` layout of ERNIE 4.5 (what transformers' `save_pretrained` writes and its
`from_pretrained` reads, as in the published `ERNIE-4.5-*-PT` checkpoints), written from a float
graph: the inverse of the frontends' HF-layout reader (`frontends.ernie_layouts`), in one place.

From the published Paddle layout (`formats.fastdeploy.published_tensors`: the graph's names,
[in, out], one key per routed expert) each tensor becomes:

    ernie.X                                   -> model.X                   (embeddings, norms: as is)
    ...self_attn.qkv_proj.weight [H, (nh+2nkv)hd] -> self_attn.{q,k,v}_proj.weight [out, H]
                                                 (GQA/MQA: plain [q | k | v] columns; MHA: per head
                                                 [q0 k0 v0 | q1 ...], the graph's MHA reading)
    ...{mlp,shared_experts,experts.{e}}.up_gate_proj.weight [H, 2I] -> gate_proj, up_proj [I, H]
                                                 ([gate | up] columns)
    o_proj, down_proj, mlp.gate (router) .weight  -> transposed ([out, in])
    lm_head.weight [H, V]                      -> lm_head.weight [V, H]     (untied only)
    .bias                                      -> split like its weight's columns, not transposed
    mlp.moe_statics.e_score_correction_bias [1, E] -> as is (transformers saves it there)

Every tensor keeps its dtype (bf16 stays bf16; the MoE router and its correction bias stay
float32, as the graph holds them). config.json is the source's with `architectures` spelled as
transformers spells it and `rope_parameters` added where only `rope_theta` is given (transformers
5 and paddleformers 1.2 read it). Only ERNIE 4.5 (dense and MoE) has this layout; `pt_tensors`
refuses any other family in one line, naming it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.ir.weights import WeightSource

from .fastdeploy import published_tensors

PT_ARCHITECTURES = {
    "Ernie4_5_ForCausalLM": "Ernie4_5ForCausalLM",
    "Ernie4_5ForCausalLM": "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "Ernie4_5_MoeForCausalLM",
    "Ernie4_5MoeForCausalLM": "Ernie4_5_MoeForCausalLM",
}
"""Graph architecture -> the name transformers gives it (its `Ernie4_5ForCausalLM`,
`Ernie4_5_MoeForCausalLM`); the families the -PT layout covers."""

_TRANSPOSED = ("o_proj", "down_proj", "gate")


class PtLayoutError(ErnieIRError):
    """The graph has no -PT layout (another model family)."""


def pt_covers(graph: Graph) -> bool:
    return graph.metadata.get("architecture") in PT_ARCHITECTURES


def check_pt_layout(graph: Graph, what: str) -> None:
    """PtLayoutError (one line) unless `graph` (named `what` in the message) is ERNIE 4.5."""
    if not pt_covers(graph):
        arch = graph.metadata.get("architecture") or "an unknown architecture"
        raise PtLayoutError(f"--layout pt: {what} is {arch}, and the -PT (transformers) layout is written "
                            "for ERNIE 4.5 only (Ernie4_5ForCausalLM, Ernie4_5_MoeForCausalLM): no -PT "
                            "checkpoint can be written for it")


def pt_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (the source's config.json) as a -PT checkpoint's: transformers' architecture names
    and `rope_parameters` beside `rope_theta`; every other key as it is."""
    out = dict(config)
    archs = out.get("architectures")
    if isinstance(archs, list):
        out["architectures"] = [PT_ARCHITECTURES.get(a, a) for a in archs]
    if "rope_parameters" not in out and "rope_theta" in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": out["rope_theta"]}
    return out


def pt_tensors(graph: Graph) -> list[tuple[str, WeightSource]]:
    """(key, source) of every param of a float ERNIE 4.5 graph in the -PT layout (module
    docstring), in the published order; sources are lazy (each graph tensor read once)."""
    check_pt_layout(graph, graph.name or "the model")
    cfg = graph.metadata.get("config") or {}
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    out: list[tuple[str, WeightSource]] = []
    for key, src in published_tensors(graph):  # refuses quantized, LoRA, QAT, meta graphs
        name = "model." + key[len("ernie."):] if key.startswith("ernie.") else key
        stem, leaf = name.rsplit(".", 1)
        module, proj = stem.rsplit(".", 1) if "." in stem else ("", stem)
        weight = leaf == "weight"
        if proj == "qkv_proj":
            q, k = heads * head_dim, kv * head_dim
            if kv == heads:  # MHA: per head [q_h k_h v_h]
                cols = [[(3 * h * head_dim + i * head_dim, 3 * h * head_dim + (i + 1) * head_dim)
                         for h in range(heads)] for i in range(3)]
            else:
                cols = [[(0, q)], [(q, q + k)], [(q + k, q + 2 * k)]]
            out += _split(src, [f"{module}.{p}_proj.{leaf}" for p in "qkv"], cols, weight)
        elif proj == "up_gate_proj":
            half = src.shape[-1] // 2
            out += _split(src, [f"{module}.gate_proj.{leaf}", f"{module}.up_proj.{leaf}"],
                          [[(0, half)], [(half, 2 * half)]], weight)
        elif weight and (proj in _TRANSPOSED or name == "lm_head.weight"):
            out += _split(src, [name], [[(0, src.shape[-1])]], True)
        else:
            out.append((name, src))
    return out


def _split(src: WeightSource, names: list[str], cols: list[list[tuple[int, int]]],
           transpose: bool) -> list[tuple[str, WeightSource]]:
    shared = _Shared(src, len(names))
    return [(n, _Columns(shared, c, transpose)) for n, c in zip(names, cols, strict=True)]


class _Shared:
    """One read of `source` for the `uses` tensors cut from it, dropped after the last."""

    def __init__(self, source: WeightSource, uses: int) -> None:
        self.source, self.left = source, uses
        self.array: np.ndarray | None = None
        self.lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self.lock:
            array = self.array if self.array is not None else np.asarray(self.source.read())
            self.left -= 1
            self.array = array if self.left > 0 else None
            return array


class _Columns(WeightSource):
    """The column ranges `cols` of the last axis of a shared [in, out] weight (or [out] bias),
    joined, and for a weight transposed to [out, in]."""

    def __init__(self, shared: _Shared, cols: list[tuple[int, int]], transpose: bool) -> None:
        self.shared, self.cols, self.transpose = shared, cols, transpose
        base = shared.source.shape
        width = sum(b - a for a, b in cols)
        self.dtype = shared.source.dtype
        self.shape = (width, *base[:-1][::-1]) if transpose else (*base[:-1], width)

    def read(self) -> np.ndarray:
        array = self.shared.take()
        part = np.concatenate([array[..., a:b] for a, b in self.cols], axis=-1)
        return np.ascontiguousarray(part.T if self.transpose else part)

    def describe(self) -> str:
        how = "transpose(" if self.transpose else "("
        return f"{how}columns {self.cols} of {self.shared.source.describe()})"
