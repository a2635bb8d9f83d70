"""ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`) as a graph.

The dense model of `ernie4_5.py`, with the feed-forward block of layer i an
MoE block when `(i+1) % moe_layer_interval == 0` and
`moe_layer_start_index <= i <= moe_layer_end_index`:

    w, e = moe_gate(x, gate [H, E] (f32), e_score_correction_bias [1, E], top_k = moe_k)
           p = softmax(x @ gate); experts e = top-k of p + bias; w = p[e] / max(sum p[e], moe_norm_min)
    y    = moe_experts(x, w, e, experts.up_gate_proj [E, H, 2Ie], experts.down_proj [E, Ie, H])
           = sum_j w_j * SwiGLU_{e_j}(x)
    y   += SwiGLU_shared(x)     (shared_experts, Is = Ie * moe_num_shared_experts; absent when 0)

Experts stay grouped: one `moe_experts` node per layer over stacked
weights, so a 300B graph grows with its layers, not its experts.

Multi-token-prediction weights (`ernie.mtp_block.*`, `ernie.mtp_emb_norm.*`,
`ernie.mtp_hidden_norm.*`, `ernie.mtp_linear_proj.*`) are not part of the
graph: it computes next-token logits only, as transformers does. They are
listed under `ignored_weights` in the graph metadata and can be read from
the checkpoint by name (`open_checkpoint(folder).source(key)`).
"""

from __future__ import annotations

from ernie_ir.ir import DType, Graph, GraphBuilder, Value, f32

from .blocks import swiglu
from .config import Ernie45Config, Ernie45MoeConfig
from .ernie4_5 import build_ernie45, dense_mlp
from .params import LINEAR, SMALL, ParamMaker, WeightProvider


def moe_mlp(b: GraphBuilder, P: ParamMaker, cfg: Ernie45Config, i: int, pre: str, x: Value) -> Value:
    """The feed-forward block of layer i: MoE where the placement rule says so, else dense."""
    assert isinstance(cfg, Ernie45MoeConfig)
    if not cfg.is_moe_layer(i):
        return dense_mlp(b, P, cfg, i, pre, x)
    hidden, experts, inter = cfg.hidden_size, cfg.moe_num_experts, cfg.moe_intermediate_size
    bias_name = pre + "moe_statics.e_score_correction_bias"
    use_bias = cfg.moe_use_aux_free is True or (
        cfg.moe_use_aux_free is None and P.provider.available(bias_name)
    )
    with b.scope("gate"):
        router = P(pre + "gate.weight", (hidden, experts), dtype=f32, init=LINEAR)
        bias = P(bias_name, (1, experts), dtype=f32, init=SMALL) if use_bias else None
        weights, indices = b.moe_gate(x, router, bias, top_k=cfg.moe_k, normalize=True,
                                      norm_min=cfg.moe_norm_min)
    with b.scope("experts"):
        y = b.moe_experts(
            x, weights, indices,
            P(pre + "experts.up_gate_proj.weight", (experts, hidden, 2 * inter)),
            P(pre + "experts.down_proj.weight", (experts, inter, hidden)),
        )
    shared = cfg.moe_num_shared_experts
    if shared:
        width = inter * shared
        with b.scope("shared_experts"):
            s = swiglu(
                b, x,
                P(pre + "shared_experts.up_gate_proj.weight", (hidden, 2 * width)),
                None,
                P(pre + "shared_experts.down_proj.weight", (width, hidden)),
                None,
                width,
            )
        y = b.add(y, s)
    return y


def build_ernie45_moe(cfg: Ernie45MoeConfig, weights: WeightProvider, *, name: str, dtype: DType) -> Graph:
    return build_ernie45(cfg, weights, name=name, dtype=dtype, mlp=moe_mlp)
