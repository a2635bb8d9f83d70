"""Paddle executables in artifacts: the jit.save'd inference model and the training recipe/loop."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ernie_ir.ir import ErnieIRError
from ernie_ir.runtime import run_graph
from ernie_ir.targets import CompileOptions, compile_model, load_artifact, verify_artifact

paddle = pytest.importorskip("paddle")

from ernie_ir.backends.paddle import layer as paddle_layer  # noqa: E402
from ernie_ir.backends.paddle.session import run_paddle  # noqa: E402
from ernie_ir.backends.sessions import run_artifact  # noqa: E402
from ernie_ir.training.loop import train_artifact  # noqa: E402

IDS = np.random.default_rng(1).integers(0, 1000, size=(2, 7))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize(("model", "target", "quant"), [
    ("ernie-4.5-0.3b@tiny", "cuda", "wint8"),
    ("ernie-4.5-21b-a3b@tiny", "cuda", "wint8mix"),
    ("ernie-4.5-21b-a3b@tiny", "ascend", "wint8mix"),
    ("ernie-4.5-21b-a3b@tiny", "kunlun", None),
])
def test_inference_model_loads_in_paddle_inference(tmp_path: Path, model: str, target: str,
                                                   quant: str | None) -> None:
    out = tmp_path / "art"
    compile_model(model, target, CompileOptions(quant=quant, out=out, emit="paddle-inference"))
    manifest = verify_artifact(out)
    assert "paddle" in manifest.backends
    assert {"inference/paddle/model.json", "inference/paddle/model.pdiparams"} <= set(manifest.files)
    ref = run_graph(load_artifact(out), {"input_ids": IDS})["logits"]
    got = run_paddle(out, IDS)  # paddle.inference.Config(...).disable_gpu()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4 + 2e-6 * float(np.abs(ref).max()))
    np.testing.assert_array_equal(run_artifact(out, IDS, "paddle"), got)
    # another sequence length through the same saved program (dynamic [B, S])
    ids = IDS[:1, :4]
    ref4 = run_graph(load_artifact(out), {"input_ids": ids})["logits"]
    np.testing.assert_allclose(run_paddle(out, ids), ref4, rtol=1e-5, atol=2e-4)


@pytest.mark.slow
def test_tampered_paddle_model_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "art"
    compile_model("ernie-4.5-0.3b@tiny", "kunlun", CompileOptions(quant="wint8", out=out,
                  emit="paddle-inference"))
    params = out / "inference/paddle/model.pdiparams"
    data = bytearray(params.read_bytes())
    data[-1] ^= 1
    params.chmod(0o644)
    params.write_bytes(bytes(data))
    with pytest.raises(ErnieIRError, match="modified"):
        run_paddle(out, IDS)


def _capture_layers(monkeypatch: pytest.MonkeyPatch) -> list:
    layers: list = []
    real = paddle_layer.build_layer

    def spy(*a, **k):
        layer = real(*a, **k)
        layers.append(layer)
        return layer

    monkeypatch.setattr(paddle_layer, "build_layer", spy)
    return layers


@pytest.mark.slow
@pytest.mark.parametrize(("model", "target", "quant", "lora"), [
    ("ernie-4.5-0.3b@tiny", "cuda", None, 4),
    ("ernie-4.5-21b-a3b@tiny", "ascend", "wint8mix", 4),
    ("ernie-4.5-0.3b@tiny", "kunlun", "qat-int8", None),
    ("ernie-4.5-21b-a3b@tiny", "cuda", "qat-int8", None),
])
def test_training_lowers_loss_and_keeps_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str,
                                             target: str, quant: str | None, lora: int | None) -> None:
    out = tmp_path / "train"
    report = compile_model(model, target, CompileOptions(quant=quant, lora_rank=lora, mode="training",
                           out=out))
    assert report.mode == "training"
    recipe = json.loads((out / "training/train.json").read_text())
    assert recipe["trainable"] and recipe["optimizer"]["name"] == "AdamW"
    assert "paddle.distributed.launch" in recipe["launch"][target]
    assert "train" in (out / "training/launch.sh").read_text()
    rank0 = {p.name: sha(p) for p in (out / "rank0").iterdir()}
    layers = _capture_layers(monkeypatch)
    losses = train_artifact(out, steps=30).losses
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0]
    # base params bit-identical: in the trained Layer and on disk
    graph = load_artifact(out)
    layer = layers[0]
    frozen = [p for p in graph.params.values() if not p.trainable and "qat_state" not in p.annotations]
    assert frozen
    for p in frozen:
        expect = np.asarray(p.read())
        expect = expect.astype(np.float32) if p.type.dtype.is_float else expect.astype(np.int8)
        np.testing.assert_array_equal(layer.tensor(p).numpy(), expect, err_msg=p.name)
    assert {p.name: sha(p) for p in (out / "rank0").iterdir()} == rank0
    # trained params went to a listed checkpoint; the artifact still verifies
    manifest = verify_artifact(out)
    assert "training/checkpoints/run-001-step-30/params.safetensors" in manifest.files
    from safetensors.numpy import load_file

    ckpt = load_file(str(out / "training/checkpoints/run-001-step-30/params.safetensors"))
    assert set(ckpt) == set(recipe["trainable"]) | set(recipe["qat_state"])
    moved = [n for n in recipe["trainable"] if not np.array_equal(
        ckpt[n], np.asarray(graph.params[n].read()).astype(np.float32))]
    assert moved


def test_training_with_jsonl_data(tmp_path: Path) -> None:
    out = tmp_path / "train"
    compile_model("ernie-4.5-0.3b@tiny", "kunlun", CompileOptions(lora_rank=4, mode="training", out=out))
    data = tmp_path / "d.jsonl"
    rng = np.random.default_rng(0)
    lines = [json.dumps({"input_ids": rng.integers(0, 1000, size=n).tolist()}) for n in (12, 9, 16, 5)]
    data.write_text("\n".join(lines) + "\n")
    losses = train_artifact(out, steps=20, data=data, options={"lr": 5e-3}, save=False).losses
    assert losses[-1] < losses[0]
    assert not any("checkpoints" in name for name in verify_artifact(out).files)


def test_training_needs_trainable_params(tmp_path: Path) -> None:
    out = tmp_path / "t"
    with pytest.raises(ErnieIRError, match=r"--lora-rank.*train the float model first"):
        compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(quant="wint8", mode="training", out=out))
    assert not out.exists() and not list(tmp_path.iterdir())


def test_train_bad_inputs(tmp_path: Path) -> None:
    inf = tmp_path / "inf"
    compile_model("ernie-4.5-0.3b@tiny", "kunlun", CompileOptions(out=inf))
    with pytest.raises(ErnieIRError, match="not a training artifact"):
        train_artifact(inf, steps=2)
    tr = tmp_path / "tr"
    compile_model("ernie-4.5-0.3b@tiny", "kunlun", CompileOptions(lora_rank=2, mode="training", out=tr))
    with pytest.raises(ErnieIRError, match="--steps"):
        train_artifact(tr, steps=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2]}\n')
    with pytest.raises(ErnieIRError, match="input_ids"):
        train_artifact(tr, steps=1, data=bad)
    bad.write_text('{"input_ids": [1, 99999999]}\n')
    with pytest.raises(ErnieIRError, match=r"\[0, "):
        train_artifact(tr, steps=1, data=bad)


def test_missing_paddle_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ernie_ir.load import load_input

    graph = load_input("ernie-4.5-0.3b@tiny")
    monkeypatch.setitem(sys.modules, "paddle", None)  # `import paddle` now raises ImportError
    with pytest.raises(paddle_layer.PaddleMissingError, match=r"ernie-ir\[paddle\] or paddlepaddle-gpu"):
        paddle_layer.build_layer(graph)
    # The default Paddle executable is built from rank0/ at load: compile needs no Paddle ...
    report = compile_model("ernie-4.5-0.3b@tiny", "kunlun", CompileOptions(out=tmp_path / "a"))
    assert "paddle" in report.emit and "paddle" in verify_artifact(tmp_path / "a").backends
    with pytest.raises(ErnieIRError, match="paddlepaddle-gpu"):  # ... running it does
        run_paddle(tmp_path / "a", IDS)
    # a traced Paddle Inference program does, before anything is written
    with pytest.raises(ErnieIRError, match=r"--emit paddle-inference needs PaddlePaddle"):
        compile_model("ernie-4.5-0.3b@tiny", "kunlun", CompileOptions(out=tmp_path / "b",
                      emit="paddle-inference"))
    assert not (tmp_path / "b").exists()


def test_a_second_training_run_keeps_the_first_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "twice"
    compile_model("ernie-4.5-0.3b@tiny", "cuda", CompileOptions(lora_rank=2, mode="training", out=out))
    train_artifact(out, steps=2)
    first = (out / "training/checkpoints/run-001-step-2/params.safetensors").read_bytes()
    train_artifact(out, steps=2, options={"lr": 1e-2})
    files = verify_artifact(out).files
    assert {"training/checkpoints/run-001-step-2/params.safetensors",
            "training/checkpoints/run-002-step-2/params.safetensors"} <= set(files)
    assert (out / "training/checkpoints/run-001-step-2/params.safetensors").read_bytes() == first
