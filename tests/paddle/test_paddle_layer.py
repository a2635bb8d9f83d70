"""The Paddle Layer built from an IR graph equals the reference interpreter (float32 tolerance)."""

from __future__ import annotations

import numpy as np
import pytest

from ernie_ir.load import load_input
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime import Interpreter, run_graph

paddle = pytest.importorskip("paddle")

from ernie_ir.runtime.paddle_layer import build_layer  # noqa: E402

MODELS = ["ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"]
PIPELINES = {
    "float-cuda": "legalize-cuda{cuda_arch=80}",
    "wint8-ascend": "wint8,legalize-ascend",
    "wint8mix-cuda": "wint8mix,legalize-cuda{cuda_arch=80}",
    "wint8mix-cuda70": "wint8mix,legalize-cuda{cuda_arch=70}",
    "wint8mix-kunlun": "wint8mix,legalize-kunlun",
    "wint8mix-lora-ascend": "wint8mix,lora{rank=4},legalize-ascend",
    "qat-int8-kunlun": "qat-int8,legalize-kunlun",
    "fp8-cuda90": "fp8,legalize-cuda{cuda_arch=90}",
}
IDS = np.random.default_rng(0).integers(0, 1000, size=(2, 9))


def lowered(model: str, pipeline: str):
    g = load_input(model)
    run_pipeline(g, pipeline, evaluator=Interpreter)  # fp8 calibrates with it
    return g


def assert_close(out: np.ndarray, ref: np.ndarray) -> None:
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 + 2e-6 * float(np.abs(ref).max()))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", list(PIPELINES))
def test_layer_equals_interpreter(model: str, name: str) -> None:
    g = lowered(model, PIPELINES[name])
    ref = run_graph(g, {"input_ids": IDS})["logits"]
    layer = build_layer(g, device="cpu")
    layer.eval()
    with paddle.no_grad():
        out = layer(paddle.to_tensor(IDS)).numpy()
    assert_close(out, ref)


def test_cpu_uses_portable_weight_only() -> None:
    g = lowered("ernie-4.5-0.3b@tiny", PIPELINES["wint8mix-cuda"])
    layer = build_layer(g, device="cpu")
    assert layer.kernels and all(k.startswith("portable") for k in layer.kernels.values())


def test_params_trainable_flags() -> None:
    g = lowered("ernie-4.5-0.3b@tiny", PIPELINES["wint8mix-lora-ascend"])
    layer = build_layer(g, device="cpu")
    trainable = {p.name for p in g.params.values() if p.trainable}
    assert trainable and set(layer.trainable_names) == trainable
    assert all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    for p in g.params.values():
        if p.type.dtype.is_float:
            assert layer.tensor(p).stop_gradient == (not p.trainable)


def test_fake_quant_straight_through_gradient() -> None:
    g = lowered("ernie-4.5-0.3b@tiny", PIPELINES["qat-int8-kunlun"])
    layer = build_layer(g, device="cpu")
    layer.train()
    loss = layer(paddle.to_tensor(IDS)).mean()
    loss.backward()
    grads = [layer.tensor(n).grad for n in layer.trainable_names]
    assert all(gr is not None for gr in grads)
    assert sum(float(paddle.abs(gr).sum()) for gr in grads) > 0


def test_qat_state_is_committed() -> None:
    g = lowered("ernie-4.5-0.3b@tiny", PIPELINES["qat-int8-kunlun"])
    layer = build_layer(g, device="cpu")
    state = [p.name for p in g.params.values() if "qat_state" in p.annotations]
    before = layer.state_numpy(state)
    layer.track_state = True
    with paddle.no_grad():
        layer(paddle.to_tensor(IDS))
    assert layer.commit_state() == len(state)
    after = layer.state_numpy(state)
    assert any(not np.array_equal(before[n], after[n]) for n in state)
    # the interpreter's out_state/out_accum for the first node are what was committed
    node = next(n for n in g if n.op == "fake_quant_moving_average")
    outs = {}
    from ernie_ir.runtime import Interpreter

    Interpreter(g).run({"input_ids": IDS}, observer=lambda n, r: outs.setdefault(id(n), r))
    _, s, st, acc = outs[id(node)]
    np.testing.assert_allclose(after[node.inputs[1].name], s, rtol=1e-6)
    np.testing.assert_allclose(after[node.inputs[3].name], st, rtol=1e-6)
    np.testing.assert_allclose(after[node.inputs[2].name], acc, rtol=1e-6)
