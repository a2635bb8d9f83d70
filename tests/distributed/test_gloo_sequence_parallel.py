"""Sequence parallelism (`compile --sp`) on real paddle.distributed processes (2 gloo ranks).

The rank graphs of an `--tp 2 --sp` artifact hold the residual stream and the norms on token
shards of the flattened B*S tokens, a reduce_scatter after each row-parallel block (on gloo:
all_reduce + this rank's slice; backward: all-gather) and an all_gather_sequence before each
column-parallel one (backward: this rank's slice of the gradient the "f" functions summed).

- forward: the gloo logits equal the SPMD interpreter's and the unsplit model's (1e-5 relative);
- training: tp 2 sp LoRA losses equal the one-rank run step for step (1e-5 relative), for the
  dense and the MoE ERNIE 4.5 families and GPT (whose position embeddings are sliced onto the
  shards: scatter_sequence, its gradient summed by the "f" before it);
- a batch whose B*S tokens do not divide by tp is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _dist_testkit import IDS, compile_art, leftover_processes, rel_err

from ernie_ir.backends.sessions import run_artifact
from ernie_ir.ir.storage import load_graph
from ernie_ir.load import load_input
from ernie_ir.runtime import Interpreter
from ernie_ir.training.loop import train_artifact

STEPS = 3
MODELS = {"dense": "ernie-4.5-0.3b@tiny", "moe": "ernie-4.5-300b-a47b@tiny", "gpt": "gpt-345m@tiny"}
LAYOUT = {"dense": {"tp": 2}, "moe": {"tp": 2, "ep": 2}, "gpt": {"tp": 2}}


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gloo-sp")
    out = {}
    for fam, model in MODELS.items():
        out[f"{fam}-sp"] = compile_art(tmp, model, f"{fam}-sp", sp=True, **LAYOUT[fam])
    return out


@pytest.fixture(scope="module")
def train_arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gloo-sp-train")
    kw = {"mode": "training", "lora_rank": 4}
    out = {}
    for fam, model in MODELS.items():
        out[f"{fam}-one"] = compile_art(tmp, model, f"{fam}-one", **kw)
        out[f"{fam}-sp"] = compile_art(tmp, model, f"{fam}-sp", sp=True, **LAYOUT[fam], **kw)
    return out


def _close(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


@pytest.mark.parametrize("fam", sorted(MODELS))
def test_sp_gloo_logits_equal_spmd_and_unsplit(arts: dict[str, Path], fam: str) -> None:
    art = arts[f"{fam}-sp"]
    graph = load_graph(art / "rank0")
    ops = {n.op for n in graph}
    assert {"reduce_scatter", "all_gather_sequence"} <= ops and "all_reduce" not in ops
    ref = Interpreter(load_input(MODELS[fam])).run({"input_ids": IDS})["logits"]
    spmd = run_artifact(art, IDS, "interpreter")
    gloo = run_artifact(art, IDS, "paddle", timeout_s=120)
    e_spmd, e_gloo = rel_err(spmd, ref), rel_err(gloo, spmd)
    print(f"[distributed] {MODELS[fam]} {LAYOUT[fam]} sp: SPMD vs unsplit {e_spmd:.2e}, gloo vs SPMD "
          f"{e_gloo:.2e}")
    assert e_spmd < 1e-5 and e_gloo < 1e-5
    assert not leftover_processes()


@pytest.mark.parametrize("fam", sorted(MODELS))
def test_sp_training_losses_equal_one_rank(train_arts: dict[str, Path], fam: str) -> None:
    one = train_artifact(train_arts[f"{fam}-one"], STEPS).losses
    sp = train_artifact(train_arts[f"{fam}-sp"], STEPS, timeout_s=180).losses
    err = _close(sp, one)
    print(f"[distributed] {MODELS[fam]} LoRA {LAYOUT[fam]} sp vs 1 rank, {STEPS} steps: {sp} vs {one}, "
          f"max rel {err:.2e}")
    assert err < 1e-5
    assert not leftover_processes()


def test_sp_refuses_tokens_not_divisible_by_tp(arts: dict[str, Path]) -> None:
    odd = IDS[:1, :7]  # 7 tokens over 2 ranks
    with pytest.raises(Exception) as err:
        run_artifact(arts["dense-sp"], odd, "paddle", timeout_s=120)
    msg = str(err.value)
    assert "7 tokens (batch x sequence) do not divide into tp 2" in msg, msg
    assert not leftover_processes()
