"""Element types of the IR and their numpy / ml_dtypes storage.

Every tensor in a graph has one of these element types. The short names
(`f32`, `bf16`, `i4`, ...) are what the text format prints; `numpy` gives the
array dtype that holds the values (ml_dtypes supplies bf16, fp8 and int4).
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    """An element type. The value is the short name used in the text format."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    F8E4M3 = "f8e4m3"
    F8E5M2 = "f8e5m2"
    I64 = "i64"
    I32 = "i32"
    I8 = "i8"
    I4 = "i4"
    U8 = "u8"
    BOOL = "bool"

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"DType.{self.name}"

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype that stores values of this type (int4 unpacked, one per byte)."""
        return _NUMPY[self]

    @property
    def bits(self) -> int:
        """Width of one element in bits (4 for i4, 1 byte-wide bool counts 8)."""
        return _BITS[self]

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @classmethod
    def parse(cls, name: str) -> DType:
        """The dtype for a short name; raises ValueError naming the valid ones."""
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(d.value for d in cls)
            raise ValueError(f"unknown dtype {name!r} (expected one of: {valid})") from None

    @classmethod
    def from_numpy(cls, dtype: np.dtype | type) -> DType:
        """The dtype that a numpy/ml_dtypes array dtype stores."""
        dt = np.dtype(dtype)
        for d, nd in _NUMPY.items():
            if nd == dt:
                return d
        raise ValueError(f"numpy dtype {dt} has no ernie-ir dtype")


_NUMPY: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F8E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.F8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DType.I64: np.dtype(np.int64),
    DType.I32: np.dtype(np.int32),
    DType.I8: np.dtype(np.int8),
    DType.I4: np.dtype(ml_dtypes.int4),
    DType.U8: np.dtype(np.uint8),
    DType.BOOL: np.dtype(np.bool_),
}

_BITS: dict[DType, int] = {
    DType.F32: 32,
    DType.F16: 16,
    DType.BF16: 16,
    DType.F8E4M3: 8,
    DType.F8E5M2: 8,
    DType.I64: 64,
    DType.I32: 32,
    DType.I8: 8,
    DType.I4: 4,
    DType.U8: 8,
    DType.BOOL: 8,
}

_FLOATS = frozenset({DType.F32, DType.F16, DType.BF16, DType.F8E4M3, DType.F8E5M2})
_INTS = frozenset({DType.I64, DType.I32, DType.I8, DType.I4, DType.U8})

f32 = DType.F32
f16 = DType.F16
bf16 = DType.BF16
f8e4m3 = DType.F8E4M3
f8e5m2 = DType.F8E5M2
i64 = DType.I64
i32 = DType.I32
i8 = DType.I8
i4 = DType.I4
u8 = DType.U8
boolean = DType.BOOL
