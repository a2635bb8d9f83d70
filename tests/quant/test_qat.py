"""qat-insert: PaddleSlim's QuantizedLinear as fake-quant nodes (kernels: test_quant_paddle_crosscheck)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from _quant_testkit import logits, rel_error, token_ids

from ernie_ir.frontends import load_model
from ernie_ir.ir import GraphBuilder, f32, tensor
from ernie_ir.ir.verifier import verify
from ernie_ir.ir.weights import ArraySource
from ernie_ir.ops.quant_numerics import abs_max, fake_quant_dequant, moving_average_state
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime.interpreter import run_graph

GPT = "gpt-345m@tiny"
MOE = "ernie-4.5-21b-a3b@tiny"


def test_qat_int8_on_gpt_wraps_every_linear_like_quantized_linear() -> None:
    g = load_model(GPT)
    run_pipeline(g, "qat-int8")
    verify(g)
    linears = [n for n in g if n.op == "linear"]
    assert len(linears) == 8
    for n in linears:
        x, w = n.inputs[0], n.inputs[1]
        assert w.producer.op == "fake_quant" and w.producer.attrs.axes == ()  # type: ignore[union-attr]
        assert w.producer.attrs.bits == 8 and w.producer.attrs.round_type == 1  # type: ignore[union-attr]
        mavg = x.producer  # type: ignore[union-attr]
        assert mavg.op == "fake_quant_moving_average" and mavg.attrs.is_test is False  # type: ignore[union-attr]
        assert mavg.inputs[0].producer.op == "pact"  # type: ignore[union-attr]
    m = "gpt.decoder.layers.1.linear2.activation_quant"
    for k, v in (("scale", 0.001), ("accum", 1.0), ("state", 1.0)):
        p = g.params[f"{m}.{k}"]
        assert str(p.type) == "f32[1]" and p.read()[0] == np.float32(v) and not p.trainable
        assert p.annotations == {"qat_state": k}
    alpha = g.params[f"{m}.pact_alpha"]
    assert alpha.read()[0] == 20.0 and alpha.trainable and alpha.annotations == {"learning_rate": 1000.0}
    # full-parameter QAT with frozen embeddings (PaddleFleetX's freeze_embedding)
    assert not g.params["gpt.embeddings.word_embeddings.weight"].trainable
    assert g.params["gpt.decoder.layers.0.linear1.weight"].trainable
    assert g.params["gpt.decoder.norm.bias"].trainable


def test_qat_linear_computes_pact_then_moving_average_then_weight_fake_quant() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    b = GraphBuilder("q")
    x = b.input("x", tensor(f32, "B", 16))
    with b.scope("layers.0.linear1"):
        y = b.linear(x, b.param("layers.0.linear1.weight", source=ArraySource(w)),
                     b.param("layers.0.linear1.bias", source=ArraySource(bias)))
    b.output(y, name="y")
    run_pipeline(b.graph, "qat-int8")
    xs = (30 * rng.standard_normal((4, 16))).astype(np.float32)
    got = run_graph(b.graph, {"x": xs})["y"]
    clipped = np.clip(xs, -20, 20)  # PACT with alpha 20
    s, _, _ = moving_average_state(abs_max(clipped), np.float32(1), np.float32(1), 0.9)
    xq = fake_quant_dequant(clipped, s, 8, 1)
    wq = fake_quant_dequant(w, abs_max(w), 8, 1)
    np.testing.assert_array_equal(got, xq @ wq + bias)


def test_channel_wise_weights_and_skip_map_from_a_paddleslim_config(tmp_path: Path) -> None:
    f = tmp_path / "qat.yaml"
    f.write_text("Quantization:\n  weight_quantize_type: channel_wise_abs_max\n"
                 "  activation_quantize_type: moving_average_abs_max\n  activation_preprocess_type: None\n"
                 "  skip_tensor_map: {block_0: [linear2]}\n")
    g = load_model(GPT)
    run_pipeline(g, f'quant-annotate{{config="{f}"}},qat-insert{{is_test=true}}')
    by_scope = {n.scope: n for n in g if n.op == "linear"}
    skipped = by_scope["gpt.decoder.layers.0.linear2"]
    assert skipped.inputs[1].name == "gpt.decoder.layers.0.linear2.weight"  # untouched
    n = by_scope["gpt.decoder.layers.1.linear2"]
    assert n.inputs[1].producer.attrs.axes == (1,)  # type: ignore[union-attr]
    assert n.inputs[0].producer.op == "fake_quant_moving_average"  # type: ignore[union-attr]
    assert n.inputs[0].producer.attrs.is_test  # type: ignore[union-attr]
    assert not any(node.op == "pact" for node in g)


def test_experts_get_per_expert_weight_fake_quant() -> None:
    g = load_model(MOE)
    run_pipeline(g, "qat-int8")
    moe = next(n for n in g if n.op == "moe_experts")
    for idx in (3, 4):
        fq = moe.inputs[idx].producer  # type: ignore[union-attr]
        assert fq.op == "fake_quant" and fq.attrs.axes == (0,)  # type: ignore[union-attr]
    assert moe.inputs[0].producer.op == "rms_norm"  # type: ignore[union-attr]  (no activation quant)
    err = rel_error(logits(g, token_ids(1024)), logits(load_model(MOE), token_ids(1024)))
    assert err < 0.5  # first step: the moving average starts from Paddle's state (scale 0.001, 1, 1)
