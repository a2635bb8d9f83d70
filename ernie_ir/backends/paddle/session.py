"""Run an artifact's Paddle executable on this machine: its target's device where Paddle has it, else CPU.

`run_paddle(artifact, input_ids)`: inference artifacts load `inference/paddle/model.json` +
`model.pdiparams` with Paddle Inference (`Config(...).disable_gpu()`); artifacts without that
model (training artifacts) get their Layer built from `rank0/` (the portable form) and run in
dygraph. Where this Paddle has the artifact's target device (ernie_ir.backends.paddle.devices: a cuda
artifact on paddlepaddle-gpu with a GPU, ascend with the npu plugin, kunlun on an XPU build),
the Layer is built from `rank0/` on that device instead, with the device kernels the kernel
plan names. The Paddle files' sha256 are checked against the manifest first.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ernie_ir.backends.paddle.layer import require_paddle
from ernie_ir.ir import ErnieIRError

MODEL = Path("inference") / "paddle" / "model.json"
PARAMS = Path("inference") / "paddle" / "model.pdiparams"


def _check_files(root: Path, names: list[Path]) -> None:
    from ernie_ir.artifacts import check_files, read_manifest

    check_files(root, read_manifest(root), [n.as_posix() for n in names])


def paddle_device_for(root: Path) -> str:
    """Where `run_paddle` runs the artifact: its target's device when this Paddle has it, else "cpu".
    The device kind is the artifact's data (its launch recipe's `paddle_device`, e.g. "gpu:0"), so
    a plugin's target runs on its device too. Only a hint (the files are checked before they
    run), so it reads the manifest and the recipe leniently."""
    import json

    from ernie_ir.backends.paddle.devices import run_device

    try:
        manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
        target, mode = manifest.get("target"), manifest.get("mode")
    except (OSError, ValueError, AttributeError, RecursionError):
        return "cpu"
    if not isinstance(target, str):
        return "cpu"
    kind = None
    if mode in ("inference", "training"):
        try:
            recipe = json.loads((root / mode / "launch.json").read_text(encoding="utf-8"))
            device = recipe.get("paddle_device")
            kind = device.split(":", 1)[0] if isinstance(device, str) and device else None
        except (OSError, ValueError, AttributeError, RecursionError):
            kind = None
    return run_device(target, kind)


def run_paddle(artifact: Path, input_ids: np.ndarray) -> np.ndarray:
    """Logits [B, S, V] of the artifact's Paddle executable, for int token ids [B, S].

    On a machine whose Paddle has the target's device (`paddle_device_for`), the Layer is built
    from `rank0/` on that device with the device kernels; elsewhere the CPU executable runs.
    """
    paddle = require_paddle()
    root = Path(artifact)
    ids = np.ascontiguousarray(np.asarray(input_ids), dtype=np.int64)
    if ids.ndim != 2:
        raise ErnieIRError(f"input_ids must be [batch, seq], got shape {list(ids.shape)}")
    device = paddle_device_for(root)
    if device != "cpu" or not (root / MODEL).is_file():
        return _run_layer(paddle, root, ids, device)
    _check_files(root, [MODEL, PARAMS])
    from paddle import inference

    config = inference.Config(str(root / MODEL), str(root / PARAMS))
    config.disable_gpu()
    config.disable_glog_info()
    # oneDNN's pass pipeline prints diagnostics on stdout (breaking `run --json`) and may
    # refuse ops; the plain CPU kernels run the traced program as it is.
    config.disable_mkldnn()
    predictor = inference.create_predictor(config)
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    handle.reshape(list(ids.shape))
    handle.copy_from_cpu(ids)
    predictor.run()
    return np.asarray(predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu())


def _run_layer(paddle: object, root: Path, ids: np.ndarray, device: str) -> np.ndarray:
    """The Layer built from `rank0/` on `device` (device kernels there, the portable form on CPU)."""
    from ernie_ir.backends.paddle.layer import build_layer
    from ernie_ir.ir.storage import load_graph

    if not (root / "rank0").is_dir():
        raise ErnieIRError(f"{root} has no Paddle model ({MODEL}) and no rank0/ graph")
    _check_files(root, [Path("rank0/graph.ir"), Path("rank0/weights.safetensors")])
    layer = build_layer(load_graph(root / "rank0"), device=device)
    layer.eval()
    with paddle.no_grad():  # type: ignore[attr-defined]
        return np.asarray(layer(paddle.to_tensor(ids)).numpy())  # type: ignore[attr-defined]
