"""Resumable training on one rank: checkpoint folders every --save-steps, the newest
--save-total-limit kept, a run resumed from a checkpoint equal bit for bit to the run that was
not interrupted (losses, params, optimizer and RNG state), the evaluation loss against an
independent numpy computation, sequences given as a list, bad input refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _cli_kit import cli

from ernie_ir.ir import ErnieIRError
from ernie_ir.runtime import run_graph
from ernie_ir.targets import CompileOptions, compile_model, load_artifact, verify_artifact

paddle = pytest.importorskip("paddle")

from safetensors.numpy import load_file  # noqa: E402

from ernie_ir.artifacts import record_files  # noqa: E402
from ernie_ir.training.checkpoints import OPTIMIZER, PARAMS, TRAINER_STATE  # noqa: E402
from ernie_ir.training.loop import TrainHooks, TrainResult, train_artifact  # noqa: E402

MODEL = "ernie-4.5-0.3b@tiny"
# 6 sequences in batches of 2 (3 batches), 2 batches a step: step k takes batches 2k, 2k+1 mod 3,
# so where the data stands is not the same at every step; cosine decay after 1 warmup step.
OPTIONS = {"batch_size": 2, "grad_accum": 2, "lr": 5e-3, "schedule": "cosine", "warmup_steps": 1,
           "weight_decay": 0.01}
LENGTHS = (12, 5, 9, 3, 7, 10)


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("train-resume")
    # LoRA with dropout: the resumed run must draw the dropout masks the first run drew
    compile_model(MODEL, "kunlun", CompileOptions(pipeline="lora{rank=4,dropout=0.3}", mode="training",
                  out=tmp / "lora"))
    compile_model(MODEL, "kunlun", CompileOptions(quant="qat-int8", mode="training", out=tmp / "qat"))
    compile_model(MODEL, "kunlun", CompileOptions(lora_rank=2, mode="training", out=tmp / "other"))
    return {"lora": tmp / "lora", "qat": tmp / "qat", "other": tmp / "other"}


@pytest.fixture(scope="module")
def seqs() -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(11)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = rng.integers(1, 1000, size=n).tolist()
        labels = [-100] * (n // 3) + ids[n // 3:] if i % 2 else ids  # every other one masks a prompt
        out.append((ids, labels))
    return out


@pytest.fixture()
def art(arts: dict[str, Path], tmp_path: Path) -> Path:
    """A fresh copy of the LoRA artifact (no checkpoints)."""
    shutil.copytree(arts["lora"], tmp_path / "art")
    return tmp_path / "art"


def _jsonl(path: Path, seqs: list[tuple[list[int], list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"input_ids": i, "labels": lab}) + "\n" for i, lab in seqs))
    return path


def _files(folder: Path) -> dict[str, dict[str, np.ndarray]]:
    return {f.name: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}


def _assert_same_files(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert sorted(fa[name]) == sorted(fb[name]), name
        for key in fa[name]:
            np.testing.assert_array_equal(fb[name][key], fa[name][key], err_msg=f"{name}: {key}")


@pytest.mark.parametrize("kind", ["lora", "qat"])
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(arts: dict[str, Path], tmp_path: Path, seqs,
                                                            kind: str) -> None:
    art = tmp_path / kind
    shutil.copytree(arts[kind], art)
    full = train_artifact(art, 5, data=seqs, options={**OPTIONS, "save_steps": 2})
    names = [p.name for p in full.checkpoints]
    assert names == ["run-001-step-2", "run-001-step-4", "run-001-step-5"] and full.first_step == 1
    folder = full.checkpoints[0]
    assert sorted(p.name for p in folder.iterdir()) == [OPTIMIZER.format(rank=0), PARAMS, TRAINER_STATE]
    state = json.loads((folder / TRAINER_STATE).read_text())
    assert (state["step"], state["steps"], state["world_size"], state["resumed_from"]) == (2, 5, 1, None)
    assert state["data"]["batches"] == 3 and state["data"]["next_batch"] == 4 % 3
    assert state["loss"] == full.losses[1] and state["options"]["lr"] == 5e-3
    opt = load_file(str(folder / OPTIMIZER.format(rank=0)))
    trained = [p.name for p in load_artifact(art).params.values() if p.trainable]
    assert {k.rpartition("/")[0] for k in opt} == set(trained)  # IR names, not Paddle's tensor names
    assert {k.rpartition("/")[2] for k in opt} >= {"moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"}
    verify_artifact(art)

    # resume from step 2 (by name) in the same process: a new run, the same numbers
    resumed = train_artifact(art, 5, data=seqs, options={**OPTIONS, "save_steps": 2}, resume="run-001-step-2")
    print(f"[train] {kind} resume from step 2: {resumed.losses} vs {full.losses[2:]}")
    assert resumed.losses == full.losses[2:] and resumed.first_step == 3
    assert [p.name for p in resumed.checkpoints] == ["run-002-step-4", "run-002-step-5"]
    for step in (4, 5):
        _assert_same_files(art / f"training/checkpoints/run-001-step-{step}",
                           art / f"training/checkpoints/run-002-step-{step}")
        a, b = (json.loads((art / f"training/checkpoints/run-00{k}-step-{step}" / TRAINER_STATE).read_text())
                for k in (1, 2))
        assert a["rng_state"] == b["rng_state"] and a["loss"] == b["loss"] and a["run_id"] != b["run_id"]
        assert b["resumed_from"] == "run-001-step-2"
    if kind == "lora":  # dropout drew random numbers: the checkpoint's RNG state is not the seed's
        paddle.seed(0)
        from ernie_ir.training.checkpoints import rng_state

        assert state["rng_state"]["rank0"] != rng_state(paddle)
    verify_artifact(art)


def test_save_steps_total_limit_and_on_checkpoint(art: Path, seqs) -> None:
    calls: list[tuple[str, bool]] = []

    def add_adapter(folder: Path) -> None:  # what the fine-tune layer does: a folder beside the params
        calls.append((folder.name, (folder / PARAMS).is_file()))
        extra = folder / "adapter" / "lora_config.json"
        extra.parent.mkdir()
        extra.write_text("{}")
        record_files(art, [extra])

    result = train_artifact(art, 5, data=seqs, options={**OPTIONS, "save_steps": 2, "save_total_limit": 2},
                            hooks=TrainHooks(on_checkpoint=add_adapter))
    assert calls == [("run-001-step-2", True), ("run-001-step-4", True), ("run-001-step-5", True)]
    kept = ["run-001-step-4", "run-001-step-5"]
    assert [p.name for p in result.checkpoints] == kept
    assert sorted(p.name for p in (art / "training/checkpoints").iterdir()) == kept
    files = verify_artifact(art).files  # the removed folder's entries (the adapter's too) are gone
    assert not any("step-2" in n for n in files)
    assert "training/checkpoints/run-001-step-4/adapter/lora_config.json" in files
    # the limit counts the artifact's checkpoints: a later run keeps its own newest only
    again = train_artifact(art, 1, data=seqs, options={**OPTIONS, "save_total_limit": 1})
    assert [p.name for p in again.checkpoints] == ["run-002-step-1"]
    assert sorted(p.name for p in (art / "training/checkpoints").iterdir()) == ["run-002-step-1"]
    # without --save-steps: one checkpoint, at the end (as before)
    end = train_artifact(art, 3, data=seqs, options=OPTIONS)
    assert [p.name for p in end.checkpoints] == ["run-003-step-3"]
    # checkpoints whose on_checkpoint has not run yet (a multi-rank run's launcher) are spared
    from ernie_ir.training.checkpoints import prune_checkpoints

    assert prune_checkpoints(art, 0, spare=lambda name: name.startswith("run-003")) == [
        art / "training/checkpoints/run-002-step-1"]
    assert sorted(p.name for p in (art / "training/checkpoints").iterdir()) == ["run-003-step-3"]
    verify_artifact(art)


def _numpy_eval(art: Path, params: dict[str, np.ndarray], seqs) -> float:
    """Mean next-token cross-entropy over the target tokens of `seqs`, each run unpadded by the
    interpreter with the checkpoint's params."""
    graph = load_artifact(art)
    for name, value in params.items():
        graph.params[name].set_data(value.astype(np.float32))
    total, count = 0.0, 0
    for ids, labels in seqs:
        logits = run_graph(graph, {"input_ids": np.array([ids], np.int64)})["logits"][0].astype(np.float64)
        m = logits.max(-1, keepdims=True)
        lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        for t in range(1, len(ids)):
            if labels[t] != -100:
                total -= lp[t - 1, labels[t]]
                count += 1
    return total / count


def test_eval_losses_equal_an_independent_computation(art: Path, seqs, tmp_path: Path) -> None:
    train_data, eval_seqs = seqs[:4], seqs[4:] + seqs[:1]
    result = train_artifact(art, 3, data=train_data, options={**OPTIONS, "eval_steps": 2, "save_steps": 1},
                            eval_sequences=eval_seqs)
    assert [s for s, _ in result.eval_losses] == [2, 3]
    for step, got in result.eval_losses:
        params = load_file(str(art / f"training/checkpoints/run-001-step-{step}" / PARAMS))
        want = _numpy_eval(art, params, eval_seqs)
        print(f"[train] eval loss at step {step}: {got:.6f}, numpy {want:.6f}")
        assert got == pytest.approx(want, rel=1e-5)
        state = json.loads((art / f"training/checkpoints/run-001-step-{step}" / TRAINER_STATE).read_text())
        assert state["eval_loss"] == got
    # evaluating changes nothing of the training (eval mode: no dropout draws, no QAT commit)
    plain = train_artifact(art, 3, data=train_data, options=OPTIONS, save=False)
    assert plain.losses == result.losses and plain.eval_losses == []
    # the same data as a jsonl file: the same numbers; without eval_steps: at the end only
    from_file = train_artifact(art, 3, data=_jsonl(tmp_path / "t.jsonl", train_data), options=OPTIONS,
                               eval_data=_jsonl(tmp_path / "e.jsonl", eval_seqs), save=False)
    assert from_file.losses == result.losses and from_file.eval_losses == result.eval_losses[-1:]


def test_sequences_as_input_are_validated_like_file_lines(art: Path) -> None:
    def refused(data: object, match: str, **kw: object) -> None:
        with pytest.raises(ErnieIRError, match=match) as e:
            train_artifact(art, 1, data=data, save=False, **kw)
        assert "\n" not in str(e.value)

    ok = ([1, 2, 3], None)
    refused([ok, ([1, 99999], None)], r"^data\[1\]: input_ids must be a list of >= 2 token ids in \[0, ")
    refused([ok, ([1], [1])], r"^data\[1\]: input_ids")
    refused([([1, 2, 3], [1, 2])], r"^data\[0\]: labels must be a list as long as input_ids")
    refused([([1, 2, 3], [1, -100, -100])], r"^data\[0\]: every label after the first .* nothing to learn")
    refused([([True, False], None)], r"^data\[0\]: input_ids")
    refused([[1, 2, 3]], r"^data\[0\]: expected an \(input_ids, labels\) pair")
    refused([], r"^data holds no sequences")
    refused([ok], r"^eval_sequences\[0\]: labels", eval_sequences=[([1, 2], [5])])
    refused([ok], "give the evaluation data once", eval_sequences=[ok], eval_data=Path("x.jsonl"))
    # numpy arrays and numpy integers are token ids too; labels None: every token is a target
    a = train_artifact(art, 1, data=[(np.array([1, 2, 3]), None), ([np.int64(4), 5], [4, 5])], save=False)
    b = train_artifact(art, 1, data=[([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 5])], save=False)
    assert a.losses == b.losses


def test_bad_resume_input_is_one_line(arts: dict[str, Path], art: Path, seqs, tmp_path: Path,
                                      capsys) -> None:
    def refused(match: str, steps: int = 3, **kw: object) -> None:
        kw = {"data": seqs, "options": OPTIONS, **kw}
        with pytest.raises(ErnieIRError, match=match) as e:
            train_artifact(art, steps, **kw)
        assert "\n" not in str(e.value)

    refused(r"^--resume: .* holds no checkpoint to resume from", resume=True)
    train_artifact(art, 2, data=seqs, options=OPTIONS)
    ckpt = art / "training/checkpoints/run-001-step-2"
    before = sorted(p.name for p in (art / "training/checkpoints").iterdir())
    refused(r"--steps 2 must be greater than the step 2 of the checkpoint run-001-step-2", steps=2,
            resume=True)
    refused(r"--lr 0.001 differs from the checkpoint's 0.005; .* --lr, --schedule, --warmup-steps, "
            r"--batch-size, --grad-accum must be the checkpoint's", resume=True,
            options={**OPTIONS, "lr": 1e-3})
    refused(r"--grad-accum 1 differs", resume=True, options={**OPTIONS, "grad_accum": 1})
    refused(r"--batch-size 3 differs", resume=True, options={**OPTIONS, "per_device_train_batch_size": 3})
    refused(r"--schedule 'linear' differs", resume=True, options={**OPTIONS, "lr_scheduler_type": "linear"})
    refused(r"the training data differs from the checkpoint's run", resume=True, data=seqs[:5])
    refused(r"no such checkpoint folder", resume="run-009-step-2")
    other = train_artifact(arts["other"], 1, data=seqs, options=OPTIONS).checkpoints[0]
    refused(r"the checkpoint belongs to another artifact", resume=other)
    elsewhere = tmp_path / "copied"
    shutil.copytree(ckpt, elsewhere)
    state = json.loads((elsewhere / TRAINER_STATE).read_text())
    (elsewhere / TRAINER_STATE).write_text(json.dumps({**state, "world_size": 2}))
    refused(r"the checkpoint was trained on 2 rank\(s\), .* has 1", resume=elsewhere)
    (elsewhere / TRAINER_STATE).write_text("{")
    refused(r"trainer_state.json is not an ernie-ir trainer state", resume=elsewhere)
    refused(r"not a training checkpoint folder \(no trainer_state.json\)", resume=tmp_path)
    moments = ckpt / OPTIMIZER.format(rank=0)
    good = moments.read_bytes()
    moments.write_bytes(good[:-4] + b"\0\0\0\0")  # a checkpoint inside the artifact is hashed first
    refused(r"optimizer.rank0.safetensors was modified", resume=True)
    moments.write_bytes(good)
    refused(r"--eval-steps needs evaluation data", options={**OPTIONS, "eval_steps": 1})
    refused(r"--save-steps and --save-total-limit need checkpoints", save=False,
            options={**OPTIONS, "save_steps": 1})
    assert sorted(p.name for p in (art / "training/checkpoints").iterdir()) == before  # nothing written

    # the CLI: exit 2, one error line
    for argv in (["--resume", "--resume-from", "run-001-step-2"], ["--resume", "--steps", "1"],
                 ["--save-steps", "0"], ["--save-total-limit", "-1"], ["--eval-steps", "2"],
                 ["--resume-from-checkpoint", str(tmp_path / "nowhere")]):
        code, stdout, stderr = cli(capsys, "train", str(art), "--steps", "3", *argv)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and stdout == "" and len(lines) == 1, (argv, stderr)
        assert lines[0].startswith("error: "), (argv, stderr)


def test_cli_resume_save_steps_and_config(art: Path, seqs, tmp_path: Path, capsys) -> None:
    data = _jsonl(tmp_path / "d.jsonl", seqs)
    flags = ["--data", str(data), "--batch-size", "2", "--grad-accum", "2", "--lr", "5e-3", "--schedule",
             "cosine", "--warmup-steps", "1", "--weight-decay", "0.01"]
    full = train_artifact(art, 4, data=data, options=OPTIONS, save=False).losses
    code, stdout, _ = cli(capsys, "train", str(art), "--steps", "2", *flags, "--json")
    out = json.loads(stdout)
    assert code == 0 and out["first_step"] == 1 and out["eval_losses"] == []
    assert out["checkpoints"] == [str(art / "training/checkpoints/run-001-step-2")]
    # a 4-step run checkpointed at step 2 (a 2-step run's schedule ends at step 2: not the same run)
    code, stdout, _ = cli(capsys, "train", str(art), "--steps", "4", *flags, "--save-steps", "2", "--json")
    assert json.loads(stdout)["losses"] == full
    code, stdout, _ = cli(capsys, "train", str(art), "--steps", "4", *flags,
                          "--resume-from", "run-002-step-2")
    assert code == 0, stdout
    lines = stdout.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["step", "3"], ["step", "4"]]
    assert float(lines[0].split()[3]) == pytest.approx(full[2], abs=1e-6)
    assert lines[-1] == f"checkpoint {art / 'training/checkpoints/run-003-step-4'}"
    # ERNIEKit's resume_from_checkpoint in --config; --resume: the newest (run-003-step-4)
    config = tmp_path / "c.yaml"
    config.write_text("resume_from_checkpoint: run-002-step-2\nsave_steps: 1\nsave_total_limit: 1\n")
    code, stdout, _ = cli(capsys, "train", str(art), "--steps", "4", *flags, "--config", str(config),
                          "--json")
    out = json.loads(stdout)
    assert out["first_step"] == 3 and out["losses"] == full[2:]
    assert out["checkpoints"] == [str(art / "training/checkpoints/run-004-step-4")]
    assert sorted(p.name for p in (art / "training/checkpoints").iterdir()) == ["run-004-step-4"]
    code, stdout, _ = cli(capsys, "train", str(art), "--steps", "5", *flags, "--resume", "--json")
    out = json.loads(stdout)
    assert code == 0 and out["first_step"] == 5 and len(out["losses"]) == 1
    verify_artifact(art)
    assert isinstance(train_artifact(art, 1, save=False), TrainResult)
