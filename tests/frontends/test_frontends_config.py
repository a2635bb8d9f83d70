"""config.json parsing: typed per architecture, unknown keys kept, defaults only where libraries agree."""

from __future__ import annotations

import pytest

from ernie_ir.frontends import (
    ConfigError,
    Ernie35SEConfig,
    Ernie45Config,
    Ernie45MoeConfig,
    GPTConfig,
    parse_config,
    supported_architectures,
)
from ernie_ir.frontends.builtins import PUBLISHED

DENSE = {"architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0}
MOE = {**DENSE, "architectures": ["Ernie4_5_MoeForCausalLM"], "moe_num_experts": 8, "moe_k": 2,
       "moe_intermediate_size": 16}


def test_architecture_picks_the_class():
    assert type(parse_config(DENSE)) is Ernie45Config
    assert type(parse_config({**DENSE, "architectures": ["Ernie4_5ForCausalLM"]})) is Ernie45Config
    assert type(parse_config(MOE)) is Ernie45MoeConfig
    assert type(parse_config(PUBLISHED["ernie-3.5-se-3b"])) is Ernie35SEConfig
    assert type(parse_config(PUBLISHED["gpt-345m"])) is GPTConfig
    assert "GPTForCausalLM" in supported_architectures()


def test_unknown_keys_are_kept_and_dumped():
    cfg = parse_config({**DENSE, "paddleformers_version": "1.2.0", "rope_scaling": None})
    assert cfg.to_json()["paddleformers_version"] == "1.2.0"


def test_defaults_where_the_libraries_agree():
    dense = parse_config(DENSE)
    assert (dense.num_key_value_heads, dense.head_dim) == (4, 128)
    assert (dense.tie_word_embeddings, dense.use_bias) == (True, False)
    moe = parse_config(MOE)
    assert moe.head_dim == 16  # hidden / heads for MoE
    assert (moe.moe_num_shared_experts, moe.moe_layer_start_index, moe.moe_layer_interval) == (2, 1, 1)
    assert moe.moe_layer_end_index == 1  # -1 resolved to the last layer
    assert [moe.is_moe_layer(i) for i in range(2)] == [False, True]


def test_moe_placement_rule():
    moe = parse_config({**MOE, "num_hidden_layers": 8, "moe_layer_start_index": 2, "moe_layer_end_index": 6,
                        "moe_layer_interval": 2})
    assert [i for i in range(8) if moe.is_moe_layer(i)] == [3, 5]


def test_rope_theta_from_rope_parameters():
    data = {k: v for k, v in DENSE.items() if k != "rope_theta"}
    cfg = parse_config({**data, "rope_parameters": {"rope_theta": 123.0, "rope_type": "default"}})
    assert cfg.rope_theta == 123.0
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):
        parse_config({**data, "rope_parameters": {"rope_theta": 1.0, "rope_type": "yarn"}})


@pytest.mark.parametrize("data, message", [
    ({k: v for k, v in DENSE.items() if k != "rope_theta"}, "missing required key 'rope_theta'"),
    ({k: v for k, v in MOE.items() if k != "moe_k"}, "missing required key 'moe_k'"),
    ({**DENSE, "num_attention_heads": 0}, "key 'num_attention_heads'"),
    ({**DENSE, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({**MOE, "moe_k": 9}, "moe_k 9 exceeds moe_num_experts 8"),
    ({**MOE, "use_bias": True}, "use_bias: true is not supported for the MoE model"),
    ({**MOE, "moe_num_experts": [64, 64]}, "key 'moe_num_experts'"),
    ({**PUBLISHED["gpt-345m"], "normalize_before": False}, "post-LayerNorm"),
    ({**PUBLISHED["gpt-345m"], "hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({**PUBLISHED["ernie-3.5-se-3b"], "num_hidden_layers": 1}, "parallel_attn_hatf needs at least 2 layers"),
    ({**DENSE, "architectures": []}, "architecture an empty list is not supported"),
])
def test_bad_configs(data, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_config(data, "cfg.json")
    assert str(e.value).startswith("cfg.json")
    assert "\n" not in str(e.value)


def test_gpt_reads_hidden_act_as_an_alias():
    data = {k: v for k, v in PUBLISHED["gpt-345m"].items() if k != "hidden_activation"}
    assert parse_config({**data, "hidden_act": "gelu_new"}).hidden_activation == "gelu_new"
