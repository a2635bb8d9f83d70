"""The CLI's words (issue 41 items 4 and 8): refusals that name the right fix, "did you mean"
for mistyped names, memory sizes with units, `plan ARTIFACT` reading its target, and the
option names other tools use (`--tensor-parallel-size`, `--quantization`, `--target-modules`,
`--do-sample`). Each test fails on the words the CLI printed before."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from _cli_kit import cli, user_error

import ernie_ir

GPT = "gpt-345m@tiny"


@pytest.fixture(scope="module")
def ascend_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ernie_ir.targets import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("messages") / "art"
    compile_model(GPT, "ascend", CompileOptions(out=out))
    return out


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding config.json and no weights."""
    from ernie_ir.frontends.builtins import builtin_config

    folder = tmp_path_factory.mktemp("config-only")
    (folder / "config.json").write_text(json.dumps(builtin_config("gpt-345m", "tiny")))
    return folder


# -- plan ARTIFACT: the target is the artifact's ----------------------------------------------------

def test_plan_artifact_reads_its_target(capsys: pytest.CaptureFixture[str], ascend_artifact: Path) -> None:
    code, out, err = cli(capsys, "plan", str(ascend_artifact), "--json")
    assert code == 0, err
    assert json.loads(out)["target"] == "ascend"


def test_plan_artifact_other_target_says_drop_it(capsys: pytest.CaptureFixture[str],
                                                 ascend_artifact: Path) -> None:
    line = user_error(capsys, "plan", str(ascend_artifact), "--target", "cuda")
    assert "compiled for --target ascend, not cuda: drop --target" in line
    assert "give --target ascend" not in line  # the advice that used to end in "Missing option"


def test_plan_model_needs_target(capsys: pytest.CaptureFixture[str]) -> None:
    line = user_error(capsys, "plan", GPT)
    assert "give --target (one of cuda, ascend, kunlun" in line and "Missing option" not in line


# -- memory sizes need a unit -------------------------------------------------------------------

@pytest.mark.parametrize(("flag", "value"), [("--device-memory", "80"), ("--reserve", "2"),
                                             ("--device-memory", "8e10")])
def test_memory_size_without_unit_is_refused(capsys: pytest.CaptureFixture[str], flag: str,
                                             value: str) -> None:
    line = user_error(capsys, "plan", GPT, "--target", "cuda", flag, value)
    assert line == (f"error: {flag} {value}: a memory size needs a unit: give one, e.g. {value}GiB "
                    f"(or {value}B for bytes)")


def test_memory_size_in_bytes_takes_b(capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_ir.planning import parse_memory

    assert parse_memory("85899345920B") == parse_memory("80GiB") == 80 * 2**30


# -- did you mean --------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "hint"), [
    (["show", GPT, "--quant", "wint8mx"], "unknown quantization 'wint8mx' (did you mean wint8mix?)"),
    (["show", "ernie-4.5-0.3b@tny"], "(did you mean ernie-4.5-0.3b@tiny?)"),
    (["show", "ernie-4.5-0.3bb@tiny"],
     "'ernie-4.5-0.3bb@tiny' is neither a model folder nor a built-in model "
     "(did you mean ernie-4.5-0.3b@tiny?)"),
    (["show", "gpt345m"], "(did you mean gpt-345m?)"),
    (["plan", GPT, "--target", "cdua"], "unknown target 'cdua' (did you mean cuda?)"),
])
def test_did_you_mean(capsys: pytest.CaptureFixture[str], argv: list[str], hint: str) -> None:
    assert hint in user_error(capsys, *argv)


def test_no_suggestion_when_nothing_is_near() -> None:
    from ernie_ir.ir.suggest import did_you_mean

    assert did_you_mean("zzzz", ["cuda", "ascend"]) == ""
    assert did_you_mean("cuda", ["cuda", "ascend"]) == ""
    assert did_you_mean("CDUA", ["cuda", "ascend"]) == " (did you mean cuda?)"


# -- no Python keywords in the CLI's messages --------------------------------------------------

def test_existing_out_names_the_flag_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = user_error(capsys, "export", GPT, "--out", str(out))
    assert line.endswith("already exists: pass --force to replace it"), line
    assert (out / "keep.txt").read_text() == "mine"


def test_no_message_pairs_a_flag_with_a_keyword() -> None:
    """`--force (force=True)`: one convention, the flag alone (docs/architecture.md)."""
    root = Path(ernie_ir.__file__).parent
    paired = re.compile(r"--[a-z][a-z-]* \(\w+=")
    found = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if paired.search(line)]
    assert found == []


def test_pickle_refusal_names_the_flag(capsys: pytest.CaptureFixture[str], config_only: Path,
                                       tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    shutil.copytree(config_only, folder)
    (folder / "model_state.pdparams").write_bytes(b"\x80\x04N.")
    line = user_error(capsys, "show", str(folder))
    assert "pass --trust-pickle if you trust where it came from" in line and "trust_pickle" not in line


# -- an artifact without its manifest, a folder without weights ----------------------------------

@pytest.mark.parametrize("argv", [["show"], ["run", "--tokens", "1,2"]])
def test_artifact_without_manifest_says_so(capsys: pytest.CaptureFixture[str], ascend_artifact: Path,
                                          tmp_path: Path, argv: list[str]) -> None:
    art = tmp_path / "art"
    shutil.copytree(ascend_artifact, art)
    (art / "manifest.json").unlink()
    line = user_error(capsys, argv[0], str(art), *argv[1:])
    assert "has no manifest.json" in line and "compile it again" in line
    assert "meta graph" not in line


def test_config_only_folder_hints_meta(capsys: pytest.CaptureFixture[str], config_only: Path) -> None:
    line = user_error(capsys, "show", str(config_only))
    assert "no weights in" in line and "give --meta" in line
    code, _, err = cli(capsys, "show", str(config_only), "--meta", "--summary")
    assert code == 0, err


# -- the names other tools use ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["compile", "plan"])
def test_tensor_parallel_size_is_tp(capsys: pytest.CaptureFixture[str], command: str, tmp_path: Path) -> None:
    extra = ["--out", str(tmp_path / "art")] if command == "compile" else []
    line = user_error(capsys, command, GPT, "--target", "cuda", "--tensor-parallel-size", "3", *extra)
    assert "--tp 3: the vocabulary of 1024 rows does not divide into 3 parts" in line


def test_quantization_is_quant(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = user_error(capsys, "compile", GPT, "--target", "cuda", "--quantization", "wint3",
                      "--out", str(tmp_path / "art"))
    assert "unknown quantization 'wint3'" in line
    assert not (tmp_path / "art").exists()


def test_target_modules_is_lora_targets(capsys: pytest.CaptureFixture[str]) -> None:
    line = user_error(capsys, "show", GPT, "--lora-rank", "4", "--target-modules", "(")
    assert "pattern '(' is not a valid regular expression" in line


def test_do_sample_samples(capsys: pytest.CaptureFixture[str]) -> None:
    """`--do-sample` is sampling at temperature 1: the tokens of `--temperature 1` with the same
    seed, not the greedy ones (this model and seed: they differ at the fourth token)."""
    def tokens(*flags: str) -> list[int]:
        code, out, err = cli(capsys, "generate", "ernie-4.5-0.3b@tiny", "--prompt-ids", "1,2,3",
                             "--max-new-tokens", "6", "--json", *flags)
        assert code == 0, err
        return json.loads(out)["new_tokens"][0]

    sampled = tokens("--do-sample", "--seed", "1")
    assert sampled == tokens("--temperature", "1", "--seed", "1")
    assert sampled != tokens()
