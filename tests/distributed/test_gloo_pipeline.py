"""Pipeline parallelism (`compile --pp`) on real paddle.distributed processes (gloo).

A `--pp 2` artifact holds every rank graph cut into two stages at a decoder-layer boundary; each
stage is one process (with --tp 2: two, each stage's pair its own tensor-parallel group), the
activations and their gradients cross the stages by gloo send/recv under 1F1B or GPipe with
micro-batches.

- training: pp 2 LoRA losses equal the one-rank run step for step (1e-5 relative) for the dense
  and the MoE ERNIE 4.5 families and GPT, under 1F1B and GPipe; the merged checkpoint equals the
  one-rank run's (AdamW's first steps amplify float noise in near-zero gradients: 1e-4 / 1e-5);
  the first stage never holds more than pp micro-batches under 1F1B, every one under GPipe;
- tp 2 x pp 2 with sp on 4 processes (MoE): losses equal one rank, the logits equal the
  interpreter's run of the same stages and the unsplit model;
- a checkpoint resumed is bit for bit the uninterrupted run; a trained pipelined artifact
  compiles for inference to the one-rank run's logits;
- bad input (one line, exit 2, nothing written or left running): more stages than layers,
  micro-batches not dividing the batch or without a pipeline, dp with pp, generate / eval / plan
  of a pipelined artifact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import user_error
from _dist_testkit import IDS, compile_art, leftover_processes, rel_err
from safetensors.numpy import load_file

from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir import ErnieIRError
from ernie_ir.load import load_input
from ernie_ir.runtime import Interpreter
from ernie_ir.training.loop import train_artifact

STEPS = 3
MODELS = {"dense": "ernie-4.5-0.3b@tiny", "moe": "ernie-4.5-21b-a3b@tiny", "gpt": "gpt-345m@tiny"}
LORA = {"mode": "training", "lora_rank": 4}


def _rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gloo-pp")
    out = {}
    for fam, model in MODELS.items():
        out[f"{fam}-one"] = compile_art(tmp, model, f"{fam}-one", **LORA)
        out[f"{fam}-pp"] = compile_art(tmp, model, f"{fam}-pp", pp=2, micro_batches=2, **LORA)
    return out


@pytest.fixture(scope="module")
def one_rank(arts: dict[str, Path]) -> dict[str, object]:
    return {fam: train_artifact(arts[f"{fam}-one"], STEPS) for fam in MODELS}


@pytest.fixture(scope="module")
def dense_pp(arts: dict[str, Path]) -> object:
    """The dense pp 2 artifact trained with its compiled defaults (1F1B, 2 micro-batches)."""
    return train_artifact(arts["dense-pp"], STEPS, timeout_s=240)


@pytest.mark.parametrize("fam", sorted(MODELS))
def test_pp2_training_equals_one_rank(arts: dict[str, Path], one_rank: dict[str, object], dense_pp: object,
                                      fam: str) -> None:
    ref = one_rank[fam]
    schedule, m = {"dense": ("1f1b", 2), "moe": ("1f1b", 4), "gpt": ("gpipe", 4)}[fam]
    run = dense_pp if fam == "dense" else train_artifact(
        arts[f"{fam}-pp"], STEPS, timeout_s=240, options={"pipeline_schedule": schedule, "micro_batches": m})
    assert not leftover_processes()
    err = _rel(run.losses, ref.losses)
    print(f"[distributed] {MODELS[fam]} LoRA pp 2 ({schedule}, {m} micro-batches) vs 1 rank: {run.losses} vs "
          f"{ref.losses}, max rel {err:.2e}")
    assert err < 1e-5
    manifest = json.loads((arts[f"{fam}-pp"] / "manifest.json").read_text())
    assert manifest["parallel"]["pp"] == 2 and manifest["parallel"]["ranks"] == ["rank0", "rank1"]
    want = load_file(str(ref.checkpoints[-1] / "params.safetensors"))
    got = load_file(str(run.checkpoints[-1] / "params.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    stages = [s["pipeline"] for s in run.rank_stats]
    assert [s["stage"] for s in stages] == [0, 1]
    # 1F1B: stage s holds at most min(pp - s, m) micro-batches; GPipe: all of them
    assert [s["peak_in_flight"] for s in stages] == ([m, m] if schedule == "gpipe" else [min(2, m), 1])
    assert all(0.0 <= s["idle_fraction"] < 1.0 and s["ideal_bubble"] == pytest.approx(1 / (m + 1))
               for s in stages)


def test_tp2_pp2_sp_four_processes_equal_one_rank(tmp_path: Path, arts: dict[str, Path],
                                                  one_rank: dict[str, object]) -> None:
    art = compile_art(tmp_path, MODELS["moe"], "moe-tp2-sp-pp2", tp=2, sp=True, pp=2, micro_batches=2,
                      **LORA)
    run = train_artifact(art, STEPS, timeout_s=300)
    assert not leftover_processes()
    err = _rel(run.losses, one_rank["moe"].losses)
    print(f"[distributed] {MODELS['moe']} LoRA tp 2 x pp 2 sp (4 processes) vs 1 rank: max rel {err:.2e}")
    assert err < 1e-5
    placed = [(s["mp_rank"], s["pipeline"]["stage"]) for s in run.rank_stats]
    assert placed == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # inference of the same layout: gloo == the interpreter's stages == the unsplit model
    inf = compile_art(tmp_path, MODELS["moe"], "moe-inf", tp=2, sp=True, pp=2, micro_batches=2)
    ref = Interpreter(load_input(MODELS["moe"])).run({"input_ids": IDS})["logits"]
    spmd = run_artifact(inf, IDS, "interpreter")
    gloo = run_artifact(inf, IDS, "paddle", timeout_s=180)
    assert not leftover_processes()
    assert rel_err(spmd, ref) < 1e-5 and rel_err(gloo, spmd) < 1e-5, (rel_err(spmd, ref), rel_err(gloo, spmd))


def test_resume_is_bit_for_bit_and_trained_artifact_compiles(tmp_path: Path, arts: dict[str, Path],
                                                             one_rank: dict[str, object],
                                                             dense_pp: object) -> None:
    art = compile_art(tmp_path, MODELS["dense"], "dense-pp", pp=2, micro_batches=2, **LORA)
    train_artifact(art, 2, timeout_s=240)
    rest = train_artifact(art, STEPS, resume=True, timeout_s=240)
    assert rest.losses == dense_pp.losses[2:]
    assert not leftover_processes()
    # serve what it learned: the trained pipelined artifact compiles (one rank) to the 1-rank run's model
    served = compile_art(tmp_path, str(arts["dense-pp"]), "served-pp",
                         checkpoint=dense_pp.checkpoints[-1].name)
    served_one = compile_art(tmp_path, str(arts["dense-one"]), "served-one",
                             checkpoint=one_rank["dense"].checkpoints[-1].name)
    a = run_artifact(served, IDS, "interpreter")
    b = run_artifact(served_one, IDS, "interpreter")
    assert rel_err(a, b) < 1e-4


def test_bad_pipeline_input_is_one_line(tmp_path: Path, arts: dict[str, Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad"
    inference = compile_art(tmp_path, MODELS["dense"], "dense-inf-pp", pp=2)
    ids = tmp_path / "ids.npy"
    np.save(ids, IDS)
    cases = [
        (["compile", MODELS["dense"], "--target", "cuda", "--pp", "3", "--out", str(out)],
         "has 2 decoder layer(s) and every stage needs at least one: give --pp 2 or less"),
        (["compile", MODELS["dense"], "--target", "cuda", "--micro-batches", "2", "--out", str(out)],
         "it needs --pp 2 or more"),
        (["compile", MODELS["dense"], "--target", "cuda", "--mode", "training", "--lora-rank", "2",
          "--pp", "2", "--dp", "2", "--out", str(out)], "data parallelism of a pipelined model is not built"),
        (["compile", MODELS["dense"], "--target", "cuda", "--pp", "2", "--emit", "fastdeploy", "--out",
          str(out)], "a FastDeploy checkpoint is tensor-parallel only"),
        (["train", str(arts["dense-pp"]), "--steps", "1", "--micro-batches", "3"],
         "--micro-batches 3 does not divide the batch of 4 row(s): use one of [1, 2, 4]"),
        (["train", str(arts["dense-one"]), "--steps", "1", "--micro-batches", "2"],
         "this artifact has none: compile it with --pp N"),
        (["train", str(arts["dense-pp"]), "--steps", "1", "--dp", "2"],
         "data parallelism of a pipelined artifact is not built"),
        (["generate", str(inference), "--prompt-ids", "1,2,3"], "is pipelined (--pp 2)"),
        (["eval", str(inference), "--data", str(ids)], "is pipelined (--pp 2)"),
        (["plan", str(arts["dense-pp"]), "--target", "cuda", "--mode", "training"],
         "plan its source model with the same --tp/--ep/--sp and --pp 2"),
    ]
    for args, want in cases:
        line = user_error(capsys, *args)  # exit 2, one error line, no traceback
        assert want in line, (args, line)
        assert not out.exists()
    assert not leftover_processes()


def test_micro_batches_dividing_check_is_library_level() -> None:
    from ernie_ir.backends.paddle.pipeline_schedule import check_micro_batches

    assert check_micro_batches(8, 4) == 2
    with pytest.raises(ErnieIRError, match="use one of \\[1, 2, 3, 6\\]"):
        check_micro_batches(6, 4)
