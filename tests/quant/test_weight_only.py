"""weight-only-quant: structure, numerics, bad weights, meta graphs, storage and error budgets.

Error budgets (relative Frobenius error of the logits against the float
model, tiny built-ins, 2 x 12 seeded tokens) are asserted here and quoted in
docs/quantization.md; run with `-s` to print them.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _quant_testkit import logits, rel_error, token_ids, top1

from ernie_ir.frontends import load_model
from ernie_ir.ir import DType, GraphBuilder, bf16, f32, tensor
from ernie_ir.ir.storage import load_graph, save_graph
from ernie_ir.ir.verifier import verify
from ernie_ir.ir.weights import ArraySource
from ernie_ir.ops.quant_numerics import NonFiniteWeightError, weight_dequantize, weight_quantize
from ernie_ir.passes import run_pipeline

MOE = "ernie-4.5-21b-a3b@tiny"
GPT = "gpt-345m@tiny"
DENSE = "ernie-4.5-0.3b@tiny"


def test_wint8mix_structure_on_the_moe_model() -> None:
    g = load_model(MOE)
    run_pipeline(g, "wint8mix")
    ops = [n.op for n in g]
    assert "linear" not in ops
    assert ops.count("weight_only_linear") == 12  # qkv, o per layer; dense mlp of layer 0; shared experts
    assert ops.count("dequantize") == 4  # up_gate and down of the two MoE layers
    q = g.params["ernie.layers.1.mlp.experts.up_gate_proj.quant_weight"]
    assert str(q.type) == "i4[16,80,64]" and q.annotations["quant"]["source_dtype"] == "bf16"
    assert str(g.params["ernie.layers.1.mlp.experts.up_gate_proj.weight_scale"].type) == "bf16[16,64]"
    assert str(g.params["ernie.layers.1.mlp.shared_experts.down_proj.quant_weight"].type) == "i8[64,80]"
    assert str(g.params["ernie.layers.1.mlp.shared_experts.down_proj.weight_scale"].type) == "bf16[80]"
    assert "ernie.layers.1.mlp.experts.up_gate_proj.weight" not in g.params
    for kept in ("ernie.embed_tokens.weight", "ernie.layers.1.mlp.gate.weight"):
        assert g.params[kept].type.dtype in (DType.BF16, DType.F32)
    deq = next(n for n in g if n.op == "dequantize")
    assert deq.attrs.dtype == DType.BF16 and deq.output.users[0].op == "moe_experts"
    # the new params sit where the weights they replace were
    names = list(g.params)
    i = names.index("ernie.layers.0.self_attn.qkv_proj.quant_weight")
    assert names[i - 1] == "ernie.layers.0.input_layernorm.weight"
    assert names[i + 1] == "ernie.layers.0.self_attn.qkv_proj.weight_scale"
    verify(g)


def test_quantized_params_hold_paddle_weight_quantize_values() -> None:
    float_g = load_model(MOE)
    g = load_model(MOE)
    run_pipeline(g, "wint8mix")
    for name, bits in (("ernie.layers.0.self_attn.qkv_proj", 8), ("ernie.layers.2.mlp.experts.down_proj", 4)):
        w = float_g.params[f"{name}.weight"].read()
        q, s = weight_quantize(w, bits)
        np.testing.assert_array_equal(g.params[f"{name}.quant_weight"].read().astype(np.int8), q)
        scale = g.params[f"{name}.weight_scale"].read()
        np.testing.assert_array_equal(scale.view(np.uint16), s.view(np.uint16))


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("algo", ["weight_only_int8", "weight_only_int4"])
def test_grouped_quantization_on_a_built_graph(tmp_path: Path, group: int, algo: str) -> None:
    rng = np.random.default_rng(group)
    w = (0.05 * rng.standard_normal((256, 96))).astype(ml_dtypes.bfloat16)
    b = GraphBuilder("g")
    x = b.input("x", tensor(bf16, "B", 256))
    with b.scope("model.layers.0.mlp.down_proj"):
        y = b.linear(x, b.param("model.layers.0.mlp.down_proj.weight", source=ArraySource(w)))
    b.output(y, name="y")
    cfg = tmp_path / "q.yaml"
    cfg.write_text(f"rules: [{{match: '.*down_proj', algo: {algo}, group_size: {group}}}]\n")
    run_pipeline(b.graph, f'quant-annotate{{config="{cfg}"}},weight-only-quant')
    (node,) = list(b.graph)
    assert node.op == "weight_only_linear" and node.attrs.group_size == group
    scale = b.graph.params["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.type.shape == (256 // group, 96)
    bits = 8 if algo.endswith("8") else 4
    q, s = weight_quantize(w, bits, group)
    xs = rng.standard_normal((3, 256)).astype(np.float32)
    from ernie_ir.runtime.interpreter import run_graph

    out = run_graph(b.graph, {"x": xs})["y"]
    np.testing.assert_array_equal(out, xs @ weight_dequantize(q, s, group))


def test_nan_weight_is_an_error_naming_the_param_and_changes_nothing() -> None:
    g = load_model(GPT)
    p = g.params["gpt.decoder.layers.1.linear2.weight"]
    bad = np.array(p.read())
    bad[5, 7] = np.nan
    p.set_data(bad)
    run_pipeline(g, "quant-annotate{preset=wint8}")
    before = [n.op for n in g]
    with pytest.raises(NonFiniteWeightError,
                       match=r"param gpt\.decoder\.layers\.1\.linear2\.weight holds nan at index \[5, 7\]"):
        run_pipeline(g, "weight-only-quant")
    assert [n.op for n in g] == before and "gpt.decoder.layers.1.linear2.weight" in g.params


def test_inf_expert_weight_is_an_error_naming_the_param() -> None:
    g = load_model(MOE)
    p = g.params["ernie.layers.2.mlp.experts.up_gate_proj.weight"]
    bad = np.array(p.read())
    bad[3, 1, 2] = -np.inf
    p.set_data(bad)
    with pytest.raises(NonFiniteWeightError,
                       match=r"experts\.up_gate_proj\.weight holds -inf at index \[3, 1, 2\]"):
        run_pipeline(g, "wint4")


def test_all_zero_channels_give_finite_outputs() -> None:
    g = load_model(DENSE)
    p = g.params["ernie.layers.0.mlp.down_proj.weight"]
    w = np.array(p.read())
    w[:, :7] = 0
    p.set_data(w)
    run_pipeline(g, "wint4")
    s = g.params["ernie.layers.0.mlp.down_proj.weight_scale"].read().astype(np.float32)
    assert (s[:7] == 0).all() and np.isfinite(s).all()
    assert (g.params["ernie.layers.0.mlp.down_proj.quant_weight"].read().astype(np.int8)[:, :7] == 0).all()
    assert np.isfinite(logits(g, token_ids(1024))).all()


def test_meta_graph_gets_typed_params_without_data() -> None:
    g = load_model("ernie-4.5-21b-a3b@meta")
    run_pipeline(g, "wint8mix")
    q = g.params["ernie.layers.5.mlp.experts.up_gate_proj.quant_weight"]
    assert str(q.type) == "i4[64,2560,3072]" and q.source is None
    assert str(g.params["ernie.layers.5.mlp.experts.up_gate_proj.weight_scale"].type) == "bf16[64,3072]"


def test_float32_weights_get_float32_scales() -> None:
    g = load_model(GPT)
    run_pipeline(g, "wint8")
    assert g.params["gpt.decoder.layers.0.linear1.weight_scale"].type.dtype == f32


def test_saved_quantized_graph_reloads_bit_exact(tmp_path: Path) -> None:
    g = load_model(MOE)
    run_pipeline(g, "wint8mix")
    ids = token_ids(1024)
    before = logits(g, ids)
    save_graph(g, tmp_path / "q")
    h = load_graph(tmp_path / "q")
    for name in ("ernie.layers.1.mlp.experts.down_proj.quant_weight",
                 "ernie.layers.0.mlp.up_gate_proj.quant_weight"):
        np.testing.assert_array_equal(h.params[name].read(), g.params[name].read())
    assert h.params["ernie.layers.1.mlp.experts.down_proj.quant_weight"].type.dtype == DType.I4
    np.testing.assert_array_equal(logits(h, ids), before)


# -- error budgets ------------------------------------------------------------------------------------

BUDGETS = {  # preset: upper bound of rel_error on the tiny models (measured values in the docs)
    "wint8": 0.05,
    "wint8mix": 0.10,
    "wint4": 0.40,
}


@pytest.fixture(scope="module")
def budgets() -> dict[str, dict[str, tuple[float, float]]]:
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for model in (MOE, GPT, DENSE):
        ids = token_ids(1024, (2, 12))
        ref = logits(load_model(model), ids)
        out[model] = {}
        for preset in BUDGETS:
            g = load_model(model)
            run_pipeline(g, preset)
            y = logits(g, ids)
            out[model][preset] = (rel_error(y, ref), top1(y, ref))
    for model, rows in out.items():
        print(f"\n[error budget] {model}: " + ", ".join(f"{p} rel {r:.4f} top1 {t:.3f}"
                                                       for p, (r, t) in rows.items()))
    return out


@pytest.mark.parametrize("model", [MOE, GPT, DENSE])
def test_error_budgets_are_ordered_and_bounded(budgets: dict, model: str) -> None:
    rows = budgets[model]
    for preset, bound in BUDGETS.items():
        assert rows[preset][0] < bound, (model, preset, rows[preset])
    assert rows["wint8"][0] < rows["wint4"][0]
    if model == MOE:
        assert rows["wint8"][0] < rows["wint8mix"][0] < rows["wint4"][0]
    else:  # no routed experts: wint8mix is wint8
        assert rows["wint8mix"][0] == rows["wint8"][0]
    assert rows["wint8"][1] >= 0.9
