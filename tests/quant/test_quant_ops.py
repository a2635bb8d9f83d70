"""The quantization and LoRA ops: type rules (with their messages) and kernels against their docstrings."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ernie_ir.ir import GraphBuilder, OpError, bf16, f8e4m3, f32, i4, i8, i64, tensor
from ernie_ir.ops.quant_numerics import weight_dequantize
from ernie_ir.runtime.interpreter import run_graph


def _b() -> GraphBuilder:
    return GraphBuilder("t")


@pytest.mark.parametrize(("build", "message"), [
    (lambda b: b.weight_only_linear(b.input("x", tensor(f32, 2, 8)), b.input("w", tensor(bf16, 8, 4)),
                                    b.input("s", tensor(bf16, 4))), "weight must be i8 or i4"),
    (lambda b: b.weight_only_linear(b.input("x", tensor(f32, 2, 8)), b.input("w", tensor(i8, 8, 4)),
                                    b.input("s", tensor(bf16, 5))), "scale length and out_features"),
    (lambda b: b.weight_only_linear(b.input("x", tensor(f32, 2, 8)), b.input("w", tensor(i4, 128, 4)),
                                    b.input("s", tensor(bf16, 3, 4)), group_size=64),
     r"scale rows and ceil\(in_features / 64\)"),
    (lambda b: b.dequantize(b.input("q", tensor(f8e4m3, 4, 8, 2)), b.input("s", tensor(f32, 8))),
     "an fp8 scale is f32"),
    (lambda b: b.lora(b.input("y", tensor(f32, 2, 4)), b.input("x", tensor(f32, 2, 8)),
                      b.input("a", tensor(f32, 8, 3)), b.input("b", tensor(f32, 2, 4)), scale=1.0),
     "lora_A's rank and lora_B's rows"),
    (lambda b: b.fake_quant(b.input("x", tensor(f32, 2, 8)), axes=(2,)), "channel axis 2 out of range"),
    (lambda b: b.fake_quant_moving_average(b.input("x", tensor(f32, 2, 8)), *(b.input(n, tensor(f32, 2))
                                           for n in "sat")), r"shape of scale \(a \[1\] tensor\)"),
    (lambda b: b.fp8_linear(b.input("x", tensor(f32, 2, 8)), b.input("w", tensor(bf16, 8, 4)),
                            b.input("ws", tensor(f32)), b.input("xs", tensor(f32))), "weight must be f8e4m3"),
])
def test_type_rules_name_the_problem(build, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OpError, match=message):
        build(_b())


def test_weight_only_linear_and_dequantize_kernels() -> None:
    rng = np.random.default_rng(0)
    q = rng.integers(-7, 8, size=(2, 130, 6)).astype(np.int8)
    s = (rng.random((2, 3, 6)) * 0.1).astype(ml_dtypes.bfloat16)
    b = _b()
    qv = b.input("q", tensor(i4, 2, 130, 6))
    sv = b.input("s", tensor(bf16, 2, 3, 6))
    b.output(b.dequantize(qv, sv, dtype=f32, group_size=64), name="w")
    w = run_graph(b.graph, {"q": q, "s": s})["w"]
    np.testing.assert_array_equal(w[1, 70], q[1, 70].astype(np.float32) * s[1, 1].astype(np.float32))
    np.testing.assert_array_equal(w, weight_dequantize(q, s, 64))


def test_moe_experts_lora_with_zero_b_equals_moe_experts() -> None:
    rng = np.random.default_rng(1)
    e, h, inter, r = 4, 8, 6, 2
    ug = rng.standard_normal((e, h, 2 * inter)).astype(np.float32)
    dn = rng.standard_normal((e, inter, h)).astype(np.float32)
    b = _b()
    x = b.input("x", tensor(f32, 5, h))
    wts = b.input("w", tensor(f32, 5, 2))
    idx = b.input("i", tensor(i64, 5, 2))
    ugv, dnv = b.input("ug", tensor(f32, e, h, 2 * inter)), b.input("dn", tensor(f32, e, inter, h))
    a1, b1 = b.input("a1", tensor(f32, e, h, r)), b.input("b1", tensor(f32, e, r, 2 * inter))
    base = b.moe_experts(x, wts, idx, ugv, dnv)
    lora = b.moe_experts_lora(x, wts, idx, ugv, dnv, a1, b1, scale=2.0)
    b.output(base, lora, names=["base", "lora"])
    feeds = {"x": rng.standard_normal((5, h)).astype(np.float32), "w": rng.random((5, 2)).astype(np.float32),
             "i": rng.integers(0, e, (5, 2)), "ug": ug, "dn": dn,
             "a1": rng.standard_normal((e, h, r)).astype(np.float32),
             "b1": np.zeros((e, r, 2 * inter), np.float32)}
    out = run_graph(b.graph, feeds)
    np.testing.assert_array_equal(out["lora"], out["base"])
    feeds["b1"] = rng.standard_normal((e, r, 2 * inter)).astype(np.float32)
    out = run_graph(b.graph, feeds)
    assert not np.allclose(out["lora"], out["base"])
    with pytest.raises(OpError, match="up_gate_A and up_gate_B come together"):
        b.moe_experts_lora(x, wts, idx, ugv, dnv, a1, scale=1.0)
