"""Run an ONNX artifact (`ernie_ir.targets.emit_onnx`) in onnxruntime on the CPU.

Exact settings (the default): `ORT_ENABLE_BASIC` graph optimisation, which
keeps DequantizeLinear + MatMul as written (the default level fuses them into
`MatMulNBits` with accuracy_level 4, quantising activations to int8), plus
the session config `session.qdq_matmulnbits_accuracy_level = 0` should a
fusion run anyway. `fast=True`: `ORT_ENABLE_ALL` with onnxruntime's default
accuracy level (4): faster int8/int4 matmuls, activations quantised to int8,
numerics no longer equal the interpreter's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ernie_ir.ir import ErnieIRError


def session(model_path: Path, *, fast: bool = False, threads: int | None = None):
    """An onnxruntime InferenceSession on the CPU EP with exact (default) or fast settings."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if fast:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    else:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if threads is not None:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    path = Path(model_path)
    if not path.is_file():
        raise ErnieIRError(f"no ONNX model at {path}")
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def run_onnx(model_path: Path, input_ids: np.ndarray, *, fast: bool = False) -> np.ndarray:
    """Logits [B, S, V] (float32) of the ONNX model at `model_path` for `input_ids` [B, S]."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ErnieIRError(f"input_ids must be an integer [B, S] array, got {ids.dtype} {list(ids.shape)}")
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException

    try:
        sess = session(model_path, fast=fast)
        return sess.run(None, {sess.get_inputs()[0].name: ids.astype(np.int64)})[0]
    except (Fail, RuntimeException) as e:  # a model this exporter wrote wrong: say so in one line
        detail = " ".join(str(e).split())[:300]
        raise ErnieIRError(f"onnxruntime cannot run {model_path} ({detail}): recompile the artifact, and "
                           "report this as an ernie-ir bug with the compile command") from None
