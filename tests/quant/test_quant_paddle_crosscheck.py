"""Our quantization kernels against Paddle 3.3.1's own, on CPU, bit for bit.

One reference run (tests/quant/reference/pf_quant_ops.py in the `pf`
environment) computes every case; the tests compare:

- `weight_quantize` int8 / int4, per channel and groups 64 / 128: our int
  values equal Paddle's (its arch-70 byte layout undone) and our bf16 scales
  have Paddle's bits. In an all-zero channel Paddle writes 127 (int8) or -7
  (int4) and we write 0: both dequantize to 0 with the scale 0 both give.
- fake quant-dequant abs_max, channel-wise (quant_axis 0 and 1), moving
  average (3 training steps with the state fed back, and is_test): equal bits.
- PACT equals Paddle's relu formulation bit for bit.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from _quant_testkit import run_reference, undo_sm70_int4, undo_sm70_int8

from ernie_ir.ir import GraphBuilder, f32, tensor
from ernie_ir.ops.quant_numerics import (
    abs_max,
    fake_quant_dequant,
    moving_average_state,
    weight_dequantize,
    weight_quantize,
    weight_quantize_reference,
)
from ernie_ir.runtime.interpreter import run_graph

pytestmark = pytest.mark.reference

K, N = 256, 128
GROUPS = (-1, 64, 128)
ALGOS = {"weight_only_int8": 8, "weight_only_int4": 4}


def _weight() -> np.ndarray:
    """bf16 [K, N]: N(0, 0.05) plus a zero channel, exact rounding ties and a clipping column."""
    rng = np.random.default_rng(0)
    w = (0.05 * rng.standard_normal((K, N))).astype(np.float32)
    w[:, 3] = 0.0
    # column 5: absmax 127 * 2^-8 gives the exact scale 2^-8 (int8), so (k + 0.5) * 2^-8 are ties
    w[:, 5] = 0.0
    w[0, 5] = 127 * 2.0**-8
    halves = np.arange(0.5, 100.0, 1.0)
    w[1:1 + len(halves), 5] = halves * 2.0**-8
    w[101:101 + len(halves), 5] = -halves * 2.0**-8
    # column 7: absmax 7 * 2^-4 -> int4 scale 2^-4, ties at (k + 0.5) * 2^-4
    w[:, 7] = 0.0
    w[0, 7] = 7 * 2.0**-4
    w[1:8, 7] = np.arange(0.5, 7.0, 1.0) * 2.0**-4
    w[8:15, 7] = -np.arange(0.5, 7.0, 1.0) * 2.0**-4
    # column 9: one large outlier, so most of the channel rounds to small ints
    w[17, 9] = 3.0
    return w.astype(ml_dtypes.bfloat16)


def _tie_grid(rng: np.random.Generator, bits: int) -> np.ndarray:
    """float32 [16, 32] with abs-max exactly b in every row and column: half-integers are ties."""
    b = 2 ** (bits - 1) - 1
    x = (b / 3 * rng.standard_normal((16, 32))).astype(np.float32)
    x[:8] = rng.integers(-2 * b + 1, 2 * b, size=(8, 32)) / 2
    x = np.clip(x, -b + 0.5, b - 0.5).astype(np.float32)
    for i in range(32):
        x[i % 16, i] = b if i % 2 == 0 else -b
    return x


@pytest.fixture(scope="module")
def paddle_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("pf_quant_ops")
    rng = np.random.default_rng(1)
    w = _weight()
    arrays: dict[str, np.ndarray] = {"w_bf16": w.view(np.uint16)}
    cases: list[dict] = []
    for algo in ALGOS:
        for g in GROUPS:
            cases.append({"op": "weight_quantize", "name": f"wq_{algo}_{g}", "x": "w_bf16", "algo": algo,
                          "arch": 70, "group_size": g})
    for bits in (8, 4):
        arrays[f"grid{bits}"] = _tie_grid(rng, bits)
        arrays[f"rand{bits}"] = (2.0 * rng.standard_normal((16, 32))).astype(np.float32)
        for src in (f"grid{bits}", f"rand{bits}"):
            for rt in (0, 1):
                cases.append({"op": "fake_abs_max", "name": f"abs_{src}_{rt}", "x": src, "bits": bits,
                              "round_type": rt})
                for axis in (0, 1):
                    cases.append({"op": "fake_channel", "name": f"ch_{src}_{rt}_{axis}", "x": src,
                                  "bits": bits, "round_type": rt, "quant_axis": axis})
        for rt in (0, 1):
            steps = []
            for s in range(3):
                x = (1.0 + s) * rng.standard_normal((16, 32))
                arrays[f"mavg{bits}_{rt}_{s}"] = x.astype(np.float32)
                steps.append(f"mavg{bits}_{rt}_{s}")
            cases.append({"op": "fake_mavg", "name": f"mavg_{bits}_{rt}", "xs": steps, "bits": bits,
                          "round_type": rt, "rate": 0.9, "init": [0.001, 1.0, 1.0], "is_test": False})
            cases.append({"op": "fake_mavg", "name": f"mtest_{bits}_{rt}", "xs": [f"grid{bits}"],
                          "bits": bits, "round_type": rt, "rate": 0.9, "init": [2.75, 1.0, 1.0],
                          "is_test": True})
    arrays["act"] = (30.0 * rng.standard_normal((8, 64))).astype(np.float32)
    cases.append({"op": "pact", "name": "pact", "x": "act", "alpha": 20.0})
    np.savez(tmp / "in.npz", **arrays)
    out = run_reference("pf_quant_ops.py", {"inputs": str(tmp / "in.npz"), "cases": cases}, tmp / "out")
    meta = json.loads((out / "meta.json").read_text())
    assert not meta["refused"], meta["refused"]
    return {"out": dict(np.load(out / "out.npz")), "in": arrays, "w": w, "meta": meta}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("group", GROUPS)
def test_weight_quantize_equals_paddle(paddle_run: dict, algo: str, group: int) -> None:
    bits = ALGOS[algo]
    w = paddle_run["w"]
    out = paddle_run["out"]
    tag = f"wq_{algo}_{group}"
    assert bool(out[f"{tag}_scale_is_bf16"]), "Paddle returns bf16 scales for bf16 weights"
    q, scale = weight_quantize(w, bits, group)
    ref_q, _ = weight_quantize_reference(w, bits, group)
    np.testing.assert_array_equal(q, ref_q)
    assert scale.dtype == ml_dtypes.bfloat16
    # scales: the same bits (Paddle's came back widened to float32, exactly)
    np.testing.assert_array_equal(_bits(scale.astype(np.float32)), _bits(out[f"{tag}_scale"]))
    undo = undo_sm70_int8 if bits == 8 else undo_sm70_int4
    pq = undo(out[f"{tag}_q"], K, N)
    per_row = scale.astype(np.float32) if group == -1 else np.repeat(scale.astype(np.float32), group, 0)[:K]
    live = np.broadcast_to(per_row != 0, (K, N))
    np.testing.assert_array_equal(q[live], pq[live])
    # zero channels: Paddle writes 127 / -7, we write 0; both dequantize to 0
    assert (q[:, 3] == 0).all() and not live[:, 3].any()
    np.testing.assert_array_equal(weight_dequantize(q, scale, group), weight_dequantize(pq, scale, group))


def test_rounding_ties_go_away_from_zero(paddle_run: dict) -> None:
    w = paddle_run["w"]
    q8, s8 = weight_quantize(w, 8)
    assert float(s8[5]) == 2.0**-8
    np.testing.assert_array_equal(q8[1:101, 5], np.arange(1, 101))  # 0.5 -> 1, 1.5 -> 2, ...
    q4, s4 = weight_quantize(w, 4)
    assert float(s4[7]) == 2.0**-4
    np.testing.assert_array_equal(q4[1:8, 7], np.arange(1, 8))
    np.testing.assert_array_equal(q4[8:15, 7], -np.arange(1, 8))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rt", [0, 1])
@pytest.mark.parametrize("src", ["grid", "rand"])
def test_fake_quant_abs_max_bit_exact(paddle_run: dict, bits: int, rt: int, src: str) -> None:
    x = paddle_run["in"][f"{src}{bits}"]
    out = paddle_run["out"]
    b = GraphBuilder("fq")
    v = b.input("x", tensor(f32, 16, 32))
    b.output(b.fake_quant(v, bits=bits, round_type=rt), name="y")
    y = run_graph(b.graph, {"x": x})["y"]
    np.testing.assert_array_equal(_bits(y), _bits(out[f"abs_{src}{bits}_{rt}_out"]))
    np.testing.assert_array_equal(_bits(abs_max(x).reshape(1)), _bits(out[f"abs_{src}{bits}_{rt}_scale"]))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rt", [0, 1])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("src", ["grid", "rand"])
def test_fake_quant_channel_wise_bit_exact(paddle_run: dict, bits: int, rt: int, axis: int, src: str) -> None:
    x = paddle_run["in"][f"{src}{bits}"]
    out = paddle_run["out"]
    b = GraphBuilder("fq")
    v = b.input("x", tensor(f32, 16, 32))
    b.output(b.fake_quant(v, bits=bits, round_type=rt, axes=(axis,)), name="y")
    y = run_graph(b.graph, {"x": x})["y"]
    np.testing.assert_array_equal(_bits(y), _bits(out[f"ch_{src}{bits}_{rt}_{axis}_out"]))
    np.testing.assert_array_equal(_bits(abs_max(x, (axis,))), _bits(out[f"ch_{src}{bits}_{rt}_{axis}_scale"]))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rt", [0, 1])
def test_moving_average_training_steps_bit_exact(paddle_run: dict, bits: int, rt: int) -> None:
    out, arrays = paddle_run["out"], paddle_run["in"]
    b = GraphBuilder("mavg")
    v = b.input("x", tensor(f32, 16, 32))
    sc, ac, st = (b.input(n, tensor(f32, 1)) for n in ("scale", "accum", "state"))
    y, s2, st2, ac2 = b.fake_quant_moving_average(v, sc, ac, st, bits=bits, round_type=rt, moving_rate=0.9)
    b.output(y, s2, st2, ac2, names=["y", "s", "st", "ac"])
    state = {"scale": np.array([0.001], np.float32), "accum": np.array([1.0], np.float32),
             "state": np.array([1.0], np.float32)}
    for step in range(3):
        x = arrays[f"mavg{bits}_{rt}_{step}"]
        res = run_graph(b.graph, {"x": x, **state})
        tag = f"mavg_{bits}_{rt}"
        np.testing.assert_array_equal(_bits(res["y"]), _bits(out[f"{tag}_out{step}"]))
        np.testing.assert_array_equal(_bits(res["s"]), _bits(out[f"{tag}_scale{step}"]))
        np.testing.assert_array_equal(_bits(res["st"]), _bits(out[f"{tag}_state{step}"]))
        np.testing.assert_array_equal(_bits(res["ac"]), _bits(out[f"{tag}_accum{step}"]))
        expect = moving_average_state(abs_max(x), state["accum"][0], state["state"][0], 0.9)
        assert (res["s"][0], res["ac"][0], res["st"][0]) == expect
        np.testing.assert_array_equal(_bits(res["y"]), _bits(fake_quant_dequant(x, expect[0], bits, rt)))
        state = {"scale": res["s"], "accum": res["ac"], "state": res["st"]}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rt", [0, 1])
def test_moving_average_is_test_uses_stored_scale(paddle_run: dict, bits: int, rt: int) -> None:
    x = paddle_run["in"][f"grid{bits}"]
    b = GraphBuilder("mavg")
    v = b.input("x", tensor(f32, 16, 32))
    sc, ac, st = (b.input(n, tensor(f32, 1)) for n in ("scale", "accum", "state"))
    y, s2, _, _ = b.fake_quant_moving_average(v, sc, ac, st, bits=bits, round_type=rt, is_test=True)
    b.output(y, s2, names=["y", "s"])
    one = np.array([1.0], np.float32)
    res = run_graph(b.graph, {"x": x, "scale": np.array([2.75], np.float32), "accum": one, "state": one})
    np.testing.assert_array_equal(_bits(res["y"]), _bits(paddle_run["out"][f"mtest_{bits}_{rt}_out0"]))
    assert res["s"][0] == np.float32(2.75)


def test_pact_bit_exact(paddle_run: dict) -> None:
    x = paddle_run["in"]["act"]
    b = GraphBuilder("pact")
    v = b.input("x", tensor(f32, 8, 64))
    a = b.input("alpha", tensor(f32, 1))
    b.output(b.pact(v, a), name="y")
    y = run_graph(b.graph, {"x": x, "alpha": np.array([20.0], np.float32)})["y"]
    np.testing.assert_array_equal(_bits(y), _bits(paddle_run["out"]["pact_out"]))
    assert np.abs(y).max() <= 20.0 < np.abs(x).max()


def test_reference_records_paddle_version(paddle_run: dict) -> None:
    assert paddle_run["meta"]["paddle"].startswith("3.")
