"""The interpreter over a small builder graph (a decoder block with MoE) equals composing the
op kernels by hand, bit for bit, with symbolic batch and sequence dims."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _ops_testkit import run1, run_kernel

from ernie_ir.ir import GraphBuilder, bf16, f32, i64, tensor
from ernie_ir.ir.equality import structural_diff
from ernie_ir.ir.parser import parse_graph
from ernie_ir.ir.printer import print_graph
from ernie_ir.ir.verifier import verify
from ernie_ir.ir.weights import ArraySource
from ernie_ir.runtime import run_graph

V, H, NH, KV, D, E, I, K = 11, 8, 4, 2, 2, 3, 6, 2


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def f(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return {
        "embed": f(V, H).astype(ml_dtypes.bfloat16),  # bf16 param: widened exactly to f32
        "norm1": f(H) + 1,
        "qkv": f(H, NH * D + 2 * KV * D),
        "o": f(NH * D, H),
        "ln_w": f(H) + 1,
        "ln_b": f(H),
        "gate": f(H, E),
        "gate_bias": f(E, scale=0.1),
        "up_gate": f(E, H, 2 * I),
        "down": f(E, I, H),
    }


def _build(w: dict[str, np.ndarray]):
    b = GraphBuilder("block")
    p = {k: b.param(k, source=ArraySource(v)) for k, v in w.items()}
    ids = b.input("ids", tensor(i64, "B", "S"))
    pos = b.input("pos", tensor(i64, "B", "S"))
    h = b.embedding(ids, p["embed"])
    assert h.type == tensor(bf16, "B", "S", H)
    n = b.rms_norm(h, p["norm1"], eps=1e-6)
    qkv = b.linear(n, p["qkv"])
    q, k, v = b.split(qkv, axis=-1, sizes=(NH * D, KV * D, KV * D))
    q = b.rope(b.reshape(q, shape=(0, 0, NH, -1)), pos, theta=10000.0)
    k = b.rope(b.reshape(k, shape=(0, 0, KV, -1)), pos, theta=10000.0)
    v = b.reshape(v, shape=(0, 0, KV, -1))
    a = b.attention(q, k, v, causal=True)
    a = b.reshape(a, shape=(0, 0, -1))
    h2 = b.add(h, b.linear(a, p["o"]))
    n2 = b.layer_norm(h2, p["ln_w"], p["ln_b"], eps=1e-5)
    wts, idx = b.moe_gate(n2, p["gate"], p["gate_bias"], top_k=K)
    m = b.moe_experts(n2, wts, idx, p["up_gate"], p["down"])
    h3 = b.add(h2, m)
    act = b.mul(b.gelu(h3, approximate="tanh"), b.silu(h3))
    t = b.transpose(act, perm=(1, 0, 2))  # [S, B, H]
    t = b.concat(t, t, axis=2)  # [S, B, 2H]
    t = b.cast(t, dtype=bf16)
    half = b.split(t, axis=2, sizes=(H, H))[0]
    logits = b.lm_head(b.transpose(half, perm=(1, 0, 2)), p["embed"], transpose_weight=True)
    probs = b.softmax(logits, axis=-1)
    b.output(probs, idx, names=["probs", "experts"])
    assert logits.type == tensor(f32, "B", "S", V)
    return b.graph


def _by_hand(w: dict[str, np.ndarray], ids: np.ndarray, pos: np.ndarray,
             emulate_bf16: bool = False) -> dict[str, np.ndarray]:
    """The same computation as explicit kernel calls, params widened to float32. With
    `emulate_bf16`, every result the graph types as bf16 is rounded to bf16 (all activations
    here: the embedding table is bf16), as `run_graph(..., emulate=bf16)` promises."""
    p = {k: v.astype(np.float32) for k, v in w.items()}

    def rnd(a: np.ndarray) -> np.ndarray:
        a = a.astype(np.float32)
        return a.astype(ml_dtypes.bfloat16).astype(np.float32) if emulate_bf16 else a

    def op(name, *args, **attrs):
        return rnd(run1(name, *args, **attrs))

    def split(x, **attrs):
        return [rnd(a) for a in run_kernel("split", x, **attrs)]

    h = op("embedding", ids, p["embed"])
    n = op("rms_norm", h, p["norm1"], eps=1e-6)
    qkv = op("linear", n, p["qkv"])
    q, k, v = split(qkv, axis=-1, sizes=(NH * D, KV * D, KV * D))
    q = op("rope", op("reshape", q, shape=(0, 0, NH, -1)), pos, theta=10000.0)
    k = op("rope", op("reshape", k, shape=(0, 0, KV, -1)), pos, theta=10000.0)
    v = op("reshape", v, shape=(0, 0, KV, -1))
    a = op("reshape", op("attention", q, k, v, causal=True), shape=(0, 0, -1))
    h2 = op("add", h, op("linear", a, p["o"]))
    n2 = op("layer_norm", h2, p["ln_w"], p["ln_b"], eps=1e-5)
    wts, idx = run_kernel("moe_gate", n2, p["gate"], p["gate_bias"], top_k=K)  # f32 / i64 results
    h3 = op("add", h2, op("moe_experts", n2, wts, idx, p["up_gate"], p["down"]))
    act = op("mul", op("gelu", h3, approximate="tanh"), op("silu", h3))
    t = op("transpose", act, perm=(1, 0, 2))
    t = op("concat", t, t, axis=2)
    t = op("cast", t, dtype=bf16)  # the interpreter holds floats as f32 (rnd widens)
    half = split(t, axis=2, sizes=(H, H))[0]
    logits = run1("lm_head", op("transpose", half, perm=(1, 0, 2)), p["embed"], transpose_weight=True)
    return {"probs": run1("softmax", logits, axis=-1), "experts": idx}


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (2, 5), (3, 4)])
def test_interpreter_equals_composed_kernels(batch, seq):
    w = _weights(batch * 10 + seq)
    graph = _build(w)
    rng = np.random.default_rng(seq)
    ids = rng.integers(0, V, (batch, seq)).astype(np.int64)
    pos = np.tile(np.arange(seq) + 3, (batch, 1)).astype(np.int64)
    out = run_graph(graph, {"ids": ids, "pos": pos})
    ref = _by_hand(w, ids, pos)
    assert set(out) == {"probs", "experts"}
    assert out["probs"].shape == (batch, seq, V) and out["probs"].dtype == np.float32
    assert out["experts"].shape == (batch, seq, K) and out["experts"].dtype == np.int64
    np.testing.assert_array_equal(out["probs"], ref["probs"])
    np.testing.assert_array_equal(out["experts"], ref["experts"])
    np.testing.assert_allclose(out["probs"].sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize(("batch", "seq"), [(2, 3)])
def test_interpreter_bf16_emulation_equals_rounding_each_bf16_result(batch, seq):
    w = _weights(7)
    graph = _build(w)
    ids = np.arange(batch * seq).reshape(batch, seq).astype(np.int64) % V
    pos = np.tile(np.arange(seq), (batch, 1)).astype(np.int64)
    out = run_graph(graph, {"ids": ids, "pos": pos}, emulate=bf16)
    ref = _by_hand(w, ids, pos, emulate_bf16=True)
    np.testing.assert_array_equal(out["probs"], ref["probs"])
    np.testing.assert_array_equal(out["experts"], ref["experts"])
    plain = _by_hand(w, ids, pos, emulate_bf16=False)
    assert not np.array_equal(out["probs"], plain["probs"])  # emulation changed the numbers


def test_block_graph_verifies_and_round_trips_through_text():
    graph = _build(_weights())
    verify(graph)
    assert structural_diff(graph, parse_graph(print_graph(graph))) is None


def test_interpreter_detects_a_wrong_param_through_the_outputs():
    # The comparison above can fail: perturbing one weight changes the result.
    w = _weights(1)
    ids = np.array([[1, 2, 3]], np.int64)
    pos = np.array([[0, 1, 2]], np.int64)
    base = run_graph(_build(w), {"ids": ids, "pos": pos})["probs"]
    w2 = dict(w)
    w2["o"] = w["o"] * np.float32(1.01)
    assert not np.array_equal(base, run_graph(_build(w2), {"ids": ids, "pos": pos})["probs"])
