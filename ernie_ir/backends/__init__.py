"""Executable backends: each kind's lowering, writing and running, opened through one door.

`open_backend(artifact, backend)` returns a `BackendSession` (`logits`, `decoder`) that `run`,
`generate` and `eval` share; `BACKENDS` is the one ordered list;
`choose_backend` picks the fastest an artifact offers (`PREFERENCE`). Sub-packages: `interpreter/`
(the reference interpreter over rank graphs), `onnx/` (lowering to ONNX, onnxruntime sessions),
`paddle/` (the Paddle Layer, its inference executable, devices, multi-rank launching),
`fastdeploy/` (the writer of `--emit fastdeploy`; FastDeploy itself serves the folder, not run here).
"""

from ernie_ir.backends.base import BackendError, BackendSession, DecoderParts
from ernie_ir.backends.sessions import (
    AUTO,
    BACKENDS,
    PREFERENCE,
    BackendChoice,
    artifact_backends,
    check_backend,
    choose_backend,
    open_backend,
    reference_backend,
    resolve_backend,
    run_artifact,
)

__all__ = ["AUTO", "BACKENDS", "PREFERENCE", "BackendChoice", "BackendError", "BackendSession",
           "DecoderParts",
           "artifact_backends", "check_backend", "choose_backend", "open_backend", "reference_backend",
           "resolve_backend", "run_artifact"]
