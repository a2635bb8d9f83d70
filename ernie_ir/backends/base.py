"""What every backend session is: the one interface `run`, `generate` and `eval` use.

A `BackendSession` is a compiled artifact opened on one backend (`open_backend` in
ernie_ir.backends.sessions checks the artifact and picks the class). It answers two questions:

- `logits(input_ids)`: the logits [B, S, V] of whole sequences (what `ernie-ir run` and
  `ernie-ir eval` score);
- `decoder(graphs)`: how to take one KV-cache step (`step`), or, where the backend runs the whole
  loop elsewhere (several Paddle ranks), the loop itself (`run`). `graphs` are the rank graphs
  after the kv-cache pass, which the caller applies (the pass lives above the backends); a
  backend whose executable already is a decoder (`compiled_decoder`: ONNX) ignores them and
  reports its own cache layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ernie_ir.ir import Graph
from ernie_ir.runtime.decoding import DecodeError, DecodeOptions, DecodeResult, StepFn

StopFn = Callable[[int, list[int]], bool]
TokensFn = Callable[[int, np.ndarray, list[bool]], None]
RunFn = Callable[[list[list[int]], DecodeOptions, StopFn | None, TokensFn | None], DecodeResult]
CacheLayers = tuple[tuple[int, int], ...]


class BackendError(DecodeError):
    """An unknown backend, or one the artifact does not offer."""


@dataclass
class DecoderParts:
    """How a backend decodes: `step` (one call of the decoder), or `run` (the whole loop, run
    elsewhere; `step` then refuses), and the cache layout when the executable fixes it."""

    step: StepFn
    layers: CacheLayers | None = None
    run: RunFn | None = None


class BackendSession(ABC):
    """An artifact opened on one backend (see the module docstring)."""

    name: ClassVar[str]
    compiled_decoder: ClassVar[bool] = False
    """True where the executable is the decoder itself (no kv-cache pass on the caller's side)."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root, self.manifest = root, manifest

    @abstractmethod
    def logits(self, input_ids: np.ndarray, *, timeout_s: float | None = None) -> np.ndarray:
        """Logits [B, S, V] of whole sequences `input_ids` [B, S]."""

    @abstractmethod
    def decoder(self, graphs: list[Graph], *, timeout_s: float | None = None) -> DecoderParts:
        """How to decode, from the rank graphs after the kv-cache pass (rank order)."""

    @property
    def steps_here(self) -> bool:
        """Whether `decoder(...).step` runs in this process (False: several Paddle ranks)."""
        return True

    def check_ids(self, ids: np.ndarray) -> None:
        """Token ids the rank-0 graph accepts: the interpreter's checks, for compiled executables
        (which would crash on an id out of range or silently wrap a negative one)."""
        from ernie_ir.backends.paddle.rank_worker import check_token_ids
        from ernie_ir.ops.positions import check_sequence_length

        graph = self._rank0_graph()
        if not graph.inputs or ids.size == 0:
            return
        check_token_ids(graph, ids)
        check_sequence_length(graph, int(ids.shape[-1]))

    def _rank0_graph(self) -> Graph:
        """rank0's graph text, parsed once per session (eval checks every window against it)."""
        graph = getattr(self, "_rank0", None)
        if graph is None:
            from ernie_ir.ir.parser import parse_graph

            text_path = self.root / "rank0" / "graph.ir"
            graph = parse_graph(text_path.read_text(encoding="utf-8"), source=str(text_path))
            self._rank0: Graph = graph
        return graph
