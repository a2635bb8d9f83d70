"""Element types and tensor types: the vocabulary every other part of the IR uses."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ernie_ir.ir import DType, TensorType, tensor
from ernie_ir.ir.types import broadcast_shapes, canonical_dim, dim_divide, dim_product

# name, numpy storage dtype, bits, is_float, is_int
DTYPE_TABLE = [
    ("f32", np.float32, 32, True, False),
    ("f16", np.float16, 16, True, False),
    ("bf16", ml_dtypes.bfloat16, 16, True, False),
    ("f8e4m3", ml_dtypes.float8_e4m3fn, 8, True, False),
    ("f8e5m2", ml_dtypes.float8_e5m2, 8, True, False),
    ("i64", np.int64, 64, False, True),
    ("i32", np.int32, 32, False, True),
    ("i8", np.int8, 8, False, True),
    ("i4", ml_dtypes.int4, 4, False, True),
    ("u8", np.uint8, 8, False, True),
    ("bool", np.bool_, 8, False, False),
]


def test_the_table_covers_all_eleven_dtypes():
    assert len(DType) == 11
    assert {row[0] for row in DTYPE_TABLE} == {d.value for d in DType}


@pytest.mark.parametrize(("name", "np_dtype", "bits", "is_float", "is_int"), DTYPE_TABLE)
def test_dtype_round_trips_through_its_name_and_numpy_storage(name, np_dtype, bits, is_float, is_int):
    d = DType.parse(name)
    assert str(d) == name
    assert d.numpy == np.dtype(np_dtype)
    assert DType.from_numpy(np_dtype) is d
    assert DType.from_numpy(np.dtype(np_dtype)) is d
    assert DType.from_numpy(np.zeros(3, np_dtype).dtype) is d
    assert (d.bits, d.is_float, d.is_int) == (bits, is_float, is_int)


def test_unknown_dtype_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown dtype 'f33' \(expected one of: f32, f16, bf16"):
        DType.parse("f33")


@pytest.mark.parametrize("np_dtype", [np.float64, np.int16, np.uint32, np.complex64])
def test_numpy_dtypes_without_an_ir_dtype_are_refused(np_dtype):
    with pytest.raises(ValueError, match=r"has no ernie-ir dtype"):
        DType.from_numpy(np_dtype)


@pytest.mark.parametrize(
    ("t", "text"),
    [
        (tensor(DType.BF16, "B", "S", 1024), "bf16[B,S,1024]"),
        (tensor(DType.F32), "f32[]"),
        (tensor(DType.I4, 3), "i4[3]"),
        (tensor(DType.BOOL, "S*B", 2), "bool[B*S,2]"),
        (tensor(DType.F8E4M3, "S*2*B*3"), "f8e4m3[6*B*S]"),
    ],
)
def test_tensor_types_print_compactly(t, text):
    assert str(t) == text
    assert repr(t) == f"TensorType({text})"


def test_tensor_type_canonicalises_symbolic_dims_so_equal_shapes_compare_equal():
    assert TensorType(DType.F32, ["S*B", 4]) == TensorType(DType.F32, ["B*S", 4])
    assert TensorType(DType.F32, ["S*B", 4]).shape == ("B*S", 4)
    assert hash(TensorType(DType.F32, ["S*B"])) == hash(TensorType(DType.F32, ["B*S"]))
    assert TensorType(DType.F32, ["B"]) != TensorType(DType.BF16, ["B"])


def test_tensor_type_properties():
    t = tensor(DType.BF16, "B", 4, 8)
    assert (t.rank, t.is_static, t.numel()) == (3, False, "32*B")
    assert t.with_dtype(DType.F32) == tensor(DType.F32, "B", 4, 8)
    assert t.with_shape([2, 3]) == tensor(DType.BF16, 2, 3)
    assert tensor(DType.F32, 2, 3).nbytes() == 24
    assert tensor(DType.I4, 3, 3).nbytes() == 5  # 9 nibbles round up to 5 bytes
    assert tensor(DType.F32).numel() == 1
    with pytest.raises(ValueError, match=r"symbolic shape"):
        t.nbytes()


@pytest.mark.parametrize(
    ("dim", "canonical"),
    [
        (7, 7),
        (0, 0),
        ("B", "B"),
        ("S*B", "B*S"),
        ("1*B", "B"),
        ("B*2", "2*B"),
        ("S*2*B*3", "6*B*S"),
        (" S * B ", "B*S"),
        ("B*B", "B*B"),
        ("4", 4),
        ("2*3", 6),
        ("0*B", 0),
    ],
)
def test_canonical_dim(dim, canonical):
    assert canonical_dim(dim) == canonical
    assert canonical_dim(canonical) == canonical  # idempotent


@pytest.mark.parametrize("bad", ["", "B*", "-2*B", "B+S", "2B", "B**S"])
def test_malformed_symbolic_dims_are_refused(bad):
    with pytest.raises(ValueError, match=r"malformed symbolic dim"):
        canonical_dim(bad)


def test_negative_and_bool_dims_are_refused():
    with pytest.raises(ValueError, match=r"negative dim -1"):
        canonical_dim(-1)
    with pytest.raises(TypeError, match=r"bool"):
        canonical_dim(True)


@pytest.mark.parametrize(
    ("dims", "product"),
    [
        ([], 1),
        ([2, 3, 4], 24),
        (["B", "S", 4], "4*B*S"),
        (["S", "B"], "B*S"),
        (["2*B", "3*S"], "6*B*S"),
        (["B", 0, "S"], 0),
        (["B", "B"], "B*B"),
        ([1, "B", 1], "B"),
    ],
)
def test_dim_product(dims, product):
    assert dim_product(dims) == product


@pytest.mark.parametrize(
    ("num", "den", "quotient"),
    [
        (12, 4, 3),
        (12, 5, None),
        ("4*B*S", 4, "B*S"),
        ("4*B*S", "S", "4*B"),
        ("4*B*S", "2*B", "2*S"),
        ("B*S", "B*S", 1),
        ("B", "S", None),
        ("6*B", 4, None),
        ("B", "B*B", None),
        (8, 0, None),
        (0, 5, 0),
    ],
)
def test_dim_divide(num, den, quotient):
    assert dim_divide(num, den) == quotient


@pytest.mark.parametrize(
    ("a", "b", "out"),
    [
        ([2, 3], [2, 3], (2, 3)),
        (["B", "S", 4], [4], ("B", "S", 4)),
        (["B", 1, 4], [3, 1], ("B", 3, 4)),
        ([1], ["B", "S"], ("B", "S")),
        (["B", "S"], ["B", 1], ("B", "S")),
        ([], [2], (2,)),
        ([], [], ()),
    ],
)
def test_broadcast_shapes_follows_numpy_with_symbols(a, b, out):
    assert broadcast_shapes(a, b) == out
    assert broadcast_shapes(b, a) == out
    static_a = [3 if d == "B" else 5 if d == "S" else d for d in a]
    static_b = [3 if d == "B" else 5 if d == "S" else d for d in b]
    static_out = tuple(3 if d == "B" else 5 if d == "S" else d for d in out)
    assert np.broadcast_shapes(tuple(static_a), tuple(static_b)) == static_out


@pytest.mark.parametrize(
    ("a", "b"),
    [([2, 3], [4, 3]), (["B"], ["S"]), (["B", 4], [3, 4]), ([2], [3])],
)
def test_broadcast_shapes_that_do_not_fit_are_refused(a, b):
    with pytest.raises(ValueError, match=r"do not broadcast"):
        broadcast_shapes(a, b)
