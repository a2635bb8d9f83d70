"""The Paddle Inference KV-cache decoder (`--emit paddle-inference`) and the session that steps it.

`emit_paddle_decoder(decoder, folder)` traces the portable Layer (ernie_ir.backends.paddle.layer)
of a decoder graph (the `kv-cache` pass applied to the rank graph) with `paddle.jit.to_static`
and saves it with `paddle.jit.save` as `folder/model.json` + `folder/model.pdiparams`, with
`folder/decoder.json` naming its inputs and outputs. Its interface is the ONNX decoder's
(ernie_ir.backends.onnx.lower):

- inputs `input_ids`, `attention_mask`, `position_ids` (int64 [B, S], [B, past + S], [B, S]) and
  `past_key_values.{i}.key` / `.value` (float32 [B, kv_heads, past, head_dim]; length 0 on the
  first call);
- outputs `logits` [B, S, V], then `present.{i}.key` / `.value`, in that order: Paddle names
  its fetch targets `fetch_name_N`, so `decoder.json` lists the names in fetch order.

It is the artifact's only Paddle Inference program: the whole-sequence logits (`ernie-ir run`,
`eval`) are its prefill (a mask of ones, positions 0..S-1, an empty past), so the weights are
written once. `PaddleInferenceSession` (backend "paddle-inference") runs it with a bare
`paddle.inference` predictor on the CPU (`Config(...).disable_gpu()`), one step per call.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends.base import BackendSession, CacheLayers, DecoderParts
from ernie_ir.backends.paddle.layer import PaddleEmitError, build_layer, require_paddle
from ernie_ir.ir import DType, ErnieIRError, Graph
from ernie_ir.runtime.decoding import PAST, PRESENT, StepFn

FOLDER = Path("inference") / "paddle"
MODEL = FOLDER / "model.json"
PARAMS = FOLDER / "model.pdiparams"
IO = FOLDER / "decoder.json"
"""The decoder's inputs and outputs by name, in the predictor's order, and its cache layout."""
_STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")


def emit_paddle_decoder(decoder: Graph, folder: Path) -> list[Path]:
    """jit.save the portable Layer of the decoder graph `decoder` into `folder` (created); returns
    the files written."""
    from ernie_ir.passes.decoding.kv_cache import CacheLayout

    paddle = require_paddle()
    layout = CacheLayout.of(decoder)
    names = [v.name for v in decoder.inputs]
    pasts = [PAST.format(i=i, kind=k) for i in range(len(layout.layers)) for k in ("key", "value")]
    if names != [*_STEP_INPUTS, *pasts]:
        raise PaddleEmitError(f"a Paddle Inference decoder takes {', '.join(_STEP_INPUTS)} and the past "
                              f"keys and values; this graph has {names}")
    past_dtype = "uint8" if decoder.inputs[3].type.dtype == DType.U8 else "float32"
    spec = [paddle.static.InputSpec([None, None], "int64", n) for n in _STEP_INPUTS]
    spec.append([paddle.static.InputSpec([None, kv, None, d], past_dtype, PAST.format(i=i, kind=k))
                 for i, (kv, d) in enumerate(layout.layers) for k in ("key", "value")])
    prev = paddle.get_device()
    try:
        layer = build_layer(decoder, device="cpu", portable=True)
        layer.eval()
        folder.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # Paddle warns about `place` on every traced tensor
            warnings.filterwarnings("ignore", message=".*'place' interface.*")
            paddle.jit.save(paddle.jit.to_static(_step_wrapper(paddle, layer), input_spec=spec,
                                                 full_graph=True), str(folder / MODEL.stem))
    finally:
        paddle.set_device(prev)
    for extra in folder.glob("*.pdiparams.info"):
        extra.unlink()  # a dygraph bookkeeping file Paddle Inference does not read
    io = {"inputs": names, "outputs": list(decoder.output_names),
          "cache_layers": [list(layer) for layer in layout.layers], "past_dtype": past_dtype,
          "paddle_version": paddle.__version__}
    (folder / IO.name).write_text(json.dumps(io, indent=2) + "\n", encoding="utf-8")
    return [folder / MODEL.name, folder / PARAMS.name, folder / IO.name]


def _step_wrapper(paddle: Any, layer: Any) -> Any:
    """The Layer with the decoder's signature: to_static names each input by its InputSpec, and
    needs the arguments spelled out (the past as one list)."""

    class DecoderStep(paddle.nn.Layer):  # type: ignore[misc, name-defined]
        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, past: list[Any]) -> Any:
            return self.inner(input_ids, attention_mask, position_ids, *past)

    return DecoderStep(layer)


def predictor(model: Path, params: Path) -> Any:
    """A `paddle.inference` predictor of the saved program on the CPU."""
    require_paddle()
    from paddle import inference

    config = inference.Config(str(model), str(params))
    config.disable_gpu()
    config.disable_glog_info()
    # oneDNN's pass pipeline prints diagnostics on stdout (breaking `run --json`) and may
    # refuse ops; the plain CPU kernels run the traced program as it is.
    config.disable_mkldnn()
    return inference.create_predictor(config)


def _run(pred: Any, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    for name in pred.get_input_names():
        handle = pred.get_input_handle(name)
        value = np.ascontiguousarray(feeds[name])
        handle.reshape(list(value.shape))
        handle.copy_from_cpu(value)
    pred.run()
    return [np.asarray(pred.get_output_handle(n).copy_to_cpu()) for n in pred.get_output_names()]


def read_io(root: Path) -> dict[str, Any]:
    """The artifact's `decoder.json` (its hashes are checked by the caller)."""
    try:
        io = json.loads((root / IO).read_text(encoding="utf-8"))
        layers = tuple((int(kv), int(d)) for kv, d in io["cache_layers"])
        outputs = [str(n) for n in io["outputs"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ErnieIRError(f"{root / IO} cannot be read ({type(e).__name__}): recompile the artifact with "
                           "--emit paddle-inference") from None
    return {**io, "cache_layers": layers, "outputs": outputs}


def full_sequence_feeds(ids: np.ndarray, layers: CacheLayers,
                        past_dtype: str = "float32") -> dict[str, np.ndarray]:
    """The feeds of one call over whole sequences `ids` [B, S]: a mask of ones, positions 0..S-1
    and a past of length 0."""
    b, s = ids.shape
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((b, s), np.int64),
             "position_ids": np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()}
    for i, (kv, d) in enumerate(layers):
        for kind in ("key", "value"):
            feeds[PAST.format(i=i, kind=kind)] = np.zeros((b, kv, 0, d), past_dtype)
    return feeds


def prefill_logits(root: Path, ids: np.ndarray, pred: Any = None) -> np.ndarray:
    """Logits [B, S, V] of the artifact's Paddle Inference program for whole sequences `ids`: the
    decoder's prefill; a program written before the decoder (one input, `input_ids`) is fed the
    ids alone. `pred`: a predictor of that program already made (default: a new one)."""
    pred = predictor(root / MODEL, root / PARAMS) if pred is None else pred
    if pred.get_input_names() == ["input_ids"]:
        return _run(pred, {"input_ids": ids})[0]
    io = read_io(root)
    return _run(pred, full_sequence_feeds(ids, io["cache_layers"], io.get("past_dtype", "float32")))[0]


def decoder_step(root: Path, pred: Any = None) -> tuple[StepFn, CacheLayers]:
    """One step of the artifact's Paddle Inference decoder, and its cache layout. `pred`: a
    predictor of that program already made (default: a new one)."""
    from ernie_ir.runtime.decoding import DecodeError

    pred = predictor(root / MODEL, root / PARAMS) if pred is None else pred
    if "attention_mask" not in pred.get_input_names():
        raise DecodeError(f"{root / MODEL} is a logits-only program (written before ernie-ir emitted the "
                          "Paddle Inference decoder): recompile the artifact with --emit paddle-inference")
    io = read_io(root)
    names = io["outputs"]
    if len(names) != len(pred.get_output_names()) or names[0] != "logits" or any(
            n != PRESENT.format(i=i // 2, kind=("key", "value")[i % 2]) for i, n in enumerate(names[1:])):
        raise ErnieIRError(f"{root / IO} does not describe {root / MODEL}: recompile the artifact")

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, _run(pred, feeds), strict=True))

    return step, io["cache_layers"]


class PaddleInferenceSession(BackendSession):
    """`inference/paddle/` (the KV-cache decoder) in a `paddle.inference` predictor on the CPU."""

    name = "paddle-inference"
    compiled_decoder = True

    def _predictor(self) -> Any:
        """The session's one predictor (each `eval` window reuses it), made after the files'
        sha256 are checked against the manifest."""
        pred = getattr(self, "_pred", None)
        if pred is None:
            from ernie_ir.artifacts import check_files

            check_files(self.root, self.manifest, [MODEL.as_posix(), PARAMS.as_posix(), IO.as_posix()])
            pred = self._pred = predictor(self.root / MODEL, self.root / PARAMS)
        return pred

    def logits(self, input_ids: np.ndarray, *, timeout_s: float | None = None) -> np.ndarray:
        ids = np.asarray(input_ids)
        self.check_ids(ids)
        if ids.ndim != 2:
            raise ErnieIRError(f"input_ids must be [batch, seq], got shape {list(ids.shape)}")
        return prefill_logits(self.root, np.ascontiguousarray(ids, dtype=np.int64), self._predictor())

    def decoder(self, graphs: list[Graph], *, timeout_s: float | None = None) -> DecoderParts:
        step, layers = decoder_step(self.root, self._predictor())
        return DecoderParts(step, layers)
