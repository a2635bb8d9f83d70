"""Every target x quantization x model: compile, then run through every backend the
artifact offers. Each backend agrees with the interpreter on the same lowered graph
to float32 tolerance, and the artifact stays within the quantization error budget
of the float model (docs/quantization.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ernie_ir.backends.sessions import run_artifact
from ernie_ir.frontends import load_model
from ernie_ir.runtime import run_graph
from ernie_ir.runtime.compare import compare_logits
from ernie_ir.targets import CompileOptions, compile_model, load_artifact, verify_artifact
from ernie_ir.testing.stability import stable_positions

MODELS = ["ernie-4.5-21b-a3b@tiny", "ernie-4.5-0.3b@tiny"]
TARGETS = ["cuda", "ascend", "kunlun"]
QUANTS = [None, "wint8", "wint8mix"]
BUDGET = {None: 0.0, "wint8": 0.05, "wint8mix": 0.10}  # rel_error bounds, docs/quantization.md
IDS = np.array([[1, 5, 9, 2, 7], [3, 3, 8, 1, 4]], dtype=np.int64)


@pytest.fixture(scope="module")
def float_logits() -> dict[str, np.ndarray]:
    return {m: run_graph(load_model(m), {"input_ids": IDS})["logits"] for m in MODELS}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q or "float")
def test_every_backend_agrees(model: str, target: str, quant: str | None, tmp_path: Path,
                              float_logits: dict[str, np.ndarray]) -> None:
    out = tmp_path / "artifact"
    # every executable each target can carry: kunlun's packed XPU int8 has no ONNX lowering
    onnx = target != "kunlun" or quant is None
    # exact ONNX numerics: the backends' agreement is to float32 tolerance (the default weight-only
    # numerics drop the bf16 rounding of dequantized experts; tests/onnx bounds that)
    compile_model(model, target, CompileOptions(quant=quant, out=out,
                  emit="onnx,paddle" if onnx else "paddle", onnx_numerics="exact" if onnx else None))
    manifest = verify_artifact(out)
    backends = manifest.backends
    assert backends == ["interpreter", "onnxruntime", "paddle"] if onnx else ["interpreter", "paddle"]

    reference = run_artifact(out, IDS, "interpreter")
    # the backends sum in other orders than numpy: the comparison below holds on any machine only
    # because no router's top-k is within 1e-5 of a tie on these inputs (ernie_ir.testing.stability)
    stable = stable_positions(load_artifact(out), {"input_ids": IDS})
    assert stable.compared == IDS.size, stable.unstable
    scale = float(np.max(np.abs(reference)))
    for backend in backends:
        logits = run_artifact(out, IDS, backend)
        assert logits.shape == reference.shape
        err = float(np.max(np.abs(logits - reference)))
        assert err <= 5e-5 * scale, f"{backend}: max abs {err:.3g} vs logit scale {scale:.3g}"

    versus_float = compare_logits(reference, float_logits[model])
    if quant is None:
        assert versus_float.max_abs_error == 0.0
    else:
        assert 0.0 < versus_float.rel_error < BUDGET[quant]
        assert versus_float.top1_agreement >= 0.8
