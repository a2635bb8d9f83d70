"""Sparse MoE in the Paddle layer: only the routed experts run (and only they are dequantized),
equal to the interpreter and to the dense form, for float, wint8, wint4, cuda-arch 70 packed and
LoRA experts, a 64-expert tiny variant (one token, and many tokens), the grouped experts alone
against the dense form, zero-weight (expert-parallel) slots, LoRA gradients and the traced Paddle
Inference program."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _moe_kit import CASES, EXPERTS64, IDS, moe_graph

from ernie_ir.runtime.interpreter import run_graph

paddle = pytest.importorskip("paddle")

from ernie_ir.backends.paddle import layer as paddle_layer  # noqa: E402
from ernie_ir.backends.paddle.layer import build_layer  # noqa: E402


def forward(layer: Any, ids: np.ndarray) -> np.ndarray:
    layer.eval()
    with paddle.no_grad():
        return layer(paddle.to_tensor(ids)).numpy()


def assert_close(out: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4 + 2e-6 * float(np.abs(ref).max()))


class _Counting:
    """paddle with matmul calls counted (stands in for layer.P)."""

    def __init__(self) -> None:
        self.matmuls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(paddle, name)

    def matmul(self, *a: Any, **kw: Any) -> Any:
        self.matmuls += 1
        return paddle.matmul(*a, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_layer_equals_interpreter_and_dense(case: str) -> None:
    g = moe_graph(CASES[case])
    ref = run_graph(g, {"input_ids": IDS})["logits"]
    layer = build_layer(g, device="cpu")
    sparse = forward(layer, IDS)
    layer.moe_dense = True
    dense = forward(layer, IDS)
    assert_close(sparse, ref)
    assert_close(sparse, dense)
    if "wint" in case:  # every expert stack's dequantize is deferred to the experts
        stacks = [n for n in g if n.op == "dequantize" and n.outputs[0].type.rank == 3]
        assert stacks and {id(n) for n in stacks} <= layer._expert_stacks


def test_64_experts_top6_runs_only_the_routed_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    g = moe_graph("wint8mix,legalize-cuda{cuda_arch=80}", **EXPERTS64)
    assert any(n.op == "unpack_weight" for n in g)  # packed expert stacks at the default sm80
    moe_layers = sum(n.op == "moe_experts" for n in g)
    k = next(n for n in g if n.op == "moe_gate").attrs.top_k
    assert k == 6 and moe_layers
    ids = IDS[:1, :1]
    ref = run_graph(g, {"input_ids": ids})["logits"]
    layer = build_layer(g, device="cpu")
    sliced: list[int] = []
    orig = paddle_layer._ExpertStack.__getitem__

    def getitem(self: Any, e: int) -> Any:
        sliced.append(e)
        return orig(self, e)

    monkeypatch.setattr(paddle_layer._ExpertStack, "__getitem__", getitem)
    monkeypatch.setattr(paddle_layer._ExpertStack, "full", lambda self: pytest.fail("dense dequantize"))
    counting = _Counting()
    layer.P = counting
    assert_close(forward(layer, ids), ref)
    sparse_matmuls = counting.matmuls
    # one token: 6 experts x (up_gate, down) per MoE layer, each dequantized alone
    assert len(sliced) == 2 * k * moe_layers
    monkeypatch.undo()
    layer.moe_dense = True
    counting.matmuls = 0
    assert_close(forward(layer, ids), ref)
    assert sparse_matmuls - counting.matmuls == (2 * k - 2) * moe_layers  # dense: 2 batched [E] matmuls


@pytest.mark.parametrize("pipeline", ["", "lora{rank=4}"])
def test_64_experts_many_tokens_sparse_equals_dense(pipeline: str) -> None:
    """64 experts top-6 over 12 tokens: experts with several rows, with one, with none."""
    g = moe_graph(pipeline, **EXPERTS64)
    ref = run_graph(g, {"input_ids": IDS})["logits"]
    layer = build_layer(g, device="cpu")
    sparse = forward(layer, IDS)
    layer.moe_dense = True
    dense = forward(layer, IDS)
    assert_close(sparse, dense)
    assert_close(sparse, ref)


@pytest.mark.parametrize("lora", [False, True])
def test_grouped_experts_equal_dense_values(lora: bool) -> None:
    """The grouped form on its own (E=64, k=6, 40 rows: 0 to many rows per expert, zero-weight
    slots) against the dense form, with LoRA adapters on both matmuls."""
    rng = np.random.default_rng(5)
    e, h, i, t, k, r = 64, 24, 12, 40, 6, 3
    idx = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int64)
    idx[:10] = idx[0]  # ten rows routed alike: the same experts get several rows
    w = rng.random((t, k)).astype(np.float32)
    w[3, 2] = w[17, 0] = 0.0  # skipped slots
    arrays = [rng.standard_normal((1, t, h)).astype(np.float32), w[None], idx[None],
              rng.standard_normal((e, h, 2 * i)).astype(np.float32),
              rng.standard_normal((e, i, h)).astype(np.float32)]
    if lora:
        arrays += [rng.standard_normal(s).astype(np.float32) * 0.3
                   for s in ((e, h, r), (e, r, 2 * i), (e, i, r), (e, r, h))]
    L = SimpleNamespace(P=paddle, F=paddle.nn.functional, training=False)
    node = SimpleNamespace(attrs=SimpleNamespace(scale=0.5, dropout=0.0))
    args = [paddle.to_tensor(v) for v in arrays]
    with paddle.no_grad():
        got = paddle_layer._moe_sparse(L, node, args, lora=lora)[0].numpy()  # type: ignore[arg-type]
        dense = paddle_layer._moe_dense(L, node, args, lora=lora)[0].numpy()  # type: ignore[arg-type]
    assert got.shape == (1, t, h) and np.abs(got).max() > 1
    np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-4)


def test_zero_weight_slots_are_skipped_and_equal_dense() -> None:
    """Expert-parallel rank graphs weight slots routed elsewhere 0 (moe_local_experts)."""
    rng = np.random.default_rng(0)
    e, h, i, t, k = 8, 16, 8, 5, 3
    x = rng.standard_normal((t, h)).astype(np.float32)
    ug = rng.standard_normal((e, h, 2 * i)).astype(np.float32)
    dn = rng.standard_normal((e, i, h)).astype(np.float32)
    idx = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int64)
    w = rng.random((t, k)).astype(np.float32)
    held = idx < 4
    w, idx = np.where(held, w, 0), np.where(held, idx, 0)  # what moe_local_experts writes
    ug[4:] = np.nan  # not held here: never read by the sparse form
    L = SimpleNamespace(P=paddle, F=paddle.nn.functional, training=False)
    args = [paddle.to_tensor(v) for v in (x, w, idx, ug, dn)]
    got = paddle_layer._moe_sparse(L, None, args, lora=False)[0].numpy()  # type: ignore[arg-type]
    ug[4:] = 0
    args[3] = paddle.to_tensor(ug)
    dense = paddle_layer._moe_dense(L, None, args, lora=False)[0].numpy()  # type: ignore[arg-type]
    np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-5)


def test_lora_expert_gradients_equal_dense() -> None:
    g = moe_graph("wint8mix,lora{rank=4}")
    grads = []
    for dense in (False, True):
        layer = build_layer(g, device="cpu")
        layer.moe_dense = dense
        layer.train()
        out = layer(paddle.to_tensor(IDS))
        (out * out).mean().backward()
        names = [n for n in layer.trainable_names if ".experts." in n]
        assert names
        grads.append({n: layer.tensor(n).grad.numpy() for n in names})
    for n, gs in grads[0].items():
        assert np.abs(gs).max() > 0
        np.testing.assert_allclose(gs, grads[1][n], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_traced_inference_program_is_sparse_and_exact(tmp_path: Path) -> None:
    from paddle import inference

    from ernie_ir.backends.paddle.emit import emit_paddle_inference

    g = moe_graph("wint8mix,legalize-cuda{cuda_arch=80}", **EXPERTS64)
    folder = tmp_path / "art" / "inference" / "paddle"
    emit_paddle_inference(g, folder)
    text = (folder / "model.json").read_text()
    assert "nonzero" in text and "index_add" in text
    ref = run_graph(g, {"input_ids": IDS})["logits"]
    config = inference.Config(str(folder / "model.json"), str(folder / "model.pdiparams"))
    config.disable_gpu()
    config.disable_mkldnn()
    predictor = inference.create_predictor(config)  # Paddle Inference as a user runs it
    handle = predictor.get_input_handle(predictor.get_input_names()[0])
    handle.reshape(list(IDS.shape))
    handle.copy_from_cpu(IDS)
    predictor.run()
    assert_close(predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu(), ref)
