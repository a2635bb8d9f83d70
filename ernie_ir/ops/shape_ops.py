"""Shape ops: split, concat, reshape, transpose (data unchanged, only moved)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import Field

from ernie_ir.ir import Input, OpAttrs, OpDef, OpError, TensorType, register_op
from ernie_ir.ir.types import Dim, dim_divide, dim_product

from ._checks import need, norm_axis


class SplitAttrs(OpAttrs):
    axis: int
    sizes: tuple[int, ...] = Field(min_length=1)


@register_op
class Split(OpDef):
    """outputs[i] = x[..., offset_i : offset_i + sizes[i], ...] along `axis`

    The split axis must be static and equal sum(sizes). One output per size.
    """

    name = "split"
    inputs = (Input("x"),)
    Attrs = SplitAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: SplitAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        axis = norm_axis(attrs.axis, x.rank, self.name)
        total = x.shape[axis]
        if total != sum(attrs.sizes) or any(s < 0 for s in attrs.sizes):
            raise OpError(f"split: sizes {list(attrs.sizes)} do not add up to dim {axis} of {x}")
        out = []
        for size in attrs.sizes:
            shape = list(x.shape)
            shape[axis] = size
            out.append(x.with_shape(shape))
        return out

    def kernel(self, args: Sequence[np.ndarray | None], attrs: SplitAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        cuts = np.cumsum(attrs.sizes)[:-1]
        return list(np.split(x, cuts, axis=attrs.axis))


class ConcatAttrs(OpAttrs):
    axis: int


@register_op
class Concat(OpDef):
    """y = concatenate(xs, axis): every other dim equal, the axis dims added."""

    name = "concat"
    inputs = (Input("xs", variadic=True),)
    Attrs = ConcatAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: ConcatAttrs) -> list[TensorType]:
        if not types:
            raise OpError("concat: needs at least one input")
        ts = [need(t, self.name, f"xs[{i}]") for i, t in enumerate(types)]
        first = ts[0]
        axis = norm_axis(attrs.axis, first.rank, self.name)
        total = 0
        for i, t in enumerate(ts):
            if t.dtype != first.dtype or t.rank != first.rank:
                raise OpError(f"concat: xs[{i}] is {t}, expected {first.dtype} of rank {first.rank}")
            for d in range(first.rank):
                if d != axis and t.shape[d] != first.shape[d]:
                    raise OpError(f"concat: xs[{i}] is {t}, dim {d} differs from xs[0] {first}")
            if not isinstance(t.shape[axis], int):
                raise OpError(f"concat: dim {axis} of xs[{i}] is symbolic ({t.shape[axis]})")
            total += t.shape[axis]
        shape = list(first.shape)
        shape[axis] = total
        return [first.with_shape(shape)]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: ConcatAttrs) -> list[np.ndarray]:
        return [np.concatenate(list(args), axis=attrs.axis)]


class ReshapeAttrs(OpAttrs):
    shape: tuple[int, ...]
    """Target shape; 0 copies the input dim at the same position, one -1 is inferred."""


def reshape_dims(src: Sequence[Dim], target: Sequence[int], op: str = "reshape") -> list[Dim]:
    """The output dims of reshaping `src` to `target` (ONNX 0 / -1 rules, symbolic aware)."""
    if sum(1 for t in target if t == -1) > 1:
        raise OpError(f"{op}: at most one -1 in shape {list(target)}")
    out: list[Dim] = []
    for i, t in enumerate(target):
        if t == 0:
            if i >= len(src):
                raise OpError(f"{op}: 0 at position {i} but the input has rank {len(src)}")
            out.append(src[i])
        elif t < -1:
            raise OpError(f"{op}: invalid dim {t} in shape {list(target)}")
        else:
            out.append(t)
    total = dim_product(src)
    if -1 in out:
        known = dim_product(d for d in out if d != -1)
        inferred = dim_divide(total, known)
        if inferred is None:
            raise OpError(f"{op}: cannot reshape {list(src)} into {list(target)}")
        out[out.index(-1)] = inferred
    elif dim_product(out) != total:
        raise OpError(f"{op}: cannot reshape {list(src)} ({total} elements) into {out}")
    return out


@register_op
class Reshape(OpDef):
    """y = x.reshape(shape) in C order; 0 copies an input dim, one -1 is inferred."""

    name = "reshape"
    inputs = (Input("x"),)
    Attrs = ReshapeAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: ReshapeAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        return [x.with_shape(reshape_dims(x.shape, attrs.shape))]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: ReshapeAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        shape = [x.shape[i] if t == 0 else t for i, t in enumerate(attrs.shape)]
        return [x.reshape(shape)]


class TransposeAttrs(OpAttrs):
    perm: tuple[int, ...]


@register_op
class Transpose(OpDef):
    """y = x.transpose(perm): y.shape[i] = x.shape[perm[i]]"""

    name = "transpose"
    inputs = (Input("x"),)
    Attrs = TransposeAttrs

    def infer(self, types: Sequence[TensorType | None], attrs: TransposeAttrs) -> list[TensorType]:
        x = need(types[0], self.name, "x")
        if sorted(attrs.perm) != list(range(x.rank)):
            raise OpError(f"transpose: perm {list(attrs.perm)} is not a permutation of rank {x.rank}")
        return [x.with_shape([x.shape[p] for p in attrs.perm])]

    def kernel(self, args: Sequence[np.ndarray | None], attrs: TransposeAttrs) -> list[np.ndarray]:
        x = args[0]
        assert x is not None
        return [np.transpose(x, attrs.perm)]
