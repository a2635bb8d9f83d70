"""The fine-tune workflow's bad input through the CLI (issue 22 item 6): `ernie-ir train ART
--data ...`, and `compile`/`export --lora-adapter` of a trained checkpoint. Every case is the
CLI's error contract (exit 2, one `error:` line naming the problem and the fix, nothing on
stdout) and writes nothing: the test's folder (the artifact copy, its manifest byte for byte,
training/checkpoints, the data files) is as it was, no temp leftovers, no --out folder.

Two artifacts, compiled once per module `--mode training --target cuda`:

- `art`: a random ERNIE 4.5 (hidden 48, 96 positions) with a sentencepiece tokenizer and
  ERNIE's chat template (`--lora-rank 2`): text and SFT data tokenize;
- `tiny`: the built-in `ernie-4.5-0.3b@tiny` as a graph folder (`--lora-rank 4`; a graph folder
  has no tokenizer, where the built-in name has its generated one): only
  `{"input_ids"}` data trains there (trained once: its checkpoint is the foreign checkpoint and
  adapter of the resume and merge cases).

Covered elsewhere, not repeated here: `compile --merge-lora` without an adapter on a model
without LoRA, `--merge-lora --lora-rank`, a dense adapter on a model of other widths and a
bad adapter folder (tests/quant/test_merge_lora.py `test_bad_merges_are_one_line`,
`test_adapter_shapes_that_do_not_fit`); `--resume` with --resume-from, a missing
--resume-from-checkpoint folder, --steps not past the checkpoint (tests/paddle/
test_training_resume.py `test_bad_resume_input_is_one_line`); malformed token-id lines, empty,
non-UTF-8 and unreadable data files (tests/bad_input/_bad_input_cases.py `train-data-*`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _cli_kit import run_cli as _run
from _cli_kit import user_error
from _fe_testkit import hf_to_paddle, random_hf_ernie, write_checkpoint
from test_tokenizer import ERNIE_TEMPLATE, train_sentencepiece

from ernie_ir.ir.storage import save_graph
from ernie_ir.load import load_input

pytest.importorskip("paddle")

POSITIONS = 96
CFG = {
    "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 448, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "max_position_embeddings": POSITIONS, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
TINY, TINY_RANK = "ernie-4.5-0.3b@tiny", 4
GOOD = {"src": "hello world", "tgt": "hi there"}
IDS = [{"input_ids": [1, 5, 9, 33, 2]}, {"input_ids": [7, 8, 9], "labels": [-100, 8, 9]}]


def _checkpoint(root: Path) -> Path:
    """A random ERNIE 4.5 with a sentencepiece tokenizer and ERNIE's chat template."""
    write_checkpoint(root, CFG, hf_to_paddle(random_hf_ernie(CFG, seed=7), CFG))
    train_sentencepiece(root / "tokenizer.model", dummy_prefix=False)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
        "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
        "add_bos_token": False, "add_eos_token": False, "chat_template": ERNIE_TEMPLATE}))
    return root


def _jsonl(path: Path, *rows: dict | str) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n"
                            for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ft-cli")
    base = _checkpoint(root / "base")
    tiny = save_graph(load_input(TINY), root / "tiny-graph")  # the graph alone: no tokenizer
    for src, rank, name in ((str(base), 2, "art"), (str(tiny), TINY_RANK, "tiny")):
        code, _, err = _run("compile", src, "--mode", "training", "--lora-rank", str(rank),
                            "--target", "cuda", "--out", str(root / name))
        assert code == 0, err
    trained = root / "tiny-trained"
    shutil.copytree(root / "tiny", trained)
    ids = _jsonl(root / "ids.jsonl", *IDS)
    run = _run("train", str(trained), "--steps", "1", "--data", str(ids), "--json")
    return {"root": root, "base": base, "art": root / "art", "tiny": root / "tiny", "tiny_trained": trained,
            "tiny_run": run}


@pytest.fixture()
def art(built: dict, tmp_path: Path) -> Path:
    """A fresh copy of the tokenizer-bearing training artifact (no checkpoints)."""
    return Path(shutil.copytree(built["art"], tmp_path / "art"))


@pytest.fixture()
def tiny(built: dict, tmp_path: Path) -> Path:
    """A fresh copy of ernie-4.5-0.3b@tiny's graph folder's training artifact (no tokenizer, no
    checkpoints)."""
    return Path(shutil.copytree(built["tiny"], tmp_path / "tiny"))


def _snapshot(root: Path) -> dict[str, tuple[int, int] | bytes]:
    """Every path under root with its size and mtime (folders by name; manifests by content)."""
    out: dict[str, tuple[int, int] | bytes] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[Path(dirpath, name).relative_to(root).as_posix() + "/"] = (0, 0)
        for name in filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            key = p.relative_to(root).as_posix()
            out[key] = p.read_bytes() if name == "manifest.json" else (st.st_size, st.st_mtime_ns)
    return out


def refused(capsys: pytest.CaptureFixture[str], folder: Path, *argv: str, expect: tuple[str, ...] = (),
            out: Path | None = None) -> str:
    """The CLI's one-line refusal of ARGV; nothing under `folder` (the test's tmp_path) changes:
    no checkpoint, the manifest byte for byte, no temp leftover, no `out` folder."""
    before = _snapshot(folder)
    line = user_error(capsys, *argv)
    after = _snapshot(folder)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, (argv, changed)
    assert not any(".tmp-" in k for k in after), sorted(after)
    assert out is None or not out.exists()
    for s in expect:
        assert s in line, (s, line)
    return line


def _train(art: Path, data: Path, *more: str, steps: int = 1) -> list[str]:
    return ["train", str(art), "--steps", str(steps), "--data", str(data), *more]


# -- 1. a line of no known format ------------------------------------------------------------------


@pytest.mark.parametrize("row", [{"prompt": "hi", "response": "ok"}, {}, {"system": "Be brief."},
                                 {"labels": [1, 2, 3]}], ids=["prompt-response", "empty", "system-only",
                                                              "labels-only"])
def test_a_line_without_src_tgt_text_or_input_ids(art: Path, tmp_path: Path, row: dict,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "d.jsonl", GOOD, row)
    refused(capsys, tmp_path, *_train(art, data),
            expect=(f"{data}:2: no key of a known format", '{"src": ..., "tgt": ...}',
                    '{"input_ids": [...]}'))


# -- 2. the newest turn does not fit --max-seq-len -------------------------------------------------


@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_newest_turn_longer_than_max_seq_len(art: Path, tmp_path: Path, flag: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    long = {"src": ["hi", "the quick brown fox " * 6], "tgt": ["ok", "jumps over the lazy dog " * 6]}
    data = _jsonl(tmp_path / "d.jsonl", GOOD, long)
    argv = (_train(art, data, "--max-seq-len", "24") if flag == "--data" else
            _train(art, _jsonl(tmp_path / "t.jsonl", GOOD), "--eval-data", str(data), "--max-seq-len", "24"))
    refused(capsys, tmp_path, *argv,
            expect=(f"{data}:2: the last turn needs", "more than --max-seq-len 24",
                    "truncation would remove the whole response", "raise --max-seq-len"))


# -- 3. text on an artifact without a tokenizer; token ids train there ----------------------------


@pytest.mark.parametrize("row, kind", [(GOOD, "ERNIEKit SFT"), ({"text": "hello world"}, "text"),
                                       ({"instruction": "Say hi", "output": "hi"}, "alpaca")],
                         ids=["sft", "text", "alpaca"])
def test_text_data_on_an_artifact_without_a_tokenizer(tiny: Path, tmp_path: Path, row: dict, kind: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "d.jsonl", IDS[0], row)
    refused(capsys, tmp_path, *_train(tiny, data),
            expect=(f"{data}:2: a {kind} line needs a tokenizer", "the artifact has none",
                    '{"input_ids": [...]'))


def test_token_ids_train_on_an_artifact_without_a_tokenizer(built: dict) -> None:
    code, out, err = built["tiny_run"]
    assert code == 0, err
    report = json.loads(out)
    ckpt = Path(report["checkpoints"][-1])
    assert ckpt.parent == built["tiny_trained"] / "training" / "checkpoints"
    assert len(report["losses"]) == 1
    lora = json.loads((ckpt / "adapter" / "lora_config.json").read_text())
    assert lora["r"] == TINY_RANK


# -- 4. --packing ----------------------------------------------------------------------------------


def test_packing_is_refused_with_the_reason(art: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "d.jsonl", GOOD)
    refused(capsys, tmp_path, *_train(art, data, "--packing"),
            expect=("--packing: packing is not supported", "block-diagonal", "padded"))
    code, _, err = _run(*_train(art, data, "--no-packing"))  # the same run without it trains
    assert code == 0, err


# -- 5. --max-seq-len past the model's positions, below 2 ------------------------------------------


@pytest.mark.parametrize("value, expect", [
    (str(POSITIONS + 1), (f"--max-seq-len {POSITIONS + 1} exceeds the model's {POSITIONS} positions",
                          f"give at most {POSITIONS}")),
    ("100000000", (f"exceeds the model's {POSITIONS} positions",)),
    ("1", ("--max-seq-len must be at least 2 tokens, got 1",)),
    ("0", ("at least 2 tokens, got 0",)),
    ("-5", ("at least 2 tokens, got -5",)),
])
def test_max_seq_len_out_of_range(art: Path, tmp_path: Path, value: str, expect: tuple[str, ...],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "d.jsonl", GOOD)
    refused(capsys, tmp_path, *_train(art, data, "--max-seq-len", value), expect=expect)


def test_max_seq_len_of_the_whole_model_trains(art: Path, tmp_path: Path) -> None:
    code, _, err = _run(*_train(art, _jsonl(tmp_path / "d.jsonl", GOOD), "--max-seq-len", str(POSITIONS)))
    assert code == 0, err


# -- 6. --eval-steps without --eval-data ------------------------------------------------------------


@pytest.mark.parametrize("how", ["flag", "config"])
def test_eval_steps_without_eval_data(art: Path, tmp_path: Path, how: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _jsonl(tmp_path / "d.jsonl", GOOD)
    config = tmp_path / "c.yaml"
    config.write_text("eval_steps: 2\n")
    more = ["--eval-steps", "2"] if how == "flag" else ["--config", str(config)]
    refused(capsys, tmp_path, *_train(art, data, *more), expect=("--eval-steps 2 needs evaluation data",
                                                                 "--eval-data"))


# -- 7. a trained checkpoint merged into another model ----------------------------------------------
# (the other merge refusals: tests/quant/test_merge_lora.py; here the adapter is the one `train`
# wrote into a checkpoint folder, given as that folder or its adapter/, to compile and to export)


@pytest.mark.parametrize("command", ["compile", "export"])
@pytest.mark.parametrize("which", ["checkpoint", "adapter"])
def test_an_adapter_trained_on_another_model(built: dict, tmp_path: Path, command: str, which: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = Path(json.loads(built["tiny_run"][1])["checkpoints"][-1])
    adapter = ckpt if which == "checkpoint" else ckpt / "adapter"
    out = tmp_path / "out"
    argv = ["compile", str(built["base"]), "--target", "cuda", "--merge-lora"] if command == "compile" else \
        ["export", str(built["base"])]
    refused(capsys, built["tiny_trained"], *argv, "--lora-adapter", str(adapter), "--out", str(out),
            expect=("adapter for ernie.layers.", "has lora_A [64, 4]", "needs [48, 4]"), out=out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


# -- 8. --resume with nothing of this artifact to resume ---------------------------------------------


def test_resume_without_a_checkpoint(art: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, tmp_path, *_train(art, _jsonl(tmp_path / "d.jsonl", GOOD), "--resume"),
            expect=("--resume: ", "holds no checkpoint to resume from", "train first"))


def test_resume_from_another_artifacts_checkpoint(built: dict, art: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    other = Path(json.loads(built["tiny_run"][1])["checkpoints"][-1])
    data = _jsonl(tmp_path / "d.jsonl", *IDS)
    for target in (tmp_path, built["tiny_trained"]):  # neither artifact is touched
        refused(capsys, target, *_train(art, data, "--resume-from-checkpoint", str(other), steps=2),
                expect=(f"--resume {other}: the checkpoint belongs to another artifact",
                        "resume on the artifact it was trained on"))
