"""ERNIE 4.5 dense (`Ernie4_5_ForCausalLM`) as a graph.

    h = embed_tokens[ids]
    per layer i:
        x = rms_norm(h, input_layernorm, eps)
        q, k, v = split(x @ qkv_proj)               GQA: [q | k | v]; MHA: per head
        q, k = rope(q), rope(k)                     interleaved pairs, theta = rope_theta
        h = h + attention(q, k, v, causal) @ o_proj  (kv heads shared by nh/nkv query heads)
        x = rms_norm(h, post_attention_layernorm, eps)
        h = h + mlp(x)                              dense: SwiGLU (see ernie4_5_moe for MoE layers)
    logits = rms_norm(h, norm) @ head              head = lm_head [H, V], or embed_tokens^T if tied

`head_dim` is independent of hidden_size (0.3B: 16 heads x 128 != 1024).
Activations are typed with the embedding's dtype (bf16 for published
checkpoints); RMSNorm, RoPE, attention and the routers compute in float32
as their ops state; logits are float32.
"""

from __future__ import annotations

from collections.abc import Callable

from ernie_ir.ir import DType, Graph, GraphBuilder, Value, i64, tensor

from .blocks import RopeSpec, attend, linear, merge_heads, split_fused_qkv, swiglu
from .config import Ernie45Config
from .params import BIAS, EMBEDDING, NORM, ParamMaker, WeightProvider

# (builder, params, config, layer index, "ernie.layers.{i}.mlp.", x) -> mlp output
MlpBuilder = Callable[[GraphBuilder, ParamMaker, Ernie45Config, int, str, Value], Value]


def dense_mlp(b: GraphBuilder, P: ParamMaker, cfg: Ernie45Config, i: int, pre: str, x: Value) -> Value:
    """SwiGLU with fused `up_gate_proj` [H, 2I] ([gate | up]) and `down_proj` [I, H]."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return swiglu(
        b, x,
        P(pre + "up_gate_proj.weight", (hidden, 2 * inter)),
        P(pre + "up_gate_proj.bias", (2 * inter,), init=BIAS) if cfg.use_bias else None,
        P(pre + "down_proj.weight", (inter, hidden)),
        P(pre + "down_proj.bias", (hidden,), init=BIAS) if cfg.use_bias else None,
        inter,
    )


def self_attention(b: GraphBuilder, P: ParamMaker, cfg: Ernie45Config, pre: str, x: Value) -> Value:
    """Fused-qkv GQA attention with interleaved RoPE and `o_proj`."""
    nh, nkv, hd, hidden = cfg.num_attention_heads, cfg.kv_heads, cfg.dim_per_head, cfg.hidden_size
    width = (nh + 2 * nkv) * hd
    mixed = linear(
        b, x,
        P(pre + "qkv_proj.weight", (hidden, width)),
        P(pre + "qkv_proj.bias", (width,), init=BIAS) if cfg.use_bias else None,
        "qkv_proj",
    )
    q, k, v = split_fused_qkv(b, mixed, nh, nkv, hd, "per_head" if nkv == nh else "plain")
    attn = attend(b, q, k, v, rope=RopeSpec(cfg.rope_theta, "interleaved"))
    return linear(
        b, merge_heads(b, attn, nh * hd),
        P(pre + "o_proj.weight", (nh * hd, hidden)),
        P(pre + "o_proj.bias", (hidden,), init=BIAS) if cfg.use_bias else None,
        "o_proj",
    )


def build_ernie45(cfg: Ernie45Config, weights: WeightProvider, *, name: str, dtype: DType,
                  mlp: MlpBuilder = dense_mlp) -> Graph:
    """The graph of an ERNIE 4.5 model; `mlp` builds each layer's feed-forward block."""
    b = GraphBuilder(name)
    P = ParamMaker(b, weights, dtype)
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    ids = b.input("input_ids", tensor(i64, "B", "S"))
    with b.scope("ernie"):
        table = P("ernie.embed_tokens.weight", (cfg.vocab_size, hidden), init=EMBEDDING)
        with b.scope("embed_tokens"):
            h = b.embedding(ids, table)
        for i in range(cfg.num_hidden_layers):
            pre = f"ernie.layers.{i}."
            with b.scope(f"layers.{i}"):
                with b.scope("input_layernorm"):
                    x = b.rms_norm(h, P(pre + "input_layernorm.weight", (hidden,), init=NORM), eps=eps)
                with b.scope("self_attn"):
                    attn = self_attention(b, P, cfg, pre + "self_attn.", x)
                h = b.add(h, attn)
                with b.scope("post_attention_layernorm"):
                    w = P(pre + "post_attention_layernorm.weight", (hidden,), init=NORM)
                    x = b.rms_norm(h, w, eps=eps)
                with b.scope("mlp"):
                    out = mlp(b, P, cfg, i, pre + "mlp.", x)
                h = b.add(h, out)
        with b.scope("norm"):
            h = b.rms_norm(h, P("ernie.norm.weight", (hidden,), init=NORM), eps=eps)
    with b.scope("lm_head"):
        if cfg.tie_word_embeddings:
            logits = b.lm_head(h, table, transpose_weight=True)
        else:
            logits = b.lm_head(h, P("lm_head.weight", (hidden, cfg.vocab_size)))
    b.output(logits, name="logits")
    return b.graph
