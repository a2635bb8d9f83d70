"""Regression: packed MoE experts in model.onnx, run in a bare onnxruntime session.

Every expert stack's stacked scale is a computed (unnamed) value; their ONNX initializers were
once all named `None::f32_blocked`, so every expert layer read the first one (wrong logits, or a
shape error in onnxruntime when the stacks differ). Checked without ernie-ir's runner: a plain
`onnxruntime.InferenceSession(path)` with the exact settings docs/targets.md names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ernie_ir.backends.onnx.session import full_sequence_feeds
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.targets import CompileOptions, compile_model, load_artifact

IDS = np.array([[1, 2, 3, 400, 5, 77]])


def test_packed_experts_each_read_their_own_scales(tmp_path: Path) -> None:
    out = tmp_path / "a"
    report = compile_model("ernie-4.5-21b-a3b@tiny", "cuda", CompileOptions(quant="wint8mix", cuda_arch=70,
                           out=out, emit="onnx", onnx_numerics="exact"))  # experts as DequantizeLinear
    assert not report.fallbacks  # sm70 packs every expert stack: the path under test
    path = out / "inference" / "onnx" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    scales = [i for n in model.graph.node if n.op_type == "DequantizeLinear" for i in n.input[1:2]]
    assert len(scales) == len(set(scales)), "two DequantizeLinear nodes share a scale initializer"
    assert not any(name.startswith("None") for name in scales)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(path), options)
    got = session.run(None, full_sequence_feeds(session, IDS))[0]
    ref = run_graph(load_artifact(out), {"input_ids": IDS})["logits"]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
