"""Where a param's values come from: lazy weight sources and safetensors I/O.

A `WeightSource` knows its dtype and shape without reading data; `read()`
returns the values. Checkpoints can be hundreds of GB, so the safetensors
reader memory-maps the file and `read()` of a `SafetensorsSource` returns a
read-only view: nothing is copied until a kernel touches it. Derived sources
(transpose, slice, stack, concat, cast) compose lazily, so a frontend can
describe "column block 2 of this fused tensor, transposed" without loading it.

The reader and writer are our own (the format is a JSON header plus raw
little-endian bytes) because the `safetensors` numpy backend has no bf16 or
fp8; int4 is stored as bytes with two values each (low nibble first) and
recorded in the header metadata.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import json
import math
import mmap
import os
import queue
import struct
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .dtypes import DType
from .errors import WeightError
from .inputs import open_regular

_ST_DTYPES: dict[str, DType] = {
    "F32": DType.F32,
    "F16": DType.F16,
    "BF16": DType.BF16,
    "F8_E4M3": DType.F8E4M3,
    "F8_E5M2": DType.F8E5M2,
    "I64": DType.I64,
    "I32": DType.I32,
    "I8": DType.I8,
    "U8": DType.U8,
    "BOOL": DType.BOOL,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_INT4_META = "ernie_ir.int4"
"""Metadata key: JSON object {tensor name: logical int4 shape} of the tensors stored packed, two
values per byte (low nibble first), as U8 entries of the packed shape (`packed_int4_shape`), so the
file stays a valid safetensors file that any reader opens. (Files of earlier versions list the
names only and declare the logical shape; both are read.)"""


def packed_int4_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The U8 shape of `shape` int4 values packed two per byte: the last dim halved when even,
    else one flat dim of ceil(numel / 2) bytes."""
    if shape and shape[-1] % 2 == 0:
        return (*shape[:-1], shape[-1] // 2)
    return (math.ceil(math.prod(shape) / 2),)


class WeightSource(ABC):
    """A lazy tensor: dtype and shape are known up front, data on `read()`."""

    dtype: DType
    shape: tuple[int, ...]

    @abstractmethod
    def read(self) -> np.ndarray:
        """The values, as an array of `dtype.numpy` with `shape` (may be a read-only view)."""

    @abstractmethod
    def describe(self) -> str:
        """One line saying where the data comes from."""

    @property
    def nbytes(self) -> int:
        return math.ceil(math.prod(self.shape) * self.dtype.bits / 8)

    def sliced(self, axis: int, start: int, stop: int) -> WeightSource:
        """`self[..., start:stop, ...]` along `axis`, lazily. Sources whose values are computed
        (e.g. quantized on read) override this to compute only the slice where that is exact."""
        return SlicedSource(self, axis, start, stop)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class ArraySource(WeightSource):
    """Values held in memory."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.dtype = DType.from_numpy(array.dtype)
        self.shape = tuple(int(d) for d in array.shape)

    def read(self) -> np.ndarray:
        return self.array

    def describe(self) -> str:
        return f"array {self.dtype}{list(self.shape)}"


class GeneratedSource(WeightSource):
    """Deterministic pseudo-random values: the same seed gives the same bits everywhere.

    `init` is `normal` (mean 0, `std`), `uniform` (in [-std, std]), `ones` or
    `zeros`. Values are drawn in float32 with numpy's PCG64 and cast to dtype.
    """

    def __init__(
        self,
        dtype: DType,
        shape: Sequence[int],
        seed: int,
        init: str = "normal",
        std: float = 0.02,
    ) -> None:
        if init not in ("normal", "uniform", "ones", "zeros"):
            raise ValueError(f"unknown init {init!r}")
        self.dtype = dtype
        self.shape = tuple(int(d) for d in shape)
        self.seed = seed
        self.init = init
        self.std = std

    def read(self) -> np.ndarray:
        if self.init == "ones":
            return np.ones(self.shape, self.dtype.numpy)
        if self.init == "zeros":
            return np.zeros(self.shape, self.dtype.numpy)
        rng = np.random.default_rng(self.seed)
        if self.init == "normal":
            x = rng.standard_normal(self.shape, dtype=np.float32) * np.float32(self.std)
        else:
            x = rng.uniform(-self.std, self.std, self.shape).astype(np.float32)
        return x.astype(self.dtype.numpy)

    def describe(self) -> str:
        return f"generated {self.init}(std={self.std}, seed={self.seed})"


@dataclass(frozen=True)
class _TensorEntry:
    dtype: DType
    shape: tuple[int, ...]
    start: int
    end: int
    packed_int4: bool


class SafetensorsFile:
    """A memory-mapped safetensors file. Opening it reads only the header."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.entries: dict[str, _TensorEntry] = {}
        self.metadata: dict[str, str] = {}
        self._data_start = 0
        self._mmap: np.memmap | None = None
        self._touched: list[tuple[int, int]] = []  # data ranges read since the last release_pages
        _OPEN_FILES.add(self)
        self._read_header()

    def _fail(self, what: str) -> WeightError:
        return WeightError(f"{self.path}: {what}")

    def _read_header(self) -> None:
        try:
            with open_regular(self.path, "safetensors file", WeightError) as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise self._fail("not a safetensors file (shorter than its 8-byte header length)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > 100_000_000:
                    raise self._fail(
                        f"header length {n} exceeds the file size {size}: "
                        "the file is truncated or not safetensors"
                    )
                raw = f.read(n)
        except OSError as e:
            raise self._fail(f"cannot read ({e.strerror})") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._fail("header is not valid JSON: the file is corrupt") from None
        except RecursionError:
            raise self._fail("header nests JSON too deeply to be a safetensors header: the file is "
                             "corrupt") from None
        except ValueError:  # an integer literal longer than int() converts
            raise self._fail("header holds an integer literal too long to read: the file is "
                             "corrupt") from None
        self._data_start = 8 + n
        data_size = size - self._data_start
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__") or {}, dict):
            raise self._fail("header is not a JSON object of tensors: the file is corrupt")
        meta = header.pop("__metadata__", None) or {}
        self.metadata = {str(k): str(v) for k, v in meta.items()}
        try:
            listed = json.loads(self.metadata.get(_INT4_META, "[]"))
        except (json.JSONDecodeError, TypeError, RecursionError, ValueError):
            listed = None
        if isinstance(listed, list) and all(isinstance(n, str) for n in listed):
            int4: dict[str, list[int] | None] = dict.fromkeys(listed)  # logical shape in the header
        elif isinstance(listed, dict) and all(
                isinstance(v, list) and all(type(d) is int and d >= 0 for d in v) for v in listed.values()):
            int4 = listed
        else:
            raise self._fail(f"metadata {_INT4_META} is not a map of tensor names to int4 shapes: the "
                             "file is corrupt") from None
        for name, info in header.items():
            try:
                st_dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._fail(f"tensor {name!r} has a malformed header entry") from None
            if not (isinstance(st_dtype, str) and isinstance(shape, list)
                    and all(type(d) is int and d >= 0 for d in shape)
                    and type(start) is int and type(end) is int):
                raise self._fail(f"tensor {name!r} has a malformed header entry")
            if st_dtype not in _ST_DTYPES:
                raise self._fail(f"tensor {name!r} has unsupported dtype {st_dtype}")
            dtype = _ST_DTYPES[st_dtype]
            packed = name in int4
            if packed:
                dtype = DType.I4
                logical = int4[name]
                if logical is not None:
                    if st_dtype != "U8" or tuple(shape) != packed_int4_shape(logical):
                        raise self._fail(f"tensor {name!r}: int4 {logical} must be stored as U8"
                                         f"{list(packed_int4_shape(logical))}, not {st_dtype}{shape}")
                    shape = list(logical)
            if math.prod(d for d in shape if d) * dtype.numpy.itemsize > 2**63 - 1:  # numpy's limit
                raise self._fail(f"tensor {name!r}: shape {shape} is larger than 2**63 bytes: the file "
                                 "is corrupt")
            numel = math.prod(shape)
            expect = math.ceil(numel / 2) if packed else numel * dtype.numpy.itemsize
            if end - start != expect or start < 0:
                raise self._fail(
                    f"tensor {name!r}: {end - start} bytes for {st_dtype}{shape} "
                    f"(expected {expect})"
                )
            if end > data_size:
                raise self._fail(
                    f"tensor {name!r} ends at byte {end} but the data section has "
                    f"{data_size} bytes: the file is truncated"
                )
            self.entries[name] = _TensorEntry(dtype, tuple(shape), start, end, packed)
        # Two tensors sharing bytes would alias each other's data: safetensors refuses it too.
        spans = sorted((e.start, e.end, n) for n, e in self.entries.items() if e.end > e.start)
        for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
            if start_b < end_a:
                raise self._fail(f"tensors {a!r} and {b!r} overlap in the data section (bytes "
                                 f"{start_b}..{end_a}): the file is corrupt")

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def source(self, key: str) -> SafetensorsSource:
        if key not in self.entries:
            raise self._fail(f"no tensor named {key!r}")
        return SafetensorsSource(self, key)

    def read(self, key: str) -> np.ndarray:
        e = self.entries[key]
        if self._mmap is None:
            if self.path.stat().st_size == self._data_start:
                return np.zeros(e.shape, e.dtype.numpy)
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start)
        raw = self._mmap[e.start : e.end]
        self._touched.append((e.start, e.end))
        if e.packed_int4:
            return unpack_int4(np.asarray(raw), math.prod(e.shape)).reshape(e.shape)
        return raw.view(e.dtype.numpy).reshape(e.shape)


    def release_pages(self) -> None:
        """Drop the pages read so far from this process's memory map. They stay in the page cache
        and are faulted back in on the next access, so arrays still viewing them stay valid; the
        point is that a streaming writer's resident memory stays bounded by the tensor it holds,
        not by the checkpoint it has read."""
        touched, self._touched = self._touched, []
        for start, end in touched:
            self._drop(start, end)

    def release_array(self, array: np.ndarray) -> None:
        """Drop the pages of `array` (C-contiguous) if it views this file's map: a tensor written
        as it is stored faults its pages back in after `release_pages`, when it is hashed and
        written, and nothing else would drop them again."""
        if self._mmap is None or not array.flags.c_contiguous:
            return
        start = array.__array_interface__["data"][0] - self._mmap.__array_interface__["data"][0]
        if start >= 0 and start + array.nbytes <= self._mmap.size:
            self._drop(start, start + array.nbytes)

    def _drop(self, start: int, end: int) -> None:
        """madvise(DONTNEED) the pages of data bytes [start, end) (whole pages, rounded outward)."""
        mm = getattr(self._mmap, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        base = self._data_start - self._data_start % mmap.ALLOCATIONGRANULARITY  # np.memmap's map start
        lo = self._data_start + start - base
        lo -= lo % mmap.PAGESIZE
        hi = min(self._data_start + end - base, len(mm))
        if hi > lo:
            with contextlib.suppress(OSError, ValueError):
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


_OPEN_FILES: weakref.WeakSet[SafetensorsFile] = weakref.WeakSet()


def release_mapped_pages() -> None:
    """`release_pages` of every open safetensors file (called by writers between tensors)."""
    for f in list(_OPEN_FILES):
        f.release_pages()


def release_mapped_array(array: np.ndarray) -> None:
    """`release_array` of every open safetensors file (a writer calls it once it has written
    `array`, for the tensors it writes straight from the map)."""
    for f in list(_OPEN_FILES):
        f.release_array(array)


class SafetensorsSource(WeightSource):
    """One tensor of a safetensors file, read through the file's memory map."""

    def __init__(self, file: SafetensorsFile, key: str) -> None:
        e = file.entries[key]
        self.file = file
        self.key = key
        self.dtype = e.dtype
        self.shape = e.shape

    def read(self) -> np.ndarray:
        return self.file.read(self.key)

    def describe(self) -> str:
        return f"{self.file.path.name}:{self.key}"


class _DerivedSource(WeightSource):
    def __init__(self, base: WeightSource) -> None:
        self.base = base


class TransposedSource(_DerivedSource):
    """`base` with its axes permuted (default: reversed)."""

    def __init__(self, base: WeightSource, perm: Sequence[int] | None = None) -> None:
        super().__init__(base)
        self.perm = tuple(perm) if perm is not None else tuple(reversed(range(len(base.shape))))
        self.dtype = base.dtype
        self.shape = tuple(base.shape[p] for p in self.perm)

    def read(self) -> np.ndarray:
        return np.ascontiguousarray(self.base.read().transpose(self.perm))

    def describe(self) -> str:
        return f"transpose{list(self.perm)}({self.base.describe()})"


class SlicedSource(_DerivedSource):
    """`base[..., start:stop, ...]` along one axis."""

    def __init__(self, base: WeightSource, axis: int, start: int, stop: int) -> None:
        super().__init__(base)
        axis = axis % len(base.shape)
        if not 0 <= start <= stop <= base.shape[axis]:
            raise WeightError(f"slice {start}:{stop} out of range for axis {axis} of {base.shape}")
        self.axis, self.start, self.stop = axis, start, stop
        self.dtype = base.dtype
        shape = list(base.shape)
        shape[axis] = stop - start
        self.shape = tuple(shape)

    def read(self) -> np.ndarray:
        index = [slice(None)] * len(self.shape)
        index[self.axis] = slice(self.start, self.stop)
        return self.base.read()[tuple(index)]

    def describe(self) -> str:
        return f"slice(axis={self.axis}, {self.start}:{self.stop}, {self.base.describe()})"


class ConcatSource(WeightSource):
    """Several sources joined along an existing axis."""

    def __init__(self, parts: Sequence[WeightSource], axis: int) -> None:
        if not parts:
            raise WeightError("concat of no sources")
        self.parts = list(parts)
        rank = len(parts[0].shape)
        self.axis = axis % rank
        self.dtype = parts[0].dtype
        for p in parts:
            others = [d for i, d in enumerate(p.shape) if i != self.axis]
            first = [d for i, d in enumerate(parts[0].shape) if i != self.axis]
            if p.dtype != self.dtype or len(p.shape) != rank or others != first:
                raise WeightError(f"cannot concat {p.describe()} {p.shape} with {parts[0].shape}")
        shape = list(parts[0].shape)
        shape[self.axis] = sum(p.shape[self.axis] for p in parts)
        self.shape = tuple(shape)

    def read(self) -> np.ndarray:
        return np.concatenate([p.read() for p in self.parts], axis=self.axis)

    def describe(self) -> str:
        return f"concat(axis={self.axis}, {len(self.parts)} parts, first {self.parts[0].describe()})"


class StackSource(WeightSource):
    """Several same-shaped sources stacked along a new leading axis (e.g. MoE experts)."""

    def __init__(self, parts: Sequence[WeightSource]) -> None:
        if not parts:
            raise WeightError("stack of no sources")
        self.parts = list(parts)
        first = parts[0]
        for p in parts:
            if p.shape != first.shape or p.dtype != first.dtype:
                raise WeightError(
                    f"cannot stack {p.describe()} {p.dtype}{list(p.shape)} with "
                    f"{first.dtype}{list(first.shape)}"
                )
        self.dtype = first.dtype
        self.shape = (len(parts), *first.shape)

    def read(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype.numpy)
        for i, p in enumerate(self.parts):
            out[i] = p.read()
        return out

    def describe(self) -> str:
        return f"stack({len(self.parts)} parts, first {self.parts[0].describe()})"


class CastSource(_DerivedSource):
    """`base` converted to another dtype (exact for widening float casts)."""

    def __init__(self, base: WeightSource, dtype: DType) -> None:
        super().__init__(base)
        self.dtype = dtype
        self.shape = base.shape

    def read(self) -> np.ndarray:
        return self.base.read().astype(self.dtype.numpy)

    def describe(self) -> str:
        return f"cast<{self.dtype}>({self.base.describe()})"


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Pack int4 values (any int dtype in [-8, 7]) two per byte, low nibble first."""
    flat = np.asarray(values).reshape(-1).astype(np.int8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    nibbles = flat.view(np.uint8) & np.uint8(0x0F)
    return (nibbles[0::2] | (nibbles[1::2] << np.uint8(4))).astype(np.uint8)


def unpack_int4(packed: np.ndarray, count: int) -> np.ndarray:
    """Inverse of `pack_int4`: the first `count` int4 values as an ml_dtypes int4 array."""
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    out = np.empty(p.size * 2, np.uint8)
    out[0::2] = p & 0x0F
    out[1::2] = p >> 4
    signed = ((out[:count].astype(np.int8) ^ 8) - 8).astype(np.int8)
    return signed.astype(DType.I4.numpy)


@dataclass
class _PendingTensor:
    name: str
    source: WeightSource
    start: int = 0
    end: int = 0
    meta: dict[str, object] = field(default_factory=dict)


_EXPONENT_MASKS: dict[DType, tuple[type[np.unsignedinteger], int]] = {
    DType.F32: (np.uint32, 0x7F800000),
    DType.BF16: (np.uint16, 0x7F80),
    DType.F16: (np.uint16, 0x7C00),
}
"""Per float dtype: (same-width uint, exponent bits). All exponent bits set is Inf or NaN."""
_FINITE_CHUNK = 1 << 22


def count_nonfinite(array: np.ndarray) -> int:
    """NaN and Inf values in a float array (0 for other dtypes), in bounded extra memory: the
    exponent bits are tested chunk by chunk on the raw bits, so a multi-GB tensor needs no
    float32 copy and no bool array of its size."""
    dtype = DType.from_numpy(array.dtype)
    if not dtype.is_float:
        return 0
    flat = np.ascontiguousarray(array).reshape(-1)
    bad = 0
    mask = _EXPONENT_MASKS.get(dtype)
    for lo in range(0, flat.size, _FINITE_CHUNK):
        chunk = flat[lo:lo + _FINITE_CHUNK]
        if mask is not None:
            bits = chunk.view(mask[0]) & mask[0](mask[1])
            bad += int(np.count_nonzero(bits == mask[1]))
        else:
            bad += int(chunk.size - np.count_nonzero(np.isfinite(chunk.astype(np.float32))))
    return bad


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, WeightSource | np.ndarray]],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[str, int, int], None] | None = None,
    *,
    require_finite: bool = False,
) -> str:
    """Write tensors to a safetensors file, streaming from their sources; returns the file's sha256.

    The tensors ahead of the one being written are read and computed
    meanwhile on another thread (`_ReadAhead`: quantizing or packing them
    overlaps hashing and writing this one), up to READ_AHEAD_BYTES of them, so
    the values in memory stay below that plus the largest tensor and writing a
    graph never needs its whole checkpoint in RAM. `on_tensor(name, done, total)` reports
    progress after each tensor. The digest is taken from the bytes as they are
    written, so nobody has to read the file again to hash it. `require_finite`:
    a float tensor holding NaN or Inf raises WeightError naming it (checked on the
    values as they are written, so it costs no extra pass over the checkpoint).
    """
    pending: list[_PendingTensor] = []
    offset = 0
    int4_shapes: dict[str, list[int]] = {}
    for name, t in tensors:
        src = ArraySource(np.asarray(t)) if isinstance(t, np.ndarray) else t
        nbytes = src.nbytes if src.dtype == DType.I4 else math.prod(src.shape) * src.dtype.numpy.itemsize
        pending.append(_PendingTensor(name, src, offset, offset + nbytes))
        if src.dtype == DType.I4:
            int4_shapes[name] = list(src.shape)
        offset += nbytes
    header: dict[str, object] = {}
    meta = dict(metadata or {})
    if int4_shapes:
        meta[_INT4_META] = json.dumps(int4_shapes)
    if meta:
        header["__metadata__"] = meta
    for p in pending:
        if p.source.dtype == DType.I4:
            st, shape = "U8", list(packed_int4_shape(p.source.shape))
        else:
            st, shape = _ST_NAMES[p.source.dtype], list(p.source.shape)
        header[p.name] = {"dtype": st, "shape": shape, "data_offsets": [p.start, p.end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f, _ReadAhead(pending, require_finite) as ahead:
        for chunk in (struct.pack("<Q", len(raw)), raw):
            f.write(chunk)
            digest.update(chunk)
        for done, p in enumerate(pending, 1):
            data = ahead.next()
            view = memoryview(data.reshape(-1).view(np.uint8))
            # sha256 and the write both release the GIL: hash on the other core while writing
            hashing = _HASHER.submit(digest.update, view)
            write_buffer(f, view)
            hashing.result()
            release_mapped_array(data)
            del data, view
            ahead.taken(p.end - p.start)
            if on_tensor is not None:
                on_tensor(p.name, done, len(pending))
    return digest.hexdigest()


class _ReadAhead:
    """The bytes of `pending`'s tensors (`_tensor_bytes`), in order, computed on a thread of
    their own up to READ_AHEAD_BYTES ahead of the consumer (always at least one tensor).

    A budget in bytes rather than a count of tensors: a checkpoint interleaves large weights
    with tiny norms, and a lookahead of one or two tensors leaves the producer idle behind a
    norm while a large weight is hashed (measured: the producer and the hasher then took
    turns). The consumer hands each tensor's bytes back with `taken` once written, so the
    values in memory stay below READ_AHEAD_BYTES plus the largest tensor."""

    def __init__(self, pending: Sequence[_PendingTensor], require_finite: bool) -> None:
        self._pending, self._require_finite = pending, require_finite
        self._cond = threading.Condition()
        self._ready: collections.deque[np.ndarray | BaseException] = collections.deque()
        self._ahead = 0  # bytes computed or being computed, not yet `taken`
        self._closed = False
        self._thread = threading.Thread(target=self._produce, name="ernie-ir-produce", daemon=True)

    def __enter__(self) -> _ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _produce(self) -> None:
        try:
            for p in self._pending:
                n = p.end - p.start
                with self._cond:
                    self._cond.wait_for(functools.partial(self._may_start, n))
                    if self._closed:
                        return
                    self._ahead += n
                data = _tensor_bytes(p, self._require_finite)
                with self._cond:
                    self._ready.append(data)
                    self._cond.notify_all()
        except BaseException as e:  # handed to the consumer, which raises it
            with self._cond:
                self._ready.append(e)
                self._cond.notify_all()

    def _may_start(self, nbytes: int) -> bool:
        return self._closed or self._ahead == 0 or self._ahead + nbytes <= READ_AHEAD_BYTES

    def next(self) -> np.ndarray:
        """The next tensor's bytes, or the exception computing them raised."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._ready))
            item = self._ready.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def taken(self, nbytes: int) -> None:
        """A tensor of `nbytes` is written: the producer may run that much further ahead."""
        with self._cond:
            self._ahead -= nbytes
            self._cond.notify_all()


READ_AHEAD_BYTES = 128 << 20
"""Bytes of computed tensors `write_safetensors` keeps ahead of the one it writes (with 32 MiB
the producer still waited behind the hash a quarter of the time; 128 MiB: 5%, and the writer of
a 2.5 GB checkpoint took 1.32 s instead of 1.56 s; 256 MiB gained nothing more)."""


def _tensor_bytes(p: _PendingTensor, require_finite: bool) -> np.ndarray:
    """The bytes `write_safetensors` writes for `p` (C order; int4 packed two to a byte), checked.

    Runs on the producer thread, which is also the only one to release the source pages it read
    (arrays still viewing them stay valid: the pages fault back in from the page cache)."""
    arr = p.source.read()
    if tuple(arr.shape) != p.source.shape or arr.dtype != p.source.dtype.numpy:
        raise WeightError(
            f"source of {p.name!r} produced {arr.dtype}{list(arr.shape)}, "
            f"declared {p.source.dtype}{list(p.source.shape)}"
        )
    if require_finite and (bad := count_nonfinite(arr)):
        raise WeightError(
            f"tensor {p.name!r} holds {bad} NaN/Inf value(s) of {arr.size} "
            f"(from {p.source.describe()}): the checkpoint is broken or overflowed; fix or "
            "re-export it")
    data = pack_int4(arr) if p.source.dtype == DType.I4 else np.ascontiguousarray(arr)
    del arr
    release_mapped_pages()
    return data


class _DaemonWorker:
    """One daemon thread running the calls submitted to it, in order (the sha256 of a buffer while
    the writer writes it). Not a ThreadPoolExecutor: its worker is not a daemon, and is woken at
    exit only once registered, a step after it starts; a SIGTERM (raised as an interrupt) landing
    between the two left a killed compile waiting forever for an idle worker at exit."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, which raises it
                future.set_exception(e)


_HASHER = _DaemonWorker("ernie-ir-sha256")

WRITE_CHUNK = 1 << 20
"""Bytes per write(2) of a large buffer (see `write_buffer`)."""


def write_buffer(f: BinaryIO, data: bytes | memoryview) -> None:
    """Write `data` to `f` in WRITE_CHUNK pieces. One write(2) of a 1 GB buffer into a new file
    ran 5-10x slower here than the same bytes in 1 MiB writes (0.3 s against 1.5-3 s of kernel
    time for 1.34 GB: the kernel copes badly with one huge copy into fresh page-cache pages)."""
    view = memoryview(data).cast("B")
    for lo in range(0, len(view), WRITE_CHUNK):
        f.write(view[lo:lo + WRITE_CHUNK])


def content_hash(array: np.ndarray) -> str:
    """sha256 of the array's bytes in C order, first 16 hex digits (for printing)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return h.hexdigest()[:16]
