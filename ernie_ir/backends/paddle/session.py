"""Run an artifact's Paddle executable on this machine: its target's device where Paddle has it, else CPU.

`run_paddle(artifact, input_ids)`: inference artifacts load `inference/paddle/model.json` +
`model.pdiparams` with Paddle Inference (`Config(...).disable_gpu()`) and take the decoder's
prefill (ernie_ir.backends.paddle.decoder); artifacts without that
model (training artifacts) get their Layer built from `rank0/` (the portable form) and run in
dygraph. Where this Paddle has the artifact's target device (ernie_ir.backends.paddle.devices: a cuda
artifact on paddlepaddle-gpu with a GPU, ascend with the npu plugin, kunlun on an XPU build),
the Layer is built from `rank0/` on that device instead, with the device kernels the kernel
plan names. The Paddle files' sha256 are checked against the manifest first.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends.base import BackendSession, DecoderParts, RunFn, StopFn, TokensFn
from ernie_ir.backends.paddle.layer import require_paddle
from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.runtime.decoding import DecodeError, DecodeOptions, DecodeResult, StepFn

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
    from ernie_ir.backends.paddle.decoder import IO, prefill_logits

    _check_files(root, [MODEL, PARAMS, *([IO] if (root / IO).exists() else [])])
    return prefill_logits(root, ids)


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


def layer_step(graph: Graph, device: str) -> StepFn:
    """One decoder step of `graph`'s Paddle Layer on `device`, in this process."""
    from ernie_ir.backends.paddle.layer import build_layer

    paddle = require_paddle()
    layer = build_layer(graph, device=device)
    layer.eval()
    names = [v.name for v in graph.inputs]
    outs = list(graph.output_names)

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with paddle.no_grad():
            args = [paddle.to_tensor(np.ascontiguousarray(feeds[n])) for n in names]
            res = layer(*args)
        res = res if isinstance(res, tuple) else (res,)
        return {n: np.asarray(r.numpy()) for n, r in zip(outs, res, strict=True)}

    return step


def rank_processes(root: Path, graphs: list[Graph], timeout_s: float | None) -> tuple[StepFn, RunFn]:
    """(step that refuses, run) of a multi-rank artifact's decoders on one gloo process per rank."""
    from ernie_ir.backends.paddle.launch import RUN_TIMEOUT_S, generate_distributed
    from ernie_ir.ir.printer import print_graph

    texts = [print_graph(g) for g in graphs]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise DecodeError(f"artifact {root} has {len(graphs)} ranks: its Paddle decoders run the whole "
                          "loop in their rank processes (Decoder.generate), not one step at a time")

    def run(prompts: list[list[int]], options: DecodeOptions, stop: StopFn | None,
            on_tokens: TokensFn | None) -> DecodeResult:
        new: list[list[int]] = [[] for _ in prompts]
        ended = [False] * len(prompts)  # by a stop string: the ranks know only eos and the length

        def on_step(s: int, tokens: np.ndarray, live: list[bool]) -> None:
            was_live = [a and not e for a, e in zip(live, ended, strict=True)]
            for b, t in enumerate(tokens):
                if was_live[b]:
                    new[b].append(int(t))
                    if stop is not None and stop(b, new[b]):
                        ended[b] = True
            if on_tokens is not None and any(was_live):
                on_tokens(s, tokens, was_live)

        result = generate_distributed(root, texts, prompts, options, on_step=on_step,
                                      timeout_s=RUN_TIMEOUT_S if timeout_s is None else timeout_s)
        for b, done in enumerate(ended):
            if done:
                result.new_tokens[b] = new[b]
                result.finish_reasons[b] = "stop"
        steps = max(len(n) for n in result.new_tokens)  # the loop ends once every row has
        result.decode_ms = result.decode_ms[: steps - 1]
        result.step_logits = result.step_logits[:steps]
        return result

    return step, run


class PaddleSession(BackendSession):
    """One rank: the Paddle executable (`run_paddle`) and its Layer stepping here. Several: one
    paddle.distributed gloo process per rank (ernie_ir.backends.paddle.launch), rank 0 reports;
    they run the whole generation loop there."""

    name = "paddle"

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        from ernie_ir.artifacts import artifact_mapping, require_weights

        super().__init__(root, manifest)
        require_weights(root, manifest)
        self.mapping = artifact_mapping(manifest)

    @property
    def steps_here(self) -> bool:
        return self.mapping.world_size == 1

    def logits(self, input_ids: np.ndarray, *, timeout_s: float | None = None) -> np.ndarray:
        ids = np.asarray(input_ids)
        self.check_ids(ids)
        if self.mapping.rank_graphs == 1:
            return run_paddle(self.root, ids)
        from ernie_ir.backends.paddle.launch import RUN_TIMEOUT_S, run_distributed

        if ids.ndim != 2:
            raise ErnieIRError(f"input_ids must be [batch, seq], got shape {list(ids.shape)}")
        return run_distributed(self.root, ids, self.mapping.rank_graphs,
                               timeout_s=RUN_TIMEOUT_S if timeout_s is None else timeout_s)

    def decoder(self, graphs: list[Graph], *, timeout_s: float | None = None) -> DecoderParts:
        if self.mapping.world_size > 1:
            step, run = rank_processes(self.root, graphs, timeout_s)
            return DecoderParts(step, run=run)
        return DecoderParts(layer_step(graphs[0], paddle_device_for(self.root)))
