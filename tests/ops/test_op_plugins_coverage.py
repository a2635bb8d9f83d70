"""compile's executable coverage: an op without a lowering for an executable the target offers is
refused in one line naming both (nothing written), unless skipped or declared, which is reported."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from ernie_ir.cli.app import main
from ernie_ir.frontends import load_model
from ernie_ir.ir import Input, OpDef, TensorType
from ernie_ir.ir.registry import REGISTRY
from ernie_ir.ir.storage import save_graph
from ernie_ir.passes import RewriteRule, RuleSet
from ernie_ir.targets import CompileOptions, compile_model
from ernie_ir.targets.coverage import CoverageError, check_coverage

MODEL = "ernie-4.5-0.3b@tiny"


class _Swiglu(OpDef):
    """y = gate / (1 + exp(-gate)) * up"""

    inputs = (Input("gate"), Input("up"))

    def infer(self, types: Sequence[TensorType | None], attrs: object) -> list[TensorType]:
        assert types[0] is not None
        return [types[0]]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: object) -> list[np.ndarray]:
        gate, up = args
        assert gate is not None and up is not None
        return [gate / (np.float32(1) + np.exp(-gate)) * up]


class PaddleOnly(_Swiglu):
    name = "t_swiglu_paddle"

    def lower_paddle(self, layer, node, args):
        return [layer.F.silu(args[0]) * args[1]]


class KernelOnly(_Swiglu):
    name = "t_swiglu_kernel"


class Declared(PaddleOnly):
    name = "t_swiglu_declared"
    no_onnx = "a vendor kernel with no ONNX form"


@pytest.fixture(scope="module", autouse=True)
def ops() -> Iterator[None]:
    for cls in (PaddleOnly, KernelOnly, Declared):
        REGISTRY.add(cls)
    try:
        yield
    finally:
        for cls in (PaddleOnly, KernelOnly, Declared):
            REGISTRY.remove(cls.name)


class FuseTo(RewriteRule):
    name = "t-fuse-to"

    def __init__(self, op: str) -> None:
        self.op_name = op

    def pattern(self, op, gate, up):
        return op.mul(op.silu(gate, _single_use=True), up)

    def rewrite(self, op, gate, up):
        return op.op(self.op_name, gate, up)


def model_using(tmp_path: Path, op: str) -> str:
    graph = load_model(MODEL)
    assert RuleSet([FuseTo(op)]).apply(graph) == 2
    return str(save_graph(graph, tmp_path / f"model-{op}"))


def test_an_op_without_an_onnx_lowering_is_refused_in_one_line(tmp_path: Path):
    model = model_using(tmp_path, "t_swiglu_paddle")
    with pytest.raises(CoverageError) as e:
        compile_model(model, "cuda", CompileOptions(out=tmp_path / "art", emit="onnx,paddle"))
    assert str(e.value) == (
        "op 't_swiglu_paddle' (at ernie.layers.0.mlp, 2 nodes) has no ONNX lowering, which the "
        "onnx executable of the cuda inference artifact needs: give the op a lower_onnx "
        "(docs/ops.md) or leave onnx out of --emit")
    assert not (tmp_path / "art").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model-t_swiglu_paddle"]


def test_the_cli_exits_2_with_that_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    model = model_using(tmp_path, "t_swiglu_paddle")
    with pytest.raises(SystemExit) as e:
        main(["compile", model, "--target", "cuda", "--emit", "paddle,onnx", "--out", str(tmp_path / "art")])
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: op 't_swiglu_paddle' (at ernie.layers.0.mlp, "
                                                   "2 nodes) has no ONNX lowering, which the onnx ")
    assert not (tmp_path / "art").exists()


def test_leaving_the_executable_out_compiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    model = model_using(tmp_path, "t_swiglu_paddle")
    with pytest.raises(SystemExit) as e:
        main(["compile", model, "--target", "cuda", "--out", str(tmp_path / "art"), "--json",
              "--emit", "paddle"])
    assert e.value.code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["emit"] == ["paddle"] and report["onnx_numerics"] is None
    backends = json.loads((tmp_path / "art" / "manifest.json").read_text())["backends"]
    assert backends == ["interpreter", "paddle"] and not (tmp_path / "art" / "inference" / "onnx").exists()


def test_a_declared_gap_asked_for_is_refused_with_its_reason(tmp_path: Path):
    with pytest.raises(CoverageError, match=r"^op 't_swiglu_declared' \(at ernie\.layers\.0\.mlp, 2 nodes; "
                                            r"a vendor kernel with no ONNX form\) has no ONNX lowering"):
        compile_model(model_using(tmp_path, "t_swiglu_declared"), "cuda", CompileOptions(out=tmp_path / "art",
                      emit="paddle,onnx"))
    assert not (tmp_path / "art").exists()


def test_fp8_on_cuda_names_its_missing_onnx_lowering(tmp_path: Path):
    report = compile_model(MODEL, "cuda", CompileOptions(quant="fp8", cuda_arch=90, out=tmp_path / "art"))
    assert report.emit == ["paddle"] and not [w for w in report.warnings if "executable" in w]
    with pytest.raises(CoverageError, match=(
            r"^op 'fp8_linear' \(at ernie\.layers\.0\.self_attn\.qkv_proj, \d+ nodes; opset 21 MatMul "
            r"takes no float8 inputs; Paddle runs it\) has no ONNX lowering")):
        compile_model(MODEL, "cuda", CompileOptions(quant="fp8", cuda_arch=90, out=tmp_path / "b",
                      emit="onnx"))


def test_only_the_executables_written_are_checked(tmp_path: Path):
    # kunlun's default is paddle alone: an op with a Paddle lowering alone compiles there
    report = compile_model(model_using(tmp_path, "t_swiglu_paddle"), "kunlun",
                           CompileOptions(out=tmp_path / "art"))
    assert not [w for w in report.warnings if "executable" in w]


def test_an_op_without_a_paddle_lowering_is_refused_for_paddle(tmp_path: Path):
    with pytest.raises(CoverageError, match=(
            r"^op 't_swiglu_kernel' \(at ernie\.layers\.0\.mlp, 2 nodes\) has no Paddle lowering, which "
            r"the paddle executable of the ascend inference artifact needs: give the op a lower_paddle "
            r"\(docs/ops\.md\) or leave paddle out of --emit$")):
        compile_model(model_using(tmp_path, "t_swiglu_kernel"), "ascend",
                      CompileOptions(out=tmp_path / "art"))


def test_a_training_artifact_that_could_not_run_is_refused(tmp_path: Path):
    model = model_using(tmp_path, "t_swiglu_kernel")
    with pytest.raises(CoverageError, match=(
            r"^op 't_swiglu_kernel' \(at ernie\.layers\.0\.mlp, 2 nodes\) has no Paddle lowering, so the "
            r"paddle executable of the cuda training artifact could not run: give the op a lower_paddle")):
        compile_model(model, "cuda", CompileOptions(mode="training", lora_rank=2, out=tmp_path / "art"))
    assert not (tmp_path / "art").exists()


def test_coverage_takes_emit_names_and_refuses_a_declared_gap_that_was_asked_for():
    graph = load_model(MODEL)
    RuleSet([FuseTo("t_swiglu_declared")]).apply(graph)
    warnings: list[str] = []
    kept = check_coverage([graph], ["paddle", "onnx", "fastdeploy"], target="cuda", mode="inference",
                          warnings=warnings)
    assert kept == ["paddle", "fastdeploy"]
    assert warnings == ["no onnx executable: op t_swiglu_declared has no ONNX lowering (a vendor kernel "
                        "with no ONNX form) (first at ernie.layers.0.mlp); run the artifact with "
                        "--backend interpreter or paddle"]
    with pytest.raises(CoverageError, match=r"^op 't_swiglu_declared' \(at ernie\.layers\.0\.mlp, 2 nodes; "
                                            r"a vendor kernel with no ONNX form\) has no ONNX lowering, "
                                            r"which the onnx executable"):
        check_coverage([graph], ["paddle", "onnx"], target="cuda", mode="inference", explicit=["onnx"])
    assert check_coverage([graph], ["paddle-inference"], target="ascend", mode="inference") == [
        "paddle-inference"]
