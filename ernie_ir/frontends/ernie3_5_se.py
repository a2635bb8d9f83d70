"""ERNIE-3.5-SE (PaddleNLP `llm/ernie-3.5-se`, `Ernie35ForCausalLM`) as a graph.

A parallel transformer: attention and FFN read the same LayerNorm output and
share one input and one output projection.

    h = embed_tokens[ids]
    parallel layer i (scope ernie.layers.{i}):
        x = layer_norm(h, input_layernorm, eps)
        m = x @ self_attn_mlp.qkv_gate_up_proj + b          [H, 3H + 2I]
        qkv, x1, x2 = split(m, [3H, I, I])                  qkv per head: [q_h k_h v_h]
        a = attention(rope(q), rope(k), v, causal)          [B, S, H]
        f = silu(x1) * x2                                   [B, S, I]
        h = h + concat([f, a]) @ self_attn_mlp.o_proj + b   [I + H, H], FFN rows first
    with parallel_attn_hatf ("head attention, tail FFN"):
        layer 0: h = h + o_proj(attention(layer_norm(h, input_layernorm)))   (separate q/k/v/o_proj)
        last:    h = h + down(silu(gate(x)) * up(x)), x = layer_norm(h, post_attention_layernorm)
    logits = layer_norm(h, norm) @ lm_head [H, V] (+ lm_head.bias [V] with use_bias and
             weight_share_add_bias; tied: @ embed_tokens^T)

RoPE rotates half-split pairs (x[i], x[i + D/2]) with base 10000 (the
model's `rotate_half`). With `enable_random_position_ids` (true in the
published 3B config), the reference evaluates at positions 8(s+1)-1 for
sequences up to 4096 tokens; the graph does the same (`position_ids`
stride 8, offset 7) and refuses longer sequences, where the reference
switches to another stride.
"""

from __future__ import annotations

from ernie_ir.ir import DType, Graph, GraphBuilder, Value, i64, tensor

from .blocks import RopeSpec, attend, linear, merge_heads, split_fused_qkv, split_heads
from .config import Ernie35SEConfig
from .params import BIAS, EMBEDDING, NORM, ParamMaker, WeightProvider


class _SE:
    def __init__(self, b: GraphBuilder, P: ParamMaker, cfg: Ernie35SEConfig, positions: Value) -> None:
        self.b, self.P, self.cfg, self.positions = b, P, cfg, positions
        self.rope = RopeSpec(cfg.rope_theta, "half")

    def lin(self, x: Value, name: str, n_in: int, n_out: int, module: str) -> Value:
        P = self.P
        bias = P(f"{name}.bias", (n_out,), init=BIAS) if self.cfg.use_bias else None
        return linear(self.b, x, P(f"{name}.weight", (n_in, n_out)), bias, module)

    def norm(self, x: Value, name: str) -> Value:
        hidden = self.cfg.hidden_size
        with self.b.scope(name.rsplit(".", 1)[-1]):
            weight = self.P(f"{name}.weight", (hidden,), init=NORM)
            bias = self.P(f"{name}.bias", (hidden,), init=BIAS)
            return self.b.layer_norm(x, weight, bias, eps=self.cfg.layer_norm_eps)

    def attention_layer(self, pre: str, h: Value) -> Value:
        b, cfg = self.b, self.cfg
        hidden, nh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        x = self.norm(h, pre + "input_layernorm")
        with b.scope("self_attn"):
            q, k, v = (
                split_heads(b, self.lin(x, f"{pre}self_attn.{n}_proj", hidden, hidden, f"{n}_proj"), nh, hd)
                for n in "qkv"
            )
            a = merge_heads(b, attend(b, q, k, v, rope=self.rope, positions=self.positions), hidden)
            out = self.lin(a, pre + "self_attn.o_proj", hidden, hidden, "o_proj")
        return b.add(h, out)

    def ffn_layer(self, pre: str, h: Value) -> Value:
        b, cfg = self.b, self.cfg
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        x = self.norm(h, pre + "post_attention_layernorm")
        with b.scope("mlp"):
            gate = self.lin(x, pre + "mlp.gate_proj", hidden, inter, "gate_proj")
            up = self.lin(x, pre + "mlp.up_proj", hidden, inter, "up_proj")
            out = self.lin(b.mul(b.silu(gate), up), pre + "mlp.down_proj", inter, hidden, "down_proj")
        return b.add(h, out)

    def parallel_layer(self, pre: str, h: Value) -> Value:
        b, cfg = self.b, self.cfg
        hidden, inter, nh, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.head_dim
        x = self.norm(h, pre + "input_layernorm")
        with b.scope("self_attn_mlp"):
            m = self.lin(x, pre + "self_attn_mlp.qkv_gate_up_proj", hidden, 3 * hidden + 2 * inter,
                         "qkv_gate_up_proj")
            qkv, x1, x2 = b.split(m, axis=-1, sizes=(3 * hidden, inter, inter))
            q, k, v = split_fused_qkv(b, qkv, nh, nh, hd, "per_head")
            a = merge_heads(b, attend(b, q, k, v, rope=self.rope, positions=self.positions), hidden)
            f = b.mul(b.silu(x1), x2)
            out = self.lin(b.concat(f, a, axis=-1), pre + "self_attn_mlp.o_proj", inter + hidden, hidden,
                           "o_proj")
        return b.add(h, out)


def build_ernie35_se(cfg: Ernie35SEConfig, weights: WeightProvider, *, name: str, dtype: DType) -> Graph:
    b = GraphBuilder(name)
    P = ParamMaker(b, weights, dtype)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    ids = b.input("input_ids", tensor(i64, "B", "S"))
    with b.scope("ernie"):
        table = P("ernie.embed_tokens.weight", (vocab, hidden), init=EMBEDDING)
        with b.scope("embed_tokens"):
            h = b.embedding(ids, table)
        stride, offset = (8, 7) if cfg.enable_random_position_ids else (1, 0)
        positions = b.position_ids(ids, stride=stride, offset=offset, limit=cfg.max_position_embeddings)
        se = _SE(b, P, cfg, positions)
        for i in range(cfg.num_hidden_layers):
            pre = f"ernie.layers.{i}."
            with b.scope(f"layers.{i}"):
                kind = cfg.layer_kind(i)
                if kind == "attention":
                    h = se.attention_layer(pre, h)
                elif kind == "ffn":
                    h = se.ffn_layer(pre, h)
                else:
                    h = se.parallel_layer(pre, h)
        h = se.norm(h, "ernie.norm")
    with b.scope("lm_head"):
        if cfg.tie_word_embeddings:
            logits = b.lm_head(h, table, transpose_weight=True)
        else:
            logits = b.lm_head(h, P("lm_head.weight", (hidden, vocab)))
        if cfg.lm_head_bias:
            logits = b.add(logits, P("lm_head.bias", (vocab,), init=BIAS))
    b.output(logits, name="logits")
    return b.graph
