"""fp8-quant: tensor-wise e4m3, static W8A8 inference form with calibration, and the fake (QAT) form."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _quant_testkit import logits, rel_error, token_ids

from ernie_ir.frontends import load_model
from ernie_ir.ir import DType, ErnieIRError, GraphBuilder, f32, tensor
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.weights import ArraySource
from ernie_ir.ops.quant_numerics import NonFiniteWeightError, fp8_fake_quant, fp8_quantize
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime.interpreter import Interpreter, run_graph

GPT = "gpt-345m@tiny"
MOE = "ernie-4.5-21b-a3b@tiny"


def test_fp8_inference_form_on_gpt() -> None:
    ref_graph = load_model(GPT)
    g = load_model(GPT)
    run_pipeline(g, "fp8", evaluator=Interpreter)
    nodes = [n for n in g if n.op == "fp8_linear"]
    assert len(nodes) == 8 and not any(n.op == "linear" for n in g)
    m = "gpt.decoder.layers.0.linear1"
    q, ws, xs = (g.params[f"{m}.{k}"] for k in ("quant_weight", "weight_scale", "input_scale"))
    assert str(q.type) == "f8e4m3[64,256]" and str(ws.type) == "f32[]" and str(xs.type) == "f32[]"
    w = ref_graph.params[f"{m}.weight"].read()
    assert ws.read() == np.float32(np.abs(w).max()) / np.float32(448)
    np.testing.assert_array_equal(q.read().view(np.uint8), fp8_quantize(w, ws.read()).view(np.uint8))
    assert 0 < float(xs.read()) < np.inf
    err = rel_error(logits(g, token_ids(1024)), logits(ref_graph, token_ids(1024)))
    print(f"\n[error budget] {GPT}: fp8 rel {err:.4f}")
    assert err < 0.15


def test_fp8_linear_kernel_is_static_w8a8() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    b = GraphBuilder("f")
    x = b.input("x", tensor(f32, "B", 16))
    with b.scope("proj"):
        y = b.linear(x, b.param("proj.weight", source=ArraySource(w)))
    b.output(y, name="y")
    run_pipeline(b.graph, "quant-annotate{preset=fp8},fp8-quant")  # no token input: cannot calibrate
    (node,) = list(b.graph)
    assert node.op == "fp8_linear" and b.graph.params["proj.input_scale"].source is None
    b.graph.params["proj.input_scale"].set_data(np.array(0.05, np.float32))
    xs = rng.standard_normal((3, 16)).astype(np.float32)
    got = run_graph(b.graph, {"x": xs})["y"]
    s = np.float32(np.abs(w).max() / np.float32(448))
    expect = fp8_fake_quant(xs, np.float32(0.05)) @ (fp8_quantize(w, s).astype(np.float32) * s)
    np.testing.assert_array_equal(got, expect)


def test_calibration_is_deterministic_and_can_read_token_ids(tmp_path: Path) -> None:
    def scales(pipeline: str) -> np.ndarray:
        g = load_model(GPT)
        run_pipeline(g, pipeline, evaluator=Interpreter)
        return np.array([float(p.read()) for n, p in g.params.items() if n.endswith("input_scale")])

    a = scales("fp8")
    np.testing.assert_array_equal(a, scales("fp8"))
    ids = tmp_path / "ids.npy"
    np.save(ids, token_ids(1024, (2, 16), seed=9))
    b = scales(f'quant-annotate{{preset=fp8}},fp8-quant{{calibration_file="{ids}"}}')
    assert b.shape == a.shape and not np.array_equal(a, b)


def test_fp8_on_moe_experts_uses_per_expert_scales() -> None:
    g = load_model(MOE)
    run_pipeline(g, "fp8", evaluator=Interpreter)
    deq = [n for n in g if n.op == "dequantize"]
    assert len(deq) == 4
    q, s = deq[0].inputs
    assert q.type.dtype == DType.F8E4M3 and str(s.type) == "f32[16]"  # type: ignore[union-attr]
    err = rel_error(logits(g, token_ids(1024)), logits(load_model(MOE), token_ids(1024)))
    print(f"\n[error budget] {MOE}: fp8 rel {err:.4f}")
    assert err < 0.2


def test_fake_form_for_fp8_qat() -> None:
    g = load_model(GPT)
    run_pipeline(g, "quant-annotate{preset=fp8},fp8-quant{form=fake}")
    n = next(n for n in g if n.op == "linear")
    assert n.inputs[0].producer.op == "fake_quant_fp8"  # type: ignore[union-attr]
    assert n.inputs[1].producer.op == "fake_quant_fp8"  # type: ignore[union-attr]
    x = np.array([[1.0, -2.0, 0.3]], np.float32)
    b = GraphBuilder("f")
    v = b.input("x", tensor(f32, 1, 3))
    b.output(b.fake_quant_fp8(v), name="y")
    y = run_graph(b.graph, {"x": x})["y"]
    s = np.float32(2.0) / np.float32(448)
    np.testing.assert_array_equal(y, (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s)


def test_fp8_meta_graph_and_bad_weights() -> None:
    g = load_model("ernie-4.5-21b-a3b@meta")
    run_pipeline(g, "fp8")
    assert g.params["ernie.layers.0.self_attn.qkv_proj.quant_weight"].source is None
    g = load_model(GPT)
    p = g.params["gpt.decoder.layers.0.linear1.weight"]
    bad = np.array(p.read())
    bad[0, 0] = np.inf
    p.set_data(bad)
    with pytest.raises(NonFiniteWeightError,
                       match=r"param gpt\.decoder\.layers\.0\.linear1\.weight holds NaN or Inf"):
        run_pipeline(g, "fp8")


def test_calibration_runs_the_evaluator_its_caller_gives() -> None:
    """Passes sit below runtime: fp8-quant runs the graph with `evaluator`, not its own import."""
    made: list[object] = []

    def recording(graph: object) -> Interpreter:
        made.append(graph)
        return Interpreter(graph)  # type: ignore[arg-type]

    g = load_model(GPT)
    run_pipeline(g, "fp8", evaluator=recording)
    assert made == [g]
    ref = load_model(GPT)
    run_pipeline(ref, "fp8", evaluator=Interpreter)
    assert print_graph(g, with_hashes=True) == print_graph(ref, with_hashes=True)


def test_calibration_without_an_evaluator_is_one_clear_error() -> None:
    g = load_model(GPT)
    with pytest.raises(ErnieIRError, match=r"^fp8-quant: calibrating activation scales needs a graph "
                       r"evaluator: pass evaluator=ernie_ir\.runtime\.Interpreter to run_pipeline"):
        run_pipeline(g, "quant-annotate{preset=fp8},fp8-quant")
    annotated = load_model(GPT)
    run_pipeline(annotated, "quant-annotate{preset=fp8}")
    assert print_graph(g, with_hashes=True) == print_graph(annotated, with_hashes=True)  # untouched
    meta = load_model("ernie-4.5-21b-a3b@meta")
    run_pipeline(meta, "fp8")  # no weights, nothing to calibrate: no evaluator needed
    assert any(n.op == "fp8_linear" for n in meta)
