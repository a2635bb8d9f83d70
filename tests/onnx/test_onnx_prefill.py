"""Long inputs in the ONNX decoder (issue 41 item 7): the forms chosen for prefill speed.

- An int8 weight-only linear (weight-only and exact numerics) is an `If` on the number of rows:
  from `PREFILL_ROWS` rows on, one 8-bit MatMulNBits (one float GEMM after widening the weight);
  below, the two 4-bit planes decode runs fast. Both branches decode to the same weight, and
  a call just above the threshold gives the logits a call just below gives (causal: the shared
  positions), and the interpreter's.
- Attention hides keys with an additive bias, never a `Where` over the [B, H, S, T] scores
  (onnxruntime's broadcasting Where was ~7% of a 1,024-token prefill); rows a mask hides
  completely are still zeros (tests/onnx/test_onnx_decoder.py (c)).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from ernie_ir.backends.onnx.lower import PREFILL_ROWS
from ernie_ir.backends.onnx.session import full_sequence_feeds, session
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.targets import CompileOptions, compile_model, load_artifact

WEIGHT_ONLY_TOL = 5e-3
"""As test_onnx_decoder.WEIGHT_ONLY_TOL: the interpreter keeps the bf16 rounding of dequantized
weights that the weight-only numerics drop."""
BRANCH_TOL = 1e-5
"""The two forms of one product: float32 sums in another order, relative to the largest logit."""


@pytest.fixture(scope="module")
def wint8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prefill") / "a"
    return Path(compile_model("ernie-4.5-0.3b@tiny", "cuda",
                              CompileOptions(quant="wint8", out=out, emit="onnx")).out)


def _attr(node: onnx.NodeProto, name: str) -> object:
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def test_int8_linears_choose_their_form_by_rows(wint8: Path) -> None:
    model = onnx.load(str(wint8 / "inference/onnx/model.onnx"), load_external_data=False)
    ifs = [n for n in model.graph.node if n.op_type == "If"]
    assert ifs and not any(n.op_type == "MatMulNBits" for n in model.graph.node)
    for node in ifs:
        many, few = (_attr(node, "then_branch"), _attr(node, "else_branch"))
        assert [(_attr(n, "bits"), _attr(n, "accuracy_level")) for n in many.node
                if n.op_type == "MatMulNBits"] == [(8, 1)]
        assert [(_attr(n, "bits"), _attr(n, "accuracy_level")) for n in few.node
                if n.op_type == "MatMulNBits"] == [(4, 1), (4, 1)]


@pytest.mark.slow
def test_both_forms_give_the_same_logits(wint8: Path) -> None:
    sess = session(wint8 / "inference/onnx/model.onnx")
    ids = np.random.default_rng(7).integers(3, 1000, (1, PREFILL_ROWS))
    long = sess.run(["logits"], full_sequence_feeds(sess, ids))[0]  # the 8-bit form
    short = sess.run(["logits"], full_sequence_feeds(sess, ids[:, :-1]))[0]  # the planes
    scale = np.abs(short).max()
    assert np.abs(long[:, :-1] - short).max() <= BRANCH_TOL * scale
    assert not np.array_equal(long[:, :-1], short)  # two kernels ran, not one
    ref = run_graph(load_artifact(wint8), {"input_ids": ids})["logits"]
    assert np.abs(long - ref).max() <= WEIGHT_ONLY_TOL * np.abs(ref).max()


def test_attention_scores_are_not_masked_by_where(wint8: Path) -> None:
    model = onnx.load(str(wint8 / "inference/onnx/model.onnx"), load_external_data=False)
    where_out = {o for n in model.graph.node if n.op_type == "Where" for o in n.output}
    softmax = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert softmax and not any(i in where_out for n in softmax for i in n.input)
