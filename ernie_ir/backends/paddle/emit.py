"""A logits-only Paddle Inference program of a plain graph, and whether Paddle is installed.

An artifact's `--emit paddle-inference` program is the KV-cache decoder
(ernie_ir.backends.paddle.decoder), whose prefill gives the logits; this one traces a graph as it
is (one input), for graphs that are not decoders.

- `emit_paddle_inference(graph, folder)`: the portable Layer (ernie_ir.backends.paddle.layer),
  traced with `paddle.jit.to_static` on one int64 [None, None] input (`input_ids`) and saved with
  `paddle.jit.save` as `folder/model.json` + `folder/model.pdiparams` (Paddle Inference format).
  The portable form is what a CPU can trace (REFERENCE.md 4.1: `weight_only_linear` has no CPU
  kernel and cannot be traced there); a device rebuilds the Layer from `rank0/` with its own
  kernels (`ernie_ir.backends.paddle.layer.build_layer(graph, device="gpu:0")`).
The training executable (`train.json`) is training's: ernie_ir.training.recipe.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from ernie_ir.backends.paddle.layer import PaddleEmitError, build_layer, require_paddle
from ernie_ir.ir import ErnieIRError, Graph

INFERENCE_DIR = "paddle"
MODEL_STEM = "model"


def paddle_available() -> bool:
    try:
        require_paddle()
    except ErnieIRError:
        return False
    return True


def emit_paddle_inference(graph: Graph, folder: Path) -> dict[str, Any]:
    """jit.save the portable Layer of `graph` into `folder` (created); returns a manifest entry."""
    paddle = require_paddle()
    if [v.name for v in graph.inputs] != ["input_ids"]:
        raise PaddleEmitError(f"the Paddle inference model takes one input `input_ids`; this graph has "
                              f"{[v.name for v in graph.inputs]}")
    prev = paddle.get_device()
    try:
        layer = build_layer(graph, device="cpu", portable=True)
        layer.eval()
        wrapper = _ids_wrapper(paddle, layer)
        spec = [paddle.static.InputSpec([None, None], "int64", "input_ids")]
        folder.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # Paddle warns about `place` on every traced tensor
            warnings.filterwarnings("ignore", message=".*'place' interface.*")
            paddle.jit.save(paddle.jit.to_static(wrapper, input_spec=spec, full_graph=True),
                            str(folder / MODEL_STEM))
    finally:
        paddle.set_device(prev)
    for extra in folder.glob("*.pdiparams.info"):
        extra.unlink()  # a dygraph bookkeeping file Paddle Inference does not read
    return {"format": "paddle-inference", "model": f"{INFERENCE_DIR}/{MODEL_STEM}.json",
            "params": f"{INFERENCE_DIR}/{MODEL_STEM}.pdiparams", "input": "input_ids int64 [B, S]",
            "output": layer.output_names[0], "kernels": "portable",
            "paddle_version": paddle.__version__,
            "note": "traced on CPU with portable weight-only (int values * scale, matmul); on a GPU "
                    "rebuild the Layer from rank0/ to use paddle.nn.quant.weight_only_linear"}


def _ids_wrapper(paddle: Any, layer: Any) -> Any:
    class IdsModel(paddle.nn.Layer):  # type: ignore[misc, name-defined]
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any) -> Any:
            return self.inner(input_ids)

    return IdsModel(layer)
