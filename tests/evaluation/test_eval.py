"""`ernie-ir eval` (issue 21): windows, each statistic against an independent implementation of its
definition, end-to-end figures against the interpreter's logits, KL of a model against itself,
quantization's cost, and bad input."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _cli_kit import cli, user_error
from _fe_testkit import hf_to_paddle, random_hf_ernie, write_checkpoint

from ernie_ir.evaluation import EvalError, evaluate, summarize, token_stats, windows
from ernie_ir.load import load_input
from ernie_ir.runtime import Interpreter
from ernie_ir.targets.compile import CompileOptions, compile_model

CFG = {
    "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 160, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("eval") / "model", CFG,
                            hf_to_paddle(random_hf_ernie(CFG, seed=4), CFG))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text("".join(json.dumps({"input_ids": rng.integers(0, 160, n).tolist()}) + "\n"
                            for n in (45, 1, 9, 70)))
    return path


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 80), seq_len=st.integers(2, 20), data=st.data())
def test_windows_score_every_token_once_with_enough_context(n: int, seq_len: int, data):
    stride = data.draw(st.integers(1, seq_len))
    doc = list(range(n))
    scored: list[int] = []
    for w, first in windows(doc, seq_len, stride):
        assert 2 <= len(w) <= seq_len and 1 <= first < len(w)
        assert w == doc[w[0]:w[0] + len(w)]
        if w[0] > 0:  # not the document's first window: at least L - S tokens of context
            assert first >= seq_len - stride
        scored.extend(w[first:])
    if stride < seq_len:
        assert scored == doc[1:]
    else:  # disjoint chunks: a chunk's first token has no context in its chunk (only those go)
        assert scored == sorted(set(scored)) and set(scored) <= set(doc[1:])
        assert all(t % seq_len == 0 for t in set(doc[1:]) - set(scored))


def _independent(logits: np.ndarray, ref: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """The figures straight from their definitions, token by token in Python floats."""
    nll, nll_r, kl, same, dp = [], [], [], [], []
    for z, zr, t in zip(logits.astype(float), ref.astype(float), targets, strict=True):
        p = [math.exp(v) for v in z]
        s = sum(p)
        p = [v / s for v in p]
        q = [math.exp(v) for v in zr]
        sr = sum(q)
        q = [v / sr for v in q]
        nll.append(-math.log(p[t]))
        nll_r.append(-math.log(q[t]))
        kl.append(sum(qi * (math.log(qi) - math.log(pi)) for pi, qi in zip(p, q, strict=True)))
        same.append(max(range(len(p)), key=p.__getitem__) == max(range(len(q)), key=q.__getitem__))
        dp.append(p[t] - q[t])
    ks = sorted(kl)

    def pct(x: float) -> float:  # linear interpolation between closest ranks
        pos = (len(ks) - 1) * x / 100
        lo = math.floor(pos)
        return ks[lo] + (ks[min(lo + 1, len(ks) - 1)] - ks[lo]) * (pos - lo)

    mean = sum(nll) / len(nll)
    sd = math.sqrt(sum((v - mean) ** 2 for v in nll) / (len(nll) - 1))
    return {"mean_nll": mean, "perplexity": math.exp(mean),
            "perplexity_ci95": [math.exp(mean - 1.96 * sd / math.sqrt(len(nll))),
                                math.exp(mean + 1.96 * sd / math.sqrt(len(nll)))],
            "perplexity_reference": math.exp(sum(nll_r) / len(nll_r)), "kl_mean": sum(kl) / len(kl),
            "kl_median": pct(50), "kl_p99": pct(99), "kl_p999": pct(99.9), "kl_max": ks[-1],
            "top1_agreement": sum(same) / len(same),
            "rms_delta_p": math.sqrt(sum(v * v for v in dp) / len(dp))}


def test_every_statistic_matches_its_definition():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (300, 37)).astype(np.float32)
    ref = (logits + rng.normal(0, 0.5, logits.shape)).astype(np.float32)
    targets = rng.integers(0, 37, 300)
    stats = token_stats(logits[:120], targets[:120], ref[:120])
    stats.add(token_stats(logits[120:], targets[120:], ref[120:]))
    got = summarize(stats)
    want = _independent(logits, ref, targets)
    assert got["tokens_scored"] == 300
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-9, atol=1e-12, err_msg=key)


def test_figures_equal_the_interpreter_window_by_window(ckpt: Path, corpus: Path):
    report = evaluate(ckpt, corpus, seq_len=16, stride=8, batch=3)
    it = Interpreter(load_input(str(ckpt)))
    nll = []
    for line in corpus.read_text().splitlines():
        doc = json.loads(line)["input_ids"]
        for w, first in windows(doc, 16, 8):
            logits = it.run({"input_ids": np.asarray([w])})["logits"][0].astype(np.float64)
            for j in range(first, len(w)):
                z = logits[j - 1]
                nll.append(np.log(np.exp(z - z.max()).sum()) + z.max() - z[w[j]])
    assert report.tokens_scored == 44 + 0 + 8 + 69 == len(nll)
    assert report.mean_nll == pytest.approx(float(np.mean(nll)), rel=1e-6)
    assert report.documents == 4  # the one-token document is read and scores nothing


def test_a_model_against_itself_costs_nothing_and_quantization_costs(ckpt: Path, corpus: Path,
                                                                     tmp_path: Path):
    same = evaluate(ckpt, corpus, compare_to=ckpt, seq_len=32)
    assert same.kl_max == 0.0 and same.top1_agreement == 1.0 and same.rms_delta_p == 0.0
    assert same.perplexity == same.perplexity_reference
    kl = {}
    for quant in ("wint8", "wint4"):
        art = compile_model(str(ckpt), "cuda", CompileOptions(quant=quant, out=tmp_path / quant, emit="onnx"))
        for backend in ("interpreter", "onnxruntime"):
            r = evaluate(art.out, corpus, compare_to=ckpt, seq_len=32, backend=backend)
            kl[quant, backend] = r.kl_mean
            assert r.kl_mean > 0 and r.kl_p99 <= r.kl_max
    assert kl["wint8", "interpreter"] < kl["wint4", "interpreter"] / 4
    for quant in ("wint8", "wint4"):
        assert kl[quant, "onnxruntime"] == pytest.approx(kl[quant, "interpreter"], rel=0.2)


def test_the_cli_prints_the_figures(ckpt: Path, corpus: Path, capsys):
    code, out, err = cli(capsys, "eval", str(ckpt), "--data", str(corpus), "--seq-len", "16", "--stride", "8",
                         "--compare-to", str(ckpt), "--json")
    assert code == 0, err
    data = json.loads(out)
    for key in ("perplexity", "mean_nll", "tokens_scored", "perplexity_reference", "kl_mean", "kl_median",
                "kl_p99", "kl_p999", "kl_max", "top1_agreement", "rms_delta_p"):
        assert key in data
    assert data["kl_mean"] == 0.0 and data["tokens_scored"] == 121


@pytest.mark.parametrize(("args", "fragment"), [
    (["--seq-len", "16", "--stride", "17"], "--stride must be in [1, --seq-len 16]"),
    (["--seq-len", "16", "--stride", "0"], "--stride must be in"),
    (["--seq-len", "65"], "beyond the model's 64 positions"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--compare-to", "gpt-345m@tiny"], "vocabulary of 160 tokens"),
])
def test_bad_options_are_one_line(ckpt: Path, corpus: Path, args: list[str], fragment: str, capsys):
    assert fragment in user_error(capsys, "eval", str(ckpt), "--data", str(corpus), *args)


def test_bad_corpora_are_one_line(ckpt: Path, tmp_path: Path, capsys):
    def refused(text: str, fragment: str, name: str = "c.jsonl") -> None:
        path = tmp_path / name
        path.write_text(text)
        assert fragment in user_error(capsys, "eval", str(ckpt), "--data", str(path), "--seq-len", "8")

    refused("", "no token to score")
    refused('{"input_ids": [3]}\n', "no token to score")
    refused('{"input_ids": [1, 2]}\n{"input_ids": [1, \n', "line 2 is not valid JSON")
    refused('{"input_ids": [1, 200]}\n', "outside the model's vocabulary")
    refused('{"text": "hello"}\n', "has no tokenizer")
    refused("plain text\n", "has no tokenizer", name="c.txt")
    refused('{"other": 1}\n', "line 1 holds nothing to read")
    assert "no such file" in user_error(capsys, "eval", str(ckpt), "--data", str(tmp_path / "none.jsonl"))
    with pytest.raises(EvalError, match="max-tokens"):
        evaluate(ckpt, tmp_path / "c.jsonl", max_tokens=1)


@pytest.mark.gloo
@pytest.mark.slow
def test_multi_rank_artifacts_evaluate_on_their_backends(ckpt: Path, tmp_path: Path):
    """A tp=2 artifact: every rank in lockstep (interpreter) and one paddle.distributed process per
    rank (paddle) score the corpus as the one-rank model does."""
    pytest.importorskip("paddle")
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"input_ids": np.random.default_rng(5).integers(0, 160, 30).tolist()}) + "\n")
    single = evaluate(ckpt, data, seq_len=32)
    art = compile_model(str(ckpt), "cuda", CompileOptions(tp=2, out=tmp_path / "tp2"))
    for backend in ("interpreter", "paddle"):
        r = evaluate(art.out, data, seq_len=32, backend=backend)
        assert r.tokens_scored == single.tokens_scored == 29
        assert r.mean_nll == pytest.approx(single.mean_nll, rel=1e-5), backend
