"""`eval --quant` (issue 28): the KL of wint4, WINT8MIX, W4A8C8 and WINT2 against the float model,
side by side, on a generated MoE checkpoint WINT2 can take (hidden and expert width 128: WINT2
packs K in groups of 128 rows; the built-in ernie-4.5-21b-a3b@tiny, hidden 80, is refused).

The head is untied: with the tied random embedding (std 1) the logits copy the input token with a
perplexity of ~5e30, so KL is a handful of near-ties flipping (median KL 1e-15) and its 95%
interval spans zero (measured on the corpus below: wint8mix 2.8e-3 +- 2.9e-3). Untied, on 4
documents x 128 random tokens, windows of 64 (504 tokens; docs/quantization.md section 9 has the
table):

    wint8 2.4e-4 < wint8mix 7.4e-3 ~ w4a8c8 8.3e-3 < wint2{w4_end_layer=1} 0.019 < wint2 0.044 ~ wint4 0.055

Only orderings with a clear margin (1.5x or more, intervals far apart) are asserted; W4A8C8 against
WINT8MIX (the same int4 experts plus int8 activations and the C8 cache) and WINT2 against wint4
are near each other and asserted only as "close" or not at all.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_testkit import tiny_config, write_paddle_checkpoint

from ernie_ir.evaluation import EvalError, Scoring, evaluate_quantized
from ernie_ir.ir import ErnieIRError

CFG = {**tiny_config("ernie-4.5-21b-a3b"), "hidden_size": 128, "moe_intermediate_size": 128,
       "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": False}
QUANTS = ["wint8mix", "wint4", "w4a8c8", "wint2{w4_end_layer=1}", "wint2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("moe128") / "model"
    write_paddle_checkpoint(folder, CFG)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text("".join(json.dumps({"input_ids": rng.integers(0, CFG["vocab_size"], 128).tolist()}) + "\n"
                            for _ in range(4)))
    return path


@pytest.fixture(scope="module")
def kl(model: Path, corpus: Path) -> dict[str, float]:
    reports = evaluate_quantized(model, corpus, QUANTS, scoring=Scoring(seq_len=64, batch=4))
    assert [r.quant for r in reports] == QUANTS
    for r in reports:
        assert r.reference == str(model) and r.model == str(model) and r.tokens_scored == 504
        assert r.kl_mean > 0 and r.kl_median <= r.kl_p99 <= r.kl_max
    print("\n[eval --quant] " + ", ".join(f"{r.quant} {r.kl_mean:.4g}" for r in reports))
    return {r.quant: r.kl_mean for r in reports}


@pytest.mark.slow
def test_kl_orderings_that_hold_with_a_margin(kl: dict[str, float]) -> None:
    # int4 everywhere costs far more than int4 experts with int8 elsewhere (measured 7.4x)
    assert 3 * kl["wint8mix"] < kl["wint4"]
    # 2-bit experts cost more than int4 experts, with or without the activation/KV quantization
    assert 3 * kl["wint8mix"] < kl["wint2"]  # measured 5.9x
    assert 3 * kl["w4a8c8"] < kl["wint2"]  # 5.3x
    # keeping MoE layer 1 at int4 (FastDeploy's w4 layers) halves WINT2's cost; still above WINT8MIX
    assert 1.5 * kl["wint2{w4_end_layer=1}"] < kl["wint2"]  # 2.3x
    assert 1.5 * kl["wint8mix"] < kl["wint2{w4_end_layer=1}"]  # 2.6x


@pytest.mark.slow
def test_w4a8c8_costs_little_over_wint8mix(kl: dict[str, float]) -> None:
    """The same int4 experts; int8 activations into them and the int8 KV cache add ~11%."""
    assert kl["w4a8c8"] < 1.5 * kl["wint8mix"]


@pytest.mark.slow
def test_the_cli_prints_presets_side_by_side(model: Path, corpus: Path, capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    ids = tmp_path / "calib.npy"
    np.save(ids, np.random.default_rng(3).integers(0, CFG["vocab_size"], (2, 32)))
    args = ["eval", str(model), "--data", str(corpus), "--seq-len", "64", "--max-tokens", "130",
            "--quant", "wint8mix", "--quant", "w4a8c8", "--calib-data", str(ids)]
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["reference"] == str(model) and [r["quant"] for r in data["rows"]] == ["wint8mix", "w4a8c8"]
    assert all(r["kl_mean"] > 0 for r in data["rows"])
    assert data["rows"][0]["tokens_scored"] == data["rows"][1]["tokens_scored"] > 100
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["quant", "KL", "mean"]
    assert [ln.split()[0] for ln in lines[2:]] == ["wint8mix", "w4a8c8", "reference"]


def test_refusals_are_one_line(model: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(EvalError, match="none of --quant wint4 has any"):
        evaluate_quantized(model, corpus, ["wint4"], calib_data=corpus)
    with pytest.raises(ErnieIRError, match="valid options: w4_end_layer, refine"):
        evaluate_quantized(model, corpus, ["wint4", "wint2{bogus=1}"])
    with pytest.raises(ErnieIRError, match="multiples of 128"):  # hidden 80
        evaluate_quantized("ernie-4.5-21b-a3b@tiny", corpus, ["wint2"],
                           scoring=Scoring(seq_len=32, max_tokens=40))
    assert "give --quant" in user_error(capsys, "eval", str(model), "--data", str(corpus), "--calib-data",
                                        str(corpus))
    assert "drop --backend onnxruntime" in user_error(capsys, "eval", str(model), "--data", str(corpus),
                                                      "--quant", "wint4", "--backend", "onnxruntime")
