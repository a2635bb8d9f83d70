"""Pretraining data (`train --data PREFIX`: PaddleNLP's PREFIX_ids.npy + PREFIX_idx.npz) and
`--num-train-epochs`.

- Against PaddleNLP itself (tests/reference/nlp_pretrain_windows.py, the `nlp` environment):
  for the same files, seed, window length, split and number of samples, ernie-ir's windows
  (ernie_ir.training.pretrain_data) are PaddleNLP's GPT dataset's, in the same order, for the
  training and validation parts, and so are its doc_idx, sample index (PaddleNLP builds it with
  its C++ helper) and shuffle index; the cases cover one epoch, several epochs with the last one
  shuffled apart (`separate_last_epoch`) and several without, ','- and '/'-splits, an empty
  document, ERNIE-style data (several entries per document).
- epochs -> steps (PaddleNLP's Trainer rule), for JSON Lines and pretraining data;
- bad input, one line each (exit 2, nothing written);
- `ernie-ir train` of a tiny full-parameter artifact on a PREFIX: finite losses, an eval loss
  from the validation part.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.finetune.run import epoch_steps
from ernie_ir.training.pretrain_data import (
    PretrainCorpus,
    PretrainDataError,
    WindowIndex,
    build_index,
    parse_split,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _fe_testkit import run_reference

MODEL = "ernie-4.5-0.3b@tiny"
VOCAB = 1024


def write_prefix(prefix: Path, lens: np.ndarray, docs: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """PREFIX_ids.npy (uint16, as PaddleNLP's preprocessing saves ids of a vocabulary < 65500) +
    PREFIX_idx.npz (lens int32, docs int64); returns the ids."""
    lens = np.asarray(lens, np.int32)
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=int(lens.sum())).astype(np.uint16)
    np.save(f"{prefix}_ids.npy", ids)
    docs = np.arange(lens.size + 1, dtype=np.int64) if docs is None else np.asarray(docs, np.int64)
    np.savez(f"{prefix}_idx.npz", lens=lens, docs=docs)
    return ids


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ERNIE-style data: 90 entries (sentences) of 0..40 tokens in 30 documents, one empty."""
    rng = np.random.default_rng(5)
    lens = rng.integers(1, 41, size=90)
    lens[7] = 0
    prefix = tmp_path_factory.mktemp("pretrain") / "corpus"
    write_prefix(prefix, lens, np.arange(0, 91, 3), seed=6)
    return prefix


# (seed, window length, split, training samples)
CASES = [
    (1234, 16, "949,50,1", 40),   # one epoch
    (7, 8, "8/2", 900),           # 6 epochs, the last one shuffled apart (27 < 80 % of 174 windows)
    (3, 16, "949,50,1", 300),     # 3 epochs, the last one not apart (96 >= 80 % of 102 windows)
    (11, 32, "90,10", 5),
]


@pytest.mark.reference
@pytest.mark.slow
def test_windows_are_paddlenlps(corpus: Path, tmp_path: Path) -> None:
    data = PretrainCorpus.open(corpus)
    spec_cases = [{"seed": s, "seq_length": L, "split": split,
                   "num_samples": [n, data.windows_per_pass("valid", split, L), 1]}
                  for s, L, split, n in CASES]
    ref = run_reference("nlp", "nlp_pretrain_windows.py", {"prefix": str(corpus), "cases": spec_cases},
                        tmp_path / "ref")
    meta = json.loads((ref / "meta.json").read_text())
    compared, apart = 0, set()
    for c, case in enumerate(spec_cases):
        for j, part in enumerate(("train", "valid")):
            n, L = case["num_samples"][j], case["seq_length"]
            assert n > 0 and meta["cases"][c]["lengths"][part] is not None, (c, part)
            theirs = np.load(ref / f"c{c}_{part}.npy")
            index = data.index(part, case["split"], L, case["seed"], n)
            for name, ours in (("doc_idx", index.doc_idx), ("sample_idx", index.sample_index),
                               ("shuffle_idx", index.shuffle_idx)):
                lib = np.load(ref / f"c{c}_{part}_{name}.npy")
                assert ours.dtype == lib.dtype and np.array_equal(ours, lib), (c, part, name)
            everything = data.window_tokens(index, np.arange(len(index.shuffle_idx)))
            assert np.array_equal(everything, theirs), (c, part)
            assert np.array_equal(data.windows(part, case["split"], L, case["seed"], n), theirs[:n])
            compared += len(theirs)
            if part == "train" and index.num_epochs > 1:
                apart.add(_separate(data, case, index))
    assert apart == {True, False}  # both ways of building the last epoch were compared
    assert compared == 1550  # windows (token for token) over the 4 cases, train and valid


def _separate(data: PretrainCorpus, case: dict, index: WindowIndex) -> bool:
    """Whether the last epoch was shuffled apart: it gives < 80 % of an epoch's windows."""
    tokens, L = data.tokens(data.documents("train", case["split"])), case["seq_length"]
    before = ((index.num_epochs - 1) * tokens - 1) // L
    return case["num_samples"][0] - before < int(0.8 * ((tokens - 1) // L))


def test_windows_are_the_shuffled_stream(corpus: Path) -> None:
    """Without PaddleNLP: window j is tokens [i L, i L + L] of the documents in doc_idx order
    (i = shuffle_idx[j]); epochs grow with the samples asked for."""
    data = PretrainCorpus.open(corpus)
    for seed, L, split, n in CASES:
        index = data.index("train", split, L, seed, n)
        stream = np.concatenate([np.asarray(data.ids[data.starts[d]:data.starts[d] + data.lens[d]], np.int64)
                                 for d in index.doc_idx])
        got = data.windows("train", split, L, seed, n)
        want = np.stack([stream[i * L:i * L + L + 1] for i in index.shuffle_idx[:n].astype(np.int64)])
        assert np.array_equal(got, want)
        tokens = data.tokens(data.documents("train", split))
        assert (index.num_epochs * tokens - 1) // L >= n > ((index.num_epochs - 1) * tokens - 1) // L
    assert build_index(data.lens, np.arange(5, dtype=np.int32), 3, 4, 0).num_epochs == 1


def test_epoch_steps_follow_paddlenlps_trainer() -> None:
    # max(1, int(E * max(1, ceil(N / batch) // grad_accum)))
    assert epoch_steps(10, 1, 4, 1) == 3
    assert epoch_steps(10, 2.5, 4, 1) == 7
    assert epoch_steps(10, 1, 4, 2) == 1
    assert epoch_steps(3, 3, 4, 4) == 3
    assert epoch_steps(100, 0.01, 4, 1) == 1
    assert parse_split("98/2") == (98.0, 2.0, 0.0)


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    p = tmp_path / "d"
    write_prefix(p, [3, 4])
    np.savez(f"{p}_idx.npz", lens=np.array([3, 5], np.int32), docs=np.array([0, 2]))
    with pytest.raises(PretrainDataError, match=r"lengths add up to 8 tokens, but d_ids\.npy holds 7"):
        PretrainCorpus.open(p)
    np.savez(f"{p}_idx.npz", lens=np.array([3, 4], np.int32))
    with pytest.raises(PretrainDataError, match="needs a 1-D integer array 'docs'"):
        PretrainCorpus.open(p)
    np.save(f"{p}_ids.npy", np.zeros((7,), np.float32))
    with pytest.raises(PretrainDataError, match="one 1-D integer array"):
        PretrainCorpus.open(p)


# -- the command ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("paddle")
    out = tmp_path_factory.mktemp("full") / "art"
    from ernie_ir.cli.app import main

    try:
        main(["compile", MODEL, "--target", "cuda", "--mode", "training", "--out", str(out)])
    except SystemExit as e:
        assert not e.code, e.code
    return out


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _bad(tmp_path: Path, name: str) -> str:
    """A pretraining PREFIX (or a file) under tmp_path that is wrong in the way `name` says."""
    p = tmp_path / "bad"
    if name == "only-ids":
        write_prefix(p, [20, 30])
        Path(f"{p}_idx.npz").unlink()
    elif name == "only-idx":
        write_prefix(p, [20, 30])
        Path(f"{p}_ids.npy").unlink()
    elif name == "mismatch":
        write_prefix(p, [20, 30])
        np.savez(f"{p}_idx.npz", lens=np.array([20, 31], np.int32), docs=np.array([0, 1, 2]))
    elif name == "docs":
        write_prefix(p, [20, 30], docs=[0, 1])
    elif name == "short":
        write_prefix(p, [5, 200])
    elif name == "jsonl":
        p = tmp_path / "bad.jsonl"
        p.write_text('{"input_ids": [1, 2, 3]}\n')
    else:
        write_prefix(p, [40] * 20)
    return str(p)


BAD = [
    ("only-ids", ["--steps", "1", "--max-seq-len", "8"], "bad_idx.npz is missing (", "bad_ids.npy is there"),
    ("only-idx", ["--steps", "1", "--max-seq-len", "8"], "bad_ids.npy is missing (", "bad_idx.npz is there"),
    ("mismatch", ["--steps", "1", "--max-seq-len", "8"],
     "lengths add up to 51 tokens, but bad_ids.npy holds 50", "do not belong together"),
    ("docs", ["--steps", "1", "--max-seq-len", "8"], "'docs' must run from 0 to len(lens) = 2", ""),
    ("short", ["--steps", "1", "--max-seq-len", "8", "--split", "1,1"], "holds 5 tokens, not one window",
     "--max-seq-len + 1 = 9"),
    ("ok", ["--steps", "1"], "is pretraining data: give --max-seq-len L", ""),
    ("ok", ["--steps", "1", "--max-seq-len", "8", "--split", "a,b"],
     "--split 'a,b': expected up to 3 numbers", ""),
    ("ok", ["--steps", "1", "--max-seq-len", "8", "--split", "1,2,3,4"], "expected up to 3 weights >= 0", ""),
    ("ok", ["--steps", "1", "--max-seq-len", "8", "--split", "1,-2"], "expected up to 3 weights >= 0", ""),
    ("ok", ["--steps", "1", "--max-seq-len", "8", "--split", "0,0,0"], "the weights add up to 0", ""),
    ("ok", ["--max-seq-len", "8", "--num-train-epochs", "0"], "--num-train-epochs must be a number > 0", ""),
    ("ok", ["--max-seq-len", "8", "--num-train-epochs", "-1"], "--num-train-epochs must be a number > 0", ""),
    ("ok", ["--max-seq-len", "8", "--num-train-epochs", "1", "--steps", "2"],
     "--steps 2 and --num-train-epochs 1.0 both say how long to train: give one of them", ""),
    ("ok", ["--max-seq-len", "8"], "give --steps N, or --num-train-epochs E with --data", ""),
    ("ok", ["--steps", "1", "--max-seq-len", "8", "--eval-data", "EVAL"],
     "and the validation part of --split 949,50,1 are both evaluation data", ""),
    ("jsonl", ["--steps", "1", "--split", "9,1"], "--split 9,1 cuts pretraining data", ""),
    (None, ["--num-train-epochs", "1"], "--num-train-epochs 1 needs --data", ""),
]


@pytest.mark.parametrize(("data", "argv", "says", "also"), BAD,
                         ids=[f"{d}-{' '.join(a)}" for d, a, _, _ in BAD])
def test_bad_input_is_one_line(art: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               data: str | None, argv: list[str], says: str, also: str) -> None:
    before = _files(art)
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text('{"input_ids": [1, 2, 3]}\n')
    argv = [str(eval_file) if a == "EVAL" else a for a in argv]
    data_args = [] if data is None else ["--data", _bad(tmp_path, data)]
    line = user_error(capsys, "train", str(art), *data_args, *argv)
    assert says in line and also in line, line
    assert _files(art) == before  # nothing written


def test_train_on_a_prefix(art: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = tmp_path / "pt"
    write_prefix(prefix, np.random.default_rng(2).integers(10, 60, size=40))
    code, out, err = cli(capsys, "train", str(art), "--data", str(prefix), "--max-seq-len", "16",
                         "--steps", "2", "--batch-size", "2", "--split", "90,10,0", "--json")
    assert code == 0, err
    run = json.loads(out)
    assert run["steps"] == 2 and len(run["losses"]) == 2
    assert all(math.isfinite(x) for x in run["losses"])
    ((step, eval_loss),) = run["eval_losses"]  # the validation part, at the end
    assert step == 2 and math.isfinite(eval_loss)
    # epochs: the steps follow from the training part's windows per pass
    code, out, err = cli(capsys, "train", str(art), "--data", str(prefix), "--max-seq-len", "16",
                         "--num-train-epochs", "0.1", "--batch-size", "4", "--split", "100,0,0", "--json")
    assert code == 0, err
    run = json.loads(out)
    per_pass = PretrainCorpus.open(prefix).windows_per_pass("train", "100,0,0", 16)
    assert run["steps"] == epoch_steps(per_pass, 0.1, 4, 1) == len(run["losses"])
    assert run["eval_losses"] == []


def test_epochs_on_json_lines(art: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1 + i, 2, 3, 4 + i]}) + "\n" for i in range(3)))
    code, out, err = cli(capsys, "train", str(art), "--data", str(data), "--num-train-epochs", "1.5",
                         "--batch-size", "2", "--json")
    assert code == 0, err
    run = json.loads(out)
    assert run["steps"] == 3 == len(run["losses"])  # int(1.5 * ceil(3 / 2))
