"""The reference interpreter: input checks, bf16 emulation, exact params, bounded memory."""

from __future__ import annotations

import weakref

import ml_dtypes
import numpy as np
import pytest

import ernie_ir  # noqa: F401  (registers the op set)
from ernie_ir.ir import DType, ErnieIRError, Graph, GraphBuilder, tensor
from ernie_ir.ir.weights import ArraySource
from ernie_ir.runtime import Interpreter, run_graph

F32, BF16 = DType.F32, DType.BF16


def two_input_graph() -> Graph:
    b = GraphBuilder("g")
    x = b.input("x", tensor(F32, "B", 4))
    m = b.input("m", tensor(F32, "B", 4))
    ids = b.input("ids", tensor(DType.I64, "S"))
    b.output(b.add(x, m), b.cast(ids, dtype=F32), names=["y", "z"])
    return b.graph


def good_inputs(batch: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.ones((batch, 4), np.float32), "m": np.ones((batch, 4), np.float32),
            "ids": np.arange(3)}


def test_valid_inputs_run():
    out = run_graph(two_input_graph(), good_inputs())
    assert sorted(out) == ["y", "z"]
    np.testing.assert_array_equal(out["y"], np.full((2, 4), 2, np.float32))
    np.testing.assert_array_equal(out["z"], np.arange(3, dtype=np.float32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("m"), r"^missing graph input 'm' \(f32\[B,4\]\)$"),
        (lambda d: d.update(q=np.zeros(1), r=np.zeros(1)),
         r"^unknown graph input\(s\) \['q', 'r'\]; inputs are \['ids', 'm', 'x'\]$"),
        (lambda d: d.update(x=np.ones(4, np.float32)),
         r"^input x: expected rank 2 \(f32\[B,4\]\), got shape \[4\]$"),
        (lambda d: d.update(x=np.ones((2, 5), np.float32)),
         r"^input x: dim 1 must be 4 \(f32\[B,4\]\), got 5$"),
        (lambda d: d.update(m=np.ones((3, 4), np.float32)),
         r"^input m: dim 0 \(B\) is 3 but B = 2 elsewhere$"),
        (lambda d: d.update(ids=np.ones(3, np.float32)),
         r"^input ids: expected integers \(i64\[S\]\), got float32$"),
    ],
    ids=["missing", "unknown", "wrong rank", "wrong static dim", "inconsistent symbol", "float ids"],
)
def test_bad_inputs_are_refused_with_a_clear_message(change, message):
    inputs = good_inputs()
    change(inputs)
    with pytest.raises(ErnieIRError, match=message):
        run_graph(two_input_graph(), inputs)


def test_integer_inputs_take_the_declared_dtype():
    out = Interpreter(two_input_graph()).run({**good_inputs(), "ids": np.arange(3, dtype=np.int8)})
    np.testing.assert_array_equal(out["z"], np.arange(3, dtype=np.float32))


def test_only_bf16_and_f16_can_be_emulated():
    with pytest.raises(ValueError, match=r"can only emulate bf16, f16, not f32"):
        Interpreter(two_input_graph(), emulate=F32)


# -- bf16 emulation -------------------------------------------------------------------------

def to_bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bf16 and widen back (what ml_dtypes does)."""
    return a.astype(ml_dtypes.bfloat16).astype(np.float32)


def silu(a: np.ndarray) -> np.ndarray:
    return a / (np.float32(1) + np.exp(-a))


def mixed_graph() -> Graph:
    """h = silu(cast<bf16>(x)) : bf16 ; s = mul(x, x) : f32 ; t = silu(cast<f32>(h)) : f32."""
    b = GraphBuilder("mixed")
    x = b.input("x", tensor(F32, 4, 64))
    h = b.silu(b.cast(x, dtype=BF16))
    s = b.mul(x, x)
    t = b.silu(b.cast(h, dtype=F32))
    b.output(h, s, t, names=["h", "s", "t"])
    return b.graph


@pytest.fixture
def x() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((4, 64)) * 3).astype(np.float32)


def test_bf16_emulation_rounds_every_bf16_typed_result(x):
    out = run_graph(mixed_graph(), {"x": x}, emulate=BF16)
    h_expected = to_bf16(silu(to_bf16(x)))
    assert out["h"].dtype == np.float32
    assert out["h"].tobytes() == h_expected.tobytes()
    assert out["t"].tobytes() == silu(h_expected).tobytes()


def test_bf16_emulation_leaves_f32_results_untouched(x):
    out = run_graph(mixed_graph(), {"x": x}, emulate=BF16)
    assert out["s"].tobytes() == (x * x).tobytes()
    assert not np.array_equal(out["s"], to_bf16(out["s"]))  # would differ had it been rounded
    t = out["t"]
    assert not np.array_equal(t, to_bf16(t))


def test_without_emulation_bf16_results_keep_float32_precision(x):
    out = run_graph(mixed_graph(), {"x": x})
    exact = silu(to_bf16(x))  # the cast itself still rounds: its kernel converts to bf16
    assert out["h"].tobytes() == exact.tobytes()
    assert not np.array_equal(exact, to_bf16(exact))


def test_f16_emulation_rounds_f16_results(x):
    b = GraphBuilder("half")
    xi = b.input("x", tensor(F32, 4, 64))
    b.output(b.silu(b.cast(xi, dtype=DType.F16)), name="h")
    out = run_graph(b.graph, {"x": x}, emulate=DType.F16)
    expected = silu(x.astype(np.float16).astype(np.float32)).astype(np.float16).astype(np.float32)
    assert out["h"].tobytes() == expected.tobytes()


def test_bf16_params_are_read_exactly():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    q = rng.integers(-100, 100, (4,)).astype(np.int8)
    b = GraphBuilder("params")
    x = b.input("x", tensor(F32, 3, 4))
    wp = b.param("w", source=ArraySource(w))
    qp = b.param("q", source=ArraySource(q))
    b.output(b.mul(x, wp), b.cast(qp, dtype=F32), names=["y", "z"])
    interp = Interpreter(b.graph, emulate=BF16)
    out = interp.run({"x": np.ones((3, 4), np.float32)})
    assert out["y"].dtype == np.float32
    assert out["y"].tobytes() == w.astype(np.float32).tobytes()
    np.testing.assert_array_equal(out["z"], q.astype(np.float32))
    cached = interp.param(wp)
    assert cached.dtype == np.float32 and cached.tobytes() == w.astype(np.float32).tobytes()
    assert interp.param(qp).dtype == np.int8  # integers keep their dtype


def test_a_param_can_be_a_graph_output():
    w = np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)
    b = GraphBuilder("p")
    b.input("x", tensor(F32, 4))
    p = b.param("w", source=ArraySource(w))
    b.graph.set_outputs([p], ["w"])
    out = run_graph(b.graph, {"x": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(out["w"], w.astype(np.float32))


# -- memory ---------------------------------------------------------------------------------

def test_values_are_freed_after_their_last_use():
    """a = silu(x); dead = gelu(a) (never read); b = a*a; c = softmax(b); y = c + c.

    Outputs: y and c. After each node runs, only values still needed may be alive.
    """
    gb = GraphBuilder("mem")
    x = gb.input("x", tensor(F32, 8, 16))
    a = gb.silu(x)
    dead = gb.gelu(a)
    bv = gb.mul(a, a)
    c = gb.softmax(bv)
    y = gb.add(c, c)
    gb.output(y, c, names=["y", "c"])
    names = {a: "a", dead: "dead", bv: "b", c: "c", y: "y"}
    refs: dict[str, weakref.ref] = {}
    alive_after: list[set[str]] = []

    def observer(node, results):
        for v, arr in zip(node.outputs, results, strict=True):
            refs[names[v]] = weakref.ref(arr)
        alive_after.append({n for n, r in refs.items() if r() is not None})

    out = Interpreter(gb.graph).run({"x": np.ones((8, 16), np.float32)}, observer=observer)
    assert alive_after == [
        {"a"},              # silu
        {"a", "dead"},      # gelu: its result is never read
        {"a", "b"},         # mul: dead is gone
        {"b", "c"},         # softmax: a is gone (mul was its last reader)
        {"c", "y"},         # add: b is gone; c stays because it is an output
    ]
    assert sorted(out) == ["c", "y"]
    np.testing.assert_allclose(out["y"], 2 * out["c"])
