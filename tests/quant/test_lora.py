"""lora / lora-merge: exact identity at init, initialisation, trainability, targets, merge, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _quant_testkit import logits, rel_error, token_ids

from ernie_ir.frontends import load_model
from ernie_ir.ir import DType, Graph
from ernie_ir.ir.verifier import verify
from ernie_ir.passes import PipelineError, run_pipeline
from ernie_ir.passes.lora.insert import LoraError

MOE = "ernie-4.5-21b-a3b@tiny"
GPT = "gpt-345m@tiny"
DENSE = "ernie-4.5-0.3b@tiny"
IDS = token_ids(1024, (2, 10), seed=5)


@pytest.mark.parametrize(("model", "pipeline"), [
    (MOE, "lora{rank=4}"),
    (DENSE, "lora{rank=8,alpha=32}"),
    (GPT, 'lora{rank=4,targets=[".*"]}'),
    (MOE, 'lora{rank=2,targets=[".*"],rslora=true,dropout=0.1}'),
])
def test_output_at_init_equals_the_base_model_exactly(model: str, pipeline: str) -> None:
    base = logits(load_model(model), IDS)
    g = load_model(model)
    run_pipeline(g, pipeline)
    assert any(n.op in ("lora", "moe_experts_lora") for n in g)
    np.testing.assert_array_equal(logits(g, IDS), base)


def test_wint8mix_lora_at_init_equals_wint8mix_exactly() -> None:
    q = load_model(MOE)
    run_pipeline(q, "wint8mix")
    g = load_model(MOE)
    run_pipeline(g, "wint8mix,lora{rank=4}")
    ops = [n.op for n in g]
    assert ops.count("lora") == 12 and ops.count("moe_experts_lora") == 2 and ops.count("dequantize") == 4
    lora_on = {n.inputs[0].producer.op for n in g if n.op == "lora"}  # type: ignore[union-attr]
    assert lora_on == {"weight_only_linear"}
    np.testing.assert_array_equal(logits(g, IDS), logits(q, IDS))


def test_adapters_kaiming_uniform_a_zero_b_trainable_base_frozen() -> None:
    g = load_model(MOE)
    run_pipeline(g, "lora{rank=4,seed=7}")
    a = g.params["ernie.layers.0.self_attn.qkv_proj.lora_A"]
    b = g.params["ernie.layers.0.self_attn.qkv_proj.lora_B"]
    assert str(a.type) == "f32[80,4]" and str(b.type) == "f32[4,112]"
    av = a.read()
    bound = 1 / math.sqrt(80)
    assert np.abs(av).max() <= bound and np.abs(av).max() > 0.8 * bound and av.std() > 0.4 * bound
    assert not b.read().any()
    ea = g.params["ernie.layers.1.mlp.experts.down_proj.lora_A"]
    assert str(ea.type) == "f32[16,32,4]" and np.abs(ea.read()).max() <= 1 / math.sqrt(32)
    assert str(g.params["ernie.layers.1.mlp.experts.down_proj.lora_B"].type) == "f32[16,4,80]"
    trainable = {n for n, p in g.params.items() if p.trainable}
    assert trainable == {n for n in g.params if n.endswith((".lora_A", ".lora_B"))}
    # deterministic per seed and param name
    h = load_model(MOE)
    run_pipeline(h, "lora{rank=4,seed=7}")
    np.testing.assert_array_equal(h.params[a.name].read(), av)
    k = load_model(MOE)
    run_pipeline(k, "lora{rank=4,seed=8}")
    assert not np.array_equal(k.params[a.name].read(), av)


def test_scale_alpha_default_rslora_and_dropout_attrs() -> None:
    def attrs(pipeline: str) -> tuple[float, float]:
        g = load_model(DENSE)
        run_pipeline(g, pipeline)
        node = next(n for n in g if n.op == "lora")
        return node.attrs.scale, node.attrs.dropout  # type: ignore[attr-defined]

    assert attrs("lora{rank=8}") == (2.0, 0.0)  # alpha = 2r
    assert attrs("lora{rank=8,alpha=4}") == (0.5, 0.0)
    assert attrs("lora{rank=16,alpha=32,rslora=true,dropout=0.05}") == (8.0, 0.05)


def test_rank_is_required() -> None:
    with pytest.raises(PipelineError, match="rank"):
        run_pipeline(load_model(DENSE), "lora")


def test_targets_that_match_nothing() -> None:
    with pytest.raises(LoraError, match=r"LoRA targets \['\.\*nothing\.\*'\] match no linear of the model "
                                        r"\(linears are named like gpt\.decoder\.layers\.0\.self_attn"):
        run_pipeline(load_model(GPT), 'lora{rank=4,targets=[".*nothing.*"]}')
    g = load_model(GPT)
    erniekit = '[".*qkv_proj.*", ".*o_proj.*", ".*up_gate_proj.*", ".*down_proj.*"]'
    result = run_pipeline(g, f"lora{{rank=4,targets={erniekit}}}")  # only qkv_proj exists in GPT
    assert sum(n.op == "lora" for n in g) == 2
    assert "lora: LoRA target '.*o_proj.*' matched no linear" in result.warnings


def test_default_targets_follow_the_architecture() -> None:
    g = load_model(GPT)
    result = run_pipeline(g, "lora{rank=4}")  # GPT's qkv, out_proj, linear1, linear2 per layer
    assert sum(n.op == "lora" for n in g) == 8 and not result.warnings
    dense = load_model(DENSE)
    run_pipeline(dense, "lora{rank=4}")  # ERNIEKit's four per layer
    layers = dense.metadata["config"]["num_hidden_layers"]
    assert sum(n.op == "lora" for n in dense) == 4 * layers


def test_a_second_adapter_on_the_same_layer_is_refused() -> None:
    g = load_model(DENSE)
    run_pipeline(g, "lora{rank=4}")
    with pytest.raises(LoraError, match="already has a LoRA adapter"):
        run_pipeline(g, "lora{rank=4}")


# -- merge --------------------------------------------------------------------------------------------


def _train_adapters(g: Graph, seed: int = 0) -> None:
    """Give every lora_B non-zero values (as training would) so the adapter changes the logits."""
    rng = np.random.default_rng(seed)
    for name, p in g.params.items():
        if name.endswith(".lora_B"):
            p.set_data((0.05 * rng.standard_normal(p.type.shape)).astype(p.type.dtype.numpy))


def test_merge_folds_w_plus_scale_a_b_and_keeps_the_logits_f32_model() -> None:
    g = load_model(GPT)
    run_pipeline(g, 'lora{rank=4,targets=[".*"],alpha=6}')
    _train_adapters(g)
    before = logits(g, IDS)
    name = "gpt.decoder.layers.0.linear1"
    w, a, b = (np.array(g.params[f"{name}.{k}"].read()) for k in ("weight", "lora_A", "lora_B"))
    run_pipeline(g, "lora-merge")
    verify(g)
    assert not any(n.op == "lora" for n in g) and not any(k.endswith(".lora_A") for k in g.params)
    np.testing.assert_array_equal(g.params[f"{name}.weight"].read(), w + (a @ b) * np.float32(1.5))
    assert rel_error(logits(g, IDS), before) < 1e-5
    assert "lora" not in g.metadata.get("properties", [])


def test_merge_on_bf16_moe_model_including_experts() -> None:
    g = load_model(MOE)
    run_pipeline(g, "lora{rank=4}")
    _train_adapters(g)
    before = logits(g, IDS)
    e = "ernie.layers.2.mlp.experts.up_gate_proj"
    w, a, b = (np.array(g.params[f"{e}.{k}"].read()) for k in ("weight", "lora_A", "lora_B"))
    run_pipeline(g, "lora-merge")
    assert not any(n.op == "moe_experts_lora" for n in g) and sum(n.op == "moe_experts" for n in g) == 2
    expect = (w.astype(np.float32) + np.matmul(a, b) * np.float32(2.0)).astype(w.dtype)
    np.testing.assert_array_equal(g.params[f"{e}.weight"].read(), expect)
    assert rel_error(logits(g, IDS), before) < 2e-2  # the merged weights are rounded to bf16


def test_merge_refuses_quantized_bases_unless_asked_to_dequantize() -> None:
    g = load_model(MOE)
    run_pipeline(g, "wint8mix,lora{rank=4}")
    _train_adapters(g)
    before = logits(g, IDS)
    with pytest.raises(LoraError, match=r"lora-merge: ernie\.layers\.0\.self_attn\.qkv_proj has a quantized "
                                        r"base \(weight_only_linear\); merging would re-quantize .* "
                                        r"lora-merge\{dequantize=true\}"):
        run_pipeline(g, "lora-merge")
    run_pipeline(g, "lora-merge{dequantize=true}")
    ops = {n.op for n in g}
    assert ops.isdisjoint({"lora", "moe_experts_lora", "weight_only_linear", "dequantize"})
    w = g.params["ernie.layers.1.mlp.experts.up_gate_proj.weight"]
    assert w.type.dtype == DType.BF16 and not any(k.endswith("quant_weight") for k in g.params)
    assert rel_error(logits(g, IDS), before) < 2e-2
