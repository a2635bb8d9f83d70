"""Regression tests from a review of the `ernie-ir` CLI against DESIGN.md section 6.

Each test is a bad input that used to end in a traceback, a silent success or a
half-written file; the contract is one `error:` line on stderr, exit code 2 and
nothing changed on disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

GPT = "gpt-345m@tiny"


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ernie_ir.targets import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("review") / "art"
    compile_model(GPT, "cuda", CompileOptions(out=out, emit="onnx"))
    return out


@pytest.fixture
def copy(artifact: Path, tmp_path: Path) -> Path:
    import shutil

    dest = tmp_path / "art"
    shutil.copytree(artifact, dest)
    return dest


def _edit_manifest(root: Path, **files: object) -> None:
    path = root / "manifest.json"
    m = json.loads(path.read_text())
    m["files"].update(files)
    path.write_text(json.dumps(m))


# --- verify: a tampered manifest ---------------------------------------------------------------

def test_verify_refuses_a_manifest_that_lists_a_file_outside_the_artifact(copy: Path, capsys):
    outside = copy.parent / "outside.txt"
    outside.write_text("not part of the artifact")
    _edit_manifest(copy, **{"../outside.txt": hashlib.sha256(outside.read_bytes()).hexdigest()})
    line = user_error(capsys, "verify", str(copy))
    assert "'../outside.txt', which is outside the artifact folder" in line


def test_verify_refuses_an_absolute_path_in_the_manifest(copy: Path, capsys):
    _edit_manifest(copy, **{"/etc/hostname": "0" * 64})
    assert "outside the artifact folder" in user_error(capsys, "verify", str(copy))


def test_verify_refuses_a_digest_that_is_not_a_string(copy: Path, capsys):
    _edit_manifest(copy, **{"graph.ir": 5})
    assert "sha256 of graph.ir is not a 64-digit hex string" in user_error(capsys, "verify", str(copy))


def test_compile_refuses_an_artifact_as_its_model(artifact: Path, tmp_path: Path, capsys):
    line = user_error(capsys, "compile", str(artifact), "--target", "ascend", "--out", str(tmp_path / "x"))
    assert "is a compiled artifact (already legalized for --target cuda)" in line
    assert f"compile its source model {GPT} instead" in line
    assert not (tmp_path / "x").exists()


# --- compile --out ------------------------------------------------------------------------------

def test_force_does_not_replace_a_file_and_leaves_no_leftovers(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("mine")
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--out", "afile", "--force")
    assert line == "error: afile is a file, not an artifact folder: choose another --out " \
                   "(--force replaces only folders)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    assert Path("afile").read_text() == "mine"


@pytest.mark.parametrize("out", [".", "./", ".."])
def test_out_may_not_be_the_current_folder_or_above(out: str, tmp_path: Path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--out", out, "--force")
    assert "is the current folder or one above it" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt"]


def test_an_unwritable_out_is_one_line(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("mine")
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--out", "afile/sub/art")
    assert line.startswith("error: cannot write the artifact afile/sub/art: ")
    assert line.endswith("choose a writable --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_cuda_arch_only_applies_to_cuda(tmp_path: Path, capsys):
    line = user_error(capsys, "compile", GPT, "--target", "ascend", "--cuda-arch", "90",
                      "--out", str(tmp_path / "x"))
    assert line == "error: --cuda-arch applies to --target cuda only, not ascend: drop it"


def test_compile_refuses_a_yaml_pipeline_with_quant_flags(tmp_path: Path, capsys):
    y = tmp_path / "p.yaml"
    y.write_text("- cse\n")
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--pipeline", str(y), "--quant", "wint8",
                      "--out", str(tmp_path / "x"))
    assert "cannot be combined with --quant" in line
    assert not (tmp_path / "x").exists()


def test_compile_refuses_another_targets_legalization_in_pipeline(tmp_path: Path, capsys):
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--pipeline", "wint8,legalize-kunlun",
                      "--out", str(tmp_path / "x"))
    assert "--pipeline holds legalize-kunlun: compile appends legalize-cuda" in line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("alpha", ["nan", "inf"])
def test_lora_alpha_must_be_finite(alpha: str, tmp_path: Path, capsys):
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--mode", "training", "--lora-rank", "4",
                      "--lora-alpha", alpha, "--out", str(tmp_path / "x"))
    assert line == f"error: --lora-alpha must be positive (a finite number), not {alpha}"


def test_lora_targets_that_match_nothing_hint_at_full_match(tmp_path: Path, capsys):
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--mode", "training", "--lora-rank", "4",
                      "--lora-targets", "qkv_proj", "--out", str(tmp_path / "x"))
    assert "must match a whole name (re.fullmatch), e.g. '.*qkv_proj'" in line


# --- run ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("emulate", ["f99", "i8"])
def test_run_refuses_an_unknown_emulate_dtype(emulate: str, capsys):
    line = user_error(capsys, "run", GPT, "--tokens", "1", "--emulate", emulate)
    assert line == f"error: --emulate '{emulate}': choose bf16 or f16 (activation rounding)"


def test_run_save_logits_into_a_missing_folder(tmp_path: Path, capsys):
    line = user_error(capsys, "run", GPT, "--tokens", "1", "--save-logits", str(tmp_path / "no" / "l.npy"))
    assert "does not exist: create it or choose another path" in line


def test_run_save_logits_that_cannot_be_written(tmp_path: Path, capsys):
    (tmp_path / "l.npy").mkdir()  # np.save cannot open a folder
    line = user_error(capsys, "run", GPT, "--tokens", "1", "--save-logits", str(tmp_path / "l.npy"))
    assert "cannot write it" in line


def test_run_refuses_an_empty_token_array(tmp_path: Path, capsys):
    np.save(tmp_path / "t.npy", np.zeros((1, 0), dtype=np.int64))
    line = user_error(capsys, "run", GPT, "--tokens", str(tmp_path / "t.npy"))
    assert "the array is empty [1, 0]" in line


def test_run_refuses_a_token_id_beyond_int64(capsys):
    line = user_error(capsys, "run", GPT, "--tokens", "1,99999999999999999999999")
    assert "expected comma-separated integers" in line


def test_run_refuses_nan_logits(tmp_path: Path, capsys):
    from ernie_ir.frontends import load_model
    from ernie_ir.ir.storage import save_graph
    from ernie_ir.ir.weights import ArraySource

    g = load_model(GPT)
    name = next(n for n in g.params if n.endswith("linear2.weight"))
    arr = np.array(g.params[name].source.read(), copy=True)
    arr[0, 0] = np.nan
    g.params[name].source = ArraySource(arr)
    save_graph(g, tmp_path / "nan")
    line = user_error(capsys, "run", str(tmp_path / "nan"), "--tokens", "1,2,3")
    assert "logits are NaN or Inf" in line
    line = user_error(capsys, "run", GPT, "--tokens", "1,2,3", "--compare-to", str(tmp_path / "nan"))
    assert "logits are NaN or Inf" in line


# --- show, golden, loaders -------------------------------------------------------------------

def test_missing_ir_file_says_so(tmp_path: Path, capsys):
    line = user_error(capsys, "show", str(tmp_path / "none.ir"))
    assert line == f"error: {tmp_path / 'none.ir'}: no such IR file: check the path"


def test_binary_pipeline_yaml(tmp_path: Path, capsys):
    (tmp_path / "p.yaml").write_bytes(b"\xff\xfe\x00\x9c binary")
    line = user_error(capsys, "show", GPT, "--pipeline", str(tmp_path / "p.yaml"))
    assert "is not UTF-8 text" in line


def test_binary_quant_config(tmp_path: Path, capsys):
    (tmp_path / "q.yaml").write_bytes(b"\xff\xfe\x00\x9c binary")
    line = user_error(capsys, "show", GPT, "--quant-config", str(tmp_path / "q.yaml"))
    assert "not UTF-8 text: a quant config is a YAML file" in line


def test_dump_dir_that_is_a_file(tmp_path: Path, capsys):
    (tmp_path / "d").write_text("x")
    line = user_error(capsys, "show", GPT, "--pipeline", "cse", "--dump-dir", str(tmp_path / "d"))
    assert "is a file, not a folder" in line


def test_golden_check_of_a_folder_without_goldens_fails(tmp_path: Path, capsys):
    line = user_error(capsys, "golden", "check", str(tmp_path))
    assert "no golden files" in line


@pytest.mark.parametrize("data", [b"x\n", b".", b"\x80\x02)\x86.", b"\x80\x02K\x01K\x02s."])
def test_a_corrupt_pdparams_with_trust_is_one_line(data: bytes, tmp_path: Path, capsys):
    from ernie_ir.frontends.builtins import builtin_config

    (tmp_path / "config.json").write_text(json.dumps(builtin_config("gpt-345m", "tiny")))
    (tmp_path / "model_state.pdparams").write_bytes(data)
    line = user_error(capsys, "show", str(tmp_path), "--trust-pickle")
    assert "not a readable Paddle state dict" in line


def test_compare_to_a_model_with_another_vocabulary(tmp_path: Path, capsys):
    import importlib.util

    from ernie_ir.frontends.builtins import builtin_config

    spec = importlib.util.spec_from_file_location(
        "_fe_testkit_review", Path(__file__).parent / "frontends" / "_fe_testkit.py")
    assert spec is not None and spec.loader is not None
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    cfg = dict(builtin_config("ernie-4.5-0.3b", "tiny"))
    cfg["vocab_size"] = 512
    kit.write_checkpoint(tmp_path / "v512", cfg, kit.random_hf_ernie(cfg))
    line = user_error(capsys, "run", "ernie-4.5-0.3b@tiny", "--tokens", "1,2",
                      "--compare-to", str(tmp_path / "v512"))
    assert "its logits are [1, 2, 512]" in line and "[1, 2, 1024] (a different vocabulary)" in line


@pytest.mark.parametrize("tokens,message", [
    ("1,5000", "error: embedding: token id 5000 is outside the vocabulary [0, 1024)"),
    ("-3", "error: embedding: token id -3 is outside the vocabulary [0, 1024)"),  # ORT's Gather wraps it
    (",".join(["1"] * 200), "error: position_ids: sequence length 200 reaches position 199, "
                            "beyond the model's 128 positions"),
])
def test_compiled_backends_check_token_ids_like_the_interpreter(artifact: Path, tokens: str, message: str,
                                                               capsys):
    assert user_error(capsys, "run", str(artifact), "--tokens", tokens, "--backend", "onnxruntime") == message
    assert user_error(capsys, "run", str(artifact), "--tokens", tokens) == message


def test_out_inside_an_artifact_is_refused(artifact: Path, capsys):
    before = tree(artifact)
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--out", str(artifact / "sub"))
    assert "is inside the artifact" in line
    assert tree(artifact) == before


@pytest.fixture(scope="module")
def training_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("paddle")
    from ernie_ir.targets import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("review-train") / "art"
    compile_model(GPT, "cuda", CompileOptions(mode="training", lora_rank=4, lora_targets=[".*qkv_proj"],
                  out=out))
    return out


def test_train_refuses_a_sequence_longer_than_the_positions(training_artifact: Path, tmp_path: Path,
                                                            capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"input_ids": list(range(1, 300))}) + "\n")
    before = tree(training_artifact)
    line = user_error(capsys, "train", str(training_artifact), "--steps", "1", "--data", str(data))
    assert line == (f"error: {data}:1: 299 tokens, but the model has 128 positions: give --max-seq-len 128 "
                    "to truncate it, or split the example")
    assert tree(training_artifact) == before


def test_train_on_a_corrupt_manifest_or_missing_weights(training_artifact: Path, tmp_path: Path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(training_artifact, broken)
    (broken / "manifest.json").write_text("{")
    assert "manifest.json is not valid JSON" in user_error(capsys, "train", str(broken), "--steps", "1")
    missing = tmp_path / "missing"
    shutil.copytree(training_artifact, missing)
    (missing / "rank0" / "weights.safetensors").unlink()
    line = user_error(capsys, "train", str(missing), "--steps", "1")
    assert "rank0/weights.safetensors is missing" in line


def test_a_meta_model_compiles_to_a_graph_only_artifact_that_run_refuses(tmp_path: Path, capsys):
    code, _, err = cli(capsys, "compile", "ernie-4.5-300b-a47b@meta", "--target", "cuda",
                         "--out", str(tmp_path / "x"))
    assert code == 0 and "graph-only artifact" in err
    assert (tmp_path / "x" / "rank0" / "graph.ir").is_file()
    assert not list((tmp_path / "x").rglob("*.safetensors"))
    line = user_error(capsys, "run", str(tmp_path / "x"), "--tokens", "1,2")
    assert "is a graph-only artifact" in line and "NAME@tiny" in line


def test_compile_prints_each_distinct_fallback_once(tmp_path: Path, capsys):
    code, out, _ = cli(capsys, "compile", "ernie-4.5-21b-a3b@tiny", "--target", "ascend",
                       "--quant", "wint8mix", "--out", str(tmp_path / "a"))
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("fallback: ")]
    assert len(lines) == len(set(lines))


def test_a_binary_lora_adapter_config(tmp_path: Path, capsys):
    from safetensors.numpy import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "lora_config.json").write_bytes(b"\xff\xfe\x00\x9c binary")
    save_file({"x": np.zeros((2, 2), np.float32)}, str(adapter / "adapter_model.safetensors"))
    line = user_error(capsys, "compile", "ernie-4.5-0.3b@tiny", "--target", "cuda", "--lora-adapter",
                      str(adapter), "--out", str(tmp_path / "x"))
    assert line == f"error: {adapter / 'lora_config.json'}: not UTF-8 text: re-export the adapter"


def test_a_graph_folder_with_a_binary_graph_ir(tmp_path: Path, capsys):
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "graph.ir").write_bytes(b"\xff\xfe\x00\x9c binary")
    line = user_error(capsys, "show", str(tmp_path / "g"))
    assert line == f"error: {tmp_path / 'g' / 'graph.ir'}: not a text file (IR files are UTF-8 text)"


def test_binary_training_data(training_artifact: Path, tmp_path: Path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"input_ids": [1, 2]}\n\xff\xfe\n')
    line = user_error(capsys, "train", str(training_artifact), "--steps", "1", "--data", str(data))
    assert line == (f"error: {data}:2: not UTF-8 text (byte 22): fine-tuning data is JSON Lines in UTF-8; "
                    "re-export the file as UTF-8")


@pytest.mark.parametrize("argv, fragment", [
    (["frobnicate"], "No such command 'frobnicate'"),
    (["show"], "Missing argument"),
    (["compile", "ernie-4.5-0.3b@tiny"], "Missing option '--target'"),
    (["passes", "--bogus"], "No such option: --bogus"),
    (["train", "somewhere", "--steps", "0"], "Invalid value for '--steps'"),
])
def test_usage_errors_are_one_line_too(argv: list[str], fragment: str, capsys) -> None:
    line = user_error(capsys, *argv)
    assert fragment in line and "--help" in line


def test_qat_refuses_nan_weights_like_the_other_quantizers() -> None:
    import numpy as np

    from ernie_ir.frontends import load_model
    from ernie_ir.ir import ErnieIRError
    from ernie_ir.passes import run_pipeline

    g = load_model("gpt-345m@tiny")
    name = next(n for n in g.params if n.endswith("linear1.weight"))
    bad = np.array(g.params[name].read(), copy=True)
    bad[1, 2] = np.nan
    g.params[name].set_data(bad)
    with pytest.raises(ErnieIRError, match=rf"param {name} holds nan at index \[1, 2\]"):
        run_pipeline(g, "qat-int8")
