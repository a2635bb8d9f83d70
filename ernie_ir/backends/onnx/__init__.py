"""The ONNX backend: lowering rank graphs to an ONNX decoder (`lower`) and running it in
onnxruntime (`session`)."""

from ernie_ir.backends.onnx.session import OnnxSession, full_sequence_feeds, run_onnx, session

__all__ = ["OnnxSession", "full_sequence_feeds", "run_onnx", "session"]
