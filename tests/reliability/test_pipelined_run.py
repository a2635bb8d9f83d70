"""A pipelined artifact (`compile --pp 2`, tp 1) runs as the whole model (issue 41): `run` gives the
unsplit model's logits; what would run its rank-0 graph alone (stage 0, whose output is hidden
states) is refused or runs every stage; `--nnodes` and `verify` count its rank graphs (the
Mapping's `rank_graphs`), not `world_size`. Paddle's gloo run of a pipelined artifact is checked
against the interpreter's in tests/distributed/test_gloo_pipeline.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

MODEL = "ernie-4.5-0.3b@tiny"
IDS = np.arange(1, 15, dtype=np.int64).reshape(2, 7) * 37 % 1000


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pp_run") / "ids.npy"
    np.save(path, IDS)
    return path


@pytest.fixture(scope="module")
def model_logits(tmp_path_factory: pytest.TempPathFactory, ids_file: Path) -> np.ndarray:
    from ernie_ir.load import load_input
    from ernie_ir.runtime import Interpreter

    graph = load_input(MODEL)
    return Interpreter(graph).run({"input_ids": IDS})[graph.output_names[0]]


def _run_logits(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> np.ndarray:
    saved = tmp_path / "logits.npy"
    code, _, err = cli(capsys, "run", *argv, "--save-logits", str(saved))
    assert code == 0, err
    return np.load(saved)


def test_pp_artifact_runs_the_whole_model_on_the_interpreter(compiled_artifact, capsys, tmp_path, ids_file,
                                                            model_logits) -> None:
    art = compiled_artifact(MODEL, "cuda", pp=2)
    logits = _run_logits(capsys, tmp_path, str(art), "--tokens", str(ids_file), "--backend", "interpreter")
    assert logits.shape == (2, 7, 1024)
    np.testing.assert_allclose(logits, model_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("flags", [("--emulate", "bf16"), ("--quant", "wint8"), ("--pipeline", "dce")])
def test_one_graph_flags_on_a_pp_artifact_are_refused_before_work(compiled_artifact, capsys, flags) -> None:
    # before: rank0 alone (stage 0) ran and its hidden states [1, 3, 64] printed as the logits
    art = compiled_artifact(MODEL, "cuda", pp=2)
    line = user_error(capsys, "run", str(art), "--tokens", "1,2,3", "--backend", "interpreter", *flags)
    assert "holds 2 rank graphs" in line and "pp 2" in line and f"compiled from ({MODEL})" in line


def test_compare_to_a_pp_artifact_runs_every_stage(compiled_artifact, capsys) -> None:
    art = compiled_artifact(MODEL, "cuda", pp=2)
    code, out, err = cli(capsys, "run", MODEL, "--tokens", "5,6,7", "--compare-to", str(art), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["logits_shape"] == [1, 3, 1024]
    assert report["max_abs_error"] == 0.0 and report["top1_agreement"] == 1.0


def test_generate_compare_to_a_pp_artifact_runs_every_stage(compiled_artifact) -> None:
    from ernie_ir.generation.compare import compare_to
    from ernie_ir.load import load_input
    from ernie_ir.runtime import Interpreter
    from ernie_ir.runtime.decoding import DecodeResult

    art = compiled_artifact(MODEL, "cuda", pp=2)
    graph = load_input(MODEL)
    seq = [300, 400, 500]  # ids past the hidden width (64): stage 0's argmax could not agree
    for _ in range(3):  # the model's greedy tokens
        logits = Interpreter(graph).run({"input_ids": np.array([seq])})[graph.output_names[0]]
        seq.append(int(np.argmax(logits[0, -1])))
    result = DecodeResult(prompts=[seq[:3]], new_tokens=[seq[3:]], finish_reasons=["length"],
                          prefill_ms=0.0, decode_ms=[])
    assert compare_to(art, result).agreement == [1.0]


def test_nnodes_counts_the_rank_graphs(compiled_artifact, capsys) -> None:
    art = compiled_artifact(MODEL, "cuda", pp=2)
    # 2 processes (one per stage) do not split over 3 nodes: refused before anything starts
    # (before: world_size 1 read as "one rank", and every multi-node run of it refused)
    line = user_error(capsys, "run", str(art), "--tokens", "1,2", "--backend", "paddle", "--nnodes", "3",
                      "--node-rank", "0", "--master", "127.0.0.1:1")
    assert "does not divide the 2 processes" in line
    one = compiled_artifact("gpt-345m@tiny", "cuda")
    line = user_error(capsys, "run", str(one), "--tokens", "1,2", "--backend", "paddle", "--nnodes", "2",
                      "--node-rank", "0", "--master", "127.0.0.1:1")
    assert "is one rank graph" in line


def test_verify_counts_and_loads_every_rank_graph(compiled_artifact, capsys, tmp_path) -> None:
    art = compiled_artifact(MODEL, "cuda", pp=2)
    code, out, _ = cli(capsys, "verify", str(art))
    assert code == 0 and "2 rank graphs" in out and "pp 2" in out
    # a copy without stage 1 (its files gone from the folder and the manifest) is incomplete
    cut = compiled_artifact.copy(art, tmp_path / "cut")
    shutil.rmtree(cut / "rank1")
    manifest = json.loads((cut / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("rank1/")}
    (cut / "manifest.json").write_text(json.dumps(manifest))
    line = user_error(capsys, "verify", str(cut))
    assert "rank1/graph.ir is not listed" in line and "2 rank graph(s)" in line
