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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.backends import check_backend, open_backend
from ernie_ir.backends.base import RunFn, StopFn, TokensFn
from ernie_ir.backends.interpreter.session import interpreter_step
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
    def step_here(self) -> bool:
        """Whether `step` runs in this process (False: the loop runs in several Paddle ranks)."""
        return self.run is None

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


def _vocab(graph: Graph) -> int:
    logits = graph.outputs[0].type.shape
    if not logits or not isinstance(logits[-1], int):
        raise DecodeError(f"graph {graph.name}: its first output is not logits [B, S, vocab]")
    return int(logits[-1])


def open_decoder(model: str | Path, backend: str = "interpreter", *, kv_cache_dtype: str | None = None,
                 trust_pickle: bool = False, timeout_s: float | None = None) -> Decoder:
    """`model` (a MODEL argument or an artifact folder) as a decoder on `backend`.

    `timeout_s` bounds each generation of a multi-rank artifact on Paddle (default
    ernie_ir.backends.paddle.launch.RUN_TIMEOUT_S); the ranks are stopped when it passes.

    DecodeError / ErnieIRError (one line) for an unknown backend, one the artifact does not offer,
    or a graph that cannot decode (no attention, not one `input_ids` input)."""
    check_backend(backend)
    root = Path(model)
    if not (root / "manifest.json").is_file():
        if backend != "interpreter":
            raise DecodeError(f"--backend {backend} runs a compiled artifact; {model} is a model: compile "
                              "it first (ernie-ir compile ... --emit onnx), or use --backend interpreter")
        from ernie_ir.load import load_input, tokenizer_folder

        graph = load_input(str(model), trust_pickle=trust_pickle)
        config = dict(graph.metadata.get("config") or {})
        vocab = _vocab(graph)
        layers = _decoder_graphs([graph], kv_cache_dtype)
        return Decoder(interpreter_step([graph]), layers, config, backend, vocab,
                       folder=tokenizer_folder(model), graphs=[graph],
                       cache_dtype=cache_dtype_of(graph))

    from ernie_ir.artifacts import artifact_mapping, load_rank_graphs

    session = open_backend(root, backend)
    manifest = session.manifest
    if manifest.mode != "inference":
        raise DecodeError(f"artifact {root} was compiled for {manifest.mode}; generating needs an "
                          "inference artifact: compile with --mode inference")
    if artifact_mapping(manifest).pp > 1:
        raise DecodeError(f"artifact {root} is pipelined (--pp {artifact_mapping(manifest).pp}): its stages "
                          "have no KV-cache decoder, so it cannot generate or be evaluated; `ernie-ir run` "
                          "computes its logits, or compile it without --pp (--tp for the same devices)")
    dtype = kv_cache_dtype or manifest.kv_cache_dtype
    tokenizer = manifest.tokenizer
    folder = root / tokenizer if isinstance(tokenizer, str) else None
    _, graphs = load_rank_graphs(root, verify=False)
    config = dict(graphs[0].metadata.get("config") or {})
    vocab = _vocab(graphs[0])
    if session.compiled_decoder:
        if kv_cache_dtype is not None and kv_cache_dtype != manifest.kv_cache_dtype:
            raise DecodeError(f"--kv-cache-dtype is fixed in the {backend} decoder when it is compiled: "
                              "give it to `ernie-ir compile` instead")
        parts = session.decoder([], timeout_s=timeout_s)
        assert parts.layers is not None
        return Decoder(parts.step, parts.layers, config, backend, vocab, folder=folder)
    layers = _decoder_graphs(graphs, dtype)
    parts = session.decoder(graphs, timeout_s=timeout_s)
    return Decoder(parts.step, layers, config, backend, vocab, folder=folder, graphs=graphs, run=parts.run,
                   cache_dtype=cache_dtype_of(graphs[0]))
