"""Tensor-parallel LoRA training on real paddle.distributed processes equals one-rank training.

The same model + pipeline compiled with and without --tp 2: the per-step losses agree step
for step (1e-5 relative), the global gradient norm the clip uses is the whole model's, and
the checkpoint merged from the two ranks' slices (global names and shapes, by the `shard`
annotations: params.safetensors) equals the one-rank checkpoint. ernie-4.5-0.3b@tiny has 1 KV head at tp 2, so
its KV projections (and their LoRA B columns) are held by both ranks: the shared-slice
gradient sum is exercised too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import compile_art, leftover_processes
from safetensors.numpy import load_file

from ernie_ir.backends.paddle.launch import RankProcesses
from ernie_ir.backends.paddle.layer import build_layer, require_paddle
from ernie_ir.ir.storage import load_graph
from ernie_ir.targets import verify_artifact
from ernie_ir.training.launch import WORKER as TRAINING_WORKER
from ernie_ir.training.loop import (
    TrainHooks,
    next_token_loss,
    read_training_artifact,
    train_artifact,
    training_batches,
)

STEPS = 3
MODEL = "ernie-4.5-0.3b@tiny"


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gloo-training")
    kw = {"mode": "training", "lora_rank": 4}
    return {"one": compile_art(tmp, MODEL, "one", **kw), "tp2": compile_art(tmp, MODEL, "tp2", tp=2, **kw),
            "moe-one": compile_art(tmp, "ernie-4.5-300b-a47b@tiny", "moe-one", **kw),
            "moe-ep": compile_art(tmp, "ernie-4.5-300b-a47b@tiny", "moe-ep", tp=2, ep=2, **kw)}


def _close(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


def test_tp2_losses_and_merged_checkpoint_equal_one_rank(arts: dict[str, Path]) -> None:
    one = train_artifact(arts["one"], STEPS).losses
    seen: list[tuple[int, float]] = []
    published: list[Path] = []
    hooks = TrainHooks(on_step=lambda s, v: seen.append((s, v)), on_checkpoint=published.append)
    result = train_artifact(arts["tp2"], STEPS, hooks=hooks, timeout_s=120)
    tp2 = result.losses
    err = _close(tp2, one)
    print(f"[distributed] {MODEL} LoRA tp 2 vs 1 rank, {STEPS} steps: losses {tp2}, max rel {err:.2e}")
    assert err < 1e-5
    assert seen == list(enumerate(tp2, 1))  # streamed as rank 0 reported them
    assert not leftover_processes()

    ref = load_file(str(arts["one"] / f"training/checkpoints/run-001-step-{STEPS}/params.safetensors"))
    folder = arts["tp2"] / f"training/checkpoints/run-001-step-{STEPS}"
    assert result.checkpoints == published == [folder]  # reported to the calling process
    files = ["optimizer.rank0.safetensors", "optimizer.rank1.safetensors", "params.safetensors",
             "rank0.safetensors", "rank1.safetensors", "trainer_state.json"]
    assert sorted(p.name for p in folder.iterdir()) == files
    merged = load_file(str(folder / "params.safetensors"))
    assert sorted(merged) == sorted(ref)
    for name, want in ref.items():
        assert merged[name].shape == want.shape, name
        # Adam divides by sqrt(v): float noise in near-zero gradients moves a param by a small
        # fraction of one lr step, so the bound is absolute, a hundredth of the 1e-3 step.
        np.testing.assert_allclose(merged[name], want, rtol=1e-4, atol=1e-5, err_msg=name)
    ranks = [load_file(str(folder / f"rank{r}.safetensors")) for r in range(2)]
    graphs = [load_graph(arts["tp2"] / f"rank{r}") for r in range(2)]
    cut = [n for n in ref if "shard" in graphs[0].params[n].annotations]
    whole = [n for n in ref if "shard" not in graphs[0].params[n].annotations]
    assert cut and whole  # LoRA B of column layers and A of row layers are cut; the others whole
    for r in range(2):
        for n in ref:
            assert ranks[r][n].shape == tuple(graphs[r].params[n].type.shape)
        for n in whole:
            np.testing.assert_array_equal(ranks[r][n], ranks[0][n])  # replicated stay identical
    manifest = verify_artifact(arts["tp2"])  # every checkpoint file listed with its sha256
    assert {f"training/checkpoints/run-001-step-{STEPS}/{f}" for f in files} <= set(manifest.files)


def test_tp2_global_grad_norm_is_the_whole_models(arts: dict[str, Path], tmp_path: Path) -> None:
    """The clip's norm at step 1 (reported by rank 0) equals the one-rank model's gradient norm."""
    paddle = require_paddle()
    _, recipe, _ = read_training_artifact(arts["one"])
    graph = load_graph(arts["one"] / "rank0")
    layer = build_layer(graph, device="cpu")
    layer.train()
    loss = next_token_loss(paddle, layer, *training_batches(recipe, graph, None, 0)[0])
    loss.backward()
    want = float(np.sqrt(sum(float((p.grad.numpy().astype(np.float64) ** 2).sum())
                             for p in layer.trainable_parameters())))
    assert want > recipe["optimizer"]["grad_clip_norm"]  # so the clip is active in these runs
    losses = tmp_path / "losses.jsonl"
    ranks = RankProcesses(arts["tp2"], None, ["--steps", "1", "--losses", str(losses)], 2, tmp_path,
                          worker=TRAINING_WORKER)
    ranks.start()
    ranks.wait(120)
    got = json.loads(losses.read_text().splitlines()[0])["grad_norm"]
    print(f"[distributed] global grad norm: 1 rank {want:.6f}, tp 2 {got:.6f}")
    assert got == pytest.approx(want, rel=1e-5)
    assert not leftover_processes()


def test_moe_tp2_ep2_lora_losses_equal_one_rank(arts: dict[str, Path]) -> None:
    """Expert parallelism: each rank holds 8 of the 16 experts and their adapters."""
    one = train_artifact(arts["moe-one"], STEPS, save=False).losses
    ep = train_artifact(arts["moe-ep"], STEPS, save=False, timeout_s=120).losses
    err = _close(ep, one)
    print(f"[distributed] ernie-4.5-300b-a47b@tiny LoRA tp 2 ep 2 vs 1 rank: max rel {err:.2e}")
    assert err < 1e-5
    assert not (arts["moe-ep"] / "training/checkpoints").exists() or not any(
        (arts["moe-ep"] / "training/checkpoints").iterdir())
    assert not leftover_processes()
