"""`ernie-ir train` / `train_artifact` options: each one's effect, the recipe as defaults, the
padded loss against an independent numpy cross-entropy, bad values refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli

from ernie_ir.ir import ErnieIRError
from ernie_ir.runtime import run_graph
from ernie_ir.targets import CompileOptions, compile_model, load_artifact, verify_artifact

paddle = pytest.importorskip("paddle")

from safetensors.numpy import load_file  # noqa: E402

from ernie_ir.training.loop import (  # noqa: E402
    RECIPE,
    StepProgress,
    TrainHooks,
    TrainOptions,
    record_files,
    resolve_options,
    train_artifact,
)

MODEL = "ernie-4.5-0.3b@tiny"
LENGTHS = (12, 5, 9, 3)


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train-opts") / "art"
    compile_model(MODEL, "kunlun", CompileOptions(lora_rank=4, mode="training", out=out))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("train-data") / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": rng.integers(1, 1000, size=n).tolist()}) + "\n"
                            for n in LENGTHS))
    return path


def _seqs(data: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _numpy_loss(art: Path, seqs: list[list[int]]) -> tuple[float, float]:
    """(mean cross-entropy over every real target token of `seqs`, the old wrong value: the
    same sum divided by every position of the padded batch), each sequence run unpadded by
    the interpreter."""
    graph = load_artifact(art)
    total, count = 0.0, 0
    for s in seqs:
        logits = run_graph(graph, {"input_ids": np.array([s], np.int64)})["logits"][0]
        lp = _log_softmax(logits[:-1])
        total += -float(lp[np.arange(len(s) - 1), s[1:]].sum())
        count += len(s) - 1
    padded_positions = len(seqs) * (max(map(len, seqs)) - 1)
    return total / count, total / padded_positions


def _trainable(art: Path) -> dict[str, np.ndarray]:
    graph = load_artifact(art)
    return {p.name: np.asarray(p.read(), np.float32) for p in graph.params.values() if p.trainable}


def _last_checkpoint(art: Path) -> dict[str, np.ndarray]:
    folders = sorted((art / "training/checkpoints").glob("run-*-step-*"))
    return load_file(str(folders[-1] / "params.safetensors"))


def _lrs(art: Path, steps: int, **options: object) -> list[float]:
    seen: list[StepProgress] = []
    train_artifact(art, steps, save=False, options=options, hooks=TrainHooks(on_progress=seen.append))
    return [p.lr for p in seen]


def test_padded_batch_loss_is_the_mean_over_real_tokens(art: Path, data: Path) -> None:
    want, old = _numpy_loss(art, _seqs(data))
    got = train_artifact(art, 1, data=data, save=False, options={"batch_size": 4}).losses[0]
    print(f"[train] padded batch {LENGTHS}: loss {got:.6f}, numpy {want:.6f}, old (padded mean) {old:.6f}")
    assert got == pytest.approx(want, rel=1e-5)
    assert abs(old - want) > 0.1 * want  # the old convention is far off on this batch
    # another pad id and ignore index: the same loss (padding is after the text, attention causal)
    other = train_artifact(art, 1, data=data, save=False,
                           options={"batch_size": 4, "pad_id": 999, "ignore_index": -1}).losses[0]
    assert other == pytest.approx(want, rel=1e-5)


def test_accumulating_2_batches_of_2_is_one_batch_of_4(art: Path, data: Path) -> None:
    kw = {"lr": 5e-3, "weight_decay": 0.01}
    one = train_artifact(art, 3, data=data, options={"batch_size": 4, **kw}).losses
    a = _last_checkpoint(art)
    acc = train_artifact(art, 3, data=data, options={"per_device_train_batch_size": 2,
                                                     "gradient_accumulation_steps": 2, **kw}).losses
    b = _last_checkpoint(art)
    print(f"[train] batch 4: {one}; 2 x batch 2: {acc}")
    np.testing.assert_allclose(acc, one, rtol=1e-5)
    assert one[-1] < one[0]
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6, err_msg=name)
    # without accumulation, batch 2 takes half the data per step: other losses
    half = train_artifact(art, 3, data=data, save=False, options={"batch_size": 2, **kw}).losses
    assert not np.allclose(half, one, rtol=1e-3)


def test_schedule_values_per_step() -> None:
    o = TrainOptions(lr=1.0, warmup_steps=2, schedule="linear")
    assert [o.lr_at(s, 6) for s in range(6)] == pytest.approx([0, 0.5, 1.0, 0.75, 0.5, 0.25])
    o = TrainOptions(lr=2.0, warmup_steps=0, schedule="cosine")
    assert [o.lr_at(s, 4) for s in range(4)] == pytest.approx(
        [2 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)])
    o = TrainOptions(lr=1e-3, warmup_steps=4)
    assert [o.lr_at(s, 6) for s in range(6)] == pytest.approx([0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_the_schedule_drives_the_optimizer(art: Path) -> None:
    assert _lrs(art, 4, lr=1e-2, schedule="cosine", lr_scheduler_type=None) == pytest.approx(
        [1e-2 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)])
    assert _lrs(art, 3, lr_scheduler_type="linear", warmup_steps=1) == pytest.approx([0, 1e-3, 5e-4])
    # warmup's first step has learning rate 0: AdamW moves nothing
    train_artifact(art, 1, options={"warmup_steps": 3})
    after = _last_checkpoint(art)
    for name, value in _trainable(art).items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def test_weight_decay_is_decoupled_and_only_on_trained_params(art: Path) -> None:
    lr, wd = 1e-2, 0.5
    before = _trainable(art)
    train_artifact(art, 1, options={"lr": lr, "weight_decay": 0.0})
    plain = _last_checkpoint(art)
    train_artifact(art, 1, options={"lr": lr, "weight_decay": wd})
    decayed = _last_checkpoint(art)
    moved = 0
    for name, p0 in before.items():
        # AdamW: p1 = p0 * (1 - lr * wd) - lr * adam_step; the Adam step is the same in both runs
        np.testing.assert_allclose(decayed[name] - plain[name], -lr * wd * p0, rtol=1e-4, atol=1e-7,
                                   err_msg=name)
        moved += int(np.abs(p0).max() > 0)
    assert moved  # LoRA A is random: the decay is visible
    graph = load_artifact(art)
    frozen = [p for p in graph.params.values() if not p.trainable]
    assert frozen and not set(decayed) & {p.name for p in frozen}
    verify_artifact(art)  # rank0/ untouched, checkpoints listed


def test_clip_norm_eps_and_betas_change_the_update(art: Path) -> None:
    before = _trainable(art)

    def step_size(**options: object) -> float:
        train_artifact(art, 1, options={"lr": 1e-2, **options})
        after = _last_checkpoint(art)
        return max(float(np.abs(after[n] - before[n]).max()) for n in before)

    free = step_size(clip_norm=0)
    assert free == pytest.approx(1e-2, rel=1e-3)  # Adam's first step: lr * sign(grad)
    # a tiny clip makes the gradient smaller than eps: the step shrinks
    assert step_size(max_grad_norm=1e-9, eps=1e-8) < 0.2 * free
    assert step_size(adam_epsilon=1.0) < 0.2 * free
    a = train_artifact(art, 3, save=False, options={"lr": 1e-2}).losses
    b = train_artifact(art, 3, save=False, options={"lr": 1e-2, "beta1": 0.0}).losses
    c = train_artifact(art, 3, save=False, options={"lr": 1e-2, "adam_beta2": 0.5}).losses
    assert a[0] == b[0] == c[0] and a[2] != b[2] and a[2] != c[2]


def test_seed_and_batch_size_of_the_synthetic_batch(art: Path) -> None:
    a = train_artifact(art, 1, save=False, options={"seed": 1}).losses
    assert train_artifact(art, 1, save=False, options={"seed": 1}).losses == a
    assert train_artifact(art, 1, save=False, options={"seed": 2}).losses != a
    seen: list[StepProgress] = []
    train_artifact(art, 1, save=False, options={"batch_size": 3}, hooks=TrainHooks(on_progress=seen.append))
    assert seen[0].tokens == 3 * 15 and seen[0].steps == 1 and seen[0].elapsed_s > 0


def _set_recipe(art: Path, **changes: dict) -> None:
    recipe = json.loads((art / RECIPE).read_text())
    for key, value in changes.items():
        recipe.setdefault(key, {}).update(value)
    (art / RECIPE).write_text(json.dumps(recipe))
    record_files(art, json.loads((art / "manifest.json").read_text()), [art / RECIPE])


def test_the_recipe_is_the_default_and_a_flag_overrides_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "art"
    compile_model(MODEL, "kunlun", CompileOptions(lora_rank=4, mode="training", out=out))
    recipe = json.loads((out / RECIPE).read_text())
    assert recipe["schedule"] == {"name": "constant", "warmup_steps": 0}
    assert recipe["padding"] == {"pad_id": 0, "ignore_index": -100}
    assert recipe["batch"]["gradient_accumulation_steps"] == 1
    _set_recipe(out, optimizer={"learning_rate": 5e-3, "weight_decay": 0.1}, batch={"batch_size": 2})
    opts = resolve_options(json.loads((out / RECIPE).read_text()))
    assert (opts.lr, opts.weight_decay, opts.batch_size) == (5e-3, 0.1, 2)
    want = train_artifact(out, 2, save=False, options={"lr": 5e-3}).losses
    code, stdout, _ = cli(capsys, "train", str(out), "--steps", "2", "--json")  # no --lr: the recipe's
    assert code == 0 and json.loads(stdout)["losses"] == want
    used = json.loads(stdout)["options"]
    assert (used["lr"], used["weight_decay"], used["batch_size"], used["clip_norm"]) == (5e-3, 0.1, 2, 1.0)
    code, stdout, _ = cli(capsys, "train", str(out), "--steps", "2", "--json", "--lr", "2e-2")
    again = train_artifact(out, 2, save=False, options={"lr": 2e-2}).losses
    assert json.loads(stdout)["losses"] == again != want


def test_config_file_with_erniekit_names_and_flags_over_it(art: Path, tmp_path: Path, capsys) -> None:
    yaml_file = tmp_path / "train.yaml"
    yaml_file.write_text("learning_rate: 0.004\nper_device_train_batch_size: 2\n"
                         "gradient_accumulation_steps: 2\nmax_grad_norm: 0.5\nweight_decay: 0.01\n"
                         "warmup_steps: 1\nlr_scheduler_type: cosine\n")
    want = train_artifact(art, 3, save=False, options={
        "lr": 4e-3, "batch_size": 2, "grad_accum": 2, "clip_norm": 0.5, "weight_decay": 0.01,
        "warmup_steps": 1, "schedule": "cosine"}).losses
    code, stdout, _ = cli(capsys, "train", str(art), "--steps", "3", "--json", "--config", str(yaml_file))
    assert code == 0 and json.loads(stdout)["losses"] == want
    json_file = tmp_path / "train.json"
    json_file.write_text(json.dumps({"learning_rate": 4e-3, "per_device_train_batch_size": 2}))
    code, stdout, _ = cli(capsys, "train", str(art), "--steps", "2", "--json", "--config", str(json_file),
                          "--learning-rate", "1e-2", "--gradient-accumulation-steps", "2")
    assert json.loads(stdout)["losses"] == train_artifact(
        art, 2, save=False, options={"lr": 1e-2, "batch_size": 2, "grad_accum": 2}).losses


def test_progress_bar_on_stderr(art: Path, capsys) -> None:
    code, stdout, stderr = cli(capsys, "train", str(art), "--steps", "2", "--progress")
    assert code == 0 and "step    2  loss" in stdout
    assert "2/2" in stderr and "loss" in stderr and "tok/s" in stderr and "ETA" in stderr
    code, _, stderr = cli(capsys, "train", str(art), "--steps", "1", "--no-progress")
    assert "tok/s" not in stderr


@pytest.mark.parametrize("argv", [
    ["--lr", "inf"], ["--lr", "nan"], ["--lr", "-1"], ["--lr", "0"], ["--learning-rate", "1e6"],
    ["--batch-size", "0"], ["--per-device-train-batch-size", "-2"], ["--grad-accum", "0"],
    ["--clip-norm", "inf"], ["--max-grad-norm", "-1"], ["--weight-decay", "nan"], ["--weight-decay", "5"],
    ["--beta1", "1"], ["--beta2", "-0.1"], ["--eps", "0"], ["--adam-epsilon", "inf"],
    ["--warmup-steps", "-1"], ["--schedule", "step"], ["--seed", "-3"], ["--pad-id", "-1"],
    ["--pad-id", "5000"], ["--ignore-index", "3"], ["--pad-id", "7", "--ignore-index", "7"],
])
def test_bad_values_are_one_line_exit_2(art: Path, capsys, argv: list[str]) -> None:
    before = sorted(p.name for p in (art / "training").rglob("*"))
    code, stdout, stderr = cli(capsys, "train", str(art), "--steps", "1", *argv)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and stdout == "" and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert sorted(p.name for p in (art / "training").rglob("*")) == before


def test_bad_config_files(art: Path, tmp_path: Path, capsys) -> None:
    cases = {"unknown.yaml": ("output_dirr: x\n", "unknown training option 'output_dirr'"),
             "list.yaml": ("- 1\n", "a mapping"), "broken.json": ("{", "not valid JSON"),
             "inf.json": ('{"learning_rate": Infinity}', "--lr (learning_rate)")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        code, _, stderr = cli(capsys, "train", str(art), "--steps", "1", "--config", str(tmp_path / name))
        assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    with pytest.raises(ErnieIRError, match="lr"):
        train_artifact(art, 1, options={"lr": float("inf")})
    with pytest.raises(ErnieIRError, match="unknown training option"):
        train_artifact(art, 1, options={"lerning_rate": 1e-3})


def test_labels_in_the_data_mask_the_prompt(art: Path, data: Path, tmp_path: Path) -> None:
    """ERNIEKit's SFT convention: `labels` with the ignore index over the prompt; the loss is
    the mean over the remaining targets only."""
    seqs = _seqs(data)
    graph = load_artifact(art)
    total, count = 0.0, 0
    rows = []
    for s in seqs:
        prompt = len(s) // 2
        labels = [-7] * prompt + s[prompt:]
        rows.append(json.dumps({"input_ids": s, "labels": labels}))
        lp = _log_softmax(run_graph(graph, {"input_ids": np.array([s], np.int64)})["logits"][0][:-1])
        for t in range(1, len(s)):
            if labels[t] != -7:
                total -= float(lp[t - 1, labels[t]])
                count += 1
    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(rows) + "\n")
    seen: list[StepProgress] = []
    got = train_artifact(art, 1, data=sft, save=False, options={"ignore_index": -7},
                         hooks=TrainHooks(on_progress=seen.append)).losses[0]
    assert got == pytest.approx(total / count, rel=1e-5) and seen[0].tokens == count
    with pytest.raises(ErnieIRError, match="labels must be a list as long as input_ids"):
        train_artifact(art, 1, data=sft, save=False)  # -7 is not the ignore index -100
    sft.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [1, 2]}) + "\n")
    with pytest.raises(ErnieIRError, match="as long as input_ids"):
        train_artifact(art, 1, data=sft, save=False)
    sft.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [1, -100, -100]}) + "\n")
    with pytest.raises(ErnieIRError, match="nothing to learn"):
        train_artifact(art, 1, data=sft, save=False)
