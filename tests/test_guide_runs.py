"""README.md and docs/user-guide.md run as written: every shell and Python block, in order.

The blocks of both pages run one after the other in one fresh folder, each `bash` block as a
`bash -euo pipefail` script (the `ernie-ir` of this environment first on PATH), each `python`
block with this interpreter, both with that folder as the working directory; every block must
exit 0. Blocks without a language (command synopses) are not run. Nothing in a command is
removed or weakened; the fixed substitutions, all of them:

- each `/data/X` checkpoint folder is a folder `ernie-ir export` writes, before the first block,
  from the built-in model STAND_INS names (random weights, the published layout, the built-in
  tokenizer);
- step counts become 2 (`--steps`, `--max-steps`, `--save-steps`, `--eval-steps`,
  `--warmup-steps`, ERNIEKit's `max_steps=` and the like, and the `step-N` of a checkpoint's
  name);
- a `pip install` line is skipped (the package is installed here), and so is
  `bash scripts/test.sh` (the whole suite, which holds this test);
- the files the pages take as the user's own data (USER_DATA: SFT and evaluation data, prompts,
  pretraining data, an ERNIEKit config) are written before the first block, and `tests/golden`
  is a copy of this repository's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/user-guide.md")
STAND_INS = {
    "ERNIE-4.5-0.3B-Paddle": "ernie-4.5-0.3b@small",
    "ERNIE-4.5-21B-A3B-Paddle": "ernie-4.5-21b-a3b@tiny",
    "ERNIE-4.5-300B-A47B-Paddle": "ernie-4.5-300b-a47b@tiny",
}
STEP_COUNTS = [
    (re.compile(r"(--(?:steps|max-steps|save-steps|eval-steps|warmup-steps)[ =])\d+"), r"\g<1>2"),
    (re.compile(r"\b((?:max_steps|save_steps|eval_steps|warmup_steps)=)\d+"), r"\g<1>2"),  # ERNIEKit keys
    (re.compile(r"\b(run-\d+-step-)\d+"), r"\g<1>2"),
]
SKIPPED = (re.compile(r"^\s*pip install\b"), re.compile(r"^\s*bash scripts/test\.sh\s*$"))
BLOCK_TIMEOUT_S = 600


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order (language "" when unlabeled)."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```", path.read_text(encoding="utf-8"), flags=re.S | re.M)


def substitute(code: str, data: Path) -> str:
    """A block with the fixed substitutions applied (module docstring)."""
    code = code.replace("/data/", f"{data}/")
    for pattern, repl in STEP_COUNTS:
        code = pattern.sub(repl, code)
    return "\n".join("# (skipped) " + line if any(p.search(line) for p in SKIPPED) else line
                     for line in code.splitlines()) + "\n"


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of every bash and python block of PAGES, in order."""
    out = []
    for page in PAGES:
        for i, (lang, code) in enumerate(fenced_blocks(ROOT / page), 1):
            if lang in ("bash", "python"):
                out.append((f"{page}[block {i}]", lang, code))
    return out


def write_user_data(root: Path) -> None:
    """The files the pages take as the user's own (USER_DATA)."""
    chats = [{"src": ["What is Paddle?"], "tgt": ["A deep learning framework."]},
             {"system": "Be brief.", "src": ["Hello", "Tell me about ERNIE."],
              "tgt": ["Hi!", "A family of language models."]},
             {"text": "The quick brown fox jumps over the lazy dog."},
             {"instruction": "Add", "input": "2 and 3", "output": "5"}]
    for name in ("sft.jsonl", "dev.jsonl", "sft-train.jsonl", "sft-eval.jsonl"):
        (root / name).write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    (root / "dev.txt").write_text("Once upon a time there was a small model. It answered every "
                                  "question it was asked, one token at a time.\n" * 4, encoding="utf-8")
    (root / "prompts.jsonl").write_text('"Hello"\n{"prompt": "Tell me about Paddle."}\n{"ids": [1, 2, 3]}\n',
                                        encoding="utf-8")
    rng = np.random.default_rng(0)
    np.save(root / "prompt.npy", rng.integers(7, 1000, size=(2, 5), dtype=np.int64))
    np.save(root / "ids.npy", rng.integers(7, 1000, size=(2, 16), dtype=np.int64))
    # pretraining data, PaddleNLP's preprocessing format: 200 documents of 600 tokens (a 2% validation
    # part of 4 documents holds a window of 1025)
    lens = np.full(200, 600, dtype=np.int64)
    (root / "data").mkdir()
    np.save(root / "data" / "corpus_ids.npy", rng.integers(7, 1000, size=int(lens.sum()), dtype=np.int32))
    np.savez(root / "data" / "corpus_idx.npz", lens=lens, docs=np.arange(len(lens) + 1, dtype=np.int64))
    # an ERNIEKit LoRA SFT config (the keys of ERNIEKit's examples; the command line overrides the rest)
    (root / "run_sft_lora_8k.yaml").write_text(
        "model_name_or_path: baidu/ERNIE-4.5-0.3B-Paddle\nfine_tuning: LoRA\nlora_rank: 8\n"
        "max_seq_len: 8192\nmax_steps: 100\nlearning_rate: 3.0e-4\nwarmup_steps: 10\n"
        "lr_scheduler_type: cosine\nbatch_size: 1\ngradient_accumulation_steps: 2\noutput_dir: ./output\n",
        encoding="utf-8")
    # an ERNIEKit export config (the keys of ERNIEKit's export; the command line names the run)
    (root / "run_export.yaml").write_text(
        "model_name_or_path: baidu/ERNIE-4.5-0.3B-Paddle\nfine_tuning: LoRA\noutput_dir: ./output\n",
        encoding="utf-8")
    shutil.copytree(ROOT / "tests" / "golden", root / "tests" / "golden")


USER_DATA = ("sft.jsonl", "dev.jsonl", "sft-train.jsonl", "sft-eval.jsonl", "dev.txt", "prompts.jsonl",
             "prompt.npy", "ids.npy", "data/corpus", "run_sft_lora_8k.yaml", "run_export.yaml",
             "tests/golden")


def run_block(where: str, lang: str, code: str, cwd: Path, env: dict[str, str]) -> str:
    """Runs one block; its stdout + stderr. Fails the test, naming the block, on a non-zero exit."""
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"{where} exited {done.returncode}:\n{code}\n--- output (tail) ---\n{output[-4000:]}",
                    pytrace=False)
    return output


def test_substitutions_cover_every_data_folder() -> None:
    """Each `/data/X` a block names has a stand-in, and the table changes what it says it does."""
    named = {m for _, _, code in runnable_blocks() for m in re.findall(r"/data/([\w.-]+)", code)}
    assert named == set(STAND_INS), named
    data = Path("/tmp/x")
    assert substitute("a /data/B --steps 1000 --save-steps=200 run-001-step-500 max_steps=100\n", data) == \
        "a /tmp/x/B --steps 2 --save-steps=2 run-001-step-2 max_steps=2\n"
    assert substitute('pip install ".[paddle]"\nbash scripts/test.sh\n', data).count("# (skipped)") == 2


def test_every_command_block_is_run() -> None:
    """Commands are shown in `bash` blocks (which the test below runs): an unlabeled block that
    starts a line with `ernie-ir` must be a synopsis (`[--option]` notation), not a command that
    escapes the run."""
    for page in PAGES:
        for i, (lang, code) in enumerate(fenced_blocks(ROOT / page), 1):
            commands = [line for line in code.splitlines() if line.startswith("ernie-ir ")]
            assert lang or not commands or "[--" in code, (
                f"{page}[block {i}] shows `{commands[0]}` in an unlabeled block: label it bash so it runs")


def test_readme_lists_every_command() -> None:
    """README's command synopsis names every command `ernie-ir --help` lists (and no other)."""
    import typer

    from ernie_ir.cli.app import app

    group = typer.main.get_command(app)
    listed = set(group.commands)  # type: ignore[attr-defined]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    synopsis = next(code for _, code in fenced_blocks(ROOT / "README.md") if "ernie-ir compile MODEL" in code)
    assert "## Commands" in readme
    assert set(re.findall(r"^ernie-ir ([a-z-]+)", synopsis, flags=re.M)) == listed, listed


@pytest.mark.slow
def test_readme_and_user_guide_run_as_written(tmp_path: Path) -> None:
    blocks = runnable_blocks()
    for page in PAGES:  # a page without blocks would pass empty
        assert any(where.startswith(page) for where, _, _ in blocks), f"{page} has no bash or python block"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "120"}
    data = tmp_path / "data-models"
    for folder, builtin in STAND_INS.items():
        run_block(f"stand-in {folder}", "bash", f"ernie-ir export {builtin} --out {data / folder}\n",
                  tmp_path, env)
    write_user_data(tmp_path)
    for name in USER_DATA:  # a file, a folder, or a pretraining PREFIX
        assert (tmp_path / name).exists() or Path(f"{tmp_path / name}_ids.npy").is_file(), name
    outputs = {}
    for where, lang, code in blocks:
        outputs[where] = run_block(where, lang, substitute(code, data), tmp_path, env)
    quick_start = outputs["README.md[block 1]"]
    assert "kernel plan" in quick_start and "top1_agreement" in quick_start, quick_start
