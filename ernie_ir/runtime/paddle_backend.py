"""Run an artifact's Paddle executable on this machine's CPU.

`run_paddle(artifact, input_ids)`: inference artifacts load `inference/paddle/model.json` +
`model.pdiparams` with Paddle Inference (`Config(...).disable_gpu()`); artifacts without that
model (training artifacts) get their Layer built from `rank0/` (the portable form) and run in
dygraph. The Paddle files' sha256 are checked against the manifest first.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ernie_ir.ir import ErnieIRError

from .paddle_layer import require_paddle

MODEL = Path("inference") / "paddle" / "model.json"
PARAMS = Path("inference") / "paddle" / "model.pdiparams"


def _check_files(root: Path, names: list[Path]) -> None:
    mf = root / "manifest.json"
    if not mf.is_file():
        raise ErnieIRError(f"{root} is not an ernie-ir artifact (no manifest.json)")
    listed = json.loads(mf.read_text(encoding="utf-8")).get("files", {})
    for name in names:
        key = name.as_posix()
        if key not in listed:
            raise ErnieIRError(f"artifact {root}: {key} is not listed in manifest.json")
        digest = hashlib.sha256((root / name).read_bytes()).hexdigest()
        if digest != listed[key]:
            raise ErnieIRError(f"artifact {root}: {key} was modified (sha256 does not match the manifest)")


def run_paddle(artifact: Path, input_ids: np.ndarray) -> np.ndarray:
    """Logits [B, S, V] of the artifact's Paddle executable on CPU, for int token ids [B, S]."""
    paddle = require_paddle()
    root = Path(artifact)
    ids = np.ascontiguousarray(np.asarray(input_ids), dtype=np.int64)
    if ids.ndim != 2:
        raise ErnieIRError(f"input_ids must be [batch, seq], got shape {list(ids.shape)}")
    if not (root / MODEL).is_file():
        from ernie_ir.ir.storage import load_graph

        from .paddle_layer import build_layer

        if not (root / "rank0").is_dir():
            raise ErnieIRError(f"{root} has no Paddle model ({MODEL}) and no rank0/ graph")
        _check_files(root, [Path("rank0/graph.ir"), Path("rank0/weights.safetensors")])
        layer = build_layer(load_graph(root / "rank0"), device="cpu")
        layer.eval()
        with paddle.no_grad():
            return np.asarray(layer(paddle.to_tensor(ids)).numpy())
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
