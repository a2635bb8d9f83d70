"""Calibration data as text (`--calib-data FILE.jsonl`) and the @meta estimate of what calibrating costs."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.finetune.calib_text import calibration_ids
from ernie_ir.frontends.tokenizer import load_tokenizer
from ernie_ir.ir.storage import save_graph
from ernie_ir.load import load_input, tokenizer_folder
from ernie_ir.passes.quant.calib_data import CalibrationDataError, read_windows
from ernie_ir.planning.calib_cost import (
    MEASURED_FIXED_S,
    MEASURED_WINDOW_S,
    calibration_estimate,
    calibration_note,
    layer_cost,
    model_config,
)

DENSE = "ernie-4.5-0.3b@tiny"
TEXTS = ["The quick brown fox jumps over the lazy dog.", "A graph compiler reads a model into a typed graph."]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenized cache goes to this test's folder, not the machine's temp folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def _tokenizer():  # type: ignore[no-untyped-def]
    folder = tokenizer_folder(DENSE)
    assert folder is not None
    return load_tokenizer(folder)


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_text_lines_are_the_documents_ids_each_ended_by_eos(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "calib.jsonl", [{"text": t} for t in TEXTS])
    tok = _tokenizer()
    expected = [i for t in TEXTS for i in [*tok.encode(t), tok.eos_token_id]]
    ids = np.load(calibration_ids(data, DENSE))
    assert ids.tolist() == [expected]
    windows = read_windows(calibration_ids(data, DENSE), vocab=tok.vocab_size, samples=3, seq_len=8)
    assert windows.ids.tolist() == np.asarray(expected[:24]).reshape(3, 8).tolist()
    # the manifest's record names the user's file and its digest, not the cache's
    assert windows.record()["file"] == "calib.jsonl"
    assert windows.sha256 == hashlib.sha256(data.read_bytes()).hexdigest()


def test_erniekit_sft_chats_are_rendered_through_the_chat_template(tmp_path: Path) -> None:
    chat = [("What does a compiler do?", "It reads a model."), ("And then?", "It lowers it.")]
    data = _jsonl(tmp_path / "sft.jsonl", [{"src": [u for u, _ in chat], "tgt": [a for _, a in chat]}])
    tok = _tokenizer()
    msgs: list[dict[str, str]] = []
    expected: list[int] = []
    done = ""
    for user, answer in chat:
        msgs.append({"role": "user", "content": user})
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True)
        msgs.append({"role": "assistant", "content": answer})
        full = tok.apply_chat_template(msgs, add_generation_prompt=False)
        expected += tok.encode(prompt[len(done):], add_special_tokens=False)
        expected += tok.encode(full[len(prompt):], add_special_tokens=False)
        done = full
    assert done.endswith("<|end_of_sentence|>")  # the template's end token: no EOS added after it
    assert np.load(calibration_ids(data, DENSE)).tolist() == [expected]


def test_a_npy_is_passed_through_and_a_text_file_is_not_read_by_the_pass(tmp_path: Path) -> None:
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(1, 33, dtype=np.int64)[None])
    assert calibration_ids(ids, DENSE) == ids
    text = _jsonl(tmp_path / "t.jsonl", [{"text": TEXTS[0]}])
    with pytest.raises(CalibrationDataError, match="tokenized by the caller"):
        read_windows(text, vocab=1024)


def test_compile_gptq_on_text_records_the_texts_sha256(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "calib.jsonl", [{"text": " ".join(TEXTS * 4)}] * 4)
    out = tmp_path / "art"
    code, _, err = cli(capsys, "compile", DENSE, "--target", "cuda", "--quant", "wint4{method=gptq}",
                       "--calib-data", str(data), "--calib-seq-len", "16", "--calib-samples", "4",
                       "--out", str(out))
    assert code == 0, err
    record = json.loads((out / "manifest.json").read_text())["calibration"]
    assert record["methods"] == ["gptq"]
    assert record["data"] == {"file": "calib.jsonl", "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
                              "windows": 4, "seq_len": 16}


def test_text_for_a_model_without_a_tokenizer_is_one_line(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    bare = save_graph(load_input(DENSE), tmp_path / "bare")  # a graph folder: no tokenizer
    data = _jsonl(tmp_path / "calib.jsonl", [{"text": TEXTS[0]}])
    line = user_error(capsys, "compile", str(bare), "--target", "cuda", "--quant", "wint4{method=gptq}",
                      "--calib-data", str(data), "--out", str(tmp_path / "art"))
    assert "is text, but" in line and "has no tokenizer" in line and "give a .npy of token ids" in line, line
    assert not (tmp_path / "art").exists()


SMALL = {"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
         "intermediate_size": 16, "num_hidden_layers": 2, "max_position_embeddings": 64}


def test_the_estimate_of_a_small_config_by_hand() -> None:
    # 2 windows of 4 tokens (T = 8). Linears [K, N]: qkv [8, (2 + 2) x 4 = 16], o [8, 8],
    # up_gate [8, 32], down [16, 8].
    c = layer_cost(SMALL, 0, windows=2, seq_len=4)
    assert c.hessian_bytes == 8 * (64 + 64 + 64 + 256)  # K^2 float64 per linear
    assert c.held_bytes == 4 * 8 * 8  # T x hidden float32
    # per token: 2 K N per linear + attention 4 x seq x heads x head_dim
    assert c.forward_flops == 8 * (2 * (8 * 16 + 8 * 8 + 8 * 32 + 16 * 8) + 4 * 4 * 2 * 4)
    assert c.hessian_flops == 8 * 2 * (64 + 64 + 64 + 256)
    assert c.sweep_flops == 64 * 24 + 64 * 16 + 64 * 40 + 256 * 24  # K^2 (K + N)
    moe = {**SMALL, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 4,
           "moe_layer_start_index": 1, "moe_layer_end_index": 1}
    e = layer_cost(moe, 1, windows=2, seq_len=4)  # layer 1: 4 experts of up_gate [8, 8], down [4, 8]
    assert e.hessian_bytes == 8 * (64 + 64 + 4 * (64 + 16))
    assert e.forward_flops == 8 * (2 * (8 * 16 + 8 * 8) + 2 * 4 * (8 * 8 + 4 * 8) * 2 / 4 + 4 * 4 * 2 * 4)
    assert e.sweep_flops == 64 * 24 + 64 * 16 + 4 * (64 * 16 + 16 * 12)
    assert layer_cost(moe, 0, 2, 4) == c  # below moe_layer_start_index: the dense MLP


def test_the_estimate_reproduces_the_measurement_and_sizes_the_300b() -> None:
    small = model_config("ernie-4.5-0.3b")
    assert small is not None
    assert calibration_estimate(small, 1, 512).seconds == pytest.approx(MEASURED_FIXED_S + MEASURED_WINDOW_S)
    big = model_config("ernie-4.5-300b-a47b@meta")
    assert big is not None
    est = calibration_estimate(big)
    assert (est.windows, est.seq_len, len(est.layers)) == (128, 512, 54)
    # an expert layer: 64 x (8192^2 + 3584^2) + 2 x 8192^2 float64 Hessians; 128 x 512 x 8192 float32 inputs
    assert est.largest.hessian_bytes == 8 * (64 * (8192**2 + 3584**2) + 2 * 8192**2)
    assert est.largest.held_bytes == 4 * 128 * 512 * 8192
    note = calibration_note("ernie-4.5-300b-a47b")
    assert note is not None and "128 windows of 512 tokens" in note and "Hessians 42.0 GB" in note
    assert calibration_note(str(Path("no-such-model"))) is None


def test_plan_prints_the_estimate_for_method_gptq(capsys: pytest.CaptureFixture[str]) -> None:
    plan = ("plan", "ernie-4.5-0.3b", "--target", "cuda", "--quant")
    code, text, err = cli(capsys, *plan, "wint4{method=gptq}", width=400)
    assert code == 0, err
    assert f"calibration: {calibration_note('ernie-4.5-0.3b')}" in text
    assert "method=gptq at 128 windows of 512 tokens: ~23.3 min of CPU" in text  # 67 s + 128 x 10.4 s
    code, text, err = cli(capsys, *plan, "wint4", width=400)
    assert code == 0, err
    assert "calibration:" not in text


def test_compile_at_meta_prints_the_estimate_for_its_windows(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, text, err = cli(capsys, "compile", "ernie-4.5-0.3b@meta", "--target", "cuda", "--quant",
                          "wint4{method=gptq}", "--calib-samples", "32", "--out", str(tmp_path / "art"),
                          width=400)
    assert code == 0, err
    assert f"calibration: {calibration_note('ernie-4.5-0.3b', 32)}" in text
    assert "method=gptq at 32 windows of 512 tokens: ~6.7 min of CPU" in text  # 67 s + 32 x 10.4 s
