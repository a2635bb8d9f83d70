"""Run an ONNX artifact (`ernie_ir.backends.onnx.lower`) in onnxruntime on the CPU.

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

The model `compile --emit onnx` writes is a KV-cache decoder (docs/targets.md, "The ONNX
decoder"): besides `input_ids` it reads `attention_mask`, `position_ids` and
`past_key_values.{i}.key/.value`. `full_sequence_feeds(session, ids)` gives the feeds of a
whole-sequence call (a mask of ones, positions 0..S-1, an empty past), which `run_onnx` uses;
a model without those inputs (`emit_onnx` of a plain graph) is fed `input_ids` alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends.base import BackendSession, CacheLayers, DecoderParts
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.runtime.decoding import DecodeError, StepFn

META_NUMERICS = "ernie_ir.onnx_numerics"
META_FORM = "ernie_ir.onnx_form"
ONNX_MODEL = Path("inference") / "onnx" / "model.onnx"
"""Where an artifact holds its ONNX decoder."""


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


_INT_FEEDS = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
_FLOAT_FEEDS = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def full_sequence_feeds(session: Any, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The feeds of one call over whole sequences `input_ids` [B, S] for an onnxruntime session:
    for a decoder (inputs `attention_mask`, `position_ids`, `past_key_values.*`) a mask of ones
    [B, S], positions 0..S-1 and a past of length 0 ([B, kv_heads, 0, head_dim], the sizes the
    session's inputs declare), each in the dtype its input declares; otherwise `input_ids` alone
    (int64). Read `logits` from the first output either way."""
    ids = np.asarray(input_ids).astype(np.int64)
    inputs = session.get_inputs()
    by_name = {i.name: i for i in inputs}
    if "attention_mask" not in by_name:
        return {inputs[0].name: ids}
    b, s = ids.shape
    feeds: dict[str, np.ndarray] = {}
    for i in inputs:
        if i.name == "input_ids":
            feeds[i.name] = ids.astype(_INT_FEEDS.get(i.type, np.int64))
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((b, s), _INT_FEEDS.get(i.type, np.int64))
        elif i.name == "position_ids":
            feeds[i.name] = np.broadcast_to(np.arange(s), (b, s)).astype(_INT_FEEDS.get(i.type, np.int64))
        elif i.name.startswith("past_key_values."):
            kv, d = i.shape[1], i.shape[3]
            if not (isinstance(kv, int) and isinstance(d, int)):
                raise ErnieIRError(f"ONNX decoder input {i.name} {i.shape}: kv heads and head dim must be "
                                   "fixed numbers: recompile the artifact")
            feeds[i.name] = np.zeros((b, kv, 0, d), _FLOAT_FEEDS.get(i.type, np.float32))
        else:
            raise ErnieIRError(f"ONNX model input {i.name!r} is not a decoder input this runner knows "
                               "(input_ids, attention_mask, position_ids, past_key_values.*)")
    return feeds


def run_onnx(model_path: Path, input_ids: np.ndarray, *, fast: bool = False,
             numerics: str | None = None) -> np.ndarray:
    """Logits [B, S, V] (float32) of the ONNX model at `model_path` for `input_ids` [B, S] (a
    decoder is fed `full_sequence_feeds`: the whole sequences, an empty past).

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
        names = [o.name for o in sess.get_outputs()]
        logits = "logits" if "logits" in names else names[0]  # a decoder returns its present cache too
        return sess.run([logits], full_sequence_feeds(sess, ids))[0]
    except (Fail, RuntimeException) as e:  # a model this exporter wrote wrong: say so in one line
        detail = " ".join(str(e).split())[:300]
        raise ErnieIRError(f"onnxruntime cannot run {model_path} ({detail}): recompile the artifact, and "
                           "report this as an ernie-ir bug with the compile command") from None


def decoder_step(model: Path) -> tuple[StepFn, CacheLayers]:
    """One step of the ONNX decoder at `model` and its cache layout (read from its inputs)."""
    sess = session(model)
    inputs = {i.name: i for i in sess.get_inputs()}
    if "attention_mask" not in inputs:
        raise DecodeError(f"{model} is not a decoder (no attention_mask, no past_key_values): it was "
                          "written before ernie-ir decoded with a KV cache; recompile the artifact")
    layers = []
    i = 0
    while f"past_key_values.{i}.key" in inputs:
        _, kv, _, d = inputs[f"past_key_values.{i}.key"].shape
        layers.append((int(kv), int(d)))
        i += 1
    names = [o.name for o in sess.get_outputs()]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in inputs}), strict=True))

    return step, tuple(layers)


class OnnxSession(BackendSession):
    """`inference/onnx/model.onnx` in onnxruntime, at the numerics the manifest records."""

    name = "onnxruntime"
    compiled_decoder = True

    def logits(self, input_ids: np.ndarray, *, timeout_s: float | None = None) -> np.ndarray:
        ids = np.asarray(input_ids)
        self.check_ids(ids)
        return run_onnx(self.root / ONNX_MODEL, ids, numerics=self.manifest.onnx_numerics)

    def decoder(self, graphs: list[Graph], *, timeout_s: float | None = None) -> DecoderParts:
        step, layers = decoder_step(self.root / ONNX_MODEL)
        return DecoderParts(step, layers)
