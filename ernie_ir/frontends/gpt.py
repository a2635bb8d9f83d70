"""GPT of PaddleNLP / PaddleFleetX (`GPTForCausalLM`) as a graph.

    h = word_embeddings[ids] + position_embeddings[0..S-1]
    per layer i (pre-LayerNorm, eps 1e-5 as PaddleNLP hard-codes it):
        x = layer_norm(h, norm1)
        q, k, v = x @ qkv_proj + b, split per head ([q_h k_h v_h] for each head h)
                  (or three linears q_proj, k_proj, v_proj)
        h = h + attention(q, k, v, causal) @ out_proj + b
        x = layer_norm(h, norm2)
        h = h + gelu_tanh(x @ linear1 + b) @ linear2 + b
    logits = layer_norm(h, decoder.norm) @ word_embeddings^T   (the head is always tied)

PaddleNLP masks with -1e4 instead of -inf; after the float32 softmax the
difference is below 1e-30 for any realistic score range. A stored
`lm_head.weight` (PaddleNLP writes the tied tensor twice) is not read; it
is listed under `ignored_weights` in the metadata.
"""

from __future__ import annotations

from ernie_ir.ir import DType, Graph, GraphBuilder, Value, i64, tensor

from .blocks import attend, linear, merge_heads, split_fused_qkv, split_heads
from .config import GPTConfig
from .params import BIAS, EMBEDDING, NORM, ParamMaker, WeightProvider


def _layer_norm(b: GraphBuilder, P: ParamMaker, x: Value, name: str, hidden: int) -> Value:
    with b.scope(name.rsplit(".", 1)[-1] if "." in name else name):
        return b.layer_norm(x, P(f"{name}.weight", (hidden,), init=NORM),
                            P(f"{name}.bias", (hidden,), init=BIAS), eps=GPTConfig.LAYER_NORM_EPS)


def _attention(b: GraphBuilder, P: ParamMaker, cfg: GPTConfig, pre: str, x: Value, fused: bool) -> Value:
    hidden, nh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    if fused:
        mixed = linear(b, x, P(pre + "qkv_proj.weight", (hidden, 3 * hidden)),
                       P(pre + "qkv_proj.bias", (3 * hidden,), init=BIAS), "qkv_proj")
        q, k, v = split_fused_qkv(b, mixed, nh, nh, hd, "per_head")
    else:
        q, k, v = (
            split_heads(b, linear(b, x, P(f"{pre}{n}_proj.weight", (hidden, hidden)),
                                  P(f"{pre}{n}_proj.bias", (hidden,), init=BIAS), f"{n}_proj"), nh, hd)
            for n in "qkv"
        )
    out = merge_heads(b, attend(b, q, k, v, rope=None), hidden)
    return linear(b, out, P(pre + "out_proj.weight", (hidden, hidden)),
                  P(pre + "out_proj.bias", (hidden,), init=BIAS), "out_proj")


def build_gpt(cfg: GPTConfig, weights: WeightProvider, *, name: str, dtype: DType,
              prefix: str = "gpt.", fused_qkv: bool | None = None) -> Graph:
    """The graph of a GPT model; params are named `{prefix}embeddings...` as in the checkpoint."""
    fused = cfg.fuse_attention_qkv if fused_qkv is None else fused_qkv
    b = GraphBuilder(name)
    P = ParamMaker(b, weights, dtype)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    ids = b.input("input_ids", tensor(i64, "B", "S"))
    with b.scope(prefix.rstrip(".")):
        with b.scope("embeddings"):
            table = P(prefix + "embeddings.word_embeddings.weight", (cfg.vocab_size, hidden), init=EMBEDDING)
            with b.scope("word_embeddings"):
                h = b.embedding(ids, table)
            positions = b.position_ids(ids, limit=cfg.max_position_embeddings)
            with b.scope("position_embeddings"):
                pe = b.embedding(positions, P(prefix + "embeddings.position_embeddings.weight",
                                              (cfg.max_position_embeddings, hidden), init=EMBEDDING))
            h = b.add(h, pe)
        for i in range(cfg.num_hidden_layers):
            pre = f"{prefix}decoder.layers.{i}."
            with b.scope(f"decoder.layers.{i}"):
                x = _layer_norm(b, P, h, pre + "norm1", hidden)
                with b.scope("self_attn"):
                    attn = _attention(b, P, cfg, pre + "self_attn.", x, fused)
                h = b.add(h, attn)
                x = _layer_norm(b, P, h, pre + "norm2", hidden)
                f = linear(b, x, P(pre + "linear1.weight", (hidden, inter)),
                           P(pre + "linear1.bias", (inter,), init=BIAS), "linear1")
                f = b.gelu(f, approximate="tanh")
                f = linear(b, f, P(pre + "linear2.weight", (inter, hidden)),
                           P(pre + "linear2.bias", (hidden,), init=BIAS), "linear2")
                h = b.add(h, f)
        with b.scope("decoder"):
            h = _layer_norm(b, P, h, prefix + "decoder.norm", hidden)
    with b.scope("lm_head"):
        logits = b.lm_head(h, table, transpose_weight=True)
    b.output(logits, name="logits")
    return b.graph
