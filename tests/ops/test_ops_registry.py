"""Every registered op: a stated docstring, an attribute schema, and attribute errors that
name the attribute; plus, for the core op set, a sample through infer and kernel that
agree on the output count, shapes and kinds of dtype."""

from __future__ import annotations

import enum
import typing

import numpy as np
import pytest
from pydantic.fields import FieldInfo

from ernie_ir.ir import DType, GraphBuilder, NoAttrs, OpAttrs, OpError, all_ops, f32, get_op, i64, tensor
from ernie_ir.ir.types import TensorType

CORE_OPS = {
    "embedding", "linear", "lm_head", "rms_norm", "layer_norm", "rope", "attention", "silu", "gelu",
    "softmax", "add", "mul", "moe_gate", "moe_experts", "split", "concat", "reshape", "transpose", "cast",
}

OPS = sorted(all_ops())


def test_core_op_set_is_registered():
    missing = CORE_OPS - set(all_ops())
    assert not missing, f"ops not registered: {sorted(missing)}"


def test_unknown_op_suggests_close_names():
    with pytest.raises(OpError, match=r"unknown op 'rmsnorm' \(did you mean rms_norm"):
        get_op("rmsnorm")
    with pytest.raises(AttributeError):
        GraphBuilder().not_an_op  # noqa: B018


@pytest.mark.parametrize("name", OPS)
def test_op_has_docstring_schema_and_inputs(name):
    op = get_op(name)
    assert op.name == name
    assert op.doc, f"op {name} has no docstring stating its math"
    assert len(op.doc) >= 10
    assert isinstance(op.Attrs, type) and issubclass(op.Attrs, OpAttrs)
    assert op.Attrs.model_config.get("extra") == "forbid"
    assert op.Attrs.model_config.get("frozen") is True
    assert op.inputs, f"op {name} declares no inputs"
    names = [i.name for i in op.inputs]
    assert len(set(names)) == len(names)
    # The builder exposes it with the same doc.
    assert getattr(GraphBuilder(), name).__doc__ == op.doc


@pytest.mark.parametrize("name", OPS)
def test_unknown_attribute_is_named_in_the_error(name):
    op = get_op(name)
    valid = _minimal_attrs(op.Attrs)
    with pytest.raises(OpError, match=rf"^op {name}: attribute not_an_attribute_xyz: "):
        op.make_attrs({**valid, "not_an_attribute_xyz": 1})


def _minimal_attrs(schema: type[OpAttrs]) -> dict[str, object]:
    """Values for the required fields (so that only the field under test is wrong)."""
    out: dict[str, object] = {}
    for key, field in schema.model_fields.items():
        if field.is_required():
            out[key] = _sample_value(field)
    return out


def _sample_value(field: FieldInfo) -> object:
    ann = field.annotation
    if ann is int:
        return 1
    if ann is float:
        return 1.0
    if ann is bool:
        return True
    if typing.get_origin(ann) is tuple:
        return (1,)
    if typing.get_origin(ann) is typing.Literal:
        return typing.get_args(ann)[0]
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return next(iter(ann))
    pytest.fail(f"no sample value for a required attribute of type {ann}: extend _sample_value")


ATTR_FIELDS = [
    (name, key)
    for name in OPS
    for key in get_op(name).Attrs.model_fields
]


@pytest.mark.parametrize(("name", "key"), ATTR_FIELDS, ids=[f"{n}.{k}" for n, k in ATTR_FIELDS])
def test_wrongly_typed_attribute_is_named_in_the_error(name, key):
    op = get_op(name)
    values = {**_minimal_attrs(op.Attrs), key: object()}
    with pytest.raises(OpError, match=rf"^op {name}: attribute {key}\b"):
        op.make_attrs(values)


@pytest.mark.parametrize(("name", "key"), [(n, k) for n, k in ATTR_FIELDS
                                           if get_op(n).Attrs.model_fields[k].is_required()])
def test_missing_required_attribute_is_named_in_the_error(name, key):
    op = get_op(name)
    values = _minimal_attrs(op.Attrs)
    del values[key]
    with pytest.raises(OpError, match=rf"^op {name}: attribute {key}: Field required"):
        op.make_attrs(values)


@pytest.mark.parametrize(("name", "attrs", "key"), [
    ("rms_norm", {"eps": 0.0}, "eps"),
    ("layer_norm", {"eps": -1e-5}, "eps"),
    ("rope", {"theta": 0.0}, "theta"),
    ("rope", {"theta": 1e4, "style": "neox"}, "style"),
    ("gelu", {"approximate": "fast"}, "approximate"),
    ("moe_gate", {"top_k": 0}, "top_k"),
    ("moe_gate", {"top_k": 2, "norm_min": 0.0}, "norm_min"),
    ("moe_gate", {"top_k": 2.5}, "top_k"),
    ("split", {"axis": 0, "sizes": ()}, "sizes"),
    ("split", {"axis": 0, "sizes": (1, "a")}, "sizes"),
    ("cast", {"dtype": "float32"}, "dtype"),
    ("attention", {"causal": "sometimes"}, "causal"),
    ("attention", {"scale": "big"}, "scale"),
    ("transpose", {"perm": 3}, "perm"),
    ("silu", {"approximate": "tanh"}, "approximate"),
])
def test_invalid_attribute_value_is_named(name, attrs, key):
    with pytest.raises(OpError, match=rf"^op {name}: attribute {key}\b"):
        get_op(name).make_attrs(attrs)
    # Through the builder too, where the node is created (attrs are validated before types).
    b = GraphBuilder()
    x = b.input("x", tensor(f32, 2, 4))
    required = max(1, sum(1 for i in get_op(name).inputs if not i.optional and not i.variadic))
    with pytest.raises(OpError, match=rf"attribute {key}\b"):
        b.op(name, *[x] * required, **attrs)


def test_attrs_are_hashable_and_compare_by_value():
    a = get_op("split").make_attrs({"axis": 1, "sizes": [2, 2]})
    b = get_op("split").make_attrs({"axis": 1, "sizes": (2, 2)})
    assert a == b and hash(a) == hash(b)
    assert isinstance(a.sizes, tuple)
    assert get_op("silu").make_attrs(None) == NoAttrs()


# --------------------------------------------------------------------------------------
# infer and kernel agree on a sample of each core op
# --------------------------------------------------------------------------------------

def _f(*shape):
    return np.random.default_rng(sum(shape) + len(shape)).standard_normal(shape).astype(np.float32)


SAMPLES: dict[str, tuple[list[np.ndarray], dict]] = {
    "embedding": ([np.array([[1, 2, 3]], np.int64), _f(5, 4)], {}),
    "linear": ([_f(2, 3, 4), _f(4, 5), _f(5)], {}),
    "lm_head": ([_f(2, 3, 4), _f(7, 4)], {"transpose_weight": True}),
    "rms_norm": ([_f(2, 3, 4), _f(4)], {"eps": 1e-6}),
    "layer_norm": ([_f(2, 3, 4), _f(4), _f(4)], {"eps": 1e-6}),
    "rope": ([_f(2, 3, 2, 4), np.array([[0, 1, 2], [5, 6, 7]], np.int64)], {"theta": 1e4}),
    "attention": ([_f(2, 3, 4, 8), _f(2, 5, 2, 8), _f(2, 5, 2, 6), np.ones((2, 1, 3, 5), bool)], {}),
    "silu": ([_f(2, 3)], {}),
    "gelu": ([_f(2, 3)], {}),
    "softmax": ([_f(2, 3)], {"axis": 0}),
    "add": ([_f(2, 1, 3), _f(4, 3)], {}),
    "mul": ([_f(2, 1, 3), _f(4, 3)], {}),
    "moe_gate": ([_f(2, 3, 4), _f(4, 6), _f(6)], {"top_k": 2}),
    "moe_experts": ([_f(2, 3, 4), _f(2, 3, 2), np.zeros((2, 3, 2), np.int64), _f(3, 4, 10), _f(3, 5, 4)], {}),
    "split": ([_f(2, 6)], {"axis": 1, "sizes": (1, 2, 3)}),
    "concat": ([_f(2, 1), _f(2, 3)], {"axis": 1}),
    "reshape": ([_f(2, 3, 4)], {"shape": (0, -1)}),
    "transpose": ([_f(2, 3, 4)], {"perm": (2, 0, 1)}),
    "cast": ([_f(2, 3)], {"dtype": "bf16"}),
}


def test_samples_cover_the_core_op_set():
    assert set(SAMPLES) == CORE_OPS


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_kernel_output_matches_inferred_types(name):
    args, attrs = SAMPLES[name]
    op = get_op(name)
    a = op.make_attrs(attrs)
    types = [TensorType(DType.from_numpy(x.dtype), x.shape) for x in args]
    inferred = op.infer(types, a)
    results = op.kernel(args, a)
    assert len(results) == len(inferred)
    for t, r in zip(inferred, results, strict=True):
        assert tuple(r.shape) == t.shape, f"{name}: kernel shape {r.shape} vs inferred {t}"
        if t.dtype.is_float:
            assert np.issubdtype(r.dtype, np.floating) or r.dtype == t.dtype.numpy
        elif t.dtype == i64:
            assert r.dtype == np.int64
        else:
            assert r.dtype == t.dtype.numpy
