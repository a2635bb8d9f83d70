"""benchmarks/quant_calibrated.py at toy size: its corpus, training start, cache and one measured row."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench() -> ModuleType:
    """The benchmark module, loaded from its file once."""
    name = "quant_calibrated_bench"
    if name not in sys.modules:
        sys.path.insert(0, str(BENCH))
        spec = importlib.util.spec_from_file_location(name, BENCH / "quant_calibrated.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up while being built
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_stdlib_corpus_is_fixed_and_split_apart() -> None:
    sys.path.insert(0, str(BENCH))
    from _stdlib_text import corpus_digest, split_documents, stdlib_documents

    docs = stdlib_documents(("json", "textwrap", "fractions"))
    assert docs == stdlib_documents(("json", "textwrap", "fractions"))
    assert corpus_digest(docs) == corpus_digest(list(docs))
    assert docs[0][0] == "json" and all(len(t) >= 80 for _, t in docs)
    train, held = split_documents(docs, every=3)
    assert held and train and not set(train) & set(held) and len(train) + len(held) == len(docs)
    # a document's side depends on its name alone
    assert split_documents(docs[::-1], every=3)[1] == held[::-1]


def test_calibration_windows_come_from_the_training_stream() -> None:
    bench = _bench()
    docs = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    windows = bench.calib_windows(docs, 4, 3, seed=0)
    stream = [t for d in docs for t in d]
    assert windows.shape == (4, 3)
    for w in windows.tolist():
        assert any(stream[i:i + 3] == w for i in range(len(stream) - 2))


@pytest.mark.slow
def test_quick_run_trains_caches_and_measures(tmp_path: Path) -> None:
    bench = _bench()
    settings = replace(bench.QUICK, eval_tokens=96)
    logs: list[str] = []
    corpus = bench.load_corpus(("json", "textwrap", "fractions", "argparse", "pathlib"))
    rows = bench.run(["dense"], ["wint4"], ["rtn"], settings, tmp_path, log=logs.append, corpus=corpus)
    assert [(r.preset, r.method) for r in rows] == [("float (bf16)", "-"), ("wint4", "rtn")]
    ckpt = next(tmp_path.glob("dense-*"))
    assert {"config.json", "tokenizer.json", "bench_train.json"} <= {p.name for p in ckpt.iterdir()}
    # the training start, not the generated weights' (std 1 embedding: perplexity ~1e35): two steps
    # leave the model near uniform over the vocabulary
    assert rows[0].perplexity < 2 * settings.vocab
    assert 0 < rows[1].kl_mean < 1 and math.isfinite(rows[1].perplexity)
    assert rows[1].bytes < rows[0].bytes
    # the second run reads the cached checkpoint instead of training
    logs.clear()
    again = bench.run(["dense"], ["wint4"], ["rtn"], settings, tmp_path, log=logs.append, corpus=corpus)
    assert any("cached checkpoint" in m for m in logs) and not any("trained" in m for m in logs)
    assert np.isclose(again[1].kl_mean, rows[1].kl_mean)
