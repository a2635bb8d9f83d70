"""Run an ONNX artifact (`ernie_ir.targets.emit_onnx`) in onnxruntime on the CPU.

The model's metadata says which numerics it was written for
(`ernie_ir.onnx_numerics`: "weight-only", "exact" or "fast", `ernie_ir.onnx_form`):

- form "matmulnbits" (what `compile` writes): the weight-only matmuls are
  `MatMulNBits` nodes whose `accuracy_level` fixes their numerics (1: float32,
  weight-only and exact; 4: int8 activations, fast), which onnxruntime's optimizer keeps as
  written. The session is onnxruntime's default (`ORT_ENABLE_ALL`), the same a
  user gets from a bare `onnxruntime.InferenceSession(path)`.
- form "qdq" (and files without the metadata, written before it): exact only at
  `ORT_ENABLE_BASIC` plus the session config
  `session.qdq_matmulnbits_accuracy_level = 0` (the default level fuses
  DequantizeLinear + MatMul into MatMulNBits with accuracy_level 4). `fast=True`
  runs it at the default level instead (faster, not exact).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ernie_ir.ir import ErnieIRError

META_NUMERICS = "ernie_ir.onnx_numerics"
META_FORM = "ernie_ir.onnx_form"


def model_numerics(model_path: Path) -> tuple[str, str]:
    """(numerics, form) the ONNX file records; ("exact", "qdq") for a file without the record."""
    import onnx

    path = Path(model_path)
    if not path.is_file():
        raise ErnieIRError(f"no ONNX model at {path}")
    props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return props.get(META_NUMERICS, "exact"), props.get(META_FORM, "qdq")


def session(model_path: Path, *, fast: bool = False, threads: int | None = None):
    """An onnxruntime InferenceSession on the CPU EP giving the numerics the file records
    (`fast=True`: a qdq-form file runs at the default, inexact level too)."""
    import onnxruntime as ort

    path = Path(model_path)
    _, form = model_numerics(path)
    opts = ort.SessionOptions()
    if form == "qdq" and not fast:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if threads is not None:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def run_onnx(model_path: Path, input_ids: np.ndarray, *, fast: bool = False,
             numerics: str | None = None) -> np.ndarray:
    """Logits [B, S, V] (float32) of the ONNX model at `model_path` for `input_ids` [B, S].

    `numerics`: what the artifact's manifest records ("weight-only", "exact" or "fast"); the file
    must agree.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ErnieIRError(f"input_ids must be an integer [B, S] array, got {ids.dtype} {list(ids.shape)}")
    if numerics is not None:
        recorded, _ = model_numerics(model_path)
        if recorded != numerics:
            raise ErnieIRError(f"{model_path} was written for {recorded} numerics but the manifest "
                               f"records {numerics}: recompile the artifact")
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException

    try:
        sess = session(model_path, fast=fast)
        return sess.run(None, {sess.get_inputs()[0].name: ids.astype(np.int64)})[0]
    except (Fail, RuntimeException) as e:  # a model this exporter wrote wrong: say so in one line
        detail = " ".join(str(e).split())[:300]
        raise ErnieIRError(f"onnxruntime cannot run {model_path} ({detail}): recompile the artifact, and "
                           "report this as an ernie-ir bug with the compile command") from None
