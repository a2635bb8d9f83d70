"""Multi-rank artifacts on real paddle.distributed processes (2 gloo ranks on this CPU).

Each artifact's logits from `run --backend paddle` (one process per rank, each building its
Paddle Layer from its rank{r}/ graph, collectives through paddle.distributed) must equal the
SPMD interpreter's (every rank graph in lockstep in one process) to 1e-5 relative: the only
difference is float32 summation order inside the Paddle kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import IDS, compile_art, leftover_processes, rel_err

from ernie_ir.backends.sessions import run_artifact
from ernie_ir.cli.app import main

CASES = {
    "dense": ("ernie-4.5-0.3b@tiny", {"tp": 2}),
    "moe-ep": ("ernie-4.5-300b-a47b@tiny", {"tp": 2, "ep": 2, "quant": "wint8mix"}),
    "se": ("ernie-3.5-se-3b@tiny", {"tp": 2}),
    "gpt": ("gpt-345m@tiny", {"tp": 2}),
}


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gloo-inference")
    return {name: compile_art(tmp, model, name, **kw) for name, (model, kw) in CASES.items()}


@pytest.mark.parametrize("case", ["moe-ep", "se", "gpt"])
def test_gloo_logits_equal_spmd(arts: dict[str, Path], case: str) -> None:
    art = arts[case]
    spmd = run_artifact(art, IDS, "interpreter")
    gloo = run_artifact(art, IDS, "paddle", timeout_s=120)
    assert gloo.shape == spmd.shape == (*IDS.shape, 1024)
    err = rel_err(gloo, spmd)
    print(f"[distributed] {CASES[case][0]} {CASES[case][1]}: gloo vs SPMD rel {err:.2e}")
    assert err < 1e-5
    assert (gloo.argmax(-1) == spmd.argmax(-1)).mean() == 1.0
    assert not leftover_processes()


def test_cli_run_backend_paddle_reports_like_one_rank(arts: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`ernie-ir run ART --backend paddle` on 2 ranks: --json, --save-logits and --compare-to
    work as for one rank (they happen in the CLI, on rank 0's logits)."""
    art = arts["dense"]
    ids = tmp_path / "ids.npy"
    np.save(ids, IDS)
    saved = tmp_path / "logits.npy"
    with pytest.raises(SystemExit) as done:
        main(["run", str(art), "--tokens", str(ids), "--backend", "paddle", "--json", "--save-logits",
              str(saved), "--compare-to", "ernie-4.5-0.3b@tiny", "--timeout", "120"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    report = json.loads(out)
    assert report["backend"] == "paddle" and report["logits_shape"] == [*IDS.shape, 1024]
    assert report["top1_agreement"] == 1.0 and report["rel_error"] < 1e-5  # float model: split is exact
    gloo = np.load(saved)
    err_spmd = rel_err(gloo, run_artifact(art, IDS, "interpreter"))
    print(f"[distributed] ernie-4.5-0.3b@tiny tp 2: gloo vs SPMD rel {err_spmd:.2e}")
    assert err_spmd < 1e-5
    assert report["argmax"] == gloo.argmax(-1).tolist()
    assert not leftover_processes()
