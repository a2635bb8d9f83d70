"""embedding: table lookup of token ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
