"""Full-parameter training against code nobody here wrote: three AdamW steps of ernie-ir's
`compile --mode training` (no LoRA, no QAT: every float param trains) + `train_artifact` equal
the reference libraries' own training steps on the same checkpoint, data and hyperparameters.

- Dense ERNIE 4.5 (GQA 4:2, head_dim 24, untied): paddleformers builds and saves it
  (tests/reference/pf_full_train.py) and trains it with its `labels=` loss and
  `paddle.optimizer.AdamW` + `ClipGradByGlobalNorm`; transformers loads that same folder and
  trains it with its `labels=` loss, `clip_grad_norm_` and `torch.optim.AdamW`
  (tests/reference/hf_full_train.py); ernie-ir compiles the folder and trains it. All three pairs
  are compared (so a disagreement between the references shows up as such).
- MoE ERNIE 4.5 (3 layers, MoE from layer 1, 8 experts top-2, 1 shared expert, non-zero
  score-correction bias): transformers builds, saves and trains it (`output_router_logits=False`:
  no auxiliary loss, as ernie-ir has none); ernie-ir trains the saved folder. The correction bias
  trains on neither side (transformers: `requires_grad=False`; ernie-ir's full-param pass leaves
  it fixed: it only chooses experts).

Settings shared by every side: 3 steps, one batch of 2 x 16 tokens each (ids in [1, 256): the
pad id 0 never occurs, see below), labels -100 on some positions (ernie-ir's convention: loss =
mean cross-entropy of logits[:, :-1] vs labels[:, 1:] over the labels that are not -100), AdamW
lr 2e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every param, global-norm clip 1.0
(ernie-ir's default; the gradient norms are about 5, so it clips every step), constant lr.

Tolerances (float32 on CPU). Losses: relative 1e-5 (measured: <= 1.1e-7). Weights, per trained
tensor (mapped from the checkpoint's HF layout to ernie-ir's param names with
`_fe_testkit.hf_to_paddle`, experts stacked): (1) the difference is at most 2e-3 of the tensor's
update norm ||w_ref - w_init|| (measured: <= 1.0e-4 here, up to 7e-4 for the MoE on other data
seeds), and (2) no element differs by more than 0.25 lr (measured: <= 0.026 lr here, up to
0.13 lr on other seeds). Why not elementwise 1e-6: AdamW moves each element by about
lr * m / sqrt(v) whatever the size of its gradient, so an element whose gradient is tiny by
cancellation takes a step whose size float32 rounding of that gradient decides; transformers in
float32 itself differs from transformers in float64 by up to 0.03 lr on such elements (measured
while writing this test), and the few elements ernie-ir differs on are of that kind (their
differences from float64 are of the same size). A real mistake is far outside both bounds:
measured by training ernie-ir with one setting changed against the unchanged paddleformers run,
weight decay 0 gives 0.17 of the update norm (1.4 lr in an element), beta2 0.999 1.8e-2 (1.2 lr),
no clipping 2.2e-2 (1.2 lr), eps 1e-6 2.7e-2 (1.7 lr); the faithful run gives 7.5e-5 (0.016 lr).

Known library difference (not tested): transformers' `nn.Embedding(padding_idx=pad_token_id)`
gives the pad token's embedding row (id 0) no gradient, while paddleformers and ernie-ir train
it like any other row; with id 0 in the data, the ernie-ir vs transformers difference of that
row is about 0.6 lr while everything else matches. The data leaves id 0 out.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _fe_testkit import hf_to_paddle, read_tensors, run_reference
from _trained_weights import compare_trained

from ernie_ir.ir.weights import SafetensorsFile
from ernie_ir.targets.compile import CompileOptions, compile_model
from ernie_ir.training.loop import train_artifact

pytestmark = [pytest.mark.reference, pytest.mark.slow]

VOCAB, ROWS, SEQ, STEPS = 256, 2, 16, 3
OPTIM = {"lr": 2e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "clip_norm": 1.0}
LOSS_RTOL = 1e-5  # measured: <= 1.1e-7 (one changed setting: 1.8e-5 .. 1e-4)
NORM_TOL = 2e-3  # ||w_ours - w_ref|| / ||w_ref - w_init||; measured <= 1.0e-4 (a changed setting: >= 1.8e-2)
ELEM_TOL = 0.25  # max |w_ours - w_ref| / lr; measured <= 0.026 (a changed setting: >= 1.2)
BIAS = "e_score_correction_bias"
NO_DECAY = ["bias", "norm"]  # the Trainers' exemption, as training.loop.NO_DECAY


def _batches() -> list[dict[str, list[list[int]]]]:
    rng = np.random.default_rng(7)
    out = []
    for step in range(STEPS):
        ids = rng.integers(1, VOCAB, size=(ROWS, SEQ))  # no pad id 0 (see the module docstring)
        labels = ids.copy()
        labels[0, : 3 + step] = -100  # a prompt without loss, longer every step
        labels[1, 5:8] = -100  # a hole in the middle
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


BATCHES = _batches()


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert `...experts.{e}.{proj}.weight` stacked into ernie-ir's `...experts.{proj}.weight`
    [E, ...]."""
    out, groups = {}, {}
    for k, v in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", k)
        if m:
            groups.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = v
        else:
            out[k] = v
    for k, per in groups.items():
        out[k] = np.stack([per[e] for e in range(len(per))])
    return out


def _canonical(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, np.ndarray]:
    """HF-layout tensors under ernie-ir's param names and shapes (published Paddle layout, experts
    stacked)."""
    return _stack_experts(hf_to_paddle(tensors, config))


def _ours(ckpt: Path, root: Path) -> dict[str, Any]:
    """ernie-ir: compile `ckpt` for full-parameter training, train STEPS steps on BATCHES."""
    art = root / "art"
    compile_model(str(ckpt), "cuda", CompileOptions(mode="training", out=art))
    recipe = json.loads((art / "training" / "train.json").read_text())
    data = [(ids, labels) for b in BATCHES for ids, labels in zip(b["input_ids"], b["labels"], strict=True)]
    result = train_artifact(art, STEPS, data, options={**OPTIM, "batch_size": ROWS}, save=True)
    trained = SafetensorsFile(Path(result.checkpoints[-1]) / "params.safetensors")
    return {"losses": list(result.losses), "trainable": list(recipe["trainable"]),
            "params": {n: np.array(trained.read(n)) for n in trained.entries}}


def _ref(out: Path, config: dict[str, Any]) -> dict[str, Any]:
    run = json.loads((out / "losses.json").read_text())
    return {"losses": run["losses"], "grad_norms": run["grad_norms"],
            "params": _canonical(dict(np.load(out / "trained.npz")), config)}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("full-dense")
    spec = {"vocab_size": VOCAB, "batches": BATCHES, **OPTIM, "no_decay": NO_DECAY}
    pf = run_reference("pf", "pf_full_train.py", spec, root / "pf")
    hf = run_reference("hf", "hf_full_train.py", {**spec, "load_from": str(pf / "ckpt")}, root / "hf")
    config = json.loads((pf / "ckpt" / "config.json").read_text())
    return {"init": _canonical(read_tensors(pf / "ckpt"), config), "paddleformers": _ref(pf, config),
            "transformers": _ref(hf, config), "ernie-ir": _ours(pf / "ckpt", root / "ours"),
            "hf_meta": json.loads((hf / "meta.json").read_text())}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("full-moe")
    hf = run_reference("hf", "hf_full_train.py", {"model": "moe", "vocab_size": VOCAB, "batches": BATCHES,
                                                  **OPTIM, "no_decay": NO_DECAY}, root / "hf")
    config = json.loads((hf / "ckpt" / "config.json").read_text())
    return {"init": _canonical(read_tensors(hf / "ckpt"), config), "transformers": _ref(hf, config),
            "ernie-ir": _ours(hf / "ckpt", root / "ours"),
            "hf_meta": json.loads((hf / "meta.json").read_text())}


def _compare(label: str, ours: dict[str, np.ndarray], ref: dict[str, np.ndarray],
             init: dict[str, np.ndarray]) -> None:
    worst_norm, worst_elem = compare_trained(label, ours, ref, init, lr=OPTIM["lr"], norm_tol=NORM_TOL,
                                             elem_tol=ELEM_TOL)
    print(f"\n[full-param] {label}: {len(ours)} tensors, worst |diff| / |update| {worst_norm:.2e}, "
          f"worst element {worst_elem:.2e} lr")


def _losses(label: str, ours: list[float], ref: list[float]) -> None:
    assert len(ours) == len(ref) == STEPS
    np.testing.assert_allclose(ours, ref, rtol=LOSS_RTOL, atol=0, err_msg=label)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref, strict=True))
    shown = [" ".join(f"{x:.6f}" for x in xs) for xs in (ours, ref)]
    print(f"\n[full-param] {label} losses [{shown[0]}] vs [{shown[1]}]: worst rel {worst:.2e}")


def test_every_float_param_trains(dense: dict[str, Any], moe: dict[str, Any]) -> None:
    """ernie-ir trains exactly the reference's trainable tensors: all of them, less the MoE
    router's correction bias (fixed on both sides)."""
    for run in (dense, moe):
        ours = run["ernie-ir"]
        assert sorted(ours["trainable"]) == sorted(ours["params"])
        assert sorted(ours["params"]) == sorted(n for n in run["init"] if BIAS not in n)
    biases = [n for n in moe["init"] if BIAS in n]
    assert len(biases) == 2 and all(np.abs(moe["init"][n]).max() > 0 for n in biases)
    assert sorted(moe["hf_meta"]["frozen_params"]) == [f"model.layers.{i}.mlp.gate.moe_statics.{BIAS}"
                                                       for i in (1, 2)]
    for n in biases:  # transformers kept it as saved
        assert np.array_equal(moe["transformers"]["params"][n], moe["init"][n])


def test_clipping_is_active(dense: dict[str, Any], moe: dict[str, Any]) -> None:
    """The global-norm clip (1.0) acts on every step of every reference, so it is compared too."""
    for norms in (dense["paddleformers"]["grad_norms"], dense["transformers"]["grad_norms"],
                  moe["transformers"]["grad_norms"]):
        assert min(norms) > 2 * OPTIM["clip_norm"], norms


def test_dense_matches_transformers(dense: dict[str, Any]) -> None:
    ours, ref = dense["ernie-ir"], dense["transformers"]
    _losses("dense ernie-ir vs transformers", ours["losses"], ref["losses"])
    _compare("dense ernie-ir vs transformers", ours["params"], ref["params"], dense["init"])


def test_dense_matches_paddleformers(dense: dict[str, Any]) -> None:
    ours, ref = dense["ernie-ir"], dense["paddleformers"]
    _losses("dense ernie-ir vs paddleformers", ours["losses"], ref["losses"])
    _compare("dense ernie-ir vs paddleformers", ours["params"], ref["params"], dense["init"])


def test_dense_references_agree(dense: dict[str, Any]) -> None:
    """The two references agree with each other to the same tolerance (else the check above
    would be of one library's quirks, not of training)."""
    pf, hf = dense["paddleformers"], dense["transformers"]
    _losses("dense paddleformers vs transformers", pf["losses"], hf["losses"])
    _compare("dense paddleformers vs transformers", pf["params"], hf["params"], dense["init"])


def test_moe_matches_transformers(moe: dict[str, Any]) -> None:
    ours, ref = moe["ernie-ir"], moe["transformers"]
    _losses("moe ernie-ir vs transformers", ours["losses"], ref["losses"])
    trained = {n: v for n, v in ref["params"].items() if BIAS not in n}
    _compare("moe ernie-ir vs transformers", ours["params"], trained, moe["init"])
