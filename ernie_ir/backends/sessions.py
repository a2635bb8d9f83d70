"""Open a compiled artifact on a backend: the one ordered list of backends and the one door.

    session = open_backend(Path("art"), "onnxruntime")
    logits = session.logits(np.array([[1, 2, 3]]))

Backends, in the order `--backend` lists them: "interpreter" (the lowered rank graphs in the
reference interpreter; every artifact), "onnxruntime" (`inference/onnx/model.onnx`: one-rank
inference artifacts, by default up to 2 GiB of rank weights, else with `--emit onnx`; at the
numerics the manifest records),
"paddle" (one rank: the Paddle executable; several: one paddle.distributed gloo process per
rank, rank 0 reports), "paddle-inference" (`inference/paddle/`, the KV-cache decoder of
`--emit paddle-inference` in a `paddle.inference` predictor). `open_backend` verifies the
artifact's hashes and refuses, in one line, a backend it does not know or the artifact does not
offer; `ernie-ir run`, `generate` and `eval` all come through it.

`--backend auto` (the default of `run`, `generate` and `eval`) is `choose_backend`: the first
backend of `PREFERENCE` that applies to the artifact here (see `choose_backend` for the rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ernie_ir.backends.base import BackendError, BackendSession
from ernie_ir.backends.interpreter.session import InterpreterSession
from ernie_ir.backends.onnx.session import OnnxSession
from ernie_ir.backends.paddle.decoder import PaddleInferenceSession
from ernie_ir.backends.paddle.session import PaddleSession

if TYPE_CHECKING:
    from ernie_ir.artifacts import Manifest

SESSIONS: dict[str, type[BackendSession]] = {
    cls.name: cls for cls in (InterpreterSession, OnnxSession, PaddleSession, PaddleInferenceSession)}
BACKENDS: tuple[str, ...] = tuple(SESSIONS)
"""Every backend, in the order `--backend` offers them."""
PREFERENCE: tuple[str, ...] = ("paddle-inference", "onnxruntime", "paddle", "interpreter")
"""Fastest first: what `--backend auto` tries, in this order (measured: benchmarks/default_backend.py;
paddle-inference: docs/targets.md section 7)."""
AUTO = "auto"
"""The `--backend` value that lets `choose_backend` pick."""


def check_backend(backend: str) -> None:
    """BackendError (one line) for a backend name nobody knows."""
    if backend not in SESSIONS and backend != AUTO:
        raise BackendError(f"unknown --backend {backend!r}: choose {', '.join(BACKENDS)} or {AUTO}")


@dataclass(frozen=True)
class BackendChoice:
    """The backend `--backend auto` picked, and why (the one line the CLI prints)."""

    name: str
    why: str

    def line(self) -> str:
        return f"backend: {self.name} ({self.why}; --backend to choose)"


def _onnxruntime_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


def _paddle_importable() -> bool:
    """Whether Paddle is installed (asked without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("paddle") is not None


_DEVICE_BUILDS = ("paddlepaddle-gpu", "paddlepaddle-xpu", "paddlepaddle-dcu", "paddlepaddle-rocm",
                  "paddle-custom-npu", "paddle-custom-device")
"""Paddle distributions that run on a device: without one, Paddle is not imported (seconds) to ask."""


def _device_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    for dist in _DEVICE_BUILDS:
        try:
            version(dist)
            return True
        except PackageNotFoundError:
            continue
    return False


def _paddle_device(target: str | None) -> str | None:
    """The Paddle device an artifact for `target` runs on here ("gpu:0"), None on CPU or without
    Paddle (asked only when an artifact offers paddle and not onnxruntime)."""
    from ernie_ir.backends.paddle.devices import run_device
    from ernie_ir.backends.paddle.emit import paddle_available

    if target is None or not _device_build() or not paddle_available():
        return None
    device = run_device(target)
    return None if device == "cpu" else device


def choose_backend(manifest: Manifest) -> BackendChoice:
    """The fastest backend `manifest`'s artifact offers here, in `PREFERENCE` order:

    - paddle-inference where the artifact carries the Paddle Inference decoder (`--emit
      paddle-inference`; one rank, inference) and Paddle is installed: on a CPU its predictor
      decodes faster than onnxruntime, float32 and weight-only alike (docs/targets.md section 7);
    - onnxruntime where the artifact carries the ONNX decoder (one rank, inference);
    - paddle for a one-rank inference artifact when Paddle has the target's device here (on a
      CPU Paddle's weight-only layers are slower than the interpreter's cached float weights);
    - the interpreter otherwise: every artifact offers it, a training artifact's forward is the
      reference's, and several ranks run in this one process (paddle starts a process per rank
      on every call, which each `eval` window and each `run` would pay).
    """
    offered = manifest.offered
    ranks = manifest.mapping.rank_graphs
    if "paddle-inference" in offered and _paddle_importable():
        return BackendChoice("paddle-inference", "the fastest this artifact offers")
    if "onnxruntime" in offered and _onnxruntime_importable():
        return BackendChoice("onnxruntime", "the fastest this artifact offers")
    if manifest.mode == "training":
        return BackendChoice("interpreter", "a training artifact runs its forward on the reference")
    if ranks > 1:
        return BackendChoice("interpreter", f"its {ranks} rank graphs run in one process")
    if "paddle" in offered:
        device = _paddle_device(manifest.target)
        if device is not None:
            return BackendChoice("paddle", f"Paddle's kernels on {device}")
    if "onnxruntime" not in offered:
        return BackendChoice("interpreter", "compile with --emit onnx for onnxruntime, the fastest")
    return BackendChoice("interpreter", "onnxruntime is not installed")


def resolve_backend(model: str | Path, backend: str, *, as_compiled: bool = True) -> BackendChoice | None:
    """`backend` for `model`: None when it names one (forced); for `auto`, `choose_backend` on an
    artifact run as compiled, else the interpreter (a model, or an artifact rewritten first)."""
    check_backend(backend)
    if backend != AUTO:
        return None
    root = Path(model)
    if not (root / "manifest.json").is_file():
        return BackendChoice("interpreter", "a model runs on the interpreter; compile it for onnxruntime")
    if not as_compiled:
        return BackendChoice("interpreter", "the artifact is rewritten first")
    from ernie_ir.artifacts import read_manifest

    return choose_backend(read_manifest(root))


def reference_backend(reference: str | Path, backend: str) -> str:
    """The backend a `--compare-to` reference runs on: `backend` where the reference is an
    artifact that offers it (a model compared with itself runs twice the same way), else the
    interpreter (and for several paddle ranks, which score only whole sequences)."""
    root = Path(reference)
    if backend == "interpreter" or not (root / "manifest.json").is_file():
        return "interpreter"
    from ernie_ir.artifacts import read_manifest

    manifest = read_manifest(root)
    if backend not in manifest.offered or (backend == "paddle" and manifest.mapping.rank_graphs > 1):
        return "interpreter"
    return backend


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
