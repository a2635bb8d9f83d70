"""qat-convert: a QAT graph's weight fake-quant becomes int8 weights + dequantize, computing the same.

The KL of the converted graph against the fake-quant graph it came from is 0 (issue 21 item 4):
the converted weights equal fake_quant(W) bit for bit (up to the sign of zero).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ernie_ir.evaluation.statistics import summarize, token_stats
from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, f32, tensor
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.storage import load_graph, save_graph
from ernie_ir.ir.verifier import verify
from ernie_ir.ir.weights import ArraySource
from ernie_ir.load import load_input
from ernie_ir.ops.quant_numerics import NonFiniteWeightError, abs_max, fake_quant_dequant
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.infra.base import set_graph_properties
from ernie_ir.passes.infra.pipeline_syntax import PipelineError
from ernie_ir.passes.quant.qat_convert import QatConvertError
from ernie_ir.runtime.interpreter import Interpreter

QAT = "quant-annotate{preset=qat-int8},qat-insert{is_test=true,trainable=false}"
MODELS = ["ernie-4.5-0.3b@tiny", "gpt-345m@tiny", "ernie-4.5-21b-a3b@tiny"]


def _bits(a: np.ndarray) -> np.ndarray:
    """float32 bit patterns, -0 read as +0 (int8 has no -0)."""
    return (np.asarray(a, np.float32) + np.float32(0)).view(np.uint32)


# -- the numerics -------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("binade", [1.0, 2.0 ** -100, 2.0 ** 100])
def test_the_multiply_add_correction_divides_by_b_exactly_for_every_significand(bits: int,
                                                                               binade: float) -> None:
    # x = f32(q * s) is any float32; 2^-100 < 1e-30 is below every scale Paddle does not zero.
    x = (np.arange(2 ** 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32) * np.float32(binade)
    b = np.float32(2 ** (bits - 1) - 1)
    r, m = np.float32(1) / b, np.float32(-(b + 1))
    y0 = x * r
    y = y0 + (((x + y0 * m) + y0) * r)
    assert np.array_equal(y.view(np.uint32), (x / b).view(np.uint32))
    assert (y0 != x / b).any()  # the reciprocal alone is not (why the correction exists)


def _weight_graph(w: np.ndarray, **attrs: object) -> Graph:
    """A graph whose output is fake_quant(W), marked as a QAT graph."""
    b = GraphBuilder("w")
    x = b.input("x", tensor(f32, 1))
    wq = b.fake_quant(b.param("layers.0.linear1.weight", source=ArraySource(w)), **attrs)
    b.output(wq, name="w")
    b.output(x, name="x")
    set_graph_properties(b.graph, {"qat"})
    return b.graph


def _weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    w[..., 3] = 0  # an all-zero output channel (scale 0 when per channel)
    w.reshape(-1)[[0, 1, 2, 4, 5, 6, 7]] = [0.5, -0.5, 1e-3, -0.0, 3.0, -3.0, -1e-9]  # outliers, signed zeros
    return w


CASES = [
    ((64, 48), {"axes": ()}),
    ((64, 48), {"axes": (1,)}),
    ((64, 48), {"axes": (-1,), "round_type": 0}),
    ((64, 48), {"axes": (), "bits": 4}),
    ((64, 48), {"axes": (1,), "bits": 4, "round_type": 0}),
    ((4, 32, 24), {"axes": (0,)}),
    ((4, 32, 24), {"axes": (0, 2)}),
]


@pytest.mark.parametrize(("shape", "attrs"), CASES)
def test_converted_weight_equals_fake_quant_bit_for_bit(shape: tuple[int, ...], attrs: dict) -> None:
    w = _weights(shape, seed=len(shape) + len(attrs))
    g = _weight_graph(w, **attrs)
    run_pipeline(g, "qat-convert")
    verify(g)
    assert not any(n.op == "fake_quant" for n in g)
    q = g.params["layers.0.linear1.quant_weight"]
    assert q.type.dtype == DType.I8 and "layers.0.linear1.weight" not in g.params
    got = Interpreter(g).run({"x": np.zeros(1, np.float32)})["w"]
    # the reference: Paddle's kernel as ernie_ir.ops.quant_numerics writes it
    rank = len(shape)
    keep = tuple(a % rank for a in attrs.get("axes", ()))
    s = abs_max(w, keep).reshape([shape[i] if i in keep else 1 for i in range(rank)])
    want = fake_quant_dequant(w, s, int(attrs.get("bits", 8)), int(attrs.get("round_type", 1)))
    assert np.array_equal(_bits(got), _bits(want))
    assert np.abs(q.read()).max() <= 2 ** (int(attrs.get("bits", 8)) - 1)


def test_the_one_op_form_is_within_two_ulp() -> None:
    w = _weights((256, 128), seed=3)
    g = _weight_graph(w, axes=(1,))
    run_pipeline(g, "qat-convert{exact=false}")
    assert [n.op for n in g] == ["dequantize"]
    got = Interpreter(g).run({"x": np.zeros(1, np.float32)})["w"]
    want = fake_quant_dequant(w, abs_max(w, (1,)), 8, 1)
    ulps = np.abs(_bits(got).astype(np.int64) - _bits(want).astype(np.int64))
    assert ulps.max() <= 2 and (ulps > 0).mean() > 0.1  # a third of the weights are off by an ulp or two


def test_weights_it_cannot_hold_in_int8_keep_their_fake_quant() -> None:
    w = _weights((16, 8), seed=4)
    g = _weight_graph(w, bits=16)
    result = run_pipeline(g, "qat-convert")
    assert [n.op for n in g] == ["fake_quant"]
    assert result.warnings == ["qat-convert: fake_quant at <root> stays: layers.0.linear1.weight is "
                               "fake-quantized to 16 bits (more than int8 holds)"]


def test_a_nan_weight_is_an_error_naming_it() -> None:
    w = _weights((16, 8), seed=5)
    w[2, 5] = np.nan
    g = _weight_graph(w)
    with pytest.raises(NonFiniteWeightError, match=r"layers.0.linear1.weight holds nan at index \[2, 5\]"):
        run_pipeline(g, "qat-convert")


def test_a_meta_graph_gets_typed_params_without_data() -> None:
    g = load_input("ernie-4.5-21b-a3b@meta")
    run_pipeline(g, QAT + ",qat-convert")
    verify(g)
    q = g.params["ernie.layers.1.mlp.experts.up_gate_proj.quant_weight"]
    s = g.params["ernie.layers.1.mlp.experts.up_gate_proj.weight_scale"]
    assert str(q.type) == "i8[64,2560,3072]" and str(s.type) == "f32[64,3072]"
    assert not q.has_data and not s.has_data
    assert not any(n.op == "fake_quant" for n in g)


# -- the built-in models ------------------------------------------------------------------------

def _qat_graph(name: str) -> Graph:
    g = load_input(name)
    run_pipeline(g, QAT)
    for p in g.params.values():  # a calibrated-looking activation scale instead of Paddle's initial 0.001
        if p.annotations.get("qat_state") == "scale":
            p.source = ArraySource(np.array([4.0], np.float32))
    return g


def _ids(g: Graph) -> np.ndarray:
    vocab = next(n for n in g if n.op == "embedding").inputs[1].type.shape[0]
    return np.random.default_rng(0).integers(0, vocab, size=(2, 16)).astype(np.int64)


def _kl(conv: np.ndarray, ref: np.ndarray, ids: np.ndarray) -> dict:
    v = conv.shape[-1]
    targets = ids[:, 1:].reshape(-1)
    return summarize(token_stats(conv[:, :-1].reshape(-1, v), targets, reference=ref[:, :-1].reshape(-1, v)))


@pytest.mark.parametrize("name", MODELS)
def test_converted_model_has_int8_weights_and_kl_zero_against_the_qat_graph(name: str,
                                                                           tmp_path: Path) -> None:
    qat = _qat_graph(name)
    conv = _qat_graph(name)
    result = run_pipeline(conv, "qat-convert")
    assert result.warnings == []
    assert {"qat", "quantized"} <= set(conv.metadata["properties"])

    # (b) every weight fake-quant became int8 + scale; the float weights are gone
    fq = {n.inputs[0].name: n.inputs[0] for n in qat if n.op == "fake_quant"}
    assert fq and not any(n.op == "fake_quant" for n in conv)
    assert (name == "ernie-4.5-21b-a3b@tiny") == any(w.type.rank == 3 for w in fq.values())  # experts too
    for wname, w in fq.items():
        assert wname not in conv.params
        module = wname.removesuffix(".weight")
        q, s = conv.params[f"{module}.quant_weight"], conv.params[f"{module}.weight_scale"]
        assert q.type.dtype == DType.I8 and q.type.shape == w.type.shape
        assert s.type.dtype == DType.F32 and s.type.shape == (*w.type.shape[:-2], w.type.shape[-1])
        assert q.read().dtype == np.int8
    assert sum(n.op == "fake_quant_moving_average" for n in conv) == \
        sum(n.op == "fake_quant_moving_average" for n in qat)  # activations stay fake-quantized

    # (a) the same logits, bit for bit; (c) so KL 0 and the same top-1 token everywhere
    ids = _ids(qat)
    ref = Interpreter(qat).run({"input_ids": ids})["logits"]
    got = Interpreter(conv).run({"input_ids": ids})["logits"]
    assert np.array_equal(got, ref)
    stats = _kl(got, ref, ids)
    assert stats["kl_max"] <= 1e-6 and stats["top1_agreement"] == 1.0, stats
    assert stats["kl_max"] == 0.0

    # (e) prints, parses back and verifies
    text = print_graph(conv)
    again = parse_graph(text)
    verify(again)
    assert print_graph(again) == text

    # smaller on disk, and the saved folder computes the same
    save_graph(qat, tmp_path / "qat")
    save_graph(conv, tmp_path / "conv")
    size = {k: (tmp_path / k / "weights.safetensors").stat().st_size for k in ("qat", "conv")}
    w_bytes = sum(w.type.dtype.bits // 8 * int(np.prod(w.type.shape)) for w in fq.values())
    assert size["conv"] < size["qat"] - w_bytes // 4, size
    loaded = load_graph(tmp_path / "conv")
    np.testing.assert_array_equal(Interpreter(loaded).run({"input_ids": ids})["logits"],
                                  Interpreter(conv).run({"input_ids": ids})["logits"])


@pytest.mark.parametrize("name", ["ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"])
def test_cast_form_matches_the_qat_graph_at_bf16(name: str) -> None:
    # cast=true: the weights are bf16 as fake_quant's declared type; the interpreter rounds
    # fake_quant's result to bf16 only under emulate=bf16, where both graphs then agree bit for bit
    qat, conv = _qat_graph(name), _qat_graph(name)
    run_pipeline(conv, "qat-convert{cast=true}")
    verify(conv)
    weights = [v for n in conv if n.op in ("linear", "moe_experts")
               for v in (n.inputs[1:2] if n.op == "linear" else n.inputs[3:5])]
    assert weights and all(v.producer.op == "cast" and v.type.dtype == DType.BF16  # type: ignore[union-attr]
                           for v in weights)
    ids = _ids(qat)
    ref = Interpreter(qat, emulate=DType.BF16).run({"input_ids": ids})["logits"]
    got = Interpreter(conv, emulate=DType.BF16).run({"input_ids": ids})["logits"]
    assert np.array_equal(got, ref)
    assert _kl(got, ref, ids)["kl_max"] == 0.0


@pytest.mark.parametrize("name", ["ernie-4.5-0.3b@tiny", "gpt-345m@tiny"])
def test_one_op_form_on_a_model_keeps_kl_below_tolerance(name: str) -> None:
    qat, conv = _qat_graph(name), _qat_graph(name)
    run_pipeline(conv, "qat-convert{exact=false}")
    ids = _ids(qat)
    ref = Interpreter(qat).run({"input_ids": ids})["logits"]
    got = Interpreter(conv).run({"input_ids": ids})["logits"]
    stats = _kl(got, ref, ids)
    assert stats["kl_max"] <= 1e-6 and stats["top1_agreement"] == 1.0


# -- refusals -----------------------------------------------------------------------------------

def test_a_graph_without_qat_is_refused_in_one_line() -> None:
    g = load_input("gpt-345m@tiny")
    with pytest.raises(PipelineError) as e:
        run_pipeline(g, "qat-convert")
    assert str(e.value) == ("pass qat-convert (position 1) requires qat, which no earlier pass produces; "
                            "run qat-insert before it")
    g = load_input("gpt-345m@tiny")
    run_pipeline(g, "quant-annotate{preset=wint8},weight-only-quant")
    with pytest.raises(PipelineError, match="requires qat"):
        run_pipeline(g, "qat-convert")


def test_the_training_form_is_refused_in_one_line() -> None:
    g = load_input("gpt-345m@tiny")
    with pytest.raises(QatConvertError) as e:
        run_pipeline(g, "quant-annotate{preset=qat-int8},qat-insert,qat-convert")
    msg = str(e.value)
    assert "\n" not in msg and "qat-insert{is_test=true}" in msg and isinstance(e.value, ErnieIRError)
