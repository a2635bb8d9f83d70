"""A MODEL or an artifact opened as a decoder: one `step` per call, on the backend asked for.

| source | backend | what runs |
|---|---|---|
| MODEL (checkpoint, built-in, IR, graph folder) | interpreter | its graph after the kv-cache pass |
| artifact, one rank | interpreter | `rank0/graph.ir` after the kv-cache pass |
| artifact, several ranks | interpreter | every rank's decoder in lockstep (SPMD interpreter) |
| artifact with `inference/onnx/` | onnxruntime | `model.onnx`, the decoder compile wrote |
| artifact, one rank | paddle | the Paddle Layer of rank 0's decoder graph |
| artifact, several ranks | paddle | one gloo process per rank, each running the whole loop |

Several Paddle ranks cannot step from here: `Decoder.generate` writes each rank's decoder graph
(its text only: the params are the artifact's rank weights) and the ranks run the loop in
lockstep (ernie_ir.backends.paddle.launch.generate_distributed); each step's tokens stream back, and a
stop string ends a row here (its tokens after that step are dropped, as the loop would not have
made them: rows decode independently).

The cache's dtype is the artifact's (`kv_cache_dtype` in its manifest) unless given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.ir import Graph
from ernie_ir.passes.decoding.kv_cache import KvCacheError, add_kv_cache
from ernie_ir.runtime.decoding import (
    DecodeError,
    DecodeOptions,
    DecodeResult,
    StepFn,
    cache_dtype_of,
    decode,
)

BACKENDS = ("interpreter", "onnxruntime", "paddle")
ONNX_MODEL = Path("inference") / "onnx" / "model.onnx"
StopFn = Callable[[int, list[int]], bool]
TokensFn = Callable[[int, np.ndarray, list[bool]], None]
RunFn = Callable[[list[list[int]], DecodeOptions, StopFn | None, TokensFn | None], DecodeResult]


@dataclass
class Decoder:
    """A decoder ready to step, and what the loop needs to know about its model."""

    step: StepFn
    cache_layers: tuple[tuple[int, int], ...]
    config: dict[str, Any]
    """The model's config.json (`graph.metadata["config"]`; empty for a bare IR file)."""
    backend: str
    vocab_size: int
    folder: Path | None = None
    """Where the tokenizer and generation_config.json are looked for (None: nowhere)."""
    graphs: list[Graph] = field(default_factory=list)
    """The decoder graphs (rank order); empty for the ONNX backend."""
    run: RunFn | None = None
    """Runs the whole loop elsewhere (several Paddle ranks); None: `decode` over `step`, here."""
    cache_dtype: type = np.float32
    """The numpy dtype of the empty first past (uint8 for a C8 cache)."""

    def generate(self, prompts: list[list[int]], options: DecodeOptions, *, stop: StopFn | None = None,
                 on_tokens: TokensFn | None = None) -> DecodeResult:
        """The generation loop (ernie_ir.runtime.decoding.decode) over this decoder."""
        if self.run is not None:
            return self.run(prompts, options, stop, on_tokens)
        return decode(self.step, self.cache_layers, prompts, options, cache_dtype=self.cache_dtype,
                      stop=stop, on_tokens=on_tokens)

    @property
    def context_length(self) -> int | None:
        """The most positions the model has (`max_position_embeddings`), None if unknown."""
        n = self.config.get("max_position_embeddings")
        return int(n) if isinstance(n, int) and n > 0 else None


def _decoder_graphs(graphs: list[Graph], kv_cache_dtype: str | None) -> tuple[tuple[int, int], ...]:
    layout = None
    for g in graphs:
        try:
            layout = add_kv_cache(g, kv_cache_dtype)
        except KvCacheError as e:
            raise DecodeError(f"cannot generate with this model: {e}") from None
    assert layout is not None
    return layout.layers


def _interpreter_step(graphs: list[Graph]) -> StepFn:
    if len(graphs) == 1:
        from ernie_ir.runtime import Interpreter

        it = Interpreter(graphs[0])
        return it.run
    from ernie_ir.runtime.spmd import run_spmd

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Each rank keeps its own cache (its own KV heads): the loop carries them stacked on a
        # leading rank axis, and a first step's empty past serves every rank.
        per_rank = [{k: (v[r] if k.startswith("past_key_values.") and v.ndim == 5 else v)
                     for k, v in feeds.items()} for r in range(len(graphs))]
        outs = run_spmd(graphs, per_rank)
        result = dict(outs[0])
        for k in result:
            if k.startswith("present."):
                result[k] = np.stack([o[k] for o in outs])
        return result

    return step


def _vocab(graph: Graph) -> int:
    logits = graph.outputs[0].type.shape
    if not logits or not isinstance(logits[-1], int):
        raise DecodeError(f"graph {graph.name}: its first output is not logits [B, S, vocab]")
    return int(logits[-1])


def _paddle_step(graph: Graph, device: str) -> StepFn:
    from ernie_ir.backends.paddle.layer import build_layer, require_paddle

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


def _paddle_ranks(root: Path, graphs: list[Graph], timeout_s: float | None) -> tuple[StepFn, RunFn]:
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


def _onnx_step(model: Path) -> tuple[StepFn, tuple[tuple[int, int], ...]]:
    from ernie_ir.backends.onnx.session import session

    sess = session(model)
    inputs = {i.name: i for i in sess.get_inputs()}
    if "attention_mask" not in inputs:
        raise DecodeError(f"{model} is not a decoder (no attention_mask, no past_key_values): it was "
                          "written before ernie-ir decoded with a KV cache; recompile the artifact")
    layers = []
    i = 0
    while f"past_key_values.{i}.key" in inputs:
        _, kv, _, d = inputs[f"past_key_values.{i}.key"].shape
        layers.append((int(kv), int(d)))
        i += 1
    names = [o.name for o in sess.get_outputs()]

    def step(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in inputs}), strict=True))

    return step, tuple(layers)


def open_decoder(model: str | Path, backend: str = "interpreter", *, kv_cache_dtype: str | None = None,
                 trust_pickle: bool = False, timeout_s: float | None = None) -> Decoder:
    """`model` (a MODEL argument or an artifact folder) as a decoder on `backend`.

    `timeout_s` bounds each generation of a multi-rank artifact on Paddle (default
    ernie_ir.backends.paddle.launch.RUN_TIMEOUT_S); the ranks are stopped when it passes.

    DecodeError / ErnieIRError (one line) for an unknown backend, one the artifact does not offer,
    or a graph that cannot decode (no attention, not one `input_ids` input)."""
    if backend not in BACKENDS:
        raise DecodeError(f"unknown --backend {backend!r}: choose {', '.join(BACKENDS)}")
    root = Path(model)
    if not (root / "manifest.json").is_file():
        if backend != "interpreter":
            raise DecodeError(f"--backend {backend} runs a compiled artifact; {model} is a model: compile "
                              "it first (ernie-ir compile ... --emit onnx), or use --backend interpreter")
        from ernie_ir.load import load_input

        graph = load_input(str(model), trust_pickle=trust_pickle)
        config = dict(graph.metadata.get("config") or {})
        vocab = _vocab(graph)
        layers = _decoder_graphs([graph], kv_cache_dtype)
        return Decoder(_interpreter_step([graph]), layers, config, backend, vocab,
                       folder=root if root.is_dir() else None, graphs=[graph],
                       cache_dtype=cache_dtype_of(graph))

    from ernie_ir.artifacts import artifact_mapping, load_rank_graphs, verify_artifact

    manifest = verify_artifact(root)
    offered = list(manifest.get("backends", ["interpreter"]))
    if backend not in offered:
        raise DecodeError(f"artifact {root} does not offer backend {backend!r}; it offers "
                          f"{', '.join(offered)}")
    if manifest.get("mode") != "inference":
        raise DecodeError(f"artifact {root} was compiled for {manifest.get('mode')}; generating needs an "
                          "inference artifact: compile with --mode inference")
    if artifact_mapping(manifest).pp > 1:
        raise DecodeError(f"artifact {root} is pipelined (--pp {artifact_mapping(manifest).pp}): its stages "
                          "have no KV-cache decoder, so it cannot generate or be evaluated; `ernie-ir run` "
                          "computes its logits, or compile it without --pp (--tp for the same devices)")
    dtype = kv_cache_dtype or manifest.get("kv_cache_dtype")
    tokenizer = manifest.get("tokenizer")
    folder = root / tokenizer if isinstance(tokenizer, str) else None
    _, graphs = load_rank_graphs(root, verify=False)
    config = dict(graphs[0].metadata.get("config") or {})
    vocab = _vocab(graphs[0])
    if backend == "onnxruntime":
        if kv_cache_dtype is not None and kv_cache_dtype != manifest.get("kv_cache_dtype"):
            raise DecodeError("--kv-cache-dtype is fixed in the ONNX model when it is compiled: give it to "
                              "`ernie-ir compile` instead")
        step, layers = _onnx_step(root / ONNX_MODEL)
        return Decoder(step, layers, config, backend, vocab, folder=folder)
    layers = _decoder_graphs(graphs, dtype)
    if backend == "interpreter":
        return Decoder(_interpreter_step(graphs), layers, config, backend, vocab, folder=folder,
                       graphs=graphs, cache_dtype=cache_dtype_of(graphs[0]))
    if artifact_mapping(manifest).world_size > 1:
        from ernie_ir.artifacts import require_weights

        require_weights(root, manifest)
        step, run = _paddle_ranks(root, graphs, timeout_s)
        return Decoder(step, layers, config, backend, vocab, folder=folder, graphs=graphs, run=run)
    from ernie_ir.backends.paddle.session import paddle_device_for

    return Decoder(_paddle_step(graphs[0], paddle_device_for(root)), layers, config, backend, vocab,
                   folder=folder, graphs=graphs, cache_dtype=cache_dtype_of(graphs[0]))
