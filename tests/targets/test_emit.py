"""`compile --emit`: which executables an artifact carries, their defaults, and one copy of the weights."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.backends.onnx.session import full_sequence_feeds
from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir import ErnieIRError
from ernie_ir.targets import CompileOptions, compile_model, verify_artifact
from ernie_ir.targets.executables import default_emit, parse_emit

IDS = np.array([[1, 5, 9, 2]], dtype=np.int64)


def _stored_bytes(root: Path) -> dict[str, int]:
    """Bytes of every regular file (links are not a second copy)."""
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and not p.is_symlink()}


def test_defaults_read_the_rank_bytes() -> None:
    assert default_emit("cuda", "inference") == ("paddle", "fastdeploy")
    assert default_emit("ascend", "inference") == default_emit("kunlun", "inference") == ("paddle",)
    assert default_emit("cuda", "training") == ("paddle",)
    assert parse_emit(" ONNX, paddle,onnx ") == ("onnx", "paddle")
    assert parse_emit(None) is None


@pytest.mark.parametrize("text,message", [
    ("tensorrt", "unknown executable 'tensorrt' in --emit: choose from paddle, fastdeploy, onnx"),
    (" , ", "--emit is empty"),
])
def test_bad_names(text: str, message: str) -> None:
    with pytest.raises(ErnieIRError, match=message):
        parse_emit(text)


def test_default_artifact_stores_each_weight_once(tmp_path: Path) -> None:
    """cuda sm70 packs every tiny weight, so the FastDeploy checkpoint is written too: it links
    (a dense model: weight-only MoE experts would need the bf16 copy, written only when asked for).
    The one other copy is the ONNX decoder's, written by default below ONNX_DEFAULT_MAX_BYTES."""
    out = tmp_path / "a"
    report = compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(quant="wint8mix", cuda_arch=70,
                           out=out))
    assert report.emit == ["paddle", "fastdeploy", "onnx"]
    manifest = verify_artifact(out)
    assert manifest.emit == ["paddle", "fastdeploy", "onnx"] and manifest.formats == ["fastdeploy"]
    assert manifest.backends == ["interpreter", "onnxruntime", "paddle"]
    stored = _stored_bytes(out)
    weights = stored["rank0/weights.safetensors"]
    # nothing but the rank weights and ONNX's own copy holds weight bytes: the rest is text (IR,
    # manifest, recipes, the tokenizer beside the ONNX model)
    assert {n for n, size in stored.items() if size > 0.05 * weights} <= {
        "rank0/weights.safetensors", "inference/onnx/model.onnx", "inference/onnx/model.onnx.data",
        "inference/onnx/tokenizer.json", "graph.ir", "rank0/graph.ir"}
    assert os.readlink(out / "rank0/model.safetensors") == "weights.safetensors"
    # the default paddle executable builds its Layer from rank0/ and equals the interpreter
    ref = run_artifact(out, IDS, "interpreter")
    got = run_artifact(out, IDS, "paddle")
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_onnx_numerics_without_emit_asks_for_the_onnx_decoder(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.targets import executables

    monkeypatch.setattr(executables, "ONNX_DEFAULT_MAX_BYTES", 1024)  # not there by size alone
    report = compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(out=tmp_path / "a", quant="wint8",
                                                                         onnx_numerics="fast"))
    assert "onnx" in report.emit and report.onnx_numerics == "fast"


def test_onnx_is_left_out_by_default_above_the_size_with_the_flag_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.targets import executables

    monkeypatch.setattr(executables, "ONNX_DEFAULT_MAX_BYTES", 1024)
    report = compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(out=tmp_path / "a", quant="wint8",
                                                                         cuda_arch=70))
    assert report.emit == ["paddle", "fastdeploy"]
    assert verify_artifact(tmp_path / "a").backends == ["interpreter", "paddle"]
    note = [w for w in report.warnings if "ONNX" in w]
    assert len(note) == 1 and "add it with --emit paddle,fastdeploy,onnx" in note[0], report.warnings


def test_each_asked_executable_is_written(tmp_path: Path) -> None:
    out = tmp_path / "a"
    report = compile_model("ernie-4.5-0.3b@tiny", "ascend", CompileOptions(quant="wint8", out=out,
                           emit="onnx,paddle-inference"))
    manifest = verify_artifact(out)
    assert report.emit == manifest.emit == ["onnx", "paddle-inference"]
    assert manifest.backends == ["interpreter", "onnxruntime", "paddle", "paddle-inference"]
    assert {"inference/onnx/model.onnx", "inference/paddle/model.pdiparams"} <= set(manifest.files)
    assert manifest.onnx_numerics == "weight-only"  # the default
    ref = run_artifact(out, IDS, "interpreter")
    for backend in ("onnxruntime", "paddle", "paddle-inference"):
        np.testing.assert_allclose(run_artifact(out, IDS, backend), ref, rtol=1e-5,
                                   atol=2e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("kwargs,message", [
    ({"emit": "onnx", "mode": "training", "lora_rank": 2},
     "--emit onnx is an inference executable; --mode training writes paddle"),
    ({"emit": "paddle-inference", "tp": 2}, r"--emit paddle-inference needs one rank .* has 2"),
    ({"emit": "onnx", "tp": 2}, r"--emit onnx needs one rank \(ONNX has no collectives\)"),
    ({"emit": "fastdeploy", "target": "ascend"}, "--emit fastdeploy is a cuda inference checkpoint"),
    ({"emit": "fastdeploy", "model": "gpt-345m@tiny"}, "gpt-345m@tiny is not an ERNIE 4.5 model"),
    ({"emit": "fastdeploy", "quant": "wint8mix"},
     r"--emit fastdeploy: .* is not in Paddle's packed cuda layout"),
    ({"emit": "fastdeploy"}, "--emit fastdeploy: the model is not quantized"),
    ({"onnx_numerics": "fast", "emit": "paddle"}, "--onnx-numerics fast applies to the ONNX model, "
                                                  "which this compile does not write: add onnx to --emit"),
])
def test_executables_that_cannot_be_made_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    args = {"model": "ernie-4.5-21b-a3b@tiny", "target": "cuda", **kwargs}
    with pytest.raises(ErnieIRError, match=message):
        compile_model(args.pop("model"), args.pop("target"), CompileOptions(out=tmp_path / "a", **args))
    assert not (tmp_path / "a").exists()


def test_cli_emit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "compile", "ernie-4.5-0.3b@tiny", "--target", "kunlun", "--emit",
                         "paddle,onnx", "--out", str(tmp_path / "a"))
    assert code == 0 and "executables: paddle, onnx" in out, err
    line = user_error(capsys, "compile", "ernie-4.5-0.3b@tiny", "--target", "kunlun", "--emit", "trt",
                      "--out", str(tmp_path / "b"))
    assert "unknown executable 'trt' in --emit" in line
    assert not (tmp_path / "b").exists()


def test_onnx_keeps_bf16_weights_as_bf16(tmp_path: Path) -> None:
    """A float model's ONNX copy is no bigger than its rank weights: bf16 stays bf16 (widened in
    the graph), so a bare onnxruntime session still equals the interpreter."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto

    out = tmp_path / "a"
    compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(out=out, emit="onnx"))
    model = onnx.load(str(out / "inference/onnx/model.onnx"), load_external_data=False)
    kinds = {t.name: t.data_type for t in model.graph.initializer}
    assert kinds["ernie.embed_tokens.weight"] == TensorProto.BFLOAT16
    assert kinds["ernie.layers.0.mlp.up_gate_proj.weight"] == TensorProto.BFLOAT16
    stored = _stored_bytes(out)
    assert stored["inference/onnx/model.onnx.data"] <= 1.05 * stored["rank0/weights.safetensors"]
    ref = run_artifact(out, IDS, "interpreter")
    session = ort.InferenceSession(str(out / "inference/onnx/model.onnx"))
    got = session.run(None, full_sequence_feeds(session, IDS))[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5 * float(np.abs(ref).max()))
