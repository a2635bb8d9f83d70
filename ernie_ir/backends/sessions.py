"""Open a compiled artifact on a backend: the one ordered list of backends and the one door.

    session = open_backend(Path("art"), "onnxruntime")
    logits = session.logits(np.array([[1, 2, 3]]))

Backends, in the order `--backend` lists them: "interpreter" (the lowered rank graphs in the
reference interpreter; every artifact), "onnxruntime" (`inference/onnx/model.onnx`, cuda
inference artifacts compiled with `--emit onnx`, at the numerics the manifest records),
"paddle" (one rank: the Paddle executable; several: one paddle.distributed gloo process per
rank, rank 0 reports). `open_backend` verifies the artifact's hashes and refuses, in one line, a
backend it does not know or the artifact does not offer; `ernie-ir run`, `generate` and `eval`
all come through it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ernie_ir.backends.base import BackendError, BackendSession
from ernie_ir.backends.interpreter.session import InterpreterSession
from ernie_ir.backends.onnx.session import OnnxSession
from ernie_ir.backends.paddle.session import PaddleSession

SESSIONS: dict[str, type[BackendSession]] = {
    cls.name: cls for cls in (InterpreterSession, OnnxSession, PaddleSession)}
BACKENDS: tuple[str, ...] = tuple(SESSIONS)
"""Every backend, in the order `--backend` offers them."""


def check_backend(backend: str) -> None:
    """BackendError (one line) for a backend name nobody knows."""
    if backend not in SESSIONS:
        raise BackendError(f"unknown --backend {backend!r}: choose {', '.join(BACKENDS)}")


def artifact_backends(path: Path) -> list[str]:
    """The backends the artifact's manifest offers (older artifacts: the interpreter only)."""
    from ernie_ir.artifacts import read_manifest

    return read_manifest(path).offered


def open_backend(artifact: Path, backend: str) -> BackendSession:
    """The artifact at `artifact` opened on `backend`, its hashes checked first."""
    from ernie_ir.artifacts import verify_artifact

    root = Path(artifact)
    manifest = verify_artifact(root)
    offered = manifest.offered
    if backend not in offered:
        raise BackendError(f"artifact {root} does not offer backend {backend!r}; it offers "
                           f"{', '.join(offered)}")
    check_backend(backend)
    return SESSIONS[backend](root, manifest)


def run_artifact(path: Path, input_ids: np.ndarray, backend: str, *,
                 timeout_s: float | None = None) -> np.ndarray:
    """Logits [B, S, V] of the artifact at `path` for `input_ids` [B, S] on `backend`.

    `timeout_s` bounds a multi-rank paddle run (default ernie_ir.backends.paddle.launch.RUN_TIMEOUT_S).
    """
    return open_backend(path, backend).logits(input_ids, timeout_s=timeout_s)
