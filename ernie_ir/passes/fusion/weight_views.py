"""Lazy views for fusing and unfusing weights: slices and concatenations that simplify.

Fusion passes cut a fused weight into its parts and join parts into a fused
weight without reading or copying a byte. `slice_view` and `concat_view`
build those views and keep them canonical: a slice of a slice is one slice,
a slice of a concatenation picks the parts it covers, and adjacent slices of
one tensor merge back into one slice, or into the tensor itself when they
cover it. So unfusing a fused weight and fusing its parts again gives back
the very source it started from (the same object, not an equal copy).

A quantized source (`QuantizedWeightSource`) slices and joins along its
columns without quantizing anything else: its scales are per output column
(and per group along the rows), so the columns of a quantized tensor are the
quantized columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ernie_ir.ir import DType
from ernie_ir.ir.weights import ConcatSource, GeneratedSource, SlicedSource, WeightSource

from ..quant.weight_only import QuantizedWeightSource


def slice_view(src: WeightSource | None, axis: int, start: int, stop: int) -> WeightSource | None:
    """`src[..., start:stop, ...]` along `axis`, as the simplest lazy view (None for None)."""
    if src is None:
        return None
    axis %= len(src.shape)
    if start == 0 and stop == src.shape[axis]:
        return src
    if isinstance(src, SlicedSource) and src.axis == axis:
        return slice_view(src.base, axis, src.start + start, src.start + stop)
    if isinstance(src, ConcatSource) and src.axis == axis:
        pieces: list[WeightSource | None] = []
        offset = 0
        for part in src.parts:
            size = part.shape[axis]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                pieces.append(slice_view(part, axis, lo - offset, hi - offset))
            offset += size
        return concat_view(pieces, axis)
    if isinstance(src, QuantizedWeightSource) and axis != len(src.shape) - 2:
        # columns (or experts) of a quantized tensor are the quantized columns of the base
        return QuantizedWeightSource(slice_view(src.base, axis, start, stop), src.bits,  # type: ignore[arg-type]
                                     src.group_size, src.name)
    return src.sliced(axis, start, stop)


def gather_view(src: WeightSource | None, axis: int, ranges: Sequence[tuple[int, int]]
                ) -> WeightSource | None:
    """The [start, stop) ranges of `src` along `axis`, joined in order."""
    return concat_view([slice_view(src, axis, a, b) for a, b in ranges], axis)


def concat_view(parts: Sequence[WeightSource | None], axis: int) -> WeightSource | None:
    """`parts` joined along `axis`, merging adjacent slices of one tensor (None if any is None)."""
    if not parts or any(p is None for p in parts):
        return None
    axis %= len(parts[0].shape)  # type: ignore[union-attr]
    flat: list[WeightSource] = []
    for p in parts:
        assert p is not None
        p = _canonical(p)
        flat.extend(p.parts if isinstance(p, ConcatSource) and p.axis == axis else [p])
    merged: list[WeightSource] = []
    for p in flat:
        if merged:
            joined = _join(merged[-1], p, axis)
            if joined is not None:
                merged[-1] = joined
                continue
        merged.append(p)
    return merged[0] if len(merged) == 1 else ConcatSource(merged, axis)


def _canonical(src: WeightSource) -> WeightSource:
    if isinstance(src, SlicedSource):
        out = slice_view(src.base, src.axis, src.start, src.stop)
        assert out is not None
        return out
    return src


def _join(a: WeightSource, b: WeightSource, axis: int) -> WeightSource | None:
    """One view equal to concat([a, b], axis), or None when there is none simpler."""
    if (isinstance(a, SlicedSource) and isinstance(b, SlicedSource) and a.base is b.base
            and a.axis == b.axis == axis and a.stop == b.start):
        return slice_view(a.base, axis, a.start, b.stop)
    if (isinstance(a, QuantizedWeightSource) and isinstance(b, QuantizedWeightSource)
            and (a.bits, a.group_size) == (b.bits, b.group_size) and axis == len(a.shape) - 1):
        base = concat_view([a.base, b.base], axis)
        assert base is not None
        return QuantizedWeightSource(base, a.bits, a.group_size, a.name)
    return None


def zeros(dtype: DType, shape: Sequence[int]) -> WeightSource:
    """A lazy all-zero tensor (the bias of a part that had none: adding it is exact)."""
    return GeneratedSource(dtype, shape, 0, "zeros")


class SumSource(WeightSource):
    """dtype(f32(a) + f32(b)): two biases folded into one, computed on read."""

    def __init__(self, a: WeightSource, b: WeightSource, dtype: DType) -> None:
        self.a, self.b = a, b
        self.dtype = dtype
        self.shape = tuple(a.shape)

    def read(self) -> np.ndarray:
        total = np.asarray(self.a.read(), np.float32) + np.asarray(self.b.read(), np.float32)
        return total.astype(self.dtype.numpy)

    def describe(self) -> str:
        return f"sum({self.a.describe()}, {self.b.describe()})"
