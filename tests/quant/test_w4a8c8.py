"""W4A8C8 (issue 28, items 1 and 2): the moe_experts_w4a8 and C8 KV-cache kernels against
independent numpy implementations of REFERENCE.md 14, the w4a8c8 pass with its calibration,
C8 decoding, the split of calibrated scales and the Paddle lowerings.

The references below are written from REFERENCE 14 / FastDeploy's kernels, not from the ops:
activation quantization round(clip(127 * in_scale * x, -127, 127)) with C `round` (half away
from zero: `initialize_moe_routing_kernel`, and `QuantHelperFunc` with round_type 1 for the
down_proj input), int64 accumulation, per-output-channel dequantization; C8
clip(round_half_even(scale * x), -127, 127) + 128 as uint8 with scale = 127 / absmax.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _quant_testkit import logits, rel_error, token_ids, top1

from ernie_ir.frontends import load_model
from ernie_ir.ir import DType, ErnieIRError, GraphBuilder, OpError, f32, get_op, i64, tensor
from ernie_ir.ir.weights import ArraySource
from ernie_ir.ops.kv_cache_int8 import c8_scales
from ernie_ir.ops.moe_w4a8 import hadamard_blocks, int_matmul, quantize_activation
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.decoding.kv_cache import KvCacheError, add_kv_cache
from ernie_ir.passes.parallel.split import mapping_for, split_graph
from ernie_ir.passes.quant.w4a8 import W4A8C8Error
from ernie_ir.runtime.decoding import DecodeOptions, cache_dtype_of, decode
from ernie_ir.runtime.interpreter import Interpreter, run_graph
from ernie_ir.runtime.spmd import run_spmd

MOE = "ernie-4.5-21b-a3b@tiny"
MOE300 = "ernie-4.5-300b-a47b@tiny"
BF16 = np.dtype(ml_dtypes.bfloat16)

# -- independent references (REFERENCE 14) ---------------------------------------------------------


def ref_round_half_away(v: np.ndarray) -> np.ndarray:
    """C `round` of float32 values, in float64 (|v| + 0.5 is exact there)."""
    v = np.asarray(v, np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def ref_act_quant(x: np.ndarray, in_scale: float) -> np.ndarray:
    """int64 round(clip(127 * in_scale * x, -127, 127)): the multiplier and the product in float32
    (FastDeploy's `max_bound * scale * x`)."""
    m = np.float32(np.float32(127) * np.float32(in_scale))
    v = np.asarray(m * np.asarray(x, np.float32), np.float32)
    return np.clip(ref_round_half_away(v), -127, 127).astype(np.int64)


def ref_sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h.astype(np.float32)


def ref_expert(v: np.ndarray, ug, ugs, ugi, dn, dns, dni, block: int = 0) -> np.ndarray:
    """One expert's W4A8 FFN on rows v [T, H] (logical int4 weights)."""
    inter = dn.shape[0]
    acc = np.einsum("tk,kn->tn", ref_act_quant(v, ugi), np.asarray(ug).astype(np.int64))
    h = acc.astype(np.float32) * np.asarray(ugs, np.float32)
    gate, up = h[:, :inter], h[:, inter:]
    a = gate / (np.float32(1) + np.exp(-gate)) * up
    if block:
        a = a @ np.kron(np.eye(inter // block, dtype=np.float32), ref_sylvester(block))
    acc2 = np.einsum("tk,kn->tn", ref_act_quant(a, dni), np.asarray(dn).astype(np.int64))
    return acc2.astype(np.float32) * np.asarray(dns, np.float32)


def ref_c8_quant(x: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    scale = np.float32(127) / np.asarray(absmax, np.float32)
    v = np.asarray(scale * np.asarray(x, np.float32), np.float64)
    r = np.where(np.abs(v - np.trunc(v)) == 0.5, 2 * np.round(v / 2), np.floor(v + 0.5))  # half to even
    return (np.clip(r, -127, 127) + 128).astype(np.uint8)


def ref_c8_dequant(q: np.ndarray, absmax: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) - np.float32(128)) * (np.asarray(absmax, np.float32) / np.float32(127))


def w4a8_case(rng: np.random.Generator, e: int = 3, h: int = 16, inter: int = 8) -> dict[str, np.ndarray]:
    i4 = np.dtype(ml_dtypes.int4)
    return {
        "up_gate": rng.integers(-8, 8, size=(e, h, 2 * inter)).astype(i4),
        "up_gate_scale": rng.uniform(1e-4, 2e-3, size=(e, 2 * inter)).astype(np.float32),
        "up_gate_in_scale": rng.uniform(0.2, 1.0, size=e).astype(np.float32),
        "down": rng.integers(-8, 8, size=(e, inter, h)).astype(i4),
        "down_scale": rng.uniform(1e-4, 2e-3, size=(e, h)).astype(np.float32),
        "down_in_scale": rng.uniform(0.5, 4.0, size=e).astype(np.float32),
    }


def run_w4a8(case: dict[str, np.ndarray], x: np.ndarray, wts: np.ndarray, idx: np.ndarray,
             block: int = 0) -> np.ndarray:
    op = get_op("moe_experts_w4a8")
    args = [x, wts, idx, *(case[k] for k in ("up_gate", "up_gate_scale", "up_gate_in_scale", "down",
                                             "down_scale", "down_in_scale"))]
    return op.kernel(args, op.make_attrs({"hadamard_block": block}))[0]


# -- W4A8 kernel ---------------------------------------------------------------------------------


def test_activation_rounding_ties_go_away_from_zero_and_clip_at_127() -> None:
    m64 = np.float64(np.float32(127) * np.float32(2.0 ** -7))  # in_scale 2^-7: multiplier 127/128 exactly
    ties, want = [], []
    for k in range(-130, 130):
        x = np.float32((k + 0.5) / m64)
        if np.float32(np.float32(m64) * x) == np.float32(k + 0.5):  # the float32 product is a tie
            ties.append(x)
            want.append(np.clip(k + 1 if k >= 0 else k, -127, 127))  # away from zero, then clipped
    assert len(ties) > 100
    q = quantize_activation(np.array(ties, np.float32), np.float32(2.0 ** -7))
    np.testing.assert_array_equal(q, want)
    assert q.dtype == np.int8
    assert quantize_activation(np.float32(0.5 / m64), np.float32(2.0 ** -7)) == 1  # half-even would give 0
    big = np.array([1e30, -1e30, 300.0, -300.0, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(quantize_activation(big, np.float32(1)), [127, -127, 127, -127, 127, -127])
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10000).astype(np.float32) * 3
    np.testing.assert_array_equal(quantize_activation(x, np.float32(0.37)), ref_act_quant(x, 0.37))


def test_int8_int4_products_accumulate_exactly_in_int32() -> None:
    rng = np.random.default_rng(1)
    k = 20000  # |acc| up to 20000 * 127 * 8 = 2.03e7 > 2^24: float32 accumulation would round
    a = rng.integers(-127, 128, size=(4, k)).astype(np.int8)
    a[0] = 127
    a[0, -1] = 2  # acc[0, 0] = 889 * 19999 + 14, odd and above 2^24: no float32 holds it
    b = rng.integers(-8, 8, size=(k, 16)).astype(np.dtype(ml_dtypes.int4))
    b[:, 0] = 7
    exact = np.einsum("tk,kn->tn", a.astype(np.int64), b.astype(np.int64))
    got = int_matmul(a, b)
    assert got.dtype == np.int32 and abs(int(exact[0, 0])) > 2 ** 24
    np.testing.assert_array_equal(got, exact)
    lossy = np.matmul(a.astype(np.float32), b.astype(np.float32))
    assert (lossy.astype(np.int64) != exact).any(), "the case must be one float32 accumulation gets wrong"


def test_w4a8_expert_ffn_equals_the_reference_exactly() -> None:
    """top-1 routing with weight 1: the op's output row is one expert's FFN, bit for bit."""
    rng = np.random.default_rng(2)
    case = w4a8_case(rng)
    x = (rng.standard_normal((2, 5, 16)) * 2).astype(np.float32)
    idx = rng.integers(0, 3, size=(2, 5, 1)).astype(np.int64)
    out = run_w4a8(case, x, np.ones((2, 5, 1), np.float32), idx)
    args = [case[k] for k in ("up_gate", "up_gate_scale", "up_gate_in_scale", "down", "down_scale",
                              "down_in_scale")]
    for t in np.ndindex(2, 5):
        e = int(idx[t][0])
        want = ref_expert(x[t][None], *(a[e] for a in args))
        np.testing.assert_array_equal(out[t], want[0])
    # per output channel: doubling one channel's scale doubles exactly that channel
    case2 = dict(case, down_scale=case["down_scale"].copy())
    case2["down_scale"][:, 3] *= 2
    out2 = run_w4a8(case2, x, np.ones((2, 5, 1), np.float32), idx)
    np.testing.assert_array_equal(out2[..., 3], 2 * out[..., 3])
    np.testing.assert_array_equal(np.delete(out2, 3, -1), np.delete(out, 3, -1))


def test_w4a8_topk_combine_and_hadamard_against_the_reference() -> None:
    rng = np.random.default_rng(3)
    case = w4a8_case(rng, e=4, h=16, inter=8)
    x = (rng.standard_normal((3, 7, 16)) * 2).astype(np.float32)
    idx = np.stack([rng.permutation(4)[:2] for _ in range(21)]).reshape(3, 7, 2).astype(np.int64)
    wts = rng.uniform(0.1, 1, size=(3, 7, 2)).astype(np.float32)
    args = [case[k] for k in ("up_gate", "up_gate_scale", "up_gate_in_scale", "down", "down_scale",
                              "down_in_scale")]
    for block in (0, 4, 8):
        out = run_w4a8(case, x, wts, idx, block)
        want = np.zeros_like(out)
        for t in np.ndindex(3, 7):
            for j in range(2):
                e = int(idx[t][j])
                want[t] += wts[t][j] * ref_expert(x[t][None], *(a[e] for a in args), block=block)[0]
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
    np.testing.assert_array_equal(hadamard_blocks(np.eye(8, dtype=np.float32), 4),
                                  np.kron(np.eye(2), ref_sylvester(4)))


def test_w4a8_type_rule_errors_are_one_line() -> None:
    def build(**over: object) -> None:
        b = GraphBuilder("t")
        x = b.input("x", tensor(f32, "B", 16))
        w = b.input("w", tensor(f32, "B", 2))
        i = b.input("i", tensor(i64, "B", 2))
        types = {"up_gate": tensor(DType.I4, 4, 16, 16), "up_gate_scale": tensor(f32, 4, 16),
                 "up_gate_in_scale": tensor(f32, 4), "down": tensor(DType.I4, 4, 8, 16),
                 "down_scale": tensor(f32, 4, 16), "down_in_scale": tensor(f32, 4)}
        types.update(over.pop("types", {}))  # type: ignore[arg-type]
        params = [b.param(k, t) for k, t in types.items()]
        b.moe_experts_w4a8(x, w, i, *params, **over)

    build()
    for types, pattern in (({"up_gate": tensor(DType.BF16, 4, 16, 16)}, "input up_gate must be i4"),
                           ({"down_in_scale": tensor(f32, 3)}, "expert counts of up_gate and down_in_scale"),
                           ({"down_scale": tensor(f32, 4, 8)}, "down_scale columns and down columns"),
                           ({"up_gate": tensor(DType.I4, 4, 16, 12), "up_gate_scale": tensor(f32, 4, 12)},
                            r"up_gate has 12 columns, expected 2 x 8")):
        with pytest.raises(OpError, match=pattern) as info:
            build(types=types)
        assert "\n" not in str(info.value)
    with pytest.raises(OpError, match="hadamard_block 16 does not divide the expert intermediate size 8"):
        build(hadamard_block=16)
    with pytest.raises(OpError, match="hadamard_block"):
        build(hadamard_block=3)


# -- C8 kernels ----------------------------------------------------------------------------------


def test_c8_quantize_ties_to_even_clips_and_offsets_by_128() -> None:
    op_q, op_dq = get_op("kv_cache_quantize"), get_op("kv_cache_dequantize")
    absmax = np.full((1, 12), 127, np.float32)  # write scale 127 / 127 = 1: x is what gets rounded
    x = np.array([[[[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -127.5, -200, 0, 3.25]]]], np.float32)
    q = op_q.kernel([x, absmax], op_q.make_attrs({}))[0]
    assert q.dtype == np.uint8
    np.testing.assert_array_equal(q[0, 0, 0], [128, 130, 130, 128, 126, 126, 254, 255, 1, 1, 128, 131])
    np.testing.assert_array_equal(q, ref_c8_quant(x, absmax))
    back = op_dq.kernel([q, absmax], op_dq.make_attrs({"dtype": DType.F32}))[0]
    np.testing.assert_array_equal(back[0, 0, 0], [0, 2, 2, 0, -2, -2, 126, 127, -127, -127, 0, 3])


def test_c8_round_trip_per_channel() -> None:
    rng = np.random.default_rng(4)
    absmax = rng.uniform(0.01, 5, size=(2, 8)).astype(np.float32)
    x = (rng.uniform(-1, 1, size=(3, 9, 2, 8)) * absmax).astype(np.float32)
    op_q, op_dq = get_op("kv_cache_quantize"), get_op("kv_cache_dequantize")
    q = op_q.kernel([x, absmax], op_q.make_attrs({}))[0]
    np.testing.assert_array_equal(q, ref_c8_quant(x, absmax))
    assert q.min() >= 1 and q.max() <= 255  # -127..127 + 128: 0 never occurs
    back = op_dq.kernel([q, absmax], op_dq.make_attrs({"dtype": DType.F32}))[0]
    np.testing.assert_array_equal(back, ref_c8_dequant(q, absmax))
    step = absmax / 127
    assert (np.abs(back - x) <= step * 0.5 * (1 + 1e-5)).all()  # within half a step per channel
    # bf16 scales (FastDeploy keeps them in the model's dtype): the scales are rounded to bf16
    s, o = c8_scales(absmax, DType.BF16)
    a16 = absmax.astype(BF16).astype(np.float32)
    np.testing.assert_array_equal(s, (np.float32(127) / a16).astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(o, (a16 / np.float32(127)).astype(BF16).astype(np.float32))
    with pytest.raises(OpError, match=r"absmax shape and x's last two dims"):
        b = GraphBuilder("t")
        b.kv_cache_quantize(b.input("x", tensor(f32, "B", "S", 2, 8)), b.param("a", tensor(f32, 4, 4)))


# -- the w4a8c8 pass ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted() -> dict[str, object]:
    """The tiny 21B MoE: float, w4a8c8 (default: 256 random calibration tokens, seed 0), and
    w4a8c8{kv_cache=float} (the same experts, float cache)."""
    out: dict[str, object] = {"float": load_model(MOE)}
    for key, pipeline in (("c8", "w4a8c8"), ("w4a8", "w4a8c8{kv_cache=float}")):
        g = load_model(MOE)
        out[key + "_result"] = run_pipeline(g, pipeline, evaluator=Interpreter)
        out[key] = g
    return out


def test_pass_structure_and_logits_close_to_float(converted) -> None:
    g, ref = converted["c8"], converted["float"]
    assert [n.op for n in g].count("moe_experts_w4a8") == 2 and not g.nodes_by_op("moe_experts")
    assert len(g.nodes_by_op("kv_cache_quantize")) == 6  # k and v of 3 attentions
    m = "ernie.layers.1.mlp.experts"
    assert str(g.params[f"{m}.up_gate_proj.quant_weight"].type) == "i4[16,80,64]"
    assert str(g.params[f"{m}.up_gate_proj.weight_scale"].type) == "bf16[16,64]"
    assert str(g.params[f"{m}.down_proj.in_scale"].type) == "f32[16]"
    assert str(g.params["ernie.layers.1.self_attn.cachek_matmul.activation_scale"].type) == "f32[2,8]"
    assert f"{m}.up_gate_proj.weight" not in g.params
    assert g.metadata["w4a8c8"]["moe_quant_type"] == "w4a8"
    assert g.metadata["w4a8c8"]["kv_cache_quant_type"] == "int8"
    assert converted["c8_result"].warnings == []
    ids = token_ids(1024)
    base = logits(ref, ids)
    errs = {k: rel_error(logits(converted[k], ids), base) for k in ("w4a8", "c8")}
    agree = top1(logits(g, ids), base)
    print(f"\n[error budget] {MOE}: w4a8 rel {errs['w4a8']:.4f}, w4a8c8 rel {errs['c8']:.4f}, "
          f"top1 {agree:.3f}")
    # wint8mix (int4 experts, int8 dense) measures 0.0455 here and int4 experts dominate it; the
    # int8 activations and C8 cache each add about 0.01: 0.15 leaves a 2.5x margin
    assert errs["w4a8"] < 0.15 and errs["c8"] < 0.15 and agree >= 0.9


def _hooked_float_run(graph, ids):
    """Run the float graph, keeping every moe_experts input (x, indices) and attention k/v."""
    keep = {}
    want = {}
    for n in graph:
        if n.op == "moe_experts":
            want[n.inputs[0]], want[n.inputs[2]] = (n, "x"), (n, "idx")
        if n.op == "attention":
            want[n.inputs[1]], want[n.inputs[2]] = (n, "k"), (n, "v")

    def observer(node, results):
        for v, a in zip(node.outputs, results, strict=True):
            if v in want:
                keep[want[v]] = np.array(a)

    Interpreter(graph).run({"input_ids": ids}, observer=observer)
    return keep


def test_calibrated_scales_are_the_abs_max_of_the_float_graph(converted) -> None:
    ref, g = converted["float"], converted["c8"]
    ids = np.random.default_rng(0).integers(0, 1024, size=(1, 256))  # the pass's default calibration set
    seen = _hooked_float_run(ref, ids)
    moe = [n for n in ref if n.op == "moe_experts"]
    att = [n for n in ref if n.op == "attention"]
    for n in moe:
        m = n.scope
        x, idx = seen[(n, "x")].reshape(-1, 80), seen[(n, "idx")].reshape(256, -1)
        ug = np.asarray(n.inputs[3].read()).astype(np.float32)
        absmax_in, absmax_down = np.zeros(16, np.float32), np.zeros(16, np.float32)
        for e in range(16):
            rows = np.nonzero((idx == e).any(axis=1))[0]
            assert rows.size, "every expert is reached by 256 tokens"
            absmax_in[e] = np.abs(x[rows]).max()
            h = x[rows] @ ug[e]
            absmax_down[e] = np.abs(h[:, :32] / (1 + np.exp(-h[:, :32])) * h[:, 32:]).max()
        np.testing.assert_array_equal(g.params[f"{m}.up_gate_proj.in_scale"].read(),
                                      np.float32(1) / absmax_in)
        np.testing.assert_allclose(1 / g.params[f"{m}.down_proj.in_scale"].read(), absmax_down, rtol=1e-6)
        # int4 weights: Paddle's weight_quantize int4 (abs-max / 7 in bf16, round half away, clip 7)
        w = np.asarray(n.inputs[3].read())
        ws = (np.abs(w.astype(np.float32)).max(axis=1) / np.float32(7)).astype(BF16).astype(np.float32)
        q = np.clip(ref_round_half_away(w.astype(np.float32) / ws[:, None, :]), -7, 7)
        np.testing.assert_array_equal(np.asarray(g.params[f"{m}.up_gate_proj.quant_weight"].read()).astype(
            np.int64), q)
        acc_scale = ((ws / np.float32(127)) / (np.float32(1) / absmax_in)[:, None]).astype(BF16)
        np.testing.assert_array_equal(g.params[f"{m}.up_gate_proj.weight_scale"].read(), acc_scale)
    for n in att:
        for kind, key in (("cachek", "k"), ("cachev", "v")):
            a = np.abs(seen[(n, key)]).reshape(-1, 2, 8).max(axis=0)
            np.testing.assert_array_equal(g.params[f"{n.scope}.{kind}_matmul.activation_scale"].read(), a)


def test_experts_no_token_reached_get_the_layer_maximum(tmp_path) -> None:
    g, ref = load_model(MOE), load_model(MOE)
    ids = np.array([[7, 7, 7, 900, 7, 7, 3, 3, 7, 7, 7, 7, 7, 7, 7, 7]], np.int64)  # few distinct tokens
    path = tmp_path / "calib.npy"
    np.save(path, ids)
    result = run_pipeline(g, f'w4a8c8{{calibration_file="{path}"}}', evaluator=Interpreter)
    assert any("got no calibration token" in w for w in result.warnings)
    seen = _hooked_float_run(ref, ids)
    total = 0
    for n in ref.nodes_by_op("moe_experts"):
        x, idx = seen[(n, "x")].reshape(16, -1), seen[(n, "idx")].reshape(16, -1)
        absmax = np.array([np.abs(x[(idx == e).any(axis=1)]).max(initial=0) for e in range(16)], np.float32)
        reached = absmax > 0
        total += int((~reached).sum())
        want = np.float32(1) / np.where(reached, absmax, absmax.max())
        np.testing.assert_array_equal(g.params[f"{n.scope}.up_gate_proj.in_scale"].read(), want)
    assert 0 < total == g.metadata["w4a8c8"]["unreached_experts"]


@pytest.mark.parametrize(("model", "pipeline", "pattern"), [
    ("ernie-4.5-0.3b@tiny", "w4a8c8", r"no routed experts \(moe_experts\): W4A8 quantizes routed experts"),
    (MOE, "w4a8c8{calibration_tokens=8}", r"8 calibration token\(s\) cannot reach the 16 routed experts"),
    (MOE, 'w4a8c8{calibration_file="{tmp}/missing.npy"}', "does not exist"),
    (MOE, 'w4a8c8{calibration_file="{tmp}/oov.npy"}', r"token ids must be in \[0, 1024\)"),
    (MOE, "w4a8c8{hadamard_block=12}", "hadamard_block=12 must be 0 or a power of two dividing"),
    (MOE, "wint4,w4a8c8", "already quantized"),
    (MOE, "w4a8c8{calibration_tokens=32},w4a8c8", r"already W4A8 \(run w4a8c8 once\)"),
    (MOE, "lora{rank=4},w4a8c8", "carry LoRA adapters: merge them first"),
])
def test_refusals_are_one_line(model: str, pipeline: str, pattern: str, tmp_path) -> None:
    np.save(tmp_path / "oov.npy", np.array([[1, 2, 5000] * 10]))
    pipeline = pipeline.replace("{tmp}", str(tmp_path))
    g = load_model(model)
    with pytest.raises(ErnieIRError, match=pattern) as info:
        run_pipeline(g, pipeline, evaluator=Interpreter)
    assert "\n" not in str(info.value)
    if "no routed experts" in pattern:
        assert isinstance(info.value, W4A8C8Error)


def test_meta_graph_gets_typed_params_and_real_sizes_rotate() -> None:
    g = load_model("ernie-4.5-300b-a47b@meta")
    run_pipeline(g, "w4a8c8")  # no weights, nothing to calibrate: no evaluator needed
    node = g.nodes_by_op("moe_experts_w4a8")[0]
    assert node.attrs.hadamard_block == 128  # moe_intermediate_size 3584 = 28 x 128
    assert all(p.source is None for p in node.inputs[3:])


# -- C8 decoding ----------------------------------------------------------------------------------


def _greedy(graph, prompts, steps=6):
    layout = add_kv_cache(graph)
    options = DecodeOptions(max_new_tokens=steps, keep_logits=True)
    return layout, decode(Interpreter(graph).run, layout.layers, prompts, options,
                          cache_dtype=cache_dtype_of(graph))


def _c8_graph(kv: str = "int8"):
    g = load_model(MOE)
    run_pipeline(g, f"w4a8c8{{kv_cache={kv},calibration_tokens=64}}", evaluator=Interpreter)
    return g


def test_c8_decoder_keeps_a_u8_cache_and_stays_close_to_the_float_cache() -> None:
    prompts = [[5, 17, 300, 2], [9, 8, 7]]
    results = {}
    for kv in ("float", "int8"):
        g = _c8_graph(kv)
        layout, results[kv] = _greedy(g, prompts)
        past = next(v for v in g.inputs if v.name == "past_key_values.0.key")
        assert (layout.dtype, past.type.dtype) == (("u8", DType.U8) if kv == "int8" else ("bf16", DType.BF16))
        if kv == "int8":  # every read goes through the cache: no quantize feeds a dequantize directly
            assert not any(n.op == "kv_cache_dequantize" and n.inputs[0].producer.op == "kv_cache_quantize"
                           for n in g)
    a, b = np.stack(results["float"].step_logits), np.stack(results["int8"].step_logits)
    rel = rel_error(b, a)
    print(f"\n[C8 decode] {MOE}: step logits rel {rel:.4f} vs the float cache, max |d| "
          f"{np.abs(a - b).max():.3f} of max |logit| {np.abs(a).max():.1f}")
    # int8 per channel: each cached k/v is off by at most half a step (abs-max / 254); measured 0.020
    assert rel < 0.05
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.9


def test_c8_decoding_equals_the_full_sequence_c8_graph() -> None:
    """Prefill + decode through the u8 cache computes what the full-sequence C8 graph does (each
    key and value is quantized once either way): a row's step logits are the full graph's."""
    full_graph = _c8_graph()
    _, one = _greedy(_c8_graph(), [[5, 17, 300, 2]], steps=4)
    seq = [5, 17, 300, 2, *one.new_tokens[0]]
    full = run_graph(full_graph, {"input_ids": np.array([seq])})["logits"][0]
    for s, step in enumerate(one.step_logits):
        np.testing.assert_allclose(step[0], full[3 + s], rtol=1e-5, atol=1e-5 * float(np.abs(full).max()))


def test_kv_cache_pass_refuses_mismatched_cache_types() -> None:
    with pytest.raises(KvCacheError, match="no calibrated C8 scales"):
        add_kv_cache(load_model(MOE), "int8")
    g = load_model(MOE)
    run_pipeline(g, "w4a8c8{calibration_tokens=32}", evaluator=Interpreter)
    with pytest.raises(KvCacheError, match="cannot keep a bf16 cache"):
        add_kv_cache(g, "bf16")
    assert add_kv_cache(g, "int8").dtype == "u8"


# -- split: the scales of a rank are the global ones, sliced ---------------------------------------


@pytest.mark.parametrize(("model", "tp", "ep", "heads"), [
    (MOE, 2, 1, [[0], [1]]),      # 2 KV heads, tp 2: one head per rank
    (MOE, 2, 2, [[0], [1]]),      # experts split too
    (MOE300, 2, 1, [[0], [0]]),   # 1 KV head, tp 2: the head (and its scales) replicated
])
def test_split_slices_the_global_kv_scales_by_heads(model: str, tp: int, ep: int, heads) -> None:
    g = load_model(model)
    run_pipeline(g, "w4a8c8{calibration_tokens=64,hadamard_block=16}", evaluator=Interpreter)
    ids = token_ids(int(g.metadata["config"]["vocab_size"]))
    whole = logits(g, ids)
    ranks = split_graph(g, mapping_for(g, tp=tp, ep=ep))
    name = "ernie.layers.1.self_attn.cachek_matmul.activation_scale"
    glob = np.asarray(g.params[name].read())
    for r, rank in enumerate(ranks):
        np.testing.assert_array_equal(np.asarray(rank.params[name].read()), glob[heads[r]])
    out = run_spmd(ranks, {"input_ids": ids})[0]["logits"]
    np.testing.assert_allclose(out, whole, rtol=1e-4, atol=1e-5 * float(np.abs(whole).max()))
    for rank in ranks:  # each rank's graph decodes with its own u8 cache
        assert add_kv_cache(rank).dtype == "u8"


# -- Paddle lowerings ------------------------------------------------------------------------------


def test_paddle_lowerings_match_the_interpreter() -> None:
    paddle = pytest.importorskip("paddle")
    from ernie_ir.backends.paddle.layer import build_layer

    g = load_model(MOE)
    run_pipeline(g, "w4a8c8{calibration_tokens=64,hadamard_block=16}", evaluator=Interpreter)
    ids = token_ids(1024)
    want = logits(g, ids)
    layer = build_layer(g, device="cpu")
    layer.eval()
    with paddle.no_grad():
        got = layer(paddle.to_tensor(ids)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))
    # the C8 ops alone, bit for bit (ties included)
    x = np.array([[[[0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, -300.0]]]], np.float32) * np.float32(0.25)
    a = ArraySource(np.full((1, 8), 127 * 0.25, np.float32)).read()
    b = GraphBuilder("c8")
    q = b.kv_cache_quantize(b.input("x", tensor(f32, 1, 1, 1, 8)), b.param("a", tensor(f32, 1, 8)),
                            scale_dtype=DType.BF16)
    b.output(q, name="q")
    b.output(b.kv_cache_dequantize(q, b.graph.params["a"], dtype=DType.BF16, scale_dtype=DType.BF16),
             name="x")
    b.graph.params["a"].source = ArraySource(a)
    ref = run_graph(b.graph, {"x": x})
    layer = build_layer(b.graph, device="cpu")
    with paddle.no_grad():
        pq, px = (t.numpy() for t in layer(paddle.to_tensor(x)))
    np.testing.assert_array_equal(pq, ref["q"])
    np.testing.assert_array_equal(px, ref["x"])
