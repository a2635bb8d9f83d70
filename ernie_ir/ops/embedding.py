"""embedding: table lookup of token ids, whole or from one rank's slice of the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, OpError, TensorType, register_op

from ._checks import need, need_float, need_int, need_rank


@register_op
class Embedding(OpDef):
    """out[..., :] = table[ids[...], :]

    ids: integer [...]; table: float [V, H]; out: table.dtype [..., H].
    An id outside [0, V) is an error at run time.
    """

    name = "embedding"
    inputs = (Input("ids"), Input("table"))

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        ids, table = need(types[0], self.name, "ids"), need(types[1], self.name, "table")
        need_int(ids, self.name, "ids")
        need_float(table, self.name, "table")
        need_rank(table, 2, self.name, "table")
        return [TensorType(table.dtype, (*ids.shape, table.shape[1]))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        ids, table = args
        assert ids is not None and table is not None
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            bad = int(ids.max()) if ids.max() >= table.shape[0] else int(ids.min())
            raise OpError(f"embedding: token id {bad} is outside the vocabulary [0, {table.shape[0]})")
        return [table[ids]]


class VocabShardAttrs(OpAttrs):
    vocab_start: int = Field(ge=0)
    """The global id of the table's first row."""
    vocab_size: int = Field(ge=1)
    """The whole vocabulary (ids at or above it are errors on every rank)."""


@register_op
class VocabParallelEmbedding(OpDef):
    """out[...] = table[ids[...] - vocab_start]   where vocab_start <= ids < vocab_start + V_local
    out[...] = 0                              elsewhere

    One rank's part of a vocabulary-parallel lookup (Megatron / FastDeploy
    VocabParallelEmbedding): ids: integer [...] (global ids); table: float
    [V_local, H], rows [vocab_start, vocab_start + V_local) of the whole
    table. Summing `out` over the ranks (all_reduce) gives the whole lookup.
    An id outside [0, vocab_size) is an error at run time.
    """

    name = "vocab_parallel_embedding"
    inputs = (Input("ids"), Input("table"))
    Attrs = VocabShardAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: VocabShardAttrs) -> list[TensorType]:
        out = Embedding.infer(self, types, attrs)  # type: ignore[arg-type]
        rows = types[1].shape[0] if types[1] is not None else None
        if isinstance(rows, int) and attrs.vocab_start + rows > attrs.vocab_size:
            raise OpError(f"vocab_parallel_embedding: rows [{attrs.vocab_start}, "
                          f"{attrs.vocab_start + rows}) exceed the vocabulary of {attrs.vocab_size}")
        return out

    def kernel(self, args: Sequence[np.ndarray | None], attrs: VocabShardAttrs) -> list[np.ndarray]:
        ids, table = args
        assert ids is not None and table is not None
        if ids.size and (ids.min() < 0 or ids.max() >= attrs.vocab_size):
            bad = int(ids.max()) if ids.max() >= attrs.vocab_size else int(ids.min())
            raise OpError(f"embedding: token id {bad} is outside the vocabulary [0, {attrs.vocab_size})")
        local = ids - attrs.vocab_start
        held = (local >= 0) & (local < table.shape[0])
        out = table[np.where(held, local, 0)]
        out[~held] = 0
        return [out]
