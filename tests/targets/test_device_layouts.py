"""kunlun / ascend weight layouts: the XPU kernel's int8 [N, K] + float32 scales, the NPU binding's [K, N].

Sources (docs/targets.md section 3): Paddle paddle/phi/kernels/xpu/weight_only_linear_kernel.cc,
FastDeploy custom_ops/xpu_ops/src/ops/moe_expert_ffn.cc, PaddleCustomDevice
backends/npu/custom_op/llama_infer/fused_weight_only_linear.cc.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ernie_ir.ir import OpError
from ernie_ir.load import load_input
from ernie_ir.ops.quant_numerics import weight_quantize
from ernie_ir.ops.xpu_layout import pack_xpu, unpack_xpu
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime import run_graph

MOE, DENSE = "ernie-4.5-21b-a3b@tiny", "ernie-4.5-0.3b@tiny"
IDS = np.random.default_rng(0).integers(0, 1024, (2, 9))
_cache: dict[str, object] = {}


def graph(model: str, pipeline: str):  # type: ignore[no-untyped-def]
    key = f"{model}|{pipeline}"
    if key not in _cache:
        g = load_input(model)
        run_pipeline(g, pipeline)
        _cache[key] = g
    return _cache[key]


def logits(model: str, pipeline: str) -> np.ndarray:
    key = f"logits|{model}|{pipeline}"
    if key not in _cache:
        _cache[key] = run_graph(graph(model, pipeline), {"input_ids": IDS})["logits"]
    return _cache[key]  # type: ignore[return-value]


@pytest.mark.parametrize("shape", [(80, 112), (192, 64), (3, 5, 7)])
def test_xpu_pack_round_trips(shape: tuple[int, ...]) -> None:
    q = np.random.default_rng(1).integers(-127, 128, shape).astype(np.int8)
    p = pack_xpu(q)
    assert p.dtype == np.int8 and p.shape == (*shape[:-2], shape[-1], shape[-2]) and p.flags.c_contiguous
    assert p[..., 2, 1].tolist() == q[..., 1, 2].tolist()  # [n, k] holds q[k, n]: signed, unbiased
    np.testing.assert_array_equal(unpack_xpu(p), q)
    with pytest.raises(OpError, match="int8"):
        pack_xpu(q.astype(np.int16))


def test_kunlun_params_are_the_xpu_layout_named_after_the_checkpoint() -> None:
    src = load_input(MOE)
    g = graph(MOE, "wint8,legalize-kunlun")
    w = np.asarray(src.params["ernie.layers.0.self_attn.qkv_proj.weight"].read())
    q, s = weight_quantize(w, 8, -1)
    p = g.params["ernie.layers.0.self_attn.qkv_proj.quant_weight"]
    ps = g.params["ernie.layers.0.self_attn.qkv_proj.weight_scale"]
    assert str(p.type) == "i8[112,80]" and str(ps.type) == "f32[112]"
    assert p.annotations["device_layout"] == {"layout": "xpu", "shape": "[N, K]", "logical": [80, 112],
                                              "scale_dtype": "f32"}
    np.testing.assert_array_equal(np.asarray(p.read()), q.T)
    sf = np.asarray(ps.read())
    assert sf.dtype == np.float32 and sf.tobytes() == s.astype(np.float32).tobytes()
    assert s.dtype == ml_dtypes.bfloat16  # float32 scales are the bf16 scales widened exactly
    # experts: one [N, K] int8 + float32 [N] pair per expert, as FastDeploy names pre-quantized weights
    we = np.asarray(src.params["ernie.layers.1.mlp.experts.up_gate_proj.weight"].read())
    for e in (0, 15):
        qe, se = weight_quantize(we[e], 8, -1)
        pe = g.params[f"ernie.layers.1.mlp.experts.{e}.up_gate_proj.quant_weight"]
        np.testing.assert_array_equal(np.asarray(pe.read()), qe.T)
        sfe = np.asarray(g.params[f"ernie.layers.1.mlp.experts.{e}.up_gate_proj.weight_scale"].read())
        assert sfe.tobytes() == se.astype(np.float32).tobytes()
    assert "ernie.layers.1.mlp.experts.up_gate_proj.quant_weight" not in g.params
    ops = {n.op for n in g}
    assert {"weight_only_linear_xpu", "unpack_weight_xpu", "stack"} <= ops
    assert "weight_only_linear" not in ops
    plan = g.metadata["kernel_plan"]
    assert not plan["fallbacks"]
    assert {k["kernel"] for k in plan["kernels"]} == {"weight_only_linear_xpu(int8, [N, K], f32 scale)",
                                                     "moe_expert_ffn(int8, [N, K] per expert, f32 scales)"}


def test_kunlun_int4_experts_stay_logical_and_say_so() -> None:
    g = graph(MOE, "wint8mix,legalize-kunlun")
    assert str(g.params["ernie.layers.1.mlp.experts.up_gate_proj.quant_weight"].type) == "i4[16,80,64]"
    kernels = {k["kernel"] for k in g.metadata["kernel_plan"]["kernels"]}
    assert "moe_expert_ffn(int4, logical [K, N]: device packing not confirmed)" in kernels


def test_ascend_keeps_the_npu_bindings_k_n_layout() -> None:
    g = graph(MOE, "wint8mix,legalize-ascend")
    p = g.params["ernie.layers.0.self_attn.qkv_proj.quant_weight"]
    assert str(p.type) == "i8[80,112]"
    assert str(g.params["ernie.layers.0.self_attn.qkv_proj.weight_scale"].type) == "bf16[112]"
    assert p.annotations["device_layout"] == {"layout": "npu", "shape": "[K, N]", "logical": [80, 112],
                                              "scale_dtype": "bf16"}
    assert any(n.op == "weight_only_linear" for n in g)


@pytest.mark.parametrize("target", ["kunlun", "ascend"])
@pytest.mark.parametrize("model,quant", [(MOE, "wint8"), (MOE, "wint8mix"), (DENSE, "wint8")])
def test_lowered_graph_equals_the_quantized_graph_bit_for_bit(model: str, quant: str, target: str) -> None:
    np.testing.assert_array_equal(logits(model, f"{quant},legalize-{target}"), logits(model, quant))


paddle_cases = [(MOE, "wint8", "kunlun"), (MOE, "wint8mix", "kunlun"), (DENSE, "wint8", "kunlun"),
                (MOE, "wint8mix", "ascend")]


@pytest.mark.parametrize("model,quant,target", paddle_cases)
def test_paddle_layer_agrees_with_the_interpreter(model: str, quant: str, target: str) -> None:
    paddle = pytest.importorskip("paddle")
    from ernie_ir.backends.paddle.layer import build_layer

    pipeline = f"{quant},legalize-{target}"
    ref = logits(model, pipeline)
    layer = build_layer(graph(model, pipeline), device="cpu")
    layer.eval()
    with paddle.no_grad():
        out = layer(paddle.to_tensor(IDS)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 + 2e-6 * float(np.abs(ref).max()))


def test_kunlun_artifact_runs_on_the_paddle_backend(tmp_path: Path) -> None:
    pytest.importorskip("paddle")
    from ernie_ir.backends.sessions import run_artifact
    from ernie_ir.targets import CompileOptions, compile_model

    out = tmp_path / "art"
    compile_model(MOE, "kunlun", CompileOptions(quant="wint8", out=out))
    a = run_artifact(out, IDS, "interpreter")
    np.testing.assert_array_equal(a, logits(MOE, "wint8"))
    b = run_artifact(out, IDS, "paddle")
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-4 + 2e-6 * float(np.abs(a).max()))
