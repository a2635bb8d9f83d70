"""Sensitivity (one unit quantized at a time) and mixed precision by a KL budget (issue 21)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _cli_kit import cli, user_error

from ernie_ir.evaluation import evaluate
from ernie_ir.evaluation.sensitivity import EvalError, sensitivity, tune
from ernie_ir.load import load_input
from ernie_ir.passes.quant.config import QuantConfig, find_targets
from ernie_ir.targets.compile import CompileOptions, compile_model

MODEL = "ernie-4.5-21b-a3b@tiny"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(2)
    path = tmp_path_factory.mktemp("cal") / "c.jsonl"
    path.write_text("".join(json.dumps({"input_ids": rng.integers(0, 1024, 48).tolist()}) + "\n"
                            for _ in range(2)))
    return path


@pytest.mark.slow
def test_every_unit_has_a_cost_and_the_two_measures_agree(data: Path, tmp_path: Path, capsys):
    report = sensitivity(MODEL, data, seq_len=24)
    units = {s.path for s in find_targets(load_input(MODEL))}
    assert {u.unit for u in report.units} == units
    assert any(u.kind == "experts" for u in report.units)
    assert all(u.kl > 0 and u.approx > 0 for u in report.units)
    assert [u.kl for u in report.units] == sorted((u.kl for u in report.units), reverse=True)
    assert report.spearman is not None and report.spearman > 0
    plot = tmp_path / "s.svg"
    code, out, err = cli(capsys, "sensitivity", MODEL, "--data", str(data), "--seq-len", "24",
                         "--mode", "approx", "--plot", str(plot), "--json")
    assert code == 0, err
    approx = json.loads(out)
    assert {u["unit"] for u in approx["units"]} == units and approx["spearman"] is None
    rects = [e for e in ET.parse(plot).getroot().iter() if e.tag.endswith("rect")]
    assert len(rects) == len(units)


@pytest.mark.slow
def test_a_tuned_config_meets_its_budget_and_compiles(data: Path, tmp_path: Path, capsys):
    out_file = tmp_path / "tuned.yaml"
    code, out, err = cli(capsys, "tune", MODEL, "--data", str(data), "--seq-len", "24", "--budget", "0.002",
                         "--out", str(out_file), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["kl"] <= 0.002
    presets = {p["config"]: p for p in result["presets"]}
    for p in presets.values():  # a preset within the budget is never beaten on bytes by the tuned one
        if p["kl"] <= 0.002:
            assert result["weight_bytes"] <= p["weight_bytes"]
    assert result["weight_bytes"] < presets["wint8"]["weight_bytes"]
    config = QuantConfig.from_yaml(out_file)
    assert {r.algo.value for r in config.rules} <= {"weight_only_int4", "weight_only_int8"}
    art = compile_model(MODEL, "cuda", CompileOptions(quant_config=out_file, out=tmp_path / "art",
                        cuda_arch=70))
    measured = evaluate(art.out, data, compare_to=MODEL, seq_len=24)
    assert measured.kl_mean == pytest.approx(result["kl"], rel=1e-3)


@pytest.mark.slow
def test_budgets_no_configuration_meets_are_refused(data: Path):
    with pytest.raises(EvalError, match="smallest KL reached is"):
        tune(MODEL, data, budget=1e-9, formats=["int4"], seq_len=24)


@pytest.mark.parametrize(("command", "args", "fragment"), [
    ("sensitivity", ["--format", "int3"], "unknown --format"),
    ("sensitivity", ["--mode", "fast"], "unknown --mode"),
    ("tune", ["--budget", "0", "--out", "{tmp}/q.yaml"], "--budget must be a KL above 0"),
    ("tune", ["--budget", "0.1", "--formats", "int2", "--out", "{tmp}/q.yaml"], "unknown format"),
    ("tune", ["--budget", "0.1", "--out", "{tmp}/none/q.yaml"], "does not exist"),
])
def test_bad_input_is_one_line(data: Path, tmp_path: Path, command: str, args: list[str], fragment: str,
                               capsys):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert fragment in user_error(capsys, command, MODEL, "--data", str(data), *args)
    assert not (tmp_path / "q.yaml").exists()
