"""eval's float perplexity against the reference libraries' own `labels=` loss (issue 21 item 4):
transformers and paddleformers build random ERNIE 4.5 checkpoints, report their loss over the same
token ids, and `evaluate` on the saved checkpoint gives the same mean NLL (to 1e-5 relative)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _fe_testkit import run_reference

from ernie_ir.evaluation import evaluate

pytestmark = [pytest.mark.reference, pytest.mark.slow]

IDS = np.random.default_rng(11).integers(0, 128, (3, 17)).tolist()


@pytest.mark.parametrize(("env", "script"), [("hf", "hf_ernie_dense.py"), ("pf", "pf_ernie_dense.py")])
def test_float_perplexity_is_the_libraries_loss(env: str, script: str, tmp_path: Path):
    out = run_reference(env, script, {"input_ids": IDS, "labels_loss": True, "seed": 2}, tmp_path / "ref")
    loss = json.loads((out / "loss.json").read_text())["loss"]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in IDS))
    report = evaluate(out / "ckpt", data, seq_len=32)  # one window per row: every token after the first
    assert report.tokens_scored == 3 * 16
    assert report.mean_nll == pytest.approx(loss, rel=1e-5)
    assert report.perplexity == pytest.approx(float(np.exp(loss)), rel=1e-5)
