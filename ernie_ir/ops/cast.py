"""cast: change the element type."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, TensorType, register_op

from ._checks import need


class CastAttrs(OpAttrs):
    dtype: DType


@register_op
class Cast(OpDef):
    """y = x converted to `dtype` (floats round to nearest even; float -> int truncates)."""

    name = "cast"
    inputs = (Input("x"),)
    Attrs = CastAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: CastAttrs) -> list[TensorType]:
        return [need(types[0], self.name, "x").with_dtype(attrs.dtype)]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: CastAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        return [x.astype(attrs.dtype.numpy)]
