"""After full-parameter training: `ernie-ir export ART` writes what a full-parameter training artifact
learned as a published checkpoint (the -Paddle layout, or with `--layout pt` the -PT layout
transformers loads), and `compile ART --quant wint8` serves it quantized.

Checked on the built-in dense ERNIE 4.5 (`ernie-4.5-0.3b@tiny`: bf16, MQA 8:1, tied) and MoE
(`ernie-4.5-21b-a3b@tiny`: bf16, GQA 10:2, 16 experts top-6, 2 shared, float32 router and
score-correction bias), each compiled with `--mode training` (no LoRA: every float param trains,
the correction bias stays fixed) and trained 2 steps at lr 1e-2 (checkpoints after each step):

- the exported tensors are the trained params rounded once to bf16 (`bf16(f32 checkpoint)`), the
  untrained ones the source's bytes, in both layouts (read back by our frontend bit for bit);
  `--checkpoint` picks an older run; the -PT file holds transformers' names and shapes;
- the -PT writer is the inverse of the frontend's HF-layout reader: an MHA (per-head qkv), biased,
  untied float32 folder written here in that layout comes back byte for byte;
- (reference) paddleformers' and transformers' `AutoModelForCausalLM.from_pretrained` load the
  exported folders with every tensor equal to the file's, and their float32 logits equal ernie-ir's
  run of the trained artifact (`load_trained`, the interpreter) within LOGITS_TOL;
- `compile ART --target cuda --quant wint8` (and `--tp 2`) of the trained artifact runs and tracks
  the float trained model within QUANT_TOL;
- bad input, one line, exit 2, nothing written.

Tolerance. Both sides hold the same bf16 weights (the export's bytes are `load_trained`'s, checked
bit for bit), and both reference runs widen them exactly to float32 and compute in float32, so
what is left is float32 summation order: LOGITS_TOL = 1e-5 of max |logit| (measured: 3.0e-7 dense
transformers, 3.8e-7 dense paddleformers, 4.6e-7 MoE transformers). The bf16 rounding of the
trained values happens once, in the export and in `load_trained` alike, so it is not a tolerance;
an export that skipped it (float32 weights) or rounded the untrained router would differ by far
more (one bf16 ulp of a weight is 2^-8 relative), and training itself moves the logits by 0.40 of
max |logit| (asserted > 0.1, so the comparison is not with the base model's logits). paddleformers
1.2's MoE cannot run on a CPU (`expand_modality_expert_id` has no CPU kernel): its MoE check is
the load with every tensor equal to the file's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _fe_testkit import run_reference

from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir.weights import SafetensorsFile, write_safetensors
from ernie_ir.load import load_input, load_trained
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.targets.compile import CompileOptions, compile_model
from ernie_ir.targets.export import export_checkpoint

DENSE, MOE = "ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny"
IDS = np.array([[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 400, 500, 600, 700]], np.int64)
LOGITS_TOL = 1e-5  # of max |logit|; measured <= 4.6e-7 (see the module docstring)
QUANT_TOL = 0.05  # wint8 vs the float trained model, of max |logit|; measured 0.009 .. 0.013
BIAS = "e_score_correction_bias"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model -> its full-parameter training artifact, trained 2 steps (a checkpoint after each)."""
    pytest.importorskip("paddle")
    from ernie_ir.training.loop import train_artifact

    root = tmp_path_factory.mktemp("full_param_export")
    out = {}
    for model in (DENSE, MOE):
        art = root / model.split("@")[0]
        compile_model(model, "cuda", CompileOptions(mode="training", out=art))
        train_artifact(art, 2, options={"lr": 1e-2, "save_steps": 1})
        out[model] = art
    return out


@pytest.fixture(scope="module")
def exported(trained: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(model, layout) -> the export of its trained artifact's newest checkpoint."""
    root = tmp_path_factory.mktemp("exported")
    out = {}
    for model, art in trained.items():
        for layout in ("paddle", "pt"):
            dest = root / f"{art.name}-{layout}"
            report = export_checkpoint(str(art), dest, layout=layout)
            assert report.checkpoint == "training/checkpoints/run-001-step-2/params.safetensors"
            out[model, layout] = dest
    return out


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("model", [DENSE, MOE])
def test_export_holds_the_trained_params_rounded_once(model: str, trained: dict[str, Path],
                                                      exported: dict[tuple[str, str], Path]) -> None:
    art = trained[model]
    base = load_input(model)
    ckpt = SafetensorsFile(art / "training/checkpoints/run-001-step-2/params.safetensors")
    trainable = set(json.loads((art / "training" / "train.json").read_text())["trainable"])
    assert trainable == {n for n in base.params if not n.endswith(BIAS)}
    ours = load_trained(art)
    for layout in ("paddle", "pt"):
        back = load_input(str(exported[model, layout]))
        assert set(back.params) == set(base.params)
        for name, p in back.params.items():
            got = p.read()
            assert p.type == base.params[name].type, (layout, name)
            assert _bits(got) == _bits(ours.params[name].read()), (layout, name)
            if name in trainable:
                want = np.asarray(ckpt.read(name), np.float32).astype(got.dtype)  # one rounding
                assert _bits(got) == _bits(want), (layout, name)
                assert _bits(got) != _bits(base.params[name].read()), (layout, name)  # it trained
            else:
                assert _bits(got) == _bits(base.params[name].read()), (layout, name)
        record = json.loads((exported[model, layout] / "ernie_ir_export.json").read_text())
        assert record["layout"] == layout and record["source"]["kind"] == "training-artifact"
        assert record["source"]["steps"] == 2


@pytest.mark.slow
def test_pt_layout_is_transformers_names_and_shapes(exported: dict[tuple[str, str], Path]) -> None:
    st = SafetensorsFile(exported[MOE, "pt"] / "model.safetensors")
    keys = set(st)
    assert not any(k.startswith("ernie.") or "qkv_proj" in k or "up_gate_proj" in k for k in keys)
    shapes = {k: (str(st.source(k).dtype), list(st.source(k).shape)) for k in keys}
    layer = "model.layers.1."
    assert shapes[layer + "self_attn.q_proj.weight"] == ("bf16", [80, 80])  # [nh hd, H]
    assert shapes[layer + "self_attn.k_proj.weight"] == ("bf16", [16, 80])  # [nkv hd, H]
    assert shapes[layer + "self_attn.o_proj.weight"] == ("bf16", [80, 80])
    assert shapes[layer + "mlp.gate.weight"] == ("f32", [16, 80])  # router [E, H], float32
    assert shapes[layer + "mlp.moe_statics.e_score_correction_bias"] == ("f32", [1, 16])
    assert shapes[layer + "mlp.experts.15.gate_proj.weight"] == ("bf16", [32, 80])
    assert shapes[layer + "mlp.experts.15.down_proj.weight"] == ("bf16", [80, 32])
    assert shapes[layer + "mlp.shared_experts.up_proj.weight"] == ("bf16", [64, 80])
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == ("bf16", [192, 80])
    assert "lm_head.weight" not in keys  # tied
    config = json.loads((exported[MOE, "pt"] / "config.json").read_text())
    assert config["architectures"] == ["Ernie4_5_MoeForCausalLM"] and config["num_nextn_predict_layers"] == 0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    dense = json.loads((exported[DENSE, "pt"] / "config.json").read_text())
    assert dense["architectures"] == ["Ernie4_5ForCausalLM"]


@pytest.mark.slow
def test_checkpoint_picks_an_older_run(trained: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    art, out = trained[DENSE], tmp_path / "step1"
    code, stdout, err = cli(capsys, "export", str(art), "--checkpoint", "run-001-step-1", "--layout", "pt",
                            "--out", str(out))
    assert code == 0, err
    assert "trained weights: training/checkpoints/run-001-step-1/params.safetensors" in stdout
    step1 = load_trained(art, "run-001-step-1")
    back = load_input(str(out))
    assert all(_bits(p.read()) == _bits(step1.params[n].read()) for n, p in back.params.items())
    name = "ernie.layers.0.self_attn.qkv_proj.weight"
    assert _bits(back.params[name].read()) != _bits(load_trained(art).params[name].read())


def test_pt_writer_inverts_the_hf_reader_mha_biased_untied(tmp_path: Path) -> None:
    """An HF-layout folder (MHA: the graph holds qkv per head; biases; untied lm_head; float32)
    read by the frontend and exported with --layout pt gives back its own tensors byte for byte."""
    h, inter, vocab, heads, hd = 32, 48, 64, 4, 8
    q = heads * hd
    config = {"architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "vocab_size": vocab,
              "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 2,
              "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hd,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "use_bias": True, "hidden_act": "silu",
              "max_position_embeddings": 128, "torch_dtype": "float32"}
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
              "lm_head.weight": (vocab, h)}
    for i in range(2):
        for leaf, shape in {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                            "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (q, h),
                            "self_attn.v_proj.weight": (q, h), "self_attn.o_proj.weight": (h, q),
                            "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (q,),
                            "self_attn.v_proj.bias": (q,), "self_attn.o_proj.bias": (h,),
                            "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                            "mlp.down_proj.weight": (h, inter), "mlp.gate_proj.bias": (inter,),
                            "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)}.items():
            shapes[f"model.layers.{i}.{leaf}"] = shape
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    write_safetensors(src / "model.safetensors", list(tensors.items()))
    graph = load_input(str(src))
    qkv = graph.params["ernie.layers.0.self_attn.qkv_proj.weight"].read()
    np.testing.assert_array_equal(qkv[:, hd:2 * hd], tensors["model.layers.0.self_attn.k_proj.weight"][:hd].T)
    export_checkpoint(str(src), tmp_path / "pt", layout="pt")
    back = SafetensorsFile(tmp_path / "pt" / "model.safetensors")
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert _bits(np.asarray(back.read(k))) == _bits(v), k


# -- the reference libraries load the exports ---------------------------------------------------


def _ours(art: Path) -> np.ndarray:
    return np.asarray(run_graph(load_trained(art), {"input_ids": IDS})["logits"], np.float32)


def _check_logits(label: str, theirs: np.ndarray, ours: np.ndarray, base: np.ndarray) -> None:
    scale = float(np.abs(ours).max())
    err = float(np.abs(theirs - ours).max()) / scale
    moved = float(np.abs(base - ours).max()) / scale
    print(f"\n[export cross-check] {label}: max |theirs - ours| / max|ours| = {err:.2e} (training moved the "
          f"logits by {moved:.2f})")
    assert moved > 0.1  # the trained model, not the base one
    assert err < LOGITS_TOL, (label, err)
    assert np.array_equal(theirs.argmax(-1), ours.argmax(-1)), label


@pytest.mark.reference
@pytest.mark.slow
def test_paddleformers_and_transformers_load_the_dense_export(
        trained: dict[str, Path], exported: dict[tuple[str, str], Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    ours = _ours(trained[DENSE])
    base = np.asarray(run_graph(load_input(DENSE), {"input_ids": IDS})["logits"], np.float32)
    spec = {"input_ids": IDS.tolist()}
    runs = {"paddleformers, -Paddle layout": ("pf", "pf_load_export.py", exported[DENSE, "paddle"]),
            "paddleformers, -PT layout": ("pf", "pf_load_export.py", exported[DENSE, "pt"]),
            "transformers, -PT layout": ("hf", "hf_load_export.py", exported[DENSE, "pt"])}
    for i, (label, (env, script, folder)) in enumerate(runs.items()):
        out = run_reference(env, script, {**spec, "load_from": str(folder)}, tmp_path / f"r{i}")
        meta = json.loads((out / "meta.json").read_text())
        assert meta["state_equal_file"] is True
        if env == "hf":
            assert meta["class"] == "Ernie4_5ForCausalLM" and meta["loaded_dtype"] == "torch.bfloat16"
        with capsys.disabled():
            _check_logits(f"dense, {label}", np.load(out / "logits.npy"), ours, base)


@pytest.mark.reference
@pytest.mark.slow
def test_transformers_runs_and_paddleformers_loads_the_moe_export(
        trained: dict[str, Path], exported: dict[tuple[str, str], Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = exported[MOE, "pt"]
    hf = run_reference("hf", "hf_load_export.py", {"load_from": str(folder), "input_ids": IDS.tolist()},
                       tmp_path / "hf")
    meta = json.loads((hf / "meta.json").read_text())
    assert meta["class"] == "Ernie4_5_MoeForCausalLM" and meta["state_equal_file"] is True
    base = np.asarray(run_graph(load_input(MOE), {"input_ids": IDS})["logits"], np.float32)
    with capsys.disabled():
        _check_logits("MoE, transformers, -PT layout", np.load(hf / "logits.npy"), _ours(trained[MOE]), base)
    # paddleformers' MoE has no CPU forward: the load, every tensor equal to the file's
    pf = run_reference("pf", "pf_load_export.py", {"load_from": str(folder), "forward": False},
                       tmp_path / "pf")
    meta = json.loads((pf / "meta.json").read_text())
    assert meta["class"] == "Ernie4_5_MoeForCausalLM" and meta["state_equal_file"] is True
    assert meta["layout"] == "pt" and not (pf / "logits.npy").exists()


# -- serving the trained artifact quantized -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", [(DENSE, 2), (MOE, 1)])
def test_wint8_compile_of_the_trained_artifact_tracks_it(model: str, tp: int, trained: dict[str, Path],
                                                          tmp_path: Path) -> None:
    art, out = trained[model], tmp_path / "wint8"
    report = compile_model(str(art), "cuda", CompileOptions.from_flags(quant="wint8", tp=tp, out=out))
    assert "weight-only-quant" in report.passes_run and (tp == 1 or f"split{{tp={tp}}}" in report.passes_run)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "training-artifact" and manifest["parallel"]["world_size"] == tp
    ours = _ours(art)
    quant = np.asarray(run_artifact(out, IDS, "interpreter"), np.float32)
    base = np.asarray(run_graph(load_input(model), {"input_ids": IDS})["logits"], np.float32)
    scale = float(np.abs(ours).max())
    err, moved = float(np.abs(quant - ours).max()) / scale, float(np.abs(base - ours).max()) / scale
    print(f"\n[wint8 of the trained {model}, tp {tp}] max err {err:.3g} of max|logit| "
          f"(training moved {moved:.2f})")
    assert err < QUANT_TOL < moved


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_export_input_is_one_line(trained: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    untrained = tmp_path / "untrained"
    compile_model(DENSE, "cuda", CompileOptions(mode="training", out=untrained))
    out = tmp_path / "out"
    cases = [
        ([str(untrained)], f"{untrained} has no training checkpoint under training/checkpoints/ (it was "
                           "never trained): run `ernie-ir train"),
        ([str(trained[DENSE]), "--layout", "onnx"], "--layout 'onnx': unknown; choose paddle"),
        (["gpt-345m@tiny", "--layout", "pt"], "--layout pt: gpt-345m@tiny is GPTForCausalLM, and the -PT "
                                              "(transformers) layout is written for ERNIE 4.5 only"),
        ([str(trained[DENSE]), "--checkpoint", "run-009-step-1"], "--checkpoint run-009-step-1: no such "
                                                                  "checkpoint"),
        ([DENSE, "--checkpoint", "latest"], "--checkpoint picks a checkpoint of a training artifact"),
        ([str(trained[DENSE]), "--lora-adapter", str(tmp_path)], "is a full-parameter training artifact"),
    ]
    for argv, says in cases:
        line = user_error(capsys, "export", *argv, "--out", str(out))
        assert says in line, (argv, line)
        assert not out.exists()


@pytest.mark.slow
def test_lora_training_artifact_still_points_to_lora_adapter(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    art = tmp_path / "lora"
    compile_model(DENSE, "cuda", CompileOptions.from_flags(mode="training", lora_rank=2, out=art))
    line = user_error(capsys, "export", str(art), "--out", str(tmp_path / "out"))
    assert f"{art} is a LoRA training artifact: export its source model {DENSE} with --lora-adapter" in line
    assert not (tmp_path / "out").exists()

