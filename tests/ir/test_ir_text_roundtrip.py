"""The text format round-trips: print(parse(print(g))) == print(g), byte for byte.

Random graphs come from a hypothesis strategy that builds them the way users
do, through GraphBuilder: chains of ops with static and symbolic dims, params
with annotations, trainable flags and hashes, scopes and names that need
quoting, and graph metadata.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import DType, Graph, GraphBuilder, IRParseError, OpError, Value, tensor
from ernie_ir.ir.equality import structural_diff, structural_equal
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify_problems

FLOATS = [DType.F32, DType.BF16, DType.F16]
ALL_DTYPES = list(DType)

# Text without lone surrogates (they cannot be written to a UTF-8 file).
any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
awkward = st.sampled_from([
    "a b", 'q"uote', "ünïcödé", "(paren)", "{brace}", "[sq]", "x.y", "0", "12", "-w", "a,b",
    "back\\slash", "line\nbreak", "tab\t", "none", "trainable", "hash", "loc", "@at", "%pct",
    "é.layers.0", "中文", ") : f32[2] loc(", "} : f32[1]", "//comment", "", "model/layer-0:w", "w:",
    "1e5", "-inf", "nan", "->", "=",
])
bare = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,6}", fullmatch=True)
names = st.one_of(awkward, bare, any_text).filter(bool)
scopes = st.one_of(awkward, bare, any_text)
keys = st.one_of(awkward, bare, any_text)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    any_text,
    awkward,
    st.sampled_from(ALL_DTYPES),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
    max_leaves=6,
)
small_dicts = st.dictionaries(keys, json_values, max_size=3)
hex16 = st.from_regex(r"[0-9a-f]{16}", fullmatch=True)


class _Gen:
    """Helper state while drawing one graph."""

    def __init__(self, draw, b: GraphBuilder) -> None:
        self.draw = draw
        self.b = b
        self.used: set[str] = set()

    def fresh(self) -> str:
        return self.draw(names.filter(lambda n: n not in self.used))

    def param(self, dtype: DType, *shape):
        name = self.fresh()
        self.used.add(name)
        p = self.b.param(
            name,
            tensor(dtype, *shape),
            trainable=self.draw(st.booleans()),
            annotations=self.draw(st.one_of(st.none(), small_dicts)),
        )
        p.digest = self.draw(st.one_of(st.none(), hex16))
        return p


def _last_static(v: Value) -> int | None:
    return v.shape[-1] if v.type.rank and isinstance(v.shape[-1], int) else None


def _step(g: _Gen, op: str, x: Value, pool: list[Value]) -> list[Value]:
    """Apply `op` to x (and maybe more of the pool); [] when it does not apply."""
    draw, b = g.draw, g.b
    t = x.type
    is_float = t.dtype.is_float
    h = _last_static(x)
    if op == "linear" and is_float and h is not None:
        n = draw(st.sampled_from([1, 2, 4]))
        w = g.param(draw(st.sampled_from(FLOATS)), h, n)
        bias = g.param(draw(st.sampled_from(FLOATS)), n) if draw(st.booleans()) else None
        return [b.linear(x, w, bias)]
    if op in ("add", "mul"):
        others = [v for v in pool if v.type.dtype == t.dtype or (is_float and v.type.dtype.is_float)]
        y = draw(st.sampled_from(others))
        try:
            return [b.op(op, x, y)]
        except OpError:  # shapes do not broadcast: use a param that does
            if t.rank == 0:
                return []
            return [b.op(op, x, g.param(t.dtype, *t.shape[-1:]))]
    if op == "silu" and is_float:
        return [b.silu(x)]
    if op == "gelu" and is_float:
        return [b.gelu(x, approximate=draw(st.sampled_from(["none", "tanh"])))]
    if op == "softmax" and is_float and t.rank:
        return [b.softmax(x, axis=draw(st.integers(-t.rank, t.rank - 1)))]
    eps = st.one_of(st.floats(1e-12, 0.5), st.sampled_from([1e-5, 1e-6, 0.1]))
    if op == "rms_norm" and is_float and h is not None:
        return [b.rms_norm(x, g.param(draw(st.sampled_from(FLOATS)), h), eps=draw(eps))]
    if op == "layer_norm" and is_float and h is not None:
        w = g.param(t.dtype, h) if draw(st.booleans()) else None
        bias = g.param(t.dtype, h) if draw(st.booleans()) else None
        return [b.layer_norm(x, w, bias, eps=draw(eps))]
    if op == "reshape" and t.rank >= 2 and draw(st.booleans()):
        return [b.reshape(x, shape=(0,) * (t.rank - 2) + (-1,))]  # merge the last two dims
    if op == "reshape" and h is not None and h % 2 == 0:
        return [b.reshape(x, shape=(0,) * (t.rank - 1) + (2, h // 2))]  # split the last dim
    if op == "transpose" and t.rank:
        return [b.transpose(x, perm=tuple(draw(st.permutations(range(t.rank)))))]
    if op == "split":
        axes = [i for i, d in enumerate(t.shape) if isinstance(d, int) and d >= 2]
        if axes:
            axis = draw(st.sampled_from(axes))
            cut = draw(st.integers(1, t.shape[axis] - 1))
            sizes = (cut, t.shape[axis] - cut)
            return list(b.split(x, axis=draw(st.sampled_from([axis, axis - t.rank])), sizes=sizes))
    if op == "concat":
        axes = [i for i, d in enumerate(t.shape) if isinstance(d, int)]
        if axes:
            return [b.concat(*[x] * draw(st.integers(1, 3)), axis=draw(st.sampled_from(axes)))]
    if op == "cast":
        return [b.cast(x, dtype=draw(st.sampled_from(ALL_DTYPES)))]
    return []


OPS = ["linear", "add", "mul", "silu", "gelu", "softmax", "rms_norm", "layer_norm", "reshape",
       "transpose", "split", "concat", "cast"]


@st.composite
def graphs(draw) -> Graph:
    b = GraphBuilder(draw(names))
    g = _Gen(draw, b)
    pool: list[Value] = []
    for _ in range(draw(st.integers(1, 2))):
        name = g.fresh()
        g.used.add(name)
        lead = draw(st.lists(st.sampled_from(["B", "S", "B*S", 1, 2, 3]), max_size=2))
        h = draw(st.sampled_from([2, 4, 6]))
        pool.append(b.input(name, tensor(draw(st.sampled_from(FLOATS)), *lead, h)))
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(OPS))
        x = draw(st.sampled_from(pool))
        outer, inner = draw(scopes), draw(st.one_of(st.none(), scopes))
        with b.scope(outer):
            if inner is None:
                pool.extend(_step(g, op, x, pool))
            else:
                with b.scope(inner):
                    pool.extend(_step(g, op, x, pool))
    produced = [v for v in pool if v.producer is not None]
    if not produced:
        produced = [b.silu(pool[0])]
    outs = draw(st.lists(st.sampled_from(produced), min_size=1, max_size=3, unique_by=id))
    out_names = draw(st.lists(names, min_size=len(outs), max_size=len(outs), unique=True))
    b.output(*outs, names=out_names)
    b.graph.metadata = draw(small_dicts)
    return b.graph


ROUND_TRIP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@ROUND_TRIP
@given(graphs())
def test_print_parse_print_is_byte_identical(g):
    assert verify_problems(g) == []
    text = print_graph(g)
    parsed = parse_graph(text)
    assert print_graph(parsed) == text
    assert structural_diff(parsed, g) is None
    assert structural_diff(g, parsed) is None
    assert verify_problems(parsed) == []
    for name, p in g.params.items():
        q = parsed.params[name]
        assert (q.digest, q.trainable) == (p.digest, p.trainable)


@pytest.mark.slow
@ROUND_TRIP
@given(graphs())
def test_the_general_parser_builds_what_the_fast_path_builds(g):
    text = print_graph(g)
    fast = parse_graph(text, fast=True)
    slow = parse_graph(text, fast=False)
    assert structural_diff(fast, slow) is None
    assert print_graph(slow) == text
    for n, m in zip(fast, slow, strict=True):
        assert (n.attrs, n.scope) == (m.attrs, m.scope)
        assert type(n.attrs) is type(m.attrs)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.data())
def test_renaming_internal_values_changes_neither_text_nor_equality(g, data):
    text = print_graph(g)
    reference = parse_graph(text)
    outputs = set(g.outputs)
    for node in g:
        for v in node.outputs:
            if v not in outputs:
                v.name = data.draw(st.one_of(st.none(), names))
    assert print_graph(g) == text
    assert structural_equal(g, reference)


def test_the_documented_example_prints_exactly():
    b = GraphBuilder("demo")
    x = b.input("x", tensor(DType.F32, "B", 16))
    w = b.param("proj.weight", tensor(DType.BF16, 16, 32), trainable=True)
    with b.scope("proj"):
        y = b.linear(x, w)
    with b.scope("act"):
        z = b.silu(y)
    b.output(z, name="y")
    b.graph.metadata = {"model": "demo"}
    assert print_graph(b.graph) == (
        "graph @demo(%x: f32[B,16]) -> (y: f32[B,32]) {\n"
        '  meta {model = "demo"}\n'
        "  param @proj.weight : bf16[16,32] trainable\n"
        '  %0 = linear(%x, @proj.weight) : f32[B,32] loc("proj")\n'
        '  %1 = silu(%0) : f32[B,32] loc("act")\n'
        "  return %1\n"
        "}\n"
    )


def test_quoting_of_names_scopes_and_annotations():
    b = GraphBuilder("my graph")
    x = b.input("in put", tensor(DType.F32, 4))
    w = b.param("a b", tensor(DType.F32, 4), annotations={"quant": {"bits": 4, "kind": "wint4"},
                                                         "odd key": [1.5, None, DType.BF16]})
    w.digest = "0123456789abcdef"
    with b.scope('s"(ü)'):
        y = b.mul(x, w)
    b.output(y, name="out put")
    text = print_graph(b.graph)
    assert text == (
        'graph @"my graph"(%"in put": f32[4]) -> ("out put": f32[4]) {\n'
        '  param @"a b" : f32[4] {"odd key" = [1.5, none, bf16], quant = {bits = 4, kind = "wint4"}}'
        ' hash "0123456789abcdef"\n'
        '  %0 = mul(%"in put", @"a b") : f32[4] loc("s\\"(ü)")\n'
        "  return %0\n"
        "}\n"
    )
    g = parse_graph(text)
    assert g.name == "my graph"
    assert g.params["a b"].annotations == {"quant": {"bits": 4, "kind": "wint4"},
                                           "odd key": [1.5, None, DType.BF16]}
    assert g.nodes[0].scope == 's"(ü)'
    assert g.outputs[0].name == "out put"


def test_numpy_floats_in_metadata_and_annotations_print_as_plain_floats():
    b = GraphBuilder("g")
    x = b.input("x", tensor(DType.F32, 2))
    w = b.param("w", tensor(DType.F32, 2), annotations={"scale": np.float64(0.25)})
    b.output(b.mul(x, w), name="y")
    b.graph.metadata = {"eps": np.float64(1e-5)}
    text = print_graph(b.graph)
    assert "meta {eps = 1e-05}" in text and "param @w : f32[2] {scale = 0.25}" in text
    g = parse_graph(text)
    assert g.metadata == {"eps": 1e-5} and g.params["w"].annotations == {"scale": 0.25}


def test_special_floats_round_trip_in_metadata():
    b = GraphBuilder("g")
    x = b.input("x", tensor(DType.F32, 2))
    b.output(b.silu(x), name="y")
    b.graph.metadata = {"a": float("nan"), "b": float("inf"), "c": float("-inf"), "d": -0.0,
                        "e": 5e-324, "f": 1e16, "g": 10**30}
    text = print_graph(b.graph)
    assert "meta {a = nan, b = inf, c = -inf, d = -0.0, e = 5e-324, f = 1e+16, g = 10" in text
    meta = parse_graph(text).metadata
    assert math.isnan(meta["a"]) and meta["b"] == math.inf and meta["c"] == -math.inf
    assert math.copysign(1, meta["d"]) == -1 and meta["e"] == 5e-324 and meta["g"] == 10**30
    assert isinstance(meta["f"], float)


# -- structural_diff: what counts as a change, and how it is reported -----------------

def two_copies() -> tuple[Graph, Graph]:
    b = GraphBuilder("g")
    x = b.input("x", tensor(DType.F32, "B", 4))
    w = b.param("w", tensor(DType.F32, 4, 4))
    with b.scope("layers.0"):
        y = b.linear(x, w)
    with b.scope("layers.1"):
        z = b.softmax(y, axis=-1)
        s = b.add(z, y)
    b.output(s, name="y")
    text = print_graph(b.graph)
    return parse_graph(text), parse_graph(text)


def test_identical_graphs_have_no_diff():
    a, b = two_copies()
    assert structural_diff(a, b) is None and structural_equal(a, b)


def test_a_changed_attribute_is_reported_with_both_values():
    a, b = two_copies()
    node = b.nodes[1]
    node.attrs = node.opdef.make_attrs({"axis": 0})
    assert structural_diff(a, b) == "node #1 (softmax at layers.1): attrs {axis = -1} vs {axis = 0}"


def test_a_changed_scope_is_reported():
    a, b = two_copies()
    b.nodes[0].scope = "layers.9"
    assert structural_diff(a, b) == "node #0 (linear at layers.0): scope 'layers.0' vs 'layers.9'"


def test_a_changed_edge_is_reported_by_input_name():
    a, b = two_copies()
    add = b.nodes[2]
    add.set_input(1, add.inputs[0])  # add(z, z) instead of add(z, y)
    assert structural_diff(a, b) == "node #2 (add at layers.1): input b comes from a different value"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda g: setattr(g, "name", "h"), "graph names differ: g vs h"),
        (lambda g: g.metadata.update(k=1), "graph metadata differs"),
        (lambda g: setattr(g.params["w"], "trainable", True),
         "param @w: f32[4,4] vs f32[4,4] trainable"),
        (lambda g: g.params["w"].annotations.update(bits=4), "param @w: annotations differ"),
        (lambda g: g.output_names.__setitem__(0, "z"), "output names differ: ['y'] vs ['z']"),
        (lambda g: setattr(g.inputs[0], "name", "u"), "input x: f32[B,4] vs u: f32[B,4]"),
    ],
)
def test_other_changes_are_reported(mutate, message):
    a, b = two_copies()
    mutate(b)
    assert structural_diff(a, b) == message
    assert not structural_equal(a, b)


# -- damaged text: only IRParseError, never a crash -------------------------------------

INSERTS = [*'{}()[]%@",:=*-.0123456789 \\\nabfiBS', "none", "f32", "bf16", "u8", "loc(", "->", "\\q"]


@st.composite
def damaged_texts(draw) -> str:
    text = print_graph(draw(graphs()))
    for _ in range(draw(st.integers(1, 3))):
        lines = text.split("\n")
        kind = draw(st.sampled_from(["delete", "insert", "duplicate line", "drop line", "swap lines"]))
        if kind == "delete" and text:
            i = draw(st.integers(0, len(text) - 1))
            text = text[:i] + text[i + draw(st.integers(1, 4)):]
        elif kind == "insert":
            i = draw(st.integers(0, len(text)))
            text = text[:i] + draw(st.sampled_from(INSERTS)) + text[i:]
        elif kind == "duplicate line":
            i = draw(st.integers(0, len(lines) - 1))
            text = "\n".join([*lines[: i + 1], lines[i], *lines[i + 1 :]])
        elif kind == "drop line":
            i = draw(st.integers(0, len(lines) - 1))
            text = "\n".join(lines[:i] + lines[i + 1 :])
        elif kind == "swap lines" and len(lines) > 1:
            i = draw(st.integers(0, len(lines) - 2))
            lines[i], lines[i + 1] = lines[i + 1], lines[i]
            text = "\n".join(lines)
    return text


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_texts(), st.booleans())
def test_damaged_text_fails_cleanly_or_parses_to_a_stable_graph(text, fast):
    try:
        g = parse_graph(text, fast=fast)
    except IRParseError as e:
        assert e.line >= 1 and e.column >= 1
        return
    verify_problems(g)  # may find problems (an unused param), must not crash
    again = parse_graph(print_graph(g))
    assert structural_diff(again, g) is None
    assert print_graph(again) == print_graph(g)


def test_a_bool_attribute_is_refused_even_after_the_equal_int_was_validated():
    # True == 1 and hash(True) == hash(1): the validated-attrs cache must not let one stand for the other
    from ernie_ir.ir import get_op
    from ernie_ir.ir.errors import OpError

    softmax = get_op("softmax")
    assert softmax.make_attrs({"axis": 1}).axis == 1
    with pytest.raises(OpError, match="axis"):
        softmax.make_attrs({"axis": True})
