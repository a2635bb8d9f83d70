"""Weight sources and safetensors I/O: every dtype round-trips bit-exactly."""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import ernie_ir.ir.weights as weights
from ernie_ir.ir import DType, WeightError
from ernie_ir.ir.weights import (
    ArraySource,
    CastSource,
    ConcatSource,
    GeneratedSource,
    SafetensorsFile,
    SlicedSource,
    StackSource,
    TransposedSource,
    content_hash,
    pack_int4,
    unpack_int4,
    write_safetensors,
)


def sample(dtype: DType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Values that exercise the dtype's range (including negatives and, for floats, specials)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == DType.BOOL:
        flat = rng.integers(0, 2, n).astype(bool)
    elif dtype == DType.I4:
        flat = rng.integers(-8, 8, n).astype(np.int8).astype(ml_dtypes.int4)
    elif dtype.is_int:
        info = np.iinfo(dtype.numpy)
        flat = rng.integers(info.min, info.max, n, dtype=dtype.numpy, endpoint=True)
    else:
        flat = (rng.standard_normal(n) * 4).astype(np.float32)
        if n >= 3:
            flat[:3] = [0.0, -0.0, 1e-3]
        flat = flat.astype(dtype.numpy)
    return flat.reshape(shape)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


SHAPES = [(), (1,), (3,), (2, 3), (5, 7), (2, 3, 5), (0, 4)]


@pytest.mark.parametrize("dtype", list(DType), ids=str)
def test_every_dtype_round_trips_through_safetensors(tmp_path, dtype):
    tensors = [(f"t{i}", sample(dtype, shape, seed=i)) for i, shape in enumerate(SHAPES)]
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors, metadata={"format": "np"})
    st = SafetensorsFile(path)
    assert st.keys() == [name for name, _ in tensors] == list(st)
    assert st.metadata["format"] == "np"
    for name, arr in tensors:
        assert name in st
        src = st.source(name)
        assert (src.dtype, src.shape) == (dtype, arr.shape)
        got = src.read()
        assert got.dtype == dtype.numpy and got.shape == arr.shape
        assert bits(got) == bits(arr), name
        assert src.describe() == f"w.safetensors:{name}"


@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 15, 16, 33])
def test_int4_is_packed_two_per_byte_low_nibble_first(tmp_path, count):
    values = (np.arange(count) % 16 - 8).astype(np.int8).astype(ml_dtypes.int4)
    packed = pack_int4(values)
    assert packed.dtype == np.uint8 and packed.size == (count + 1) // 2
    assert packed[0] & 0x0F == (int(values[0]) & 0x0F)
    if count > 1:
        assert packed[0] >> 4 == (int(values[1]) & 0x0F)
    assert bits(unpack_int4(packed, count)) == bits(values)
    path = tmp_path / "i4.safetensors"
    write_safetensors(path, [("q", values)])
    assert path.stat().st_size == 8 + struct.unpack("<Q", path.read_bytes()[:8])[0] + (count + 1) // 2
    got = SafetensorsFile(path).read("q")
    assert got.dtype == ml_dtypes.int4 and bits(got) == bits(values)


def test_int4_packing_matches_a_hand_computed_byte():
    assert pack_int4(np.array([-1, 2, 7], np.int8)).tolist() == [0x2F, 0x07]
    assert unpack_int4(np.array([0x2F, 0x07], np.uint8), 3).astype(np.int8).tolist() == [-1, 2, 7]


def test_our_files_read_with_the_safetensors_package(tmp_path):
    tensors = {
        "f32": sample(DType.F32, (3, 5)),
        "f16": sample(DType.F16, (4,)),
        "i64": sample(DType.I64, (2, 2, 2)),
        "scalar": sample(DType.F32, ()),
    }
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, tensors.items(), metadata={"k": "v"})
    theirs = safetensors.numpy.load_file(path)
    assert set(theirs) == set(tensors)
    for name, arr in tensors.items():
        assert theirs[name].dtype == arr.dtype and theirs[name].shape == arr.shape
        assert bits(theirs[name]) == bits(arr)


def test_the_safetensors_package_files_read_with_ours(tmp_path):
    tensors = {
        "a.weight": sample(DType.F32, (3, 5)),
        "b": sample(DType.F16, (7,)),
        "c": sample(DType.I64, (2, 3)),
        "d": sample(DType.F32, ()),
    }
    path = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(tensors, path, metadata={"source": "test"})
    st = SafetensorsFile(path)
    assert set(st.keys()) == set(tensors) and st.metadata == {"source": "test"}
    for name, arr in tensors.items():
        got = st.read(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape and bits(got) == bits(arr)


def test_reads_are_read_only_views_of_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, [("a", sample(DType.F32, (4, 4)))])
    got = SafetensorsFile(path).read("a")
    assert not got.flags.writeable


def test_a_file_with_no_data_bytes_still_reads_empty_tensors(tmp_path):
    path = tmp_path / "empty.safetensors"
    write_safetensors(path, [("e", np.zeros((0, 3), np.float32))])
    assert SafetensorsFile(path).read("e").shape == (0, 3)


# -- damaged files --------------------------------------------------------------------

def good_file(tmp_path) -> bytes:
    path = tmp_path / "good.safetensors"
    write_safetensors(path, [("a", sample(DType.F32, (8, 8))), ("b", sample(DType.BF16, (4,)))])
    return path.read_bytes()


def header_of(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda d: d[: len(d) - 4], "tensor 'b' ends at byte 264 but the data section has 260 bytes: "
                                      "the file is truncated"),
        (lambda d: d[:5], "not a safetensors file (shorter than its 8-byte header length)"),
        (lambda d: b"", "not a safetensors file"),
        (lambda d: struct.pack("<Q", 10**6) + d[8:], "header length 1000000 exceeds the file size"),
        (lambda d: struct.pack("<Q", 2**63) + d[8:], "the file is truncated or not safetensors"),
        (lambda d: d[:8] + b"{not json" + d[17:], "header is not valid JSON: the file is corrupt"),
        (lambda d: d[:8] + b"\xff\xfe" + d[10:], "header is not valid JSON"),
        (lambda d: with_header({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
         "tensor 'a' has a malformed header entry"),
        (lambda d: with_header({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
         "tensor 'a' has unsupported dtype C64"),
        (lambda d: with_header({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
         "tensor 'a': 8 bytes for F32[3] (expected 12)"),
        (lambda d: with_header([1, 2], b""), "header is not a JSON object of tensors"),
        (lambda d: with_header({"__metadata__": ["x"]}, b""), "header is not a JSON object of tensors"),
        (lambda d: with_header({"__metadata__": {"ernie_ir.int4": "a"}}, b""),
         "metadata ernie_ir.int4 is not a map of tensor names to int4 shapes"),
        (lambda d: with_header({"a": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 8]}}, b"\0" * 8),
         "tensor 'a' has a malformed header entry"),
        (lambda d: with_header({"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
         "tensor 'a' has a malformed header entry"),
        (lambda d: with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", 8]}}, b"\0" * 8),
         "tensor 'a' has a malformed header entry"),
        (lambda d: with_header({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
         "tensor 'a' has a malformed header entry"),
    ],
    ids=["truncated data", "truncated length", "empty", "header length too big", "absurd length",
         "corrupt json", "not utf-8", "missing offsets", "unknown dtype", "wrong byte count",
         "header is a list", "metadata is a list", "bad int4 metadata", "shape is a string",
         "dtype is a list", "offset is a string", "negative dim"],
)
def test_damaged_files_raise_weight_error_naming_the_file(tmp_path, damage, fragment):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(damage(good_file(tmp_path)))
    with pytest.raises(WeightError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "broken.safetensors" in message
    assert fragment in message


def test_a_missing_file_and_a_missing_tensor_name_the_file(tmp_path):
    with pytest.raises(WeightError, match=r"nope\.safetensors: cannot read \(No such file or directory\)"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    path = tmp_path / "w.safetensors"
    path.write_bytes(good_file(tmp_path))
    with pytest.raises(WeightError, match=r"w\.safetensors: no tensor named 'zz'"):
        SafetensorsFile(path).source("zz")


def test_the_writer_refuses_a_source_that_lies_about_its_type(tmp_path):
    class Liar(ArraySource):
        def read(self):
            return np.zeros((2, 2), np.float16)

    with pytest.raises(WeightError, match=r"source of 'x' produced float16\[2, 2\], declared f32\[2, 2\]"):
        write_safetensors(tmp_path / "w.safetensors", [("x", Liar(np.zeros((2, 2), np.float32)))])


# -- the writer's read-ahead ------------------------------------------------------------

class _Recorded(ArraySource):
    """An ArraySource that logs when it is read (computed) into a shared list."""

    def __init__(self, name: str, array: np.ndarray, log: list[tuple[str, str]]) -> None:
        super().__init__(array)
        self.name, self.log = name, log

    def read(self):
        self.log.append(("read", self.name))
        return super().read()


def _write_logged(path, sizes, log, monkeypatch, budget, on_tensor=None):
    """write_safetensors of uint8 tensors t0, t1, ... of `sizes` bytes, logging each read and
    each tensor the writer hands back to the read-ahead (("taken", bytes), logged first)."""
    monkeypatch.setattr(weights, "READ_AHEAD_BYTES", budget)
    taken = weights._ReadAhead.taken

    def logged_taken(self, nbytes):
        log.append(("taken", nbytes))
        taken(self, nbytes)

    monkeypatch.setattr(weights._ReadAhead, "taken", logged_taken)
    tensors = [(f"t{i}", _Recorded(f"t{i}", np.full(n, i, np.uint8), log)) for i, n in enumerate(sizes)]

    def written(name, done, total):
        log.append(("written", name))
        if on_tensor is not None:
            on_tensor(name, done, total)

    return write_safetensors(path, tensors, on_tensor=written), tensors


def _in_flight(log, sizes):
    """The most tensor bytes read (computed) and not yet handed back, over the log."""
    size = {f"t{i}": n for i, n in enumerate(sizes)}
    now = peak = 0
    for what, item in log:
        now += size[item] if what == "read" else -item if what == "taken" else 0
        peak = max(peak, now)
    return peak


def test_the_writer_reads_ahead_within_its_byte_budget(tmp_path, monkeypatch):
    sizes = [4000, 10, 10, 4000, 10, 3000, 10, 10, 5000, 10]
    log: list[tuple[str, str]] = []
    digest, _ = _write_logged(tmp_path / "w.safetensors", sizes, log, monkeypatch, budget=8000)
    # every tensor read once, in order, before it is written
    assert [n for w, n in log if w == "read"] == [f"t{i}" for i in range(len(sizes))]
    assert all(log.index(("read", n)) < log.index(("written", n)) for w, n in log if w == "read")
    # bounded by the budget plus the largest tensor, whatever the sizes (here it reached
    # 7050: t3..t7 ride behind t0's write, t8 waits until the budget has room)
    assert 8000 - 1000 < _in_flight(log, sizes) <= 8000 + max(sizes)
    # the file holds what was given, and the digest is the file's
    got = safetensors.numpy.load_file(str(tmp_path / "w.safetensors"))
    assert all(np.array_equal(got[f"t{i}"], np.full(n, i, np.uint8)) for i, n in enumerate(sizes))
    assert digest == hashlib.sha256((tmp_path / "w.safetensors").read_bytes()).hexdigest()


def test_the_writer_reads_past_small_tensors_while_it_writes(tmp_path, monkeypatch):
    """With room in the budget the producer is not held to one tensor ahead: when t0 is written
    it has already read t1..t3 (a lookahead of one would have read only t1)."""
    sizes = [1000, 10, 10, 1000, 10]
    log: list[tuple[str, str]] = []
    seen: dict[str, list[str]] = {}
    ready = threading.Event()

    class MarksT3(_Recorded):
        def read(self):
            arr = super().read()
            if self.name == "t3":
                ready.set()
            return arr

    monkeypatch.setattr(weights, "READ_AHEAD_BYTES", 1 << 20)
    tensors = [(f"t{i}", (MarksT3 if i == 3 else _Recorded)(f"t{i}", np.full(n, i, np.uint8), log))
               for i, n in enumerate(sizes)]

    def written(name, done, total):
        if name == "t0":
            assert ready.wait(10), "the producer did not run ahead to t3"
        seen[name] = [n for w, n in log if w == "read"]

    write_safetensors(tmp_path / "w.safetensors", tensors, on_tensor=written)
    assert seen["t0"][:4] == ["t0", "t1", "t2", "t3"]


def test_a_failing_write_stops_the_read_ahead_thread(tmp_path, monkeypatch):
    log: list[tuple[str, str]] = []
    before = {t.ident for t in threading.enumerate()}

    def boom(name, done, total):
        if done == 2:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _write_logged(tmp_path / "w.safetensors", [100] * 50, log, monkeypatch, budget=300, on_tensor=boom)
    left = [t for t in threading.enumerate() if t.ident not in before and t.name == "ernie-ir-produce"]
    assert not left
    assert len([1 for w, _ in log if w == "read"]) < 50  # it stopped instead of reading everything


def test_a_failing_read_ahead_raises_in_the_writer(tmp_path):
    class Broken(ArraySource):
        def read(self):
            raise WeightError("t1: the disk returned garbage")

    ok = np.zeros(8, np.float32)
    with pytest.raises(WeightError, match="the disk returned garbage"):
        write_safetensors(tmp_path / "w.safetensors", [("t0", ok), ("t1", Broken(ok)), ("t2", ok)])


def _mapped_kib(path) -> int | None:
    """Resident KiB of this process's mappings of `path` (None where /proc/self/smaps is missing)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    total, current = 0, False
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            current = len(head) > 5 and head[5] == str(path)
        elif current and line.startswith("Rss:"):
            total += int(head[1])
    return total


def test_a_tensor_written_straight_from_its_map_leaves_no_pages_mapped(tmp_path):
    """A passthrough tensor (written as stored: an embedding) is a view of the source's map; the
    writer's hash and write fault its pages back in after the producer released them, so the
    writer releases them once more (else a 1.7 GB embedding stays resident to the end)."""
    src = tmp_path / "src.safetensors"
    big = np.arange(4 << 20, dtype=np.int32)  # 16 MiB
    write_safetensors(src, [("big", big)])
    stored = SafetensorsFile(src)
    write_safetensors(tmp_path / "out.safetensors", [("big", stored.source("big"))])
    resident = _mapped_kib(src.resolve())
    if resident is None:
        pytest.skip("no /proc/self/smaps")
    assert resident < 1024, f"{resident} KiB of the source still mapped"
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / "out.safetensors").read("big"), big)


# -- lazy derived sources ---------------------------------------------------------------

@pytest.fixture
def stored(tmp_path):
    """A (4, 6) bf16 tensor and a (2, 3, 4) f32 tensor, stored in a file."""
    a = sample(DType.BF16, (4, 6), seed=1)
    b = sample(DType.F32, (2, 3, 4), seed=2)
    path = tmp_path / "w.safetensors"
    write_safetensors(path, [("a", a), ("b", b)])
    st = SafetensorsFile(path)
    return st.source("a"), a, st.source("b"), b


def check(src, expected: np.ndarray) -> None:
    """The source promises expected's dtype and shape up front and delivers its bits."""
    assert src.dtype == DType.from_numpy(expected.dtype)
    assert src.shape == expected.shape
    assert src.nbytes == expected.nbytes
    got = src.read()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert bits(got) == bits(expected)


def test_transposed_source(stored):
    sa, a, sb, b = stored
    check(TransposedSource(sa), a.T)
    check(TransposedSource(sb, (1, 2, 0)), b.transpose(1, 2, 0))
    assert TransposedSource(sa).describe() == "transpose[1, 0](w.safetensors:a)"


def test_sliced_source(stored):
    sa, a, sb, b = stored
    check(SlicedSource(sa, 1, 2, 5), a[:, 2:5])
    check(SlicedSource(sb, -1, 0, 1), b[..., 0:1])
    check(SlicedSource(sb, 0, 1, 1), b[1:1])
    with pytest.raises(WeightError, match=r"slice 3:7 out of range for axis 0 of \(4, 6\)"):
        SlicedSource(sa, 0, 3, 7)


def test_concat_source(stored):
    sa, a, _sb, _b = stored
    parts = [SlicedSource(sa, 1, 0, 2), SlicedSource(sa, 1, 4, 6), sa]
    check(ConcatSource(parts, axis=-1), np.concatenate([a[:, 0:2], a[:, 4:6], a], axis=-1))
    check(ConcatSource([sa, sa], axis=0), np.concatenate([a, a], axis=0))
    with pytest.raises(WeightError, match=r"cannot concat"):
        ConcatSource([sa, TransposedSource(sa)], axis=0)
    with pytest.raises(WeightError, match=r"concat of no sources"):
        ConcatSource([], axis=0)


def test_stack_source(stored):
    sa, a, _sb, _b = stored
    t = TransposedSource(TransposedSource(sa))
    check(StackSource([sa, t, sa]), np.stack([a, a, a]))
    with pytest.raises(WeightError, match=r"cannot stack .* bf16\[6, 4\] with bf16\[4, 6\]"):
        StackSource([sa, TransposedSource(sa)])
    with pytest.raises(WeightError, match=r"stack of no sources"):
        StackSource([])


@pytest.mark.parametrize("target", [DType.F32, DType.F16, DType.F8E4M3, DType.I32], ids=str)
def test_cast_source(stored, target):
    sa, a, _sb, _b = stored
    check(CastSource(sa, target), a.astype(target.numpy))


def test_widening_cast_is_exact(stored):
    sa, a, _sb, _b = stored
    back = CastSource(CastSource(sa, DType.F32), DType.BF16)
    check(back, a)


def test_derived_sources_compose_lazily(stored):
    _sa, a, _sb, _b = stored
    reads = []

    class Counting(ArraySource):
        def read(self):
            reads.append(1)
            return super().read()

    base = Counting(a)
    fused = CastSource(TransposedSource(SlicedSource(base, 1, 3, 6)), DType.F32)
    assert (fused.dtype, fused.shape) == (DType.F32, (3, 4)) and reads == []
    check(fused, a[:, 3:6].T.astype(np.float32))
    assert reads == [1]
    assert fused.describe() == "cast<f32>(transpose[1, 0](slice(axis=1, 3:6, array bf16[4, 6])))"


def test_generated_source_is_deterministic():
    for init in ("normal", "uniform", "ones", "zeros"):
        a = GeneratedSource(DType.BF16, (3, 4), seed=7, init=init, std=0.5).read()
        b = GeneratedSource(DType.BF16, (3, 4), seed=7, init=init, std=0.5).read()
        assert a.dtype == ml_dtypes.bfloat16 and a.shape == (3, 4) and bits(a) == bits(b)
    u = GeneratedSource(DType.F32, (1000,), seed=1, init="uniform", std=0.5).read()
    assert u.min() >= -0.5 and u.max() <= 0.5
    n1 = GeneratedSource(DType.F32, (100,), seed=1).read()
    n2 = GeneratedSource(DType.F32, (100,), seed=2).read()
    assert bits(n1) != bits(n2)
    expected = (np.random.default_rng(1).standard_normal((100,), dtype=np.float32) * np.float32(0.02))
    assert bits(n1) == bits(expected)
    with pytest.raises(ValueError, match=r"unknown init 'xavier'"):
        GeneratedSource(DType.F32, (2,), seed=0, init="xavier")


def test_content_hash_depends_on_bytes_only():
    a = sample(DType.F32, (4, 4))
    assert content_hash(a) == content_hash(a.copy())
    assert content_hash(a.T) == content_hash(np.ascontiguousarray(a.T))
    assert content_hash(a) != content_hash(a.T)
    assert len(content_hash(a)) == 16 and int(content_hash(a), 16) >= 0


def test_int4_tensors_open_with_the_safetensors_library(tmp_path):
    """int4 is stored as U8 of the packed shape, so a bare safetensors reader opens the file."""
    from safetensors import safe_open

    from ernie_ir.ir.weights import pack_int4, write_safetensors

    rng = np.random.default_rng(3)
    even = rng.integers(-8, 8, (4, 6)).astype(DType.I4.numpy)
    odd = rng.integers(-8, 8, (3, 5)).astype(DType.I4.numpy)
    path = tmp_path / "q.safetensors"
    write_safetensors(path, [("even", even), ("odd", odd)])
    with safe_open(str(path), "np") as f:
        assert f.get_tensor("even").shape == (4, 3) and f.get_tensor("odd").shape == (8,)
        assert np.array_equal(f.get_tensor("even").reshape(-1), pack_int4(even))
        assert np.array_equal(f.get_tensor("odd"), pack_int4(odd))
    ours = SafetensorsFile(path)
    assert np.array_equal(ours.read("even").astype(np.int8), even.astype(np.int8))
    assert np.array_equal(ours.read("odd").astype(np.int8), odd.astype(np.int8))
