"""Tensor types: an element type plus a shape whose dims are static or symbolic.

A dim is an `int` (static) or a `str` (symbolic). A symbolic dim is a product
of symbol names with an optional integer coefficient, written canonically as
`B`, `B*S` or `2*S` (coefficient first, symbols sorted). Keeping products
canonical lets a reshape from `[B, S, H]` to `[B*S, H]` and back infer exact
types without a general symbolic algebra.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .dtypes import DType

Dim = int | str

_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _factor(dim: Dim) -> tuple[int, Counter[str]]:
    """Split a dim into (integer coefficient, multiset of symbols)."""
    if isinstance(dim, int):
        return dim, Counter()
    coeff = 1
    symbols: Counter[str] = Counter()
    for part in dim.split("*"):
        part = part.strip()
        if part.isdigit():
            coeff *= int(part)
        elif _SYMBOL.fullmatch(part):
            symbols[part] += 1
        else:
            raise ValueError(f"malformed symbolic dim {dim!r}")
    return coeff, symbols


def _compose(coeff: int, symbols: Counter[str]) -> Dim:
    names = sorted(symbols.elements())
    if not names or coeff == 0:  # 0*B is 0, whatever B is
        return coeff
    if coeff == 1:
        return "*".join(names)
    return "*".join([str(coeff), *names])


def canonical_dim(dim: Dim) -> Dim:
    """The canonical spelling of a dim (`S*B` -> `B*S`, `1*B` -> `B`)."""
    if isinstance(dim, bool):
        raise TypeError("a dim cannot be a bool")
    if isinstance(dim, int):
        if dim < 0:
            raise ValueError(f"negative dim {dim}")
        return dim
    return _canonical_symbolic(dim)


@functools.lru_cache(maxsize=4096)
def _canonical_symbolic(dim: str) -> Dim:
    return _compose(*_factor(dim))


def dim_product(dims: Iterable[Dim]) -> Dim:
    """The product of dims, symbolic where any factor is."""
    dims = tuple(dims)
    if all(type(d) is int for d in dims):
        return math.prod(dims)  # type: ignore[arg-type]
    return _symbolic_product(dims)


@functools.lru_cache(maxsize=4096)
def _symbolic_product(dims: tuple[Dim, ...]) -> Dim:
    coeff = 1
    symbols: Counter[str] = Counter()
    for d in dims:
        c, s = _factor(d)
        coeff *= c
        symbols.update(s)
    if coeff == 0:
        return 0
    return _compose(coeff, symbols)


def dim_divide(numerator: Dim, denominator: Dim) -> Dim | None:
    """numerator / denominator when it divides exactly, else None."""
    nc, ns = _factor(numerator)
    dc, ds = _factor(denominator)
    if dc == 0 or nc % dc != 0 or any(ns[k] < v for k, v in ds.items()):
        return None
    return _compose(nc // dc, ns - ds)


def is_static(dim: Dim) -> bool:
    return isinstance(dim, int)


@dataclass(frozen=True, slots=True)
class TensorType:
    """The type of a tensor value: element dtype and shape.

    Printed as `bf16[B,S,1024]`; a scalar is `f32[]`.
    """

    dtype: DType
    shape: tuple[Dim, ...]

    def __init__(self, dtype: DType, shape: Sequence[Dim]) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", tuple(canonical_dim(d) for d in shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def numel(self) -> Dim:
        """Number of elements (symbolic if the shape is)."""
        return dim_product(self.shape)

    def nbytes(self) -> int:
        """Storage bytes of a static tensor (int4 counts half a byte per element)."""
        if not self.is_static:
            raise ValueError(f"{self} has a symbolic shape; its size is unknown")
        return math.ceil(math.prod(self.shape) * self.dtype.bits / 8)  # type: ignore[arg-type]

    def with_shape(self, shape: Sequence[Dim]) -> TensorType:
        return TensorType(self.dtype, shape)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(dtype, self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(str(d) for d in self.shape)}]"

    def __repr__(self) -> str:
        return f"TensorType({self})"


def tensor(dtype: DType, *shape: Dim) -> TensorType:
    """Shorthand: `tensor(bf16, "B", "S", 1024)`."""
    return TensorType(dtype, shape)


def broadcast_shapes(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...]:
    """numpy broadcasting of two shapes; a symbolic dim only broadcasts with itself or 1."""
    out: list[Dim] = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ValueError(f"shapes {list(a)} and {list(b)} do not broadcast")
    return tuple(reversed(out))
