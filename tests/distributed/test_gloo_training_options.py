"""Training options on real paddle.distributed processes: a tp 2 run with padded data,
gradient accumulation, weight decay, a clip, warmup + cosine and another padding convention
equals the one-rank run with the same options, step for step; so does the rank worker started
as a device launch (`launch.sh`) starts it, with `--config train.yaml`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import compile_art, leftover_processes
from safetensors.numpy import load_file

from ernie_ir.backends.paddle.launch import RankProcesses
from ernie_ir.training.launch import WORKER as TRAINING_WORKER
from ernie_ir.training.loop import StepProgress, TrainHooks, train_artifact

MODEL = "ernie-4.5-0.3b@tiny"
OPTIONS = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 5e-3,
           "weight_decay": 0.1, "max_grad_norm": 0.5, "warmup_steps": 1, "lr_scheduler_type": "cosine",
           "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-6, "seed": 7, "pad_id": 3,
           "ignore_index": -1}


def test_tp2_with_every_option_equals_one_rank(tmp_path: Path) -> None:
    kw = {"mode": "training", "lora_rank": 4}
    one_art = compile_art(tmp_path, MODEL, "one", **kw)
    tp2_art = compile_art(tmp_path, MODEL, "tp2", tp=2, **kw)
    rng = np.random.default_rng(5)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": rng.integers(0, 1024, size=n).tolist()}) + "\n"
                            for n in (11, 4, 8, 6, 3, 9)))
    one = train_artifact(one_art, 3, data=data, options=OPTIONS).losses
    seen: list[StepProgress] = []
    tp2 = train_artifact(tp2_art, 3, data=data, options=OPTIONS, hooks=TrainHooks(on_progress=seen.append),
                         timeout_s=120).losses
    err = float(np.max(np.abs(np.subtract(tp2, one)) / np.abs(one)))
    print(f"[distributed] tp 2 with options vs 1 rank: losses {tp2}, max rel {err:.2e}")
    assert err < 1e-5
    assert [p.step for p in seen] == [1, 2, 3] and seen[0].lr == 0.0 and seen[1].lr == pytest.approx(5e-3)
    assert [p.tokens for p in seen] == [10 + 3 + 7 + 5, 2 + 8 + 10 + 3, 7 + 5 + 2 + 8]
    ref = load_file(str(one_art / "training/checkpoints/run-001-step-3/params.safetensors"))
    merged = load_file(str(tp2_art / "training/checkpoints/run-001-step-3/params.safetensors"))
    for name, want in ref.items():
        np.testing.assert_allclose(merged[name], want, rtol=1e-4, atol=5e-5, err_msg=name)
    assert not leftover_processes()
    # the device launch path: the rank worker started as launch.sh starts it, with --config
    config = tmp_path / "train.yaml"
    config.write_text("learning_rate: 0.01\nweight_decay: 0.1\nlr_scheduler_type: linear\n"
                      "per_device_train_batch_size: 2\nseed: 3\n")
    want = train_artifact(one_art, 2, save=False, options={
        "lr": 1e-2, "weight_decay": 0.1, "schedule": "linear", "batch_size": 2, "seed": 3}).losses
    losses = tmp_path / "losses.jsonl"
    args = ["--steps", "2", "--config", str(config), "--losses", str(losses)]
    ranks = RankProcesses(tp2_art, None, args, 2, tmp_path, worker=TRAINING_WORKER)
    ranks.start()
    ranks.wait(120)
    got = [json.loads(line)["loss"] for line in losses.read_text().splitlines()]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not leftover_processes()
