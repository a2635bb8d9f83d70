"""Built-in models: the published configs, and their `@tiny` shrinkings.

`NAME@meta` (or the bare `NAME`) builds the full-size graph with params that
have no data; `NAME@tiny` builds the same structure with small dimensions
and deterministic random weights (`GeneratedSource`, seeded by param name).

What `@tiny` keeps: the layer pattern (which layers are MoE, attention-only
or FFN-only), the GQA ratio, head_dim != hidden/heads where the original has
it, the expert structure (top-k, shared experts, router f32 and correction
bias), tying, biases, the RoPE style and base, eps values, and the dtypes.
What it shrinks: hidden and FFN sizes, heads, experts (to 16), layers (to
the fewest that keep the layer pattern) and the vocabulary (to 1024).

`NAME@small` (ERNIE 4.5 0.3B and 21B-A3B: SMALL) is a `@tiny` widened until
every linear packs where the deployment formats need it: hidden and expert
intermediate sizes multiples of 128 (WINT2's 4-row codes with 64-row scales),
each tensor-parallel rank's in-features at tp 2 multiples of 64 (sm80
weight-only kernels, FastDeploy's folders) and its expert intermediate size a
multiple of 128 (W4A8's Hadamard blocks).

Sources of the published configs: REFERENCE.md 1.1 (ERNIE 4.5; the MoE
values come from third-party fixtures, and `tie_word_embeddings` of 300B is
unresolved: we follow the fixtures, true), PaddleNLP
`llm/ernie-3.5-se/configuration.py` (`baidu/ernie-3.5-se-3b`), REFERENCE 2
(GPT-345M; fused qkv as in PaddleFleetX's 345M model).
"""

from __future__ import annotations

from typing import Any

PUBLISHED: dict[str, dict[str, Any]] = {
    "ernie-4.5-0.3b": {
        "architectures": ["Ernie4_5_ForCausalLM"],
        "model_type": "ernie4_5",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 18,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 103424,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    "ernie-4.5-21b-a3b": {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": "ernie4_5_moe",
        "hidden_size": 2560,
        "intermediate_size": 12288,
        "num_hidden_layers": 28,
        "num_attention_heads": 20,
        "num_key_value_heads": 4,
        "vocab_size": 103424,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_bias": False,
        "moe_num_experts": 64,
        "moe_k": 6,
        "moe_intermediate_size": 1536,
        "moe_num_shared_experts": 2,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 27,
        "moe_layer_interval": 1,
        "moe_gate": "topk",
        "moe_use_aux_free": True,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    "ernie-4.5-300b-a47b": {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": "ernie4_5_moe",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 54,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 103424,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "use_bias": False,
        "moe_num_experts": 64,
        "moe_k": 8,
        "moe_intermediate_size": 3584,
        "moe_num_shared_experts": 0,
        "moe_layer_start_index": 3,
        "moe_layer_end_index": 53,
        "moe_layer_interval": 1,
        "moe_gate": "topk",
        "moe_use_aux_free": True,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    "ernie-3.5-se-3b": {
        "architectures": ["Ernie35ForCausalLM"],
        "model_type": "ernie",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "layer_norm_eps": 1e-06,
        "use_bias": True,
        "parallel_attn_hatf": True,
        "enable_random_position_ids": True,
        "tie_word_embeddings": False,
        "weight_share_add_bias": True,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    "gpt-345m": {
        "architectures": ["GPTForCausalLM"],
        "model_type": "gpt",
        "vocab_size": 50304,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
        "max_position_embeddings": 1024,
        "hidden_activation": "gelu",
        "normalize_before": True,
        "fuse_attention_qkv": True,
        "layer_norm_eps": 1e-05,
        "torch_dtype": "float32",
    },
}

TINY: dict[str, dict[str, Any]] = {
    # 16 q heads : 2 kv heads, head_dim 128 != 1024/16  ->  8 : 1, head_dim 16 != 64/8
    "ernie-4.5-0.3b": {
        "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 1024,
    },
    # 20 : 4 heads, layer 0 dense then MoE, 64 experts top-6 + 2 shared
    #   ->  10 : 2 (head_dim 8; tp 2 cuts whole heads and KV heads), 16 experts top-6 + 2 shared
    "ernie-4.5-21b-a3b": {
        "hidden_size": 80, "intermediate_size": 192, "num_hidden_layers": 3,
        "num_attention_heads": 10, "num_key_value_heads": 2, "vocab_size": 1024,
        "moe_num_experts": 16, "moe_intermediate_size": 32, "moe_layer_end_index": 2,
    },
    # 64 : 8 heads, layers 0-2 dense then MoE, 64 experts top-8, no shared  ->  8 : 1, 16 experts top-8
    "ernie-4.5-300b-a47b": {
        "hidden_size": 64, "intermediate_size": 224, "num_hidden_layers": 5,
        "num_attention_heads": 8, "num_key_value_heads": 1, "vocab_size": 1024,
        "moe_num_experts": 16, "moe_intermediate_size": 32, "moe_layer_end_index": 4,
    },
    # attention head layer, parallel layers, FFN tail layer
    "ernie-3.5-se-3b": {
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 1024,
    },
    "gpt-345m": {
        "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "max_position_embeddings": 128,
    },
}

# widths WINT2, W4A8 and FastDeploy (tp 1 and 2, sm80) accept; layer pattern and heads as @tiny
SMALL: dict[str, dict[str, Any]] = {
    # 8 : 1 heads, head_dim 16 as @tiny; hidden 128, FFN 256 (128 per rank at tp 2)
    "ernie-4.5-0.3b": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 1024,
    },
    # 10 : 2 heads of @tiny  ->  8 : 2, head_dim 16 (q 128: 64 per rank at tp 2); FFN 256 and expert
    # intermediate 256 (128 per rank at tp 2); 16 experts top-6 + 2 shared as @tiny
    "ernie-4.5-21b-a3b": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024,
        "moe_num_experts": 16, "moe_intermediate_size": 256, "moe_layer_end_index": 2,
    },
}

VARIANTS = ("meta", "tiny", "small")
GENERATED_VARIANTS = ("tiny", "small")  # variants with deterministic random weights
TINY_SEED = 0


def builtin_models() -> list[str]:
    """The built-in model names (each also as NAME@tiny and NAME@meta; those in SMALL as NAME@small)."""
    return list(PUBLISHED)


def builtin_config(name: str, variant: str) -> dict[str, Any]:
    """The config.json dict of a built-in model: published, or shrunk for `tiny` / `small`."""
    config = dict(PUBLISHED[name])
    if variant == "tiny":
        config.update(TINY[name])
    elif variant == "small":
        config.update(SMALL[name])
    return config
