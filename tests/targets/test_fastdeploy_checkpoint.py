"""A cuda inference artifact of ERNIE 4.5 is a FastDeploy pre-quantized, pre-sharded checkpoint.

FastDeploy does not run on this CPU. Conformance is shown two ways:

(a) `fastdeploy_reads(folder)` re-implements, from REFERENCE.md section 8 (and the cuts of
    section 5) only, what FastDeploy's loader reads: config.json's `quantization_config`, tp from
    the number of rank folders, each rank{r}/model.safetensors (opened with bare safetensors),
    FastDeploy's key set, dtypes and per-rank shapes, per-expert keys; and the quantized values
    equal an independent per-channel quantization of the rank's slice of the source weights;
(b) the library reader `load_fastdeploy_checkpoint` dequantizes the files back, `merge_ranks`
    joins the ranks, and the rebuilt float model reproduces the artifact's logits.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from ernie_ir.backends.sessions import run_artifact
from ernie_ir.formats.fastdeploy import FastDeployError, load_fastdeploy_checkpoint, write_float_checkpoint
from ernie_ir.frontends import load_model
from ernie_ir.ops.cuda_layout import unpack
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.targets import CompileOptions, compile_model, verify_artifact

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_testkit import is_moe_layer, tiny_config, write_paddle_checkpoint

IDS = np.array([[1, 5, 900, 77, 3, 1000, 12], [2, 8, 13, 400, 21, 34, 55]])
DENSE, MOE = "ernie-4.5-0.3b@tiny", "ernie-4.5-300b-a47b@tiny"
QMAX = {"wint8": 127, "wint4": 7}

# Sizes every linear packs at sm80 (in_features multiples of 64) for tp 1 and 2.
SM80 = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 1024}
SM80_MOE = {**SM80, "moe_intermediate_size": 128, "moe_num_shared_experts": 2, "moe_num_experts": 8,
            "moe_k": 2}
TOKENIZER = {"tokenizer.model": b"\x00sentencepiece-bytes\x01",
             "tokenizer_config.json": b'{"model_max_length": 128}',
             "special_tokens_map.json": b'{"bos_token": "<s>"}'}


def source_folder(tmp: Path, name: str, overrides: dict[str, Any]) -> tuple[Path, dict[str, np.ndarray]]:
    """A published-layout checkpoint folder (config.json, model.safetensors, tokenizer files)."""
    cfg = {**tiny_config(name), **overrides}
    folder = tmp / "src"
    tensors = write_paddle_checkpoint(folder, cfg)
    for fname, data in TOKENIZER.items():
        (folder / fname).write_bytes(data)
    return folder, tensors


# -- (a) what FastDeploy reads, from REFERENCE.md section 8 -------------------------------------


def _ranks(folder: Path) -> list[Path]:
    dirs = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("rank")]
    return sorted(dirs, key=lambda p: int(p.name[4:]))


def expected_keys(cfg: dict[str, Any], tp: int) -> dict[str, tuple[str, list[int], str | None]]:
    """key -> (dtype, shape, quant type or None) of one rank, from the config and tp alone."""
    q = cfg["quantization_config"]
    dense, moe = ((q["dense_quant_type"], q["moe_quant_type"]) if q["quantization"] == "mix_quant"
                  else (q["quantization"], q["quantization"]))
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // nh
    keys: dict[str, tuple[str, list[int], str | None]] = {}

    def linear(prefix: str, n_in: int, n_out: int, kind: str) -> None:
        rows = n_out if kind == "wint8" else n_out // 2  # [out, in] int8; int4: two values per byte
        keys[prefix + ".quant_weight"] = ("I8", [rows, n_in], kind)
        keys[prefix + ".weight_scale"] = ("BF16", [n_out], None)

    keys["ernie.embed_tokens.weight"] = ("BF16", [vocab // tp, hidden], None)
    keys["ernie.norm.weight"] = ("BF16", [hidden], None)
    if not cfg.get("tie_word_embeddings", True):
        keys["lm_head.weight"] = ("BF16", [hidden, vocab // tp], None)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"ernie.layers.{i}."
        keys[pre + "input_layernorm.weight"] = ("BF16", [hidden], None)
        keys[pre + "post_attention_layernorm.weight"] = ("BF16", [hidden], None)
        kv_local = nkv // tp if nkv >= tp else 1  # KV heads replicated when fewer than tp
        linear(pre + "self_attn.qkv_proj", hidden, (nh // tp + 2 * kv_local) * hd, dense)
        linear(pre + "self_attn.o_proj", nh * hd // tp, hidden, dense)
        if not is_moe_layer(cfg, i):
            linear(pre + "mlp.up_gate_proj", hidden, 2 * cfg["intermediate_size"] // tp, dense)
            linear(pre + "mlp.down_proj", cfg["intermediate_size"] // tp, hidden, dense)
            continue
        experts, inter = cfg["moe_num_experts"], cfg["moe_intermediate_size"]
        keys[pre + "mlp.gate.weight"] = ("F32", [hidden, experts], None)
        if cfg.get("moe_use_aux_free", True):
            keys[pre + "mlp.moe_statics.e_score_correction_bias"] = ("F32", [1, experts], None)
        for e in range(experts):
            linear(f"{pre}mlp.experts.{e}.up_gate_proj", hidden, 2 * inter // tp, moe)
            linear(f"{pre}mlp.experts.{e}.down_proj", inter // tp, hidden, moe)
        shared = cfg.get("moe_num_shared_experts", 0)
        if shared:
            linear(pre + "mlp.shared_experts.up_gate_proj", hidden, 2 * inter * shared // tp, dense)
            linear(pre + "mlp.shared_experts.down_proj", inter * shared // tp, hidden, dense)
    return keys


def fastdeploy_reads(folder: Path, source: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Check `folder` as FastDeploy's pre-sharded, pre-quantized loader reads it; (config, tp)."""
    cfg = json.loads((folder / "config.json").read_text())
    # FastDeploy's ModelConfig.read_model_config: `dtype` (a Paddle checkpoint), never `torch_dtype`,
    # no transformers_version above 4.56.0; every other key of the source config unchanged
    assert "dtype" in cfg and "torch_dtype" not in cfg
    assert cfg["dtype"] == source.get("dtype", source.get("torch_dtype", "bfloat16"))
    for key, value in source.items():
        if key == "torch_dtype" or (key == "transformers_version" and int(str(value).split(".")[0]) >= 5):
            continue
        assert cfg[key] == value, key
    q = cfg["quantization_config"]
    assert q["is_quantized"] is True
    assert q["quantization"] in ("wint8", "wint4", "mix_quant")
    if q["quantization"] == "mix_quant":
        assert q["dense_quant_type"] in QMAX and q["moe_quant_type"] in QMAX
    ranks = _ranks(folder)
    tp = len(ranks)  # more than one rank folder: pre-sharded, served with --tensor-parallel-size tp
    assert [p.name for p in ranks] == [f"rank{r}" for r in range(tp)]
    want = expected_keys(cfg, tp)
    for rdir in ranks:
        assert not (rdir / "model.safetensors.index.json").exists()  # one file per rank
        with safe_open(str(rdir / "model.safetensors"), framework="np") as f:
            assert set(f.keys()) == set(want), sorted(set(f.keys()) ^ set(want))[:5]
            for key, (dtype, shape, _) in want.items():
                sl = f.get_slice(key)
                assert (sl.get_dtype(), list(sl.get_shape())) == (dtype, shape), key
    return cfg, tp


def rank_slice(name: str, w: np.ndarray, cfg: dict[str, Any], tp: int, r: int) -> np.ndarray:
    """Rank r's part of a global [in, out] weight, by REFERENCE.md section 5's cuts."""
    if tp == 1:
        return w
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    if name.endswith("qkv_proj"):
        q, k, v = np.split(w, [nh * hd, (nh + nkv) * hd], axis=1)
        kv_block = r if nkv >= tp else r // (tp // nkv)
        kv_parts = min(nkv, tp)
        return np.concatenate([np.split(q, tp, axis=1)[r], np.split(k, kv_parts, axis=1)[kv_block],
                               np.split(v, kv_parts, axis=1)[kv_block]], axis=1)
    if name.endswith("up_gate_proj"):
        blocks = np.split(w, 2 * tp, axis=1)
        return np.concatenate([blocks[r], blocks[r + tp]], axis=1)
    return np.split(w, tp, axis=0)[r]  # o_proj, down_proj: rows


def check_values(folder: Path, cfg: dict[str, Any], tp: int, source: dict[str, np.ndarray],
                 arch: int) -> None:
    """quant_weight = the rank's cut of an independent per-channel quantization (absmax / qmax,
    rounding half away from zero, REFERENCE.md 4.1) of the source weight."""
    want = expected_keys(cfg, tp)
    for r in range(tp):
        with safe_open(str(folder / f"rank{r}" / "model.safetensors"), framework="np") as f:
            for key, (_, _, kind) in want.items():
                if kind is None or (".layers.0." not in key and ".experts.1." not in key):
                    continue  # layer 0 and one expert per MoE layer: enough, and quick
                prefix = key[: -len(".quant_weight")]
                w = source[prefix + ".weight"].astype(np.float32)
                # scales in the weight's dtype (bf16), the division by them; quantized whole, then cut:
                # a column's scale depends on its column only, and a row-parallel layer keeps the
                # scales of its whole input axis (the rank shards sum to the unsplit quantized layer)
                scale = (np.abs(w).max(axis=0) / QMAX[kind]).astype(ml_dtypes.bfloat16).astype(np.float32)
                q = np.clip(np.sign(w) * np.floor(np.abs(w) / scale + 0.5), -QMAX[kind], QMAX[kind])
                q = rank_slice(prefix, q, cfg, tp, r)
                if not prefix.endswith(("o_proj", "down_proj")):
                    scale = rank_slice(prefix, scale[None, :], cfg, tp, r)[0]
                got = unpack(f.get_tensor(key), q.shape[0], q.shape[1], 8 if kind == "wint8" else 4, arch)
                np.testing.assert_array_equal(got, q.astype(np.int8), err_msg=key)
                raw = f.get_slice(prefix + ".weight_scale")
                stored = np.frombuffer(raw[:].tobytes(), np.uint16).view(ml_dtypes.bfloat16)
                np.testing.assert_array_equal(stored.astype(np.float32), scale, err_msg=key)


# -- (b) read back, dequantize, reproduce the logits ------------------------------------------


def reproduces_logits(art: Path, tmp: Path) -> float:
    ckpt = load_fastdeploy_checkpoint(art, expert_dtype="bf16")
    rebuilt = load_model(str(write_float_checkpoint(ckpt, tmp / "float")))
    out = run_graph(rebuilt, {"input_ids": IDS})["logits"]
    ref = run_artifact(art, IDS, "interpreter")
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def check(art: Path, tmp: Path, source_cfg: dict[str, Any], tensors: dict[str, np.ndarray] | None,
          arch: int, tp: int) -> dict[str, Any]:
    verify_artifact(art)
    cfg, found_tp = fastdeploy_reads(art, source_cfg)
    assert found_tp == tp
    assert cfg["ernie_ir"]["cuda_arch"] == arch
    for r in range(tp):  # the rank weights are stored once: model.safetensors is a link to them
        link = art / f"rank{r}" / "model.safetensors"
        assert link.is_symlink() and os.readlink(link) == "weights.safetensors"
    if tensors is not None:
        check_values(art, cfg, tp, tensors, arch)
    assert reproduces_logits(art, tmp) < 1e-5
    return cfg


@pytest.mark.parametrize(("name", "quant", "tp", "kind"), [
    (DENSE, "wint8", 1, "wint8"), (DENSE, "wint4", 2, "wint4"), (DENSE, "wint8mix", 2, "wint8"),
])
def test_tiny_models_at_sm70(tmp_path: Path, name: str, quant: str, tp: int, kind: str) -> None:
    art = tmp_path / "art"
    report = compile_model(name, "cuda", CompileOptions(quant=quant, tp=tp, cuda_arch=70, out=art))
    assert not [w for w in report.warnings if "FastDeploy" in w]
    cfg = check(art, tmp_path, tiny_config(name.split("@")[0]), None, 70, tp)
    q = cfg["quantization_config"]
    assert q["quantization"] == kind


@pytest.mark.parametrize(("name", "overrides", "quant", "tp"), [
    ("ernie-4.5-0.3b", SM80, "wint8", 1),
    ("ernie-4.5-0.3b", {**SM80, "tie_word_embeddings": False}, "wint4", 2),
])
def test_checkpoint_folders_at_default_sm80(tmp_path: Path, name: str, overrides: dict[str, Any],
                                             quant: str, tp: int) -> None:
    src, tensors = source_folder(tmp_path, name, overrides)
    art = tmp_path / "art"
    report = compile_model(str(src), "cuda", CompileOptions(quant=quant, tp=tp, out=art))
    assert report.cuda_arch == 80 and not report.fallbacks
    source_cfg = json.loads((src / "config.json").read_text())
    check(art, tmp_path, source_cfg, tensors, 80, tp)
    for fname, data in TOKENIZER.items():
        assert (art / fname).read_bytes() == data
    manifest = verify_artifact(art)
    assert manifest.formats == ["fastdeploy"] and "fastdeploy" not in manifest.backends
    files = manifest.files
    assert files[f"rank{tp - 1}/model.safetensors"] == files[f"rank{tp - 1}/weights.safetensors"]


@pytest.mark.parametrize(("model", "kwargs", "why"), [
    (MOE, {"quant": "wint8mix"}, "packed cuda layout"),  # sm80: tiny in_features are not multiples of 64
    (MOE, {"quant": "wint8mix", "tp": 2, "ep": 2, "cuda_arch": 70}, "expert parallelism"),
    (MOE, {"quant": "wint8mix", "tp": 2, "cuda_arch": 70}, "quantized per rank"),
    (MOE, {"quant": "wint8mix", "cuda_arch": 70}, "add fastdeploy to --emit"),  # the bf16 form: asked for
    (DENSE, {"quant": "wint8", "cuda_arch": 70, "lora_rank": 2}, "LoRA"),
])
def test_not_fastdeploy_loadable_is_a_warning_and_no_files(tmp_path: Path, model: str, kwargs: dict[str, Any],
                                                          why: str) -> None:
    report = compile_model(model, "cuda", CompileOptions(out=tmp_path / "a", **kwargs))
    said = [w for w in report.warnings if w.startswith("not a FastDeploy checkpoint")]
    assert len(said) == 1 and why in said[0], report.warnings
    assert not (tmp_path / "a" / "config.json").exists()
    assert not list((tmp_path / "a").glob("rank*/model.safetensors"))
    assert "formats" not in verify_artifact(tmp_path / "a")


@pytest.mark.parametrize("kwargs", [{"cuda_arch": 70}, {"quant": "fp8", "cuda_arch": 90}])
def test_unquantized_and_fp8_compiles_say_nothing_of_fastdeploy(tmp_path: Path,
                                                                kwargs: dict[str, Any]) -> None:
    """No FastDeploy folder (FastDeploy serves the source checkpoint itself; ernie-ir writes no FP8
    one) and no warning about it, unless --emit asks for one."""
    report = compile_model(DENSE, "cuda", CompileOptions(out=tmp_path / "a", **kwargs))
    assert not [w for w in report.warnings if "FastDeploy" in w] and "fastdeploy" not in report.emit
    assert not (tmp_path / "a" / "config.json").exists() and report.serve == ""


@pytest.mark.parametrize(("model", "flags", "names"), [
    (MOE, ["--quant", "wint8mix", "--tp", "2"], "fused_moe_cutlass_backend.py"),
    (MOE, ["--quant", "w4a8c8", "--tp", "2"], "CutlassW4A8MoEMethod.process_prequanted_weights"),
    (MOE, ["--quant", "wint8mix-erniekit"], "mix_quant.py"),
    (DENSE, ["--quant", "fp8", "--cuda-arch", "90"], "block_wise_fp8.py"),
    (DENSE, ["--quant", "wint8", "--tp", "2", "--ep", "2"], "load_pre_sharded_checkpoint"),
    (DENSE, [], "serves the source checkpoint itself"),
])
def test_folders_fastdeploy_cannot_load_are_refused_before_any_work(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, model: str, flags: list[str], names: str) -> None:
    """`--emit fastdeploy` where FastDeploy's loader could not read the folder: one line naming
    FastDeploy's file or function and what works instead, exit 2, nothing on disk."""
    from _cli_kit import user_error

    out = tmp_path / "art"
    arch = [] if "--cuda-arch" in flags else ["--cuda-arch", "70"]
    line = user_error(capsys, "compile", model, "--target", "cuda", "--emit", "fastdeploy", "--out", str(out),
                      *arch, *flags)
    assert "--emit fastdeploy:" in line and names in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("model", "target", "mode"), [
    ("gpt-345m@tiny", "cuda", "inference"), (DENSE, "kunlun", "inference"), (DENSE, "cuda", "training"),
])
def test_other_models_targets_and_modes_get_no_fastdeploy_files(tmp_path: Path, model: str, target: str,
                                                                mode: str) -> None:
    extra: dict[str, Any] = {"lora_rank": 2} if mode == "training" else {}
    report = compile_model(model, target, CompileOptions(quant="wint8", mode=mode, out=tmp_path / "a",
                           cuda_arch=70, **extra))
    assert not [w for w in report.warnings if "FastDeploy" in w]
    assert not (tmp_path / "a" / "config.json").exists()


def test_reader_refuses_folders_that_are_not_prequantized(tmp_path: Path) -> None:
    with pytest.raises(FastDeployError, match=r"no config\.json"):
        load_fastdeploy_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Ernie4_5_ForCausalLM"]}))
    with pytest.raises(FastDeployError, match="is_quantized"):
        load_fastdeploy_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quantization": "block_wise_fp8", "is_quantized": True}}))
    with pytest.raises(FastDeployError, match="wint8/wint4"):
        load_fastdeploy_checkpoint(tmp_path)
