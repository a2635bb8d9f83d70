"""Executable backends: each kind's lowering, writing and running, opened through one door.

`open_backend(artifact, backend)` returns a `BackendSession` (`logits`, `decoder`) that `run`,
`generate` and `eval` share; `BACKENDS` is the one ordered list. Sub-packages: `interpreter/`
(the reference interpreter over rank graphs), `onnx/` (lowering to ONNX, onnxruntime sessions),
`paddle/` (the Paddle Layer, its inference executable, devices, multi-rank launching),
`fastdeploy/` (the writer of `--emit fastdeploy`; FastDeploy itself serves the folder, not run here).
"""

from ernie_ir.backends.base import BackendError, BackendSession, DecoderParts
from ernie_ir.backends.sessions import BACKENDS, artifact_backends, check_backend, open_backend, run_artifact

__all__ = ["BACKENDS", "BackendError", "BackendSession", "DecoderParts", "artifact_backends",
           "check_backend", "open_backend", "run_artifact"]
