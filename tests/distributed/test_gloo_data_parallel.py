"""Data parallelism and ZeRO sharding on real paddle.distributed (gloo) processes.

- dp 2 (2 processes) over the same global batches equals one rank: losses, evaluation losses
  and the one checkpoint (params, replica 0's optimizer state) to float tolerance (the batch
  split changes the summation order); the last batch has 1 row, so replica 1 has none at step 3.
  Stage 1 and stage 2 (given to `train` on a dp 2 artifact) equal unsharded dp 2 bit for bit:
  losses, params, and the optimizer state, which the ranks' shards partition. The per-rank
  optimizer-state bytes, measured on the ranks from the tensors held, halve; stage 2 halves
  the gradients held after the reduce too. The clip is active (step 1's gradient norm is over
  7 times clip_norm), so bit-equal params mean bit-equal clip coefficients.
- dp 2 x tp 2 (4 processes, stage 2 sharding from the compile) equals one rank likewise.
- A stage-1 run (LoRA dropout drawing random numbers on both replicas) resumed from its step-2
  checkpoint equals the uninterrupted run bit for bit; resuming it on another layout is refused
  in one line that names both.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _dist_testkit import compile_art, leftover_processes
from safetensors.numpy import load_file

from ernie_ir.backends.paddle.layer import build_layer, require_paddle
from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.storage import load_graph
from ernie_ir.training.loop import (
    read_training_artifact,
    resolve_options,
    token_loss_sum,
    train_artifact,
    training_batches,
)

MODEL = "ernie-4.5-0.3b@tiny"
STEPS = 4
CLIP = 1.0
OPTIONS = {"batch_size": 4, "clip_norm": CLIP}
LENGTHS = (11, 4, 8, 6, 3, 9, 5, 7, 2)  # batches of 4, 4 and 1 rows; step 4 wraps to the first


def _data() -> tuple[list[Any], list[Any]]:
    rng = np.random.default_rng(5)
    seqs = [(rng.integers(0, 1024, size=n).tolist(), None) for n in LENGTHS]
    evals = [(rng.integers(0, 1024, size=n).tolist(), None) for n in (7, 5, 9)]
    return seqs, evals


def _rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


def _state_bytes(art: Path, rank: int) -> int:
    """AdamW's state of rank `rank`'s trainable params, from its graph: two float32 moments per
    element and two float32 beta powers per param."""
    g = load_graph(art / f"rank{rank}")
    return sum(8 * int(np.prod(p.type.shape)) + 8 for p in g.params.values() if p.trainable)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The one-rank reference run (in this process), and its artifact."""
    tmp = tmp_path_factory.mktemp("dp-one")
    art = compile_art(tmp, MODEL, "one", mode="training", lora_rank=4)
    seqs, evals = _data()
    return art, train_artifact(art, STEPS, seqs, options={**OPTIONS, "eval_steps": 2}, eval_sequences=evals)


def _files(folder: Path) -> dict[str, dict[str, np.ndarray]]:
    return {p.name: load_file(str(p)) for p in sorted(folder.glob("*.safetensors"))}


def test_dp2_equals_one_rank_and_sharding_equals_unsharded(one: tuple[Path, Any], tmp_path: Path) -> None:
    one_art, ref = one
    paddle = require_paddle()
    graph = load_graph(one_art / "rank0")
    _, recipe, _ = read_training_artifact(one_art)
    ids, labels = training_batches(recipe, graph, _data()[0], options=resolve_options(recipe, OPTIONS))[0]
    layer = build_layer(graph, device="cpu")
    layer.train()
    loss_sum, count = token_loss_sum(paddle, layer, ids, labels)
    (loss_sum / count).backward()
    norm0 = float(np.sqrt(sum(float((p.grad.numpy().astype(np.float64) ** 2).sum())
                              for p in layer.trainable_parameters())))
    assert norm0 > 5 * CLIP  # the clip scales the update

    art = compile_art(tmp_path, MODEL, "dp2", mode="training", lora_rank=4, dp=2)
    seqs, evals = _data()
    runs: dict[str, Any] = {}
    for stage in ("none", "stage1", "stage2"):
        t0 = time.perf_counter()
        options = {**OPTIONS, "sharding": stage, "eval_steps": 2}
        runs[stage] = train_artifact(art, STEPS, seqs, options=options, eval_sequences=evals, timeout_s=180)
        print(f"[distributed] dp 2 sharding {stage}: {time.perf_counter() - t0:.1f} s, losses "
              f"{runs[stage].losses}")
        assert not leftover_processes()
    dp2 = runs["none"]
    err = _rel(dp2.losses, ref.losses)
    eval_err = _rel([v for _, v in dp2.eval_losses], [v for _, v in ref.eval_losses])
    print(f"[distributed] dp 2 vs 1 rank: losses max rel {err:.2e}, eval max rel {eval_err:.2e}")
    assert err < 1e-5 and eval_err < 1e-5
    assert [s for s, _ in dp2.eval_losses] == [2, 4]

    # one checkpoint: replica 0's params and optimizer state; trainer_state records the layout
    folder = dp2.checkpoints[-1]
    assert [p.name for p in dp2.checkpoints] == [f"run-001-step-{STEPS}"]
    assert sorted(p.name for p in folder.iterdir()) == ["optimizer.rank0.safetensors", "params.safetensors",
                                                        "trainer_state.json"]
    state = json.loads((folder / "trainer_state.json").read_text())
    assert (state["world_size"], state["dp"], state["sharding"]) == (1, 2, None)
    assert sorted(state["rng_state"]) == ["rank0", "rank1"]
    want, got = _files(ref.checkpoints[-1]), _files(folder)
    assert sorted(got) == sorted(want)
    worst = 0.0
    for f in want:
        assert sorted(got[f]) == sorted(want[f])
        for k in want[f]:
            np.testing.assert_allclose(got[f][k], want[f][k], rtol=1e-4, atol=1e-5, err_msg=f"{f}: {k}")
            worst = max(worst, float(np.max(np.abs(got[f][k] - want[f][k]))))
    print(f"[distributed] dp 2 vs 1 rank checkpoint: max abs {worst:.2e}")

    # stage 1 and 2: bit for bit the unsharded run; the shards partition its optimizer state
    full = dp2.rank_stats[0]["optimizer_state_bytes"]
    assert full == ref.rank_stats[0]["optimizer_state_bytes"] == _state_bytes(art, 0)
    assert [s["optimizer_state_bytes"] for s in dp2.rank_stats] == [full, full]
    grads = ref.rank_stats[0]["gradient_bytes"]
    for stage in ("stage1", "stage2"):
        run = runs[stage]
        assert run.losses == dp2.losses, stage
        assert run.eval_losses == dp2.eval_losses, stage
        ckpt = run.checkpoints[-1]
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "optimizer.rank0.safetensors", "optimizer.rank1.safetensors", "params.safetensors",
            "trainer_state.json"]
        files = _files(ckpt)
        for k, v in got["params.safetensors"].items():
            np.testing.assert_array_equal(files["params.safetensors"][k], v, err_msg=f"{stage}: {k}")
        shards = [files[f"optimizer.rank{r}.safetensors"] for r in (0, 1)]
        assert not set(shards[0]) & set(shards[1])
        merged = {**shards[0], **shards[1]}
        assert sorted(merged) == sorted(got["optimizer.rank0.safetensors"])
        for k, v in got["optimizer.rank0.safetensors"].items():
            np.testing.assert_array_equal(merged[k], v, err_msg=f"{stage}: {k}")
        held = [s["optimizer_state_bytes"] for s in run.rank_stats]
        kept = [s["gradient_bytes"] for s in run.rank_stats]
        print(f"[distributed] optimizer state bytes per rank: dp 1 {full}, dp 2 {[full, full]}, dp 2 "
              f"{stage} {held}; gradient bytes held: dp 1 {grads}, dp 2 {stage} {kept}")
        assert sum(held) == full and max(held) <= 0.55 * full
        if stage == "stage2":
            assert sum(kept) == grads and max(kept) <= 0.55 * grads
        else:
            assert kept == [grads, grads]


def test_dp2_tp2_stage2_on_4_processes_equals_one_rank(one: tuple[Path, Any], tmp_path: Path) -> None:
    _, ref = one
    art = compile_art(tmp_path, MODEL, "dp2tp2", mode="training", lora_rank=4, tp=2, dp=2,
                      sharding="stage2")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["parallel"]["processes"] == 4
    assert not (art / "rank2").exists()  # the replicas share rank0/ and rank1/
    seqs, evals = _data()
    t0 = time.perf_counter()
    run = train_artifact(art, STEPS, seqs, options={**OPTIONS, "eval_steps": 2}, eval_sequences=evals,
                         timeout_s=240)
    took = time.perf_counter() - t0
    assert not leftover_processes()
    err = _rel(run.losses, ref.losses)
    eval_err = _rel([v for _, v in run.eval_losses], [v for _, v in ref.eval_losses])
    print(f"[distributed] dp 2 x tp 2 stage2 (4 processes, {took:.1f} s) vs 1 rank: losses {run.losses}, "
          f"max rel {err:.2e}, eval max rel {eval_err:.2e}")
    assert err < 1e-5 and eval_err < 1e-5
    folder = run.checkpoints[-1]
    assert sorted(p.name for p in folder.iterdir()) == [
        *(f"optimizer.rank{r}.safetensors" for r in range(4)), "params.safetensors", "rank0.safetensors",
        "rank1.safetensors", "trainer_state.json"]
    want = load_file(str(ref.checkpoints[-1] / "params.safetensors"))
    got = load_file(str(folder / "params.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # process g = replica g // 2 of rank graph g % 2: each mp rank's state split over its 2 replicas
    stats = run.rank_stats
    assert [(s["dp_index"], s["mp_rank"]) for s in stats] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for m in (0, 1):
        held = [stats[m]["optimizer_state_bytes"], stats[2 + m]["optimizer_state_bytes"]]
        assert sum(held) == _state_bytes(art, m) and max(held) <= 0.55 * _state_bytes(art, m)
        keys = [set(load_file(str(folder / f"optimizer.rank{g}.safetensors"))) for g in (m, 2 + m)]
        params = load_file(str(folder / f"rank{m}.safetensors"))
        assert not keys[0] & keys[1] and len(keys[0] | keys[1]) == 4 * len(params)  # 4 AdamW tensors each


def test_sharded_resume_is_bit_for_bit_and_another_layout_is_refused(tmp_path: Path) -> None:
    art = compile_art(tmp_path, MODEL, "dp2s1", mode="training", pipeline="lora{rank=4,dropout=0.3}", dp=2,
                      sharding="stage1")
    seqs, evals = _data()
    kw: dict[str, Any] = {"options": {"batch_size": 2, "grad_accum": 2, "lr": 5e-3, "schedule": "cosine",
                                      "warmup_steps": 1, "save_steps": 2},
                          "eval_sequences": evals, "timeout_s": 180}
    full = train_artifact(art, 4, seqs, **kw)
    assert not leftover_processes()
    assert [p.name for p in full.checkpoints] == ["run-001-step-2", "run-001-step-4"]
    refused = (r"trained on dp 2 x mp 1, sharding stage1, this run is dp 2 x mp 1, no sharding.*"
               r"--dp 2 --sharding stage1")
    with pytest.raises(ErnieIRError, match=refused):  # before any process starts
        train_artifact(art, 4, seqs, resume="run-001-step-2", **{**kw, "options": {**kw["options"],
                                                                                   "sharding": "none"}})
    resumed = train_artifact(art, 4, seqs, resume="run-001-step-2", **kw)
    assert not leftover_processes()
    print(f"[distributed] dp 2 stage1 resume from step 2: {resumed.losses} vs {full.losses[2:]}")
    assert resumed.first_step == 3 and resumed.losses == full.losses[2:]
    assert resumed.eval_losses == full.eval_losses and [s for s, _ in full.eval_losses] == [4]
    a, b = full.checkpoints[-1], resumed.checkpoints[-1]
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb) == ["optimizer.rank0.safetensors", "optimizer.rank1.safetensors",
                                        "params.safetensors"]
    for f in fa:
        assert sorted(fa[f]) == sorted(fb[f]), f
        for k in fa[f]:
            np.testing.assert_array_equal(fb[f][k], fa[f][k], err_msg=f"{f}: {k}")
    sa, sb = (json.loads((p / "trainer_state.json").read_text()) for p in (a, b))
    assert sa["rng_state"] == sb["rng_state"] and sorted(sa["rng_state"]) == ["rank0", "rank1"]
    assert sa["rng_state"]["rank0"] != sa["rng_state"]["rank1"]  # each replica draws its own dropout
