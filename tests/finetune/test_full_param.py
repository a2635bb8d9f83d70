"""Full-parameter fine-tuning (ERNIEKit's `fine_tuning: Full`): `compile MODEL --mode training` with
neither LoRA nor QAT runs the `full-param` pass, which marks every float param trainable except
those `--freeze` matches, and `ernie-ir train` updates them all.

Checked, on a dense ERNIE 4.5, a MoE ERNIE 4.5 and GPT (the built-in tiny models):

- the pass's trainable set: every float param but the MoE router's score-correction bias (it only
  chooses experts); `--freeze` patterns matched as `--lora-targets` are (whole names, modules, the
  readers' scopes: a tied embedding is also `lm_head`); annotations untouched;
- training 3 steps on the repeated synthetic batch: the first loss is the interpreter's
  cross-entropy of the base model, the losses fall, every trainable param changed, every frozen
  param (and rank0's weights) is byte for byte the base's, and the checkpoint compiles back to an
  inference artifact holding the trained values;
- tensor parallelism (gloo): the losses equal one rank's;
- bad input, one line each (exit 2, nothing written): a pattern that matches nothing, freezing
  everything, --freeze without --mode training or with LoRA/QAT, full training of a weight-only
  quantized graph;
- --pp 2 compiles with the tied embedding trainable (both ends hold it and record it: the
  pipeline sums its two gradients; tests/distributed/test_gloo_full_param.py trains it) or frozen.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli, user_error

from ernie_ir.ir import ErnieIRError
from ernie_ir.ir.storage import load_graph
from ernie_ir.ir.weights import SafetensorsFile
from ernie_ir.load import load_input, load_trained
from ernie_ir.passes import run_pipeline
from ernie_ir.passes.finetune.full_param import FullParamError, select
from ernie_ir.runtime.interpreter import run_graph
from ernie_ir.training.loop import read_training_artifact, training_batches

DENSE, MOE, GPT = "ernie-4.5-0.3b@tiny", "ernie-4.5-21b-a3b@tiny", "gpt-345m@tiny"
CORRECTION_BIAS = [f"ernie.layers.{i}.mlp.moe_statics.e_score_correction_bias" for i in (1, 2)]
# model -> (a --freeze pattern, what it freezes, the first loss's tolerance against the
# interpreter: bf16 models are rounded to bf16 between ops there, never in the Paddle Layer)
CASES = {
    DENSE: ("lm_head", ["ernie.embed_tokens.weight"], 1e-2),  # tied: lm_head reads embed_tokens
    MOE: (".*mlp.gate", ["ernie.layers.1.mlp.gate.weight", "ernie.layers.2.mlp.gate.weight"], 1e-2),
    GPT: (".*position_embeddings", ["gpt.embeddings.position_embeddings.weight"], 1e-6),
}


# -- the pass --------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [DENSE, MOE, GPT])
def test_every_float_param_trains_but_the_routers_correction_bias(model: str) -> None:
    g = load_input(model)
    annotations = {n: dict(p.annotations) for n, p in g.params.items()}
    result = run_pipeline(g, "full-param")
    fixed = CORRECTION_BIAS if model == MOE else []
    assert sorted(n for n, p in g.params.items() if not p.trainable) == fixed
    assert result.stats["1:full-param"] == {"trainable": len(g.params) - len(fixed), "frozen": 0}
    assert {n: dict(p.annotations) for n, p in g.params.items()} == annotations
    assert "full-param" in g.metadata["properties"]


@pytest.mark.parametrize("model", [DENSE, MOE, GPT])
def test_freeze_keeps_what_it_matches_fixed(model: str) -> None:
    pattern, frozen, _ = CASES[model]
    g = load_input(model)
    run_pipeline(g, f'full-param{{freeze=["{pattern}"]}}')
    fixed = frozen + (CORRECTION_BIAS if model == MOE else [])
    assert sorted(n for n, p in g.params.items() if not p.trainable) == sorted(fixed)


def test_freeze_names_are_modules_scopes_and_experts() -> None:
    g = load_input(MOE)
    by = {p: select(g, [p]).frozen for p in (
        "ernie.embed_tokens", "ernie.embed_tokens.weight", "glob:*embed_tokens", "lm_head",
        r".*experts\.\d+\.up_gate_proj", ".*layers.1.mlp.experts.*")}
    assert by["ernie.embed_tokens"] == by["ernie.embed_tokens.weight"] == by["glob:*embed_tokens"] \
        == by["lm_head"] == ("ernie.embed_tokens.weight",)
    assert by[r".*experts\.\d+\.up_gate_proj"] == ("ernie.layers.1.mlp.experts.up_gate_proj.weight",
                                                   "ernie.layers.2.mlp.experts.up_gate_proj.weight")
    assert by[".*layers.1.mlp.experts.*"] == ("ernie.layers.1.mlp.experts.up_gate_proj.weight",
                                              "ernie.layers.1.mlp.experts.down_proj.weight")
    # the router's correction bias is never trainable, frozen or not
    assert select(g, [".*moe_statics.*"]).frozen == ()


@pytest.mark.parametrize("pipeline,says", [
    ('full-param{freeze=[".*nothing"]}', "--freeze '.*nothing' matches no param of the model"),
    ('full-param{freeze=[".*"]}', "freezes every param, so nothing would train"),
    (r'full-param{freeze=[".*experts\\.[0-3]\\..*"]}', "matches some experts of ernie.layers.1.mlp.experts"),
    ("lora{rank=2},full-param", "the graph has LORA"),
    ("wint8,full-param", "cannot update quantized weights (ernie.layers.0.self_attn.qkv_proj.quant_weight "
                         "is i8): use LoRA (--lora-rank R)"),
])
def test_the_pass_refuses_in_one_line(pipeline: str, says: str) -> None:
    g = load_input(MOE)
    with pytest.raises(ErnieIRError) as info:
        run_pipeline(g, pipeline)
    assert says in str(info.value) and "\n" not in str(info.value)
    if "lora" not in pipeline and "wint8" not in pipeline:
        assert isinstance(info.value, FullParamError)


# -- training ---------------------------------------------------------------------------------


def _first_loss(art: Path, model: str) -> float:
    """The interpreter's next-token cross-entropy of the base model on the run's synthetic batch."""
    _, recipe, _ = read_training_artifact(art)
    ((ids, labels),) = training_batches(recipe, load_graph(art / "rank0"), None)
    lg = np.asarray(run_graph(load_input(model), {"input_ids": ids})["logits"], np.float64)[:, :-1]
    top = lg.max(-1)
    lse = np.log(np.exp(lg - top[..., None]).sum(-1)) + top
    return float((lse - np.take_along_axis(lg, labels[:, 1:, None], -1)[..., 0]).mean())


def _train(capsys: pytest.CaptureFixture[str], art: Path) -> dict:
    code, out, err = cli(capsys, "train", str(art), "--steps", "3", "--lr", "1e-2", "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
@pytest.mark.parametrize("model", [DENSE, MOE, GPT])
def test_training_updates_every_trainable_param_and_no_frozen_one(
        model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("paddle")
    pattern, frozen, rtol = CASES[model]
    art = tmp_path / "art"
    code, _, err = cli(capsys, "compile", model, "--target", "cuda", "--mode", "training",
                       "--freeze", pattern, "--out", str(art))
    assert code == 0, err
    recipe = json.loads((art / "training" / "train.json").read_text())
    base = load_input(model)
    fixed = set(frozen) | (set(CORRECTION_BIAS) if model == MOE else set())
    assert sorted(recipe["trainable"]) == sorted(set(base.params) - fixed)
    assert recipe["frozen_count"] == len(fixed)

    report = _train(capsys, art)
    losses = report["losses"]
    with capsys.disabled():
        print(f"\n[full-param {model}] losses {losses}")
    assert np.isfinite(losses).all() and losses[0] > losses[1] > losses[2]
    assert losses[0] == pytest.approx(_first_loss(art, model), rel=rtol)

    # the checkpoint holds every trained param (float32, global names), each moved off the base
    ckpt = SafetensorsFile(Path(report["checkpoints"][-1]) / "params.safetensors")
    assert sorted(ckpt) == sorted(recipe["trainable"])
    for n in ckpt:
        assert not np.array_equal(ckpt.read(n), base.params[n].read().astype(np.float32)), n

    # the trained model: frozen params byte for byte the base's, trained ones the checkpoint's
    trained = load_trained(art)
    for n, p in trained.params.items():
        want = base.params[n].read() if n in fixed else ckpt.read(n).astype(base.params[n].read().dtype)
        assert p.read().tobytes() == want.tobytes(), n
    assert load_graph(art / "rank0").params[recipe["trainable"][0]].read().tobytes() == \
        base.params[recipe["trainable"][0]].read().tobytes()  # rank0/ is never modified
    code, _, err = cli(capsys, "compile", str(art), "--target", "cuda", "--out", str(tmp_path / "served"))
    assert code == 0, err


@pytest.mark.gloo
@pytest.mark.slow
def test_tensor_parallel_losses_are_one_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("paddle")
    losses = []
    for tp in ("1", "2"):
        art = tmp_path / f"tp{tp}"
        code, _, err = cli(capsys, "compile", GPT, "--target", "cuda", "--mode", "training", "--tp", tp,
                           "--out", str(art))
        assert code == 0, err
        losses.append(_train(capsys, art)["losses"])
    with capsys.disabled():
        print(f"\n[full-param tp] one rank {losses[0]}, tp 2 {losses[1]}")
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,says", [
    ([DENSE, "--mode", "training", "--freeze", ".*nothing"],
     "error: --freeze '.*nothing' matches no param of the model (params are named like ernie.embed_tokens"),
    ([DENSE, "--mode", "training", "--freeze", ".*"],
     "error: --freeze '.*' freezes every param, so nothing would train"),
    ([DENSE, "--mode", "training", "--freeze", ".*embed_tokens", "--freeze", ""],
     "error: --freeze '': an empty pattern"),
    ([DENSE, "--mode", "training", "--freeze", "(unclosed"], "is not a valid regular expression"),
    ([DENSE, "--freeze", ".*embed_tokens"],
     "--freeze '.*embed_tokens' keeps params fixed in full-parameter training, and --mode inference "
     "trains nothing: add --mode training"),
    ([DENSE, "--mode", "training", "--lora-rank", "4", "--freeze", ".*embed_tokens"],
     "LoRA trains its adapters alone (every base weight is fixed already): drop --freeze"),
    ([GPT, "--mode", "training", "--quant", "qat-int8", "--freeze", ".*embed.*"],
     "QAT chooses its own trainable params"),
    ([DENSE, "--mode", "training", "--quant", "wint8"],
     "error: full-parameter training cannot update quantized weights (--quant wint8 leaves integer or "
     "FP8 weights): use LoRA (--lora-rank R), or train the float model first and quantize the "
     "trained artifact"),
    ([GPT, "--mode", "training", "--pipeline", "lora{rank=2}", "--freeze", ".*embed.*"],
     "--pipeline has lora, which chooses the trainable params itself: drop --freeze"),
])
def test_bad_full_param_input_is_one_line(argv: list[str], says: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "art"
    line = user_error(capsys, "compile", *argv, "--target", "cuda", "--out", str(out))
    assert says in line
    assert not out.exists()


@pytest.mark.parametrize("freeze", [[], ["--freeze", "ernie.embed_tokens"]])
def test_pp_trains_the_tied_embedding_or_keeps_it_frozen(freeze: list[str], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "art"
    code, _, err = cli(capsys, "compile", MOE, "--target", "cuda", "--mode", "training", "--pp", "2",
                       *freeze, "--out", str(out))
    assert code == 0, err
    recipe = json.loads((out / "training" / "train.json").read_text())
    tied = "ernie.embed_tokens.weight"
    assert (tied in recipe["trainable"]) == (not freeze)
    assert "ernie.layers.1.mlp.gate.weight" in recipe["trainable"]
    stages = [load_graph(out / f"rank{s}") for s in (0, 1)]
    for g in stages:  # both ends hold it, and record it when it trains (their gradients are summed)
        assert tied in g.params and g.params[tied].trainable == (not freeze)
        assert g.metadata["pipeline"]["tied"] == ([] if freeze else [tied])
