"""position_ids: the position of every token, from the shape of the token ids or a token index."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from ernie_ir.ir import Graph, Input, OpAttrs, OpDef, OpError, TensorType, i64, register_op

from ._checks import need, need_int, need_rank, same_dim


class PositionIdsAttrs(OpAttrs):
    stride: int = Field(default=1, ge=1)
    offset: int = Field(default=0, ge=0)
    limit: int | None = Field(default=None, ge=1)
    """Positions must stay below this (the model's max_position_embeddings); None: unchecked."""


@register_op
class PositionIds(OpDef):
    """pos[b, s] = offset + stride * index[b, s]      index: default s (only ids' shape is read)

    ids: integer [B, S]; index: optional integer [B, S], each token's index in its own sequence
    (a decoder's `position_ids` input: a cached step's tokens do not start at 0, and a padded
    row's tokens do not start where the batch does); pos: i64 [B, S]. With `limit`, a
    position >= limit is an error at run time (the sequence is longer than the model supports).
    GPT's learned positions use the defaults; ERNIE-3.5-SE with
    `enable_random_position_ids` uses stride 8, offset 7.
    """

    name = "position_ids"
    inputs = (Input("ids"), Input("index", optional=True))
    Attrs = PositionIdsAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: PositionIdsAttrs) -> list[TensorType]:
        ids = need(types[0], self.name, "ids")
        need_int(ids, self.name, "ids")
        need_rank(ids, 2, self.name, "ids")
        index = types[1] if len(types) > 1 else None
        if index is not None:
            need_int(index, self.name, "index")
            need_rank(index, 2, self.name, "index")
            same_dim(index.shape, ids.shape, self.name, "shapes of index and ids")
        return [TensorType(i64, ids.shape)]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: PositionIdsAttrs) -> list[np.ndarray]:
        ids = args[0]
        assert ids is not None
        b, s = ids.shape
        index = args[1] if len(args) > 1 else None
        if index is not None:
            if index.size and int(index.min()) < 0:
                raise OpError(f"position_ids: negative token index {int(index.min())}")
            check_positions(attrs, int(index.max()) + 1 if index.size else 0)
            return [attrs.offset + attrs.stride * index.astype(np.int64)]
        pos = attrs.offset + attrs.stride * np.arange(s, dtype=np.int64)
        check_positions(attrs, s)
        return [np.broadcast_to(pos, (b, s)).copy()]


def check_positions(attrs: PositionIdsAttrs, seq: int) -> None:
    """OpError if a sequence of `seq` tokens reaches a position at or beyond `attrs.limit`."""
    last = attrs.offset + attrs.stride * (seq - 1)
    if attrs.limit is not None and seq and last >= attrs.limit:
        raise OpError(f"position_ids: sequence length {seq} reaches position {last}, "
                      f"beyond the model's {attrs.limit} positions")


def check_sequence_length(graph: Graph, seq: int) -> None:
    """Refuse `seq` tokens per sequence where a `position_ids` node of `graph` could not place
    them: before anything of [batch, seq, ...] is allocated (compiled backends, the CLI)."""
    for node in graph.nodes:
        if node.op == "position_ids":
            check_positions(node.attrs, seq)  # type: ignore[arg-type]
