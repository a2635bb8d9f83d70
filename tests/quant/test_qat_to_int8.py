"""A trained QAT training artifact compiles to an int8 inference artifact (PaddleSlim's convert step).

`compile --mode training --quant qat-int8`, `ernie-ir train`, then `compile ART --target T`:
the checkpoint's params go onto the artifact's graph (ernie_ir.load.load_trained), the graph
takes its inference form (activation quantizers read their learned scale) and `qat-convert`
turns every fake-quantized weight into int8 + its abs-max scale. Checked against numpy written
here from the definitions (REFERENCE.md 4.3, 11): the ints and scales from the checkpoint's own
values, and the logits against the fake-quantized graph with the trained params.

Why the logits tolerances hold: qat-convert rebuilds fake_quant(W) bit for bit (its
dequantize + correctly rounded division, tests/quant/test_qat_convert.py), so the interpreter
gives the fake-quant graph's logits exactly, and Paddle gives the fake-quant artifact's exactly.
Paddle against the interpreter differs only by float32 summation order (matmul, softmax,
norms): about 1e-6 of the logits' scale; activation fake quantization could turn a 1-ulp
difference at a rounding boundary into one quantization step, which these inputs never hit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _cli_kit import cli, user_error
from safetensors.numpy import load_file

from ernie_ir.artifacts import read_manifest, read_manifest_data, record_files, write_manifest
from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir import DType, ErnieIRError, Graph
from ernie_ir.load import load_input, load_trained
from ernie_ir.passes import run_pipeline
from ernie_ir.runtime.interpreter import Interpreter
from ernie_ir.targets import CompileOptions, compile_model, load_artifact, verify_artifact
from ernie_ir.training.loop import train_artifact

pytest.importorskip("paddle")  # training and the paddle backend

MODELS = {"gpt": "gpt-345m@tiny", "ernie": "ernie-4.5-0.3b@tiny"}
STEPS = 3
IDS = np.random.default_rng(7).integers(0, 1024, size=(2, 12))
# PaddleSlim's QAT config with a scale per output channel (ERNIE); GPT uses the qat-int8 preset
# (abs_max: one scale per weight).
CHANNEL_WISE = ("Quantization:\n  weight_quantize_type: channel_wise_abs_max\n"
                "  activation_quantize_type: moving_average_abs_max\n"
                "  activation_preprocess_type: PACT\n  weight_bits: 8\n  activation_bits: 8\n")


def _train(tmp: Path, name: str, model: str, steps: int = STEPS, **kw: object) -> Path:
    art = tmp / name
    compile_model(model, "cuda", CompileOptions(mode="training", out=art, **kw))  # type: ignore[arg-type]
    train_artifact(art, steps)
    return art


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("qat-trained")
    cfg = tmp / "channel_wise.yaml"
    cfg.write_text(CHANNEL_WISE, encoding="utf-8")
    return {"gpt": _train(tmp, "gpt", MODELS["gpt"], quant="qat-int8"),
            "ernie": _train(tmp, "ernie", MODELS["ernie"], quant_config=cfg)}


def _global_file(art: Path, run: str = "run-*") -> Path:
    """Run `run`'s file of global params, in whichever layout training writes: the run folder's
    params.safetensors (merged.safetensors before it), or an older one-rank run-K-step-N.safetensors."""
    ckpts = art / "training" / "checkpoints"
    files = [*ckpts.glob(f"{run}/params.safetensors"), *ckpts.glob(f"{run}.safetensors")] \
        or list(ckpts.glob(f"{run}/merged.safetensors"))
    assert len(files) == 1, files
    return files[0]


def _as_declared(value: np.ndarray, dtype: DType) -> np.ndarray:
    """A trained float32 value as the param's declared dtype holds it, widened to float32."""
    if dtype == DType.BF16:
        return value.astype(ml_dtypes.bfloat16).astype(np.float32)
    return value.astype(np.float32)


def _half_away(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)  # exact for float32 inputs: no double rounding of the +0.5
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _weight_producer_ops(g: Graph, node_value: object) -> set[str]:
    """The ops between a linear's weight operand and the params (the dequantize chain)."""
    seen, todo = set(), [node_value]
    while todo:
        v = todo.pop()
        p = getattr(v, "producer", None)
        if p is None:
            continue
        seen.add(p.op)
        todo.extend(p.inputs)
    return seen


@pytest.mark.parametrize("target", ["cuda", "ascend", "kunlun"])
@pytest.mark.parametrize("name", ["gpt", "ernie"])
def test_trained_qat_artifact_compiles_to_int8_weights_with_the_learned_scales(
        trained: dict[str, Path], name: str, target: str, tmp_path: Path) -> None:
    art = trained[name]
    out = tmp_path / "int8"
    report = compile_model(str(art), target, CompileOptions(out=out))
    assert report.pipeline.startswith(f"qat-convert,legalize-{target}")
    manifest = verify_artifact(out)
    ckpt_file = _global_file(art)
    src = manifest.source
    assert manifest.mode == "inference" and src["kind"] == "training-artifact"
    assert src["checkpoint"] == ckpt_file.relative_to(art).as_posix() and src["steps"] == STEPS
    assert src["trained_from"]["model"] == MODELS[name]
    ckpt = load_file(str(ckpt_file))
    fq = load_trained(art)  # the fake-quant graph: training graph, inference form, trained params
    g = load_artifact(out)

    # (a) every fake-quantized weight is int8 + scale; no fake_quant on weights is left
    weights = {n.inputs[0].name: n.inputs[0].type.dtype for n in fq if n.op == "fake_quant"}
    assert len(weights) == 8 and all(w in ckpt for w in weights)  # 4 linears x 2 layers, all trained
    assert not any(n.op == "fake_quant" for n in g)
    per_channel = name == "ernie"
    for wname, dtype in weights.items():
        module = wname.removesuffix(".weight")
        assert wname not in g.params
        w = _as_declared(ckpt[wname], dtype)  # [in, out]
        s = np.abs(w).max(axis=0, keepdims=True) if per_channel else \
            np.full((1, w.shape[1]), np.abs(w).max(), np.float32)
        assert np.all(s > 0)
        q_param, s_param = g.params[f"{module}.quant_weight"], g.params[f"{module}.weight_scale"]
        assert q_param.type.dtype == DType.I8 and s_param.type.dtype == DType.F32
        np.testing.assert_array_equal(s_param.read(), s[0], err_msg=wname)
        k = np.float32(127) * (np.float32(1) / s)  # Paddle: bin_cnt * inverse(s), then * clip(x)
        want = _half_away(k * np.clip(w, -s, s))
        np.testing.assert_array_equal(q_param.read().astype(np.float64), want, err_msg=wname)
    linears = [n for n in g if n.op == "linear"]
    assert len(linears) == 8
    for n in linears:
        assert "dequantize" in _weight_producer_ops(g, n.inputs[1])  # int8 weights dequantized
    # activations keep their fake quantization, now reading the learned scale as a constant
    acts = [n for n in g if n.op == "fake_quant_moving_average"]
    assert len(acts) == 8 and all(n.attrs.is_test for n in acts)
    for n in acts:
        scale = n.inputs[1]
        np.testing.assert_array_equal(scale.read(), ckpt[scale.name])
        assert scale.read()[0] != np.float32(0.001)  # trained away from Paddle's initial state
    assert not any(p.trainable for p in g.params.values())

    # (b) the same logits as the fake-quant graph, on every backend the artifact offers
    ref = Interpreter(fq).run({"input_ids": IDS})["logits"]
    assert {"interpreter", "paddle"} <= set(manifest.backends)  # (and onnxruntime, small: by default)
    np.testing.assert_array_equal(run_artifact(out, IDS, "interpreter"), ref)
    got = run_artifact(out, IDS, "paddle")
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4 + 2e-6 * float(np.abs(ref).max()))


@pytest.mark.parametrize("name", ["gpt", "ernie"])
def test_paddle_runs_the_int8_artifact_exactly_as_the_fake_quant_one(trained: dict[str, Path], name: str,
                                                                    tmp_path: Path) -> None:
    art = trained[name]
    compile_model(str(art), "cuda", CompileOptions(out=tmp_path / "int8", emit="paddle"))
    # --disable-pass qat-convert: the trained model, fake-quantized (the opt-out)
    report = compile_model(str(art), "cuda", CompileOptions(out=tmp_path / "fq", emit="paddle",
                           disabled_passes=["qat-convert"]))
    assert report.pipeline == "legalize-cuda"
    assert any(n.op == "fake_quant" for n in load_artifact(tmp_path / "fq"))
    np.testing.assert_array_equal(run_artifact(tmp_path / "int8", IDS, "paddle"),
                                  run_artifact(tmp_path / "fq", IDS, "paddle"))


@pytest.mark.slow
def test_the_cli_compiles_the_newest_or_the_named_checkpoint(tmp_path: Path, capsys) -> None:
    art = tmp_path / "art"
    code, _, err = cli(capsys, "compile", MODELS["gpt"], "--target", "cuda", "--mode", "training",
                       "--quant", "qat-int8", "--out", str(art))
    assert code == 0, err
    train_artifact(art, 1)
    train_artifact(art, 1, options={"lr": 5e-3})  # run 2 starts from rank0/ again, at another learning rate
    names = sorted(p.name.removesuffix(".safetensors") for p in (art / "training" / "checkpoints").iterdir())
    assert names == ["run-001-step-1", "run-002-step-1"]
    outs = {}
    for key, extra in {"latest": [], "named": ["--checkpoint", "run-001-step-1"],
                       "path": ["--checkpoint", str(art / "training" / "checkpoints" / names[1])]}.items():
        outs[key] = tmp_path / key
        code, out, err = cli(capsys, "compile", str(art), "--target", "cuda", "--out", str(outs[key]), *extra)
        assert code == 0, err
        assert "pipeline: qat-convert,legalize-cuda" in out
    ckpts = {k: read_manifest(v).source["checkpoint"] for k, v in outs.items()}
    assert ckpts["latest"] == ckpts["path"] and "run-002-step-1" in ckpts["latest"]
    assert "run-001-step-1" in ckpts["named"]
    # each compiled the params of its own run
    for key, run in (("latest", names[1]), ("named", names[0])):
        ckpt = load_file(str(_global_file(art, run)))
        g = load_artifact(outs[key])
        scales = [n for n in g.params if n.endswith("activation_quant.scale")]
        assert scales and all(np.array_equal(g.params[n].read(), ckpt[n]) for n in scales)
    assert not np.array_equal(run_artifact(outs["latest"], IDS, "interpreter"),
                              run_artifact(outs["named"], IDS, "interpreter"))


def test_bad_checkpoints_are_refused_in_one_line_and_nothing_is_written(trained: dict[str, Path],
                                                                      tmp_path: Path, capsys) -> None:
    art = trained["gpt"]
    out = tmp_path / "out"

    def refused(*argv: str) -> str:
        line = user_error(capsys, "compile", *argv, "--target", "cuda", "--out", str(out))
        assert not out.exists()
        return line

    assert "no such checkpoint" in refused(str(art), "--checkpoint", "run-009-step-1")
    assert "run-001-step-3" in refused(str(art), "--checkpoint", "run-009-step-1")  # lists the real ones
    other = _global_file(trained["ernie"])
    assert "is not a checkpoint of" in refused(str(art), "--checkpoint", str(other))
    fresh = tmp_path / "fresh"
    compile_model(MODELS["gpt"], "cuda", CompileOptions(mode="training", quant="qat-int8", out=fresh))
    line = refused(str(fresh))
    assert "has no training checkpoint" in line and "ernie-ir train" in line
    assert "drop --checkpoint" in refused(MODELS["gpt"], "--checkpoint", "latest")
    assert "drop --quant" in refused(str(art), "--quant", "wint8")
    assert "--mode inference" in refused(str(art), "--mode", "training")


def test_a_checkpoint_of_another_artifact_listed_in_the_manifest_does_not_fit(trained: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    art = tmp_path / "gpt"
    shutil.copytree(trained["gpt"], art)
    foreign = art / "training" / "checkpoints" / "run-002-step-3.safetensors"
    shutil.copyfile(_global_file(trained["ernie"]), foreign)
    record_files(art, [foreign])  # listed with its sha256: only the names can tell
    with pytest.raises(ErnieIRError, match=r"does not fit the artifact's graph .* not this artifact's"):
        load_trained(art)
    assert load_trained(art, "run-001-step-3").metadata["trained"]["steps"] == STEPS


LAYOUTS = ["run-{k:03d}-step-3/params.safetensors",  # a run folder (+ optimizer, trainer_state.json)
           "run-{k:03d}-step-3.safetensors",  # one rank, before run folders
           "run-{k:03d}-step-3/merged.safetensors"]  # several ranks, before run folders


def test_every_checkpoint_layout_is_read_and_the_newest_run_wins(trained: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    art = tmp_path / "gpt"
    shutil.copytree(trained["gpt"], art)
    ckpts = art / "training" / "checkpoints"
    for k, layout in enumerate(LAYOUTS, 2):
        f = ckpts / layout.format(k=k)
        f.parent.mkdir(exist_ok=True)
        shutil.copyfile(_global_file(trained["gpt"]), f)
        record_files(art, [f])
        rel = f.relative_to(art).as_posix()
        assert load_trained(art).metadata["trained"]["checkpoint"] == rel  # newest run
        for name in (f"run-{k:03d}-step-3", str(f), str(f.parent if "/" in layout else f)):
            assert load_trained(art, name).metadata["trained"]["checkpoint"] == rel
    # an unlisted checkpoint is tampering: the hashes are checked first
    manifest = read_manifest_data(art)
    del manifest["files"][f"training/checkpoints/{LAYOUTS[-1].format(k=len(LAYOUTS) + 1)}"]
    write_manifest(art, manifest)
    with pytest.raises(ErnieIRError, match="not listed"):
        load_trained(art)


@pytest.mark.gloo
@pytest.mark.slow
def test_a_tensor_parallel_lora_artifact_is_put_back_together(tmp_path: Path) -> None:
    """LoRA trained at tp 2: the global graph the artifact keeps, the frozen params joined from
    the rank slices, the adapters from the checkpoint (global names); served at tp 1."""
    art = _train(tmp_path, "lora-tp2", MODELS["gpt"], steps=2, lora_rank=4, tp=2)
    out = tmp_path / "served"
    report = compile_model(str(art), "cuda", CompileOptions(out=out, emit="paddle,onnx"))
    assert report.pipeline == "legalize-cuda" and not report.parallel
    ckpt = load_file(str(_global_file(art)))
    ref_graph = load_input(MODELS["gpt"])
    run_pipeline(ref_graph, "lora{rank=4}")
    for k, v in ckpt.items():
        assert ref_graph.params[k].trainable and np.any(v != ref_graph.params[k].read())
        ref_graph.params[k].set_data(v)
    g = load_artifact(out)
    for k, v in ckpt.items():
        np.testing.assert_array_equal(g.params[k].read(), v)
    ref = Interpreter(ref_graph).run({"input_ids": IDS})["logits"]
    np.testing.assert_array_equal(run_artifact(out, IDS, "interpreter"), ref)
    for backend in ("paddle", "onnxruntime"):
        got = run_artifact(out, IDS, backend)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4 + 2e-6 * float(np.abs(ref).max()),
                                   err_msg=backend)
