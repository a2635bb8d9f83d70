"""ERNIE-3.5-SE against an independent numpy formulation (no pip package ships the model).

The reference below is written from REFERENCE.md section 3 and PaddleNLP's
`llm/ernie-3.5-se/modeling.py` (half-split RoPE with base 10000, positions
8(s+1)-1 when `enable_random_position_ids`), in float64, head by head, and
*unfused*: the fused `qkv_gate_up_proj` is cut into separate q, k, v (per head
[q_h k_h v_h] columns), X1 and X2 matrices, and the fused `o_proj` into its
FFN rows and attention rows, whose two products are summed. The graph keeps
the fused form (one linear in, a concat and one linear out), so agreement
shows the fused block equals the unfused computation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _fe_testkit import report, write_checkpoint

from ernie_ir.frontends import load_model
from ernie_ir.ir import OpError, get_op
from ernie_ir.runtime.interpreter import run_graph

BASE = {
    "architectures": ["Ernie35ForCausalLM"], "hidden_size": 48, "intermediate_size": 72,
    "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100, "layer_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
}
CONFIGS = {
    # the published 3B's switches: biases, head-attention/tail-FFN, strided positions, lm_head bias
    "hatf-bias-strided": {**BASE, "use_bias": True, "parallel_attn_hatf": True,
                          "enable_random_position_ids": True, "tie_word_embeddings": False},
    "all-parallel-tied": {**BASE, "num_hidden_layers": 3, "use_bias": False, "parallel_attn_hatf": False,
                          "enable_random_position_ids": False, "tie_word_embeddings": True},
    "two-layers": {**BASE, "num_hidden_layers": 2, "use_bias": True, "parallel_attn_hatf": True,
                   "weight_share_add_bias": False},
}


def se_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Random weights under the PaddleNLP module names, float32, [in, out] linears."""
    rng = np.random.default_rng(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    L, bias = cfg["num_hidden_layers"], cfg.get("use_bias", False)
    hatf = cfg.get("parallel_attn_hatf", True)
    t: dict[str, np.ndarray] = {}

    def lin(name: str, n_in: int, n_out: int) -> None:
        t[name + ".weight"] = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        if bias:
            t[name + ".bias"] = (0.1 * rng.standard_normal(n_out)).astype(np.float32)

    def ln(name: str) -> None:
        t[name + ".weight"] = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        t[name + ".bias"] = (0.1 * rng.standard_normal(H)).astype(np.float32)

    t["ernie.embed_tokens.weight"] = rng.standard_normal((V, H)).astype(np.float32)
    for i in range(L):
        p = f"ernie.layers.{i}."
        if hatf and i == 0:
            ln(p + "input_layernorm")
            for n in "qkvo":
                lin(f"{p}self_attn.{n}_proj", H, H)
        elif hatf and i == L - 1:
            ln(p + "post_attention_layernorm")
            lin(p + "mlp.gate_proj", H, I)
            lin(p + "mlp.up_proj", H, I)
            lin(p + "mlp.down_proj", I, H)
        else:
            ln(p + "input_layernorm")
            lin(p + "self_attn_mlp.qkv_gate_up_proj", H, 3 * H + 2 * I)
            lin(p + "self_attn_mlp.o_proj", I + H, H)
    ln("ernie.norm")
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (rng.standard_normal((H, V)) / np.sqrt(H)).astype(np.float32)
    if bias and cfg.get("weight_share_add_bias", True):
        t["lm_head.bias"] = (0.1 * rng.standard_normal(V)).astype(np.float32)
    return t


# -- the reference, in float64 --------------------------------------------------------------------


def reference_logits(t: dict[str, np.ndarray], cfg: dict, ids: np.ndarray) -> np.ndarray:
    w = {k: v.astype(np.float64) for k, v in t.items()}
    H, I, nh = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    L, hd, eps = cfg["num_hidden_layers"], H // nh, cfg["layer_norm_eps"]
    hatf = cfg.get("parallel_attn_hatf", True)
    S = ids.shape[1]
    pos = 8 * (np.arange(S) + 1) - 1 if cfg.get("enable_random_position_ids") else np.arange(S)
    inv = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv[None, :]                               # [S, hd/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def get(name: str) -> np.ndarray:
        return w.get(name, 0.0)  # absent bias: 0

    def layer_norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

    def rope(x):  # x [B, S, hd]: rotate_half pairs (i, i + hd/2)
        rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    def attention(q, k, v):  # [B, S, H] each -> [B, S, H]
        out = np.zeros_like(q)
        for h in range(nh):
            sl = slice(h * hd, (h + 1) * hd)
            qh, kh, vh = rope(q[..., sl]), rope(k[..., sl]), v[..., sl]
            scores = qh @ kh.transpose(0, 2, 1) / np.sqrt(hd)
            scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[..., sl] = (p / p.sum(-1, keepdims=True)) @ vh
        return out

    def silu(x):
        return x / (1 + np.exp(-x))

    h = w["ernie.embed_tokens.weight"][ids]
    for i in range(L):
        p = f"ernie.layers.{i}."
        if hatf and i == 0:
            x = layer_norm(h, p + "input_layernorm")
            q, k, v = (x @ w[f"{p}self_attn.{n}_proj.weight"] + get(f"{p}self_attn.{n}_proj.bias")
                       for n in "qkv")
            h = h + attention(q, k, v) @ w[p + "self_attn.o_proj.weight"] + get(p + "self_attn.o_proj.bias")
        elif hatf and i == L - 1:
            x = layer_norm(h, p + "post_attention_layernorm")
            g = x @ w[p + "mlp.gate_proj.weight"] + get(p + "mlp.gate_proj.bias")
            u = x @ w[p + "mlp.up_proj.weight"] + get(p + "mlp.up_proj.bias")
            h = h + (silu(g) * u) @ w[p + "mlp.down_proj.weight"] + get(p + "mlp.down_proj.bias")
        else:
            x = layer_norm(h, p + "input_layernorm")
            W = w[p + "self_attn_mlp.qkv_gate_up_proj.weight"]
            b = get(p + "self_attn_mlp.qkv_gate_up_proj.bias") + np.zeros(W.shape[1])
            # qkv columns are per head [q_h | k_h | v_h] (the model reshapes to [nh, 3 hd])
            per_head_w = W[:, : 3 * H].reshape(H, nh, 3, hd)
            per_head_b = b[: 3 * H].reshape(nh, 3, hd)
            q, k, v = (x @ per_head_w[:, :, j].reshape(H, H) + per_head_b[:, j].reshape(H) for j in range(3))
            x1 = x @ W[:, 3 * H: 3 * H + I] + b[3 * H: 3 * H + I]
            x2 = x @ W[:, 3 * H + I:] + b[3 * H + I:]
            Wo = w[p + "self_attn_mlp.o_proj.weight"]
            ffn, attn = silu(x1) * x2, attention(q, k, v)
            h = h + ffn @ Wo[:I] + attn @ Wo[I:] + get(p + "self_attn_mlp.o_proj.bias")
    h = layer_norm(h, "ernie.norm")
    logits = h @ (w["ernie.embed_tokens.weight"].T if cfg.get("tie_word_embeddings") else w["lm_head.weight"])
    return logits + get("lm_head.bias")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_se_matches_numpy_reference(name: str, tmp_path: Path):
    cfg = CONFIGS[name]
    tensors = se_tensors(cfg, seed=len(name))
    graph = load_model(str(write_checkpoint(tmp_path, cfg, tensors)))
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(2, 9))
    out = run_graph(graph, {"input_ids": ids})["logits"]
    ref = reference_logits(tensors, cfg, ids)
    _, rel = report(f"ernie-3.5-se {name} vs numpy", out, ref)
    assert rel < 1e-5


def test_se_fused_block_is_one_linear_in_one_linear_out(tmp_path: Path):
    cfg = CONFIGS["all-parallel-tied"]
    graph = load_model(str(write_checkpoint(tmp_path, cfg, se_tensors(cfg, 1))))
    block = [n for n in graph if n.scope.startswith("ernie.layers.1.self_attn_mlp")]
    linears = [n.scope for n in block if n.op == "linear"]
    assert linears == ["ernie.layers.1.self_attn_mlp.qkv_gate_up_proj", "ernie.layers.1.self_attn_mlp.o_proj"]
    (cat,) = [n for n in block if n.op == "concat"]
    assert [v.producer.op for v in cat.inputs] == ["mul", "reshape"]  # [ffn, attention], FFN first


def test_position_ids_op_and_the_se_positions():
    op = get_op("position_ids")
    (pos,) = op.kernel([np.zeros((2, 3), np.int64)], op.make_attrs({"stride": 8, "offset": 7}))
    assert pos.dtype == np.int64 and pos.tolist() == [[7, 15, 23], [7, 15, 23]]
    strided = op.make_attrs({"stride": 8, "offset": 7, "limit": 32768})
    assert op.kernel([np.zeros((1, 4096), np.int64)], strided)[0][0, -1] == 32767
    with pytest.raises(OpError, match="length 4097 reaches position 32775, beyond the model's 32768"):
        op.kernel([np.zeros((1, 4097), np.int64)], strided)
    (node,) = load_model("ernie-3.5-se-3b@tiny").nodes_by_op("position_ids")
    assert (node.attrs.stride, node.attrs.offset, node.attrs.limit) == (8, 7, 32768)
