"""Resuming a tensor-parallel run on real paddle.distributed processes: a tp 2 run resumed from
its step-2 checkpoint equals the run that was not interrupted bit for bit (losses, evaluation
loss, every rank's params and optimizer state, the merged params, each rank's RNG state), with
LoRA dropout drawing random numbers on both ranks; the checkpoints are reported to the calling
process (on_checkpoint) and the newest --save-total-limit are kept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import compile_art, leftover_processes
from safetensors.numpy import load_file

from ernie_ir.ir import ErnieIRError
from ernie_ir.targets import verify_artifact
from ernie_ir.training.loop import TrainHooks, train_artifact

MODEL = "ernie-4.5-0.3b@tiny"
OPTIONS = {"batch_size": 2, "grad_accum": 2, "lr": 5e-3, "schedule": "cosine", "warmup_steps": 1}


def test_tp2_resumed_run_is_the_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    art = compile_art(tmp_path, MODEL, "tp2", tp=2, mode="training", pipeline="lora{rank=4,dropout=0.3}")
    rng = np.random.default_rng(5)
    seqs = [(rng.integers(0, 1024, size=n).tolist(), None) for n in (11, 4, 8, 6, 3, 9)]
    evals = [(rng.integers(0, 1024, size=n).tolist(), None) for n in (7, 5)]
    kw = {"data": seqs, "options": {**OPTIONS, "eval_steps": 2, "save_steps": 2}, "eval_sequences": evals,
          "timeout_s": 180}
    seen: list[tuple[str, bool]] = []

    def on_checkpoint(folder: Path) -> None:
        seen.append((folder.name, (folder / "trainer_state.json").is_file()))

    full = train_artifact(art, 4, hooks=TrainHooks(on_checkpoint=on_checkpoint), **kw)
    assert not leftover_processes()
    assert seen == [("run-001-step-2", True), ("run-001-step-4", True)]
    assert [p.name for p in full.checkpoints] == ["run-001-step-2", "run-001-step-4"]
    assert [s for s, _ in full.eval_losses] == [2, 4]
    folder = full.checkpoints[0]
    assert sorted(p.name for p in folder.iterdir()) == [
        "optimizer.rank0.safetensors", "optimizer.rank1.safetensors", "params.safetensors",
        "rank0.safetensors", "rank1.safetensors", "trainer_state.json"]
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and sorted(state["rng_state"]) == ["rank0", "rank1"]

    with pytest.raises(ErnieIRError, match=r"--lr 0\.001 differs"):  # refused before any process starts
        train_artifact(art, 4, resume="run-001-step-2", **{**kw, "options": {**kw["options"], "lr": 1e-3}})
    seen.clear()
    resumed = train_artifact(art, 4, resume="run-001-step-2", hooks=TrainHooks(on_checkpoint=on_checkpoint),
                             **{**kw, "options": {**kw["options"], "save_total_limit": 2}})
    assert not leftover_processes()
    print(f"[distributed] tp 2 resume from step 2: losses {resumed.losses} vs {full.losses[2:]}, eval "
          f"{resumed.eval_losses} vs {full.eval_losses[1:]}")
    assert resumed.first_step == 3 and resumed.losses == full.losses[2:]
    assert resumed.eval_losses == full.eval_losses[1:]
    assert seen == [("run-002-step-4", True)]
    # the newest two of the artifact stay: run-001-step-4 and run-002-step-4
    names = sorted(p.name for p in (art / "training/checkpoints").iterdir())
    assert names == ["run-001-step-4", "run-002-step-4"]
    assert [p.name for p in resumed.checkpoints] == names[1:]
    a, b = (art / "training/checkpoints" / n for n in names)
    for f in sorted(p.name for p in a.glob("*.safetensors")):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        assert sorted(ta) == sorted(tb), f
        for key in ta:
            np.testing.assert_array_equal(tb[key], ta[key], err_msg=f"{f}: {key}")
    sa, sb = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    assert sa["rng_state"] == sb["rng_state"] and sb["resumed_from"] == "run-001-step-2"
    verify_artifact(art)
