"""Paddle `.pdparams` state dicts, read lazily and without running pickled code.

`paddle.save(state_dict)` writes a pickle (protocol 4) of a dict from names
to numpy arrays (plus a `StructuredToParameterName@@` entry). A pickle can
run arbitrary code, so the frontend opens one only when the caller trusts it
explicitly (`trust_pickle=True`, `--trust-pickle`), and even then this reader
is restricted: it resolves only the handful of globals a numpy state dict
needs (`numpy...._reconstruct`, `numpy.ndarray`, `numpy.dtype`,
`collections.OrderedDict`, `builtins.tuple`, `_codecs.encode`) and refuses
everything else.

It is also lazy: the pure-Python unpickler walks the opcode stream, and for
each large byte string (an array's raw data, written outside pickle frames)
it records the file offset and seeks past it instead of reading it. Opening
a 1 GB `.pdparams` therefore reads only a few kilobytes; `read()` of a
tensor memory-maps its bytes. Paddle stores bfloat16 tensors as uint16
arrays; they are read as bf16.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ernie_ir.ir import DType, WeightError
from ernie_ir.ir.inputs import open_regular
from ernie_ir.ir.weights import WeightSource

_SPAN_MIN = 4096  # byte strings at least this long (and outside a frame) are left on disk


class UnsafePickleError(WeightError):
    """The pickle asks for something a numpy state dict never needs (code, other classes)."""


@dataclass(frozen=True)
class _FileSpan:
    """Bytes that stay on disk: `length` bytes at `offset` of the pickle file."""

    offset: int
    length: int


class _ArrayStub:
    """What `numpy...._reconstruct` + BUILD produce here: an array's description, not its data."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype: np.dtype = np.dtype(np.uint8)
        self.fortran = False
        self.data: bytes | _FileSpan = b""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5):
            raise pickle.UnpicklingError("unexpected numpy array state")
        _version, shape, dtype, fortran, data = state
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            raise pickle.UnpicklingError("only plain numeric arrays are allowed")
        if not isinstance(data, bytes | _FileSpan):
            raise pickle.UnpicklingError("array data must be raw bytes")
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.fortran = bool(fortran)
        self.data = data
        length = data.length if isinstance(data, _FileSpan) else len(data)
        if length != math.prod(self.shape) * dtype.itemsize:
            raise pickle.UnpicklingError(f"array {self.shape} {dtype}: {length} data bytes")


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> _ArrayStub:
    if cls is not np.ndarray:
        raise pickle.UnpicklingError("only numpy.ndarray may be reconstructed")
    return _ArrayStub()


_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "tuple"): tuple,  # paddle pickles a Tensor as (name, array)
    ("_codecs", "encode"): lambda s, enc="latin1": s.encode(enc),  # protocol 2 bytes
}


class _LazyUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be overridden
    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def __init__(self, fh: io.BufferedReader) -> None:
        super().__init__(fh)
        self._fh = fh

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"refusing to load {module}.{name}: a Paddle state dict holds only numpy arrays, so this "
                "file is not one; do not load it"
            ) from None

    def _bytes_or_span(self, n: int) -> bytes | _FileSpan:
        if n >= _SPAN_MIN and self._unframer.current_frame is None:
            offset = self._fh.tell()
            self._fh.seek(n, os.SEEK_CUR)
            return _FileSpan(offset, n)
        data = self.read(n)
        if len(data) != n:
            raise pickle.UnpicklingError("pickle data was truncated")
        return data

    def load_binbytes(self) -> None:
        (n,) = struct.unpack("<I", self.read(4))
        self.append(self._bytes_or_span(n))

    def load_binbytes8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        self.append(self._bytes_or_span(n))

    dispatch[pickle.BINBYTES[0]] = load_binbytes
    dispatch[pickle.BINBYTES8[0]] = load_binbytes8


_NUMPY_DTYPES = {
    np.dtype(np.float32): DType.F32,
    np.dtype(np.float16): DType.F16,
    np.dtype(np.uint16): DType.BF16,  # Paddle's numpy() of a bfloat16 tensor
    np.dtype(np.int64): DType.I64,
    np.dtype(np.int32): DType.I32,
    np.dtype(np.int8): DType.I8,
    np.dtype(np.uint8): DType.U8,
    np.dtype(np.bool_): DType.BOOL,
}


class PdparamsFile:
    """The arrays of one `.pdparams` file: names, dtypes and shapes up front, data on read."""

    NON_TENSOR_KEYS = ("StructuredToParameterName@@",)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.entries: dict[str, _ArrayStub] = {}
        self._mmap: np.memmap | None = None
        try:
            with open_regular(self.path, "checkpoint", WeightError) as fh:
                size = os.fstat(fh.fileno()).st_size
                obj = _LazyUnpickler(fh).load()
        except OSError as e:
            raise WeightError(f"{self.path}: cannot read ({e.strerror})") from None
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{self.path}: {e}") from None
        except (EOFError, struct.error):
            raise WeightError(f"{self.path}: the pickle ends early: the file is truncated") from None
        except (pickle.UnpicklingError, ValueError) as e:
            hint = "the file is truncated" if "exhausted" in str(e) or "truncated" in str(e) else str(e)
            raise WeightError(f"{self.path}: not a readable Paddle state dict ({hint})") from None
        except RecursionError:
            raise WeightError(f"{self.path}: the pickle nests too deeply for a state dict: the file is "
                              "corrupt or not a checkpoint") from None
        except (KeyError, IndexError, TypeError, AttributeError):  # malformed opcodes or stack
            raise WeightError(f"{self.path}: not a readable Paddle state dict (corrupt or not a pickle)"
                              ) from None
        if not isinstance(obj, dict):
            raise WeightError(f"{self.path}: holds a {type(obj).__name__}, not a state dict")
        for key, value in obj.items():
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], _ArrayStub):
                value = value[1]
            if key in self.NON_TENSOR_KEYS or not isinstance(value, _ArrayStub):
                continue
            if isinstance(value.data, _FileSpan) and value.data.offset + value.data.length > size:
                raise WeightError(f"{self.path}: tensor {key!r} runs past the end: the file is truncated")
            if value.dtype.newbyteorder("=") not in _NUMPY_DTYPES or value.dtype.byteorder == ">":
                raise WeightError(f"{self.path}: tensor {key!r} has unsupported dtype {value.dtype}")
            self.entries[str(key)] = value

    def keys(self) -> list[str]:
        return list(self.entries)

    def source(self, key: str) -> PdparamsSource:
        return PdparamsSource(self, key)

    def read(self, key: str) -> np.ndarray:
        e = self.entries[key]
        dtype = _NUMPY_DTYPES[e.dtype.newbyteorder("=")]
        if isinstance(e.data, _FileSpan):
            if self._mmap is None:
                self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
            raw = self._mmap[e.data.offset : e.data.offset + e.data.length]
        else:
            raw = np.frombuffer(e.data, np.uint8)
        arr = raw.view(dtype.numpy)
        return arr.reshape(e.shape, order="F" if e.fortran else "C")


class PdparamsSource(WeightSource):
    """One array of a `.pdparams` file, memory-mapped on read."""

    def __init__(self, file: PdparamsFile, key: str) -> None:
        e = file.entries[key]
        self.file = file
        self.key = key
        self.dtype = _NUMPY_DTYPES[e.dtype.newbyteorder("=")]
        self.shape = e.shape

    def read(self) -> np.ndarray:
        return self.file.read(self.key)

    def describe(self) -> str:
        return f"{self.file.path.name}:{self.key}"
