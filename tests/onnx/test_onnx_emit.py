"""The ONNX executable of cuda inference artifacts: emitted, checked, run in onnxruntime.

Every case compiles a tiny built-in for cuda, then runs the same lowered graph
in the reference interpreter and the artifact's `inference/onnx/model.onnx` in
onnxruntime (CPU EP, ORT_ENABLE_BASIC). Tolerance: max abs logit error
<= 2e-5 x max |logit| (float32 reduction-order noise; measured <= 4.8e-7 x
max |logit|, i.e. <= 2.3e-5 absolute on logits of scale ~50).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from ernie_ir.backends.onnx.lower import OnnxExportError, emit_onnx
from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir import ErnieIRError
from ernie_ir.targets import ArtifactError, CompileOptions, compile_model, load_artifact, read_manifest

REL_TOL = 2e-5

CASES = [(m, q) for m in ("ernie-4.5-21b-a3b@tiny", "ernie-4.5-0.3b@tiny")
         for q in (None, "wint8", "wint8mix")]
CASES += [("gpt-345m@tiny", None), ("ernie-3.5-se-3b@tiny", None)]


def _ids(batch: int, seq: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, (batch, seq))


def _check(ref: np.ndarray, got: np.ndarray) -> float:
    assert got.shape == ref.shape and got.dtype == np.float32
    err = float(np.abs(ref - got).max())
    assert err <= REL_TOL * max(1.0, float(np.abs(ref).max())), err
    return err


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str | None], Path]:
    root = tmp_path_factory.mktemp("onnx")
    return {(m, q): Path(compile_model(m, "cuda", CompileOptions(quant=q, out=root / f"{m}-{q}", emit="onnx",
                                       onnx_numerics="exact")).out)
            for m, q in CASES}


@pytest.mark.parametrize(("model", "quant"), CASES, ids=[f"{m}-{q or 'none'}" for m, q in CASES])
def test_onnx_agrees_with_interpreter(artifacts: dict, model: str, quant: str | None) -> None:
    art = artifacts[(model, quant)]
    manifest = read_manifest(art)
    assert manifest.backends[:2] == ["interpreter", "onnxruntime"]
    assert {"inference/onnx/model.onnx", "inference/onnx/model.onnx.data"} <= set(manifest.files)
    onnx.checker.check_model(str(art / "inference/onnx/model.onnx"), full_check=True)
    # symbolic B and S: two sequence lengths, batch 1 and 2
    for batch, seq in ((2, 7), (1, 3), (2, 12)):
        ids = _ids(batch, seq, seed=seq)
        _check(run_artifact(art, ids, "interpreter"), run_artifact(art, ids, "onnxruntime"))


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of `graph` and of its subgraphs (If branches), depth first."""
    return [*graph.node, *(n for nd in graph.node for a in nd.attribute
                           if a.type == onnx.AttributeProto.GRAPH for n in _all_nodes(a.g))]


def test_quantized_onnx_keeps_int_weights(artifacts: dict) -> None:
    model = onnx.load(str(artifacts[("ernie-4.5-21b-a3b@tiny", "wint8mix")] / "inference/onnx/model.onnx"),
                      load_external_data=False)
    types = {t.data_type for t in model.graph.initializer}
    # int4 expert stacks are UINT8 pairs (the same bytes): the sparse MoE Loop Gathers one expert
    assert types & {onnx.TensorProto.INT4, onnx.TensorProto.UINT8} and onnx.TensorProto.INT8 in types
    ops = {n.op_type for n in model.graph.node}
    assert "DequantizeLinear" in ops  # the experts' stacks; the linears are MatMulNBits (exact level 1)
    levels = {a.i for n in _all_nodes(model.graph) if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"}
    assert levels == {1}
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer
               if not t.name.startswith("const_"))


@pytest.mark.parametrize("case", [("ernie-4.5-21b-a3b@tiny", "wint8mix"), ("ernie-4.5-0.3b@tiny", "wint8")])
def test_matmulnbits_form_is_exact(artifacts: dict, tmp_path: Path, case: tuple[str, str]) -> None:
    graph = load_artifact(artifacts[case])
    path, _ = emit_onnx(graph, tmp_path, form="matmulnbits", numerics="exact")
    model = onnx.load(str(path), load_external_data=False)
    assert any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for n in _all_nodes(model.graph))
    from ernie_ir.backends.onnx.session import run_onnx
    from ernie_ir.runtime import run_graph

    ids = _ids(2, 5)
    _check(run_graph(graph, {"input_ids": ids})["logits"], run_onnx(path, ids))


def test_fp8_cannot_lower_and_artifact_offers_interpreter_only(tmp_path: Path) -> None:
    art = Path(compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(quant="fp8", cuda_arch=90,
                             out=tmp_path / "a")).out)
    assert "onnxruntime" not in read_manifest(art).backends
    assert not (art / "inference/onnx").exists()
    with pytest.raises(OnnxExportError, match=r"cannot lower fp8_linear at ernie\.layers\.0\..*has no ONNX"):
        emit_onnx(load_artifact(art), tmp_path / "onnx")
    with pytest.raises(ErnieIRError, match="does not offer backend 'onnxruntime'; it offers interpreter"):
        run_artifact(art, _ids(1, 3), "onnxruntime")


def test_unknown_form_and_backend(artifacts: dict, tmp_path: Path) -> None:
    art = artifacts[("ernie-4.5-0.3b@tiny", None)]
    with pytest.raises(OnnxExportError, match="unknown ONNX form 'int3'"):
        emit_onnx(load_artifact(art), tmp_path, form="int3")
    with pytest.raises(ErnieIRError, match="backend 'tensorrt'; it offers interpreter, onnxruntime"):
        run_artifact(art, _ids(1, 3), "tensorrt")


def test_small_default_artifacts_carry_onnx_and_emit_paddle_does_not(tmp_path: Path) -> None:
    for target in ("cuda", "ascend"):
        art = Path(compile_model("ernie-4.5-0.3b@tiny", target, CompileOptions(quant="wint8",
                                 out=tmp_path / target)).out)
        assert "onnxruntime" in read_manifest(art).backends  # below ONNX_DEFAULT_MAX_BYTES
        assert (art / "inference/onnx/model.onnx").is_file()
    art = Path(compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(quant="wint8", emit="paddle",
                             out=tmp_path / "named")).out)
    assert "onnxruntime" not in read_manifest(art).backends
    assert not (art / "inference/onnx").exists()


def test_emit_onnx_on_ascend_agrees_with_interpreter(tmp_path: Path) -> None:
    art = Path(compile_model("ernie-4.5-21b-a3b@tiny", "ascend", CompileOptions(quant="wint8mix",
                             out=tmp_path / "a", emit="onnx", onnx_numerics="exact")).out)
    assert read_manifest(art).backends == ["interpreter", "onnxruntime"]
    ids = _ids(2, 5)
    _check(run_artifact(art, ids, "interpreter"), run_artifact(art, ids, "onnxruntime"))


def test_emit_onnx_names_the_ops_it_cannot_lower(tmp_path: Path) -> None:
    with pytest.raises(ErnieIRError, match=r"^op 'fp8_linear' .* has no ONNX lowering, which the onnx "
                                           r"executable .* leave onnx out of --emit$"):
        compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(quant="fp8", cuda_arch=90,
                      out=tmp_path / "a", emit="onnx"))
    with pytest.raises(ErnieIRError, match=r"weight_only_linear_xpu.* has no ONNX lowering"):
        compile_model("ernie-4.5-0.3b@tiny", "kunlun", CompileOptions(quant="wint8", out=tmp_path / "b",
                      emit="onnx"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_tampered_onnx_data_is_detected(tmp_path: Path) -> None:
    art = Path(compile_model("gpt-345m@tiny", "cuda", CompileOptions(out=tmp_path / "a", emit="onnx")).out)
    data = art / "inference/onnx/model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data was modified"):
        run_artifact(art, _ids(1, 3), "onnxruntime")
    assert "onnxruntime" in json.loads((art / "manifest.json").read_text())["backends"]
