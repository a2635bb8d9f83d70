"""Elementwise binary ops with numpy broadcasting: add and mul."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import DType, Input, OpAttrs, OpDef, OpError, TensorType, register_op
from ernie_ir.ir.types import broadcast_shapes

from ._checks import need


def result_dtype(op: str, a: DType, b: DType) -> DType:
    """Equal dtypes keep theirs; two different float dtypes promote to f32."""
    if a == b:
        return a
    if a.is_float and b.is_float:
        return DType.F32
    raise OpError(f"{op}: cannot combine {a} and {b}; cast one of them first")


class _Binary(OpDef):
    inputs = (Input("a"), Input("b"))

    def infer(self, types: Sequence[TensorType | None], attrs: OpAttrs) -> list[TensorType]:
        a, b = need(types[0], self.name, "a"), need(types[1], self.name, "b")
        try:
            shape = broadcast_shapes(a.shape, b.shape)
        except ValueError as e:
            raise OpError(f"{self.name}: {e}") from None
        return [TensorType(result_dtype(self.name, a.dtype, b.dtype), shape)]


@register_op
class Add(_Binary):
    """y = a + b (numpy broadcasting)"""

    name = "add"

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        return [np.add(args[0], args[1])]


@register_op
class Mul(_Binary):
    """y = a * b (numpy broadcasting)"""

    name = "mul"

    def kernel(self, args: Sequence[np.ndarray | None], attrs: OpAttrs) -> list[np.ndarray]:
        return [np.multiply(args[0], args[1])]
