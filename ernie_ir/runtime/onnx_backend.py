"""Moved: ONNX sessions live in ernie_ir.backends.onnx. This name stays so that code written
against docs/ops.md before the move (`from ernie_ir.runtime.onnx_backend import
full_sequence_feeds`) keeps importing; new code imports ernie_ir.backends.onnx."""

from ernie_ir.backends.onnx.session import full_sequence_feeds, run_onnx, session

__all__ = ["full_sequence_feeds", "run_onnx", "session"]
