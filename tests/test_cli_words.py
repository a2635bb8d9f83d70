"""The CLI's wrong or misleading words, part B (issue 41 item 4): tables that never cut their key
column, progress bars by default on a terminal, numbers for people, fallback lines that name the
shapes (not `[...]`) and suggest nothing already done, `train --config`'s list of keys, and
`generate` output of ids the tokenizer does not have."""

from __future__ import annotations

import io
import json
import re
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _cli_kit import cli, user_error
from rich.console import Console

from ernie_ir.cli import common
from ernie_ir.cli.numbers import count, fixed, sig
from ernie_ir.cli.tables import KeyTable

MODEL = "ernie-4.5-0.3b@tiny"
UNITS = [f"ernie.layers.{i}.{s}" for i in range(2)
         for s in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_gate_proj", "mlp.down_proj")]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(2)
    path = tmp_path_factory.mktemp("words") / "c.jsonl"
    path.write_text(json.dumps({"input_ids": rng.integers(0, 400, 48).tolist()}) + "\n")
    return path


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr taken for a terminal (as a user's shell is), not the captured file it is; a bar
    redrawn at every update, not 10 times a second (a run this short may end before the first)."""
    from rich.progress import Progress

    monkeypatch.setattr(common.err.get(), "_force_terminal", True)
    monkeypatch.setattr(common.err.get(), "is_interactive", True)
    monkeypatch.setenv("TERM", "xterm")  # rich draws no live display on a dumb terminal
    update = Progress.update
    monkeypatch.setattr(Progress, "update", lambda self, *a, **k: update(self, *a, **{**k, "refresh": True}))


# -- numbers ---------------------------------------------------------------------------------------

def test_numbers_for_people() -> None:
    assert fixed(725306064334739734528.0) == "7.2531e+20"  # was 725306064334739734528.0000
    assert fixed(12345.678912) == "12,345.6789" and fixed(3.5, 1) == "3.5"
    assert count(1228800) == "1,228,800"
    assert sig(0.0123456) == "0.01235" and sig(12345.6) == "12,350" and sig(1.23e-7) == "1.230e-07"
    assert sig(9.9996) == "10.00" and sig(7.253e20, 6) == "7.25300e+20" and sig(0.0) == "0"
    assert fixed(float("nan")) == "nan" and sig(float("inf")) == "inf"


def test_eval_prints_a_huge_perplexity_in_scientific_notation(capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_ir.cli.eval_cmd import _print_report

    figures = {"perplexity": 725306064334739734528.0, "perplexity_ci95": (7.0e20, 7.5e20),
               "mean_nll": 47.033, "tokens_scored": 1228800, "perplexity_reference": 30.25,
               "perplexity_reference_ci95": (29.5, 31.0),
               "kl_mean": 12.5, "kl_median": 12.0, "kl_p99": 20.0, "kl_p999": 21.0, "kl_max": 22.0,
               "top1_agreement": 0.25, "rms_delta_p": 0.5}
    report = SimpleNamespace(model="m", reference="ref", seq_len=512, stride=512, documents=3, windows=2400,
                             tokens_per_s=614400.0, figures=figures)  # an EvalReport's fields
    _print_report(report, "interpreter")
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == ("m: perplexity 7.2531e+20 (95% 7.0000e+20 .. 7.5000e+20), mean NLL "
                                   "47.03300 over 1,228,800 tokens (3 documents, 2,400 windows of 512, "
                                   "stride 512)")
    assert out.splitlines()[1] == "ref: perplexity 30.2500 (95% 29.5000 .. 31.0000)"
    assert "725306064334739734528" not in out
    assert err == "614,400.0 tokens/s (interpreter)\n"


# -- tables ----------------------------------------------------------------------------------------

def _keys(text: str) -> set[str]:
    """The first cell of every table row."""
    return {line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")}


@pytest.mark.slow
@pytest.mark.parametrize("width", [None, 50])
def test_ops_never_cuts_an_op_name_redirected_or_narrow(width: int | None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_ir.ir.registry import all_ops

    code, out, _ = cli(capsys, "ops", width=width)  # captured: not a terminal, as when redirected
    assert code == 0
    assert set(all_ops()) <= _keys(out)  # "fake_quant…" named no op at 80 columns
    assert "…" not in out


def test_a_key_table_on_a_narrow_terminal_wraps_the_text_and_keeps_the_key_and_numbers() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=40, force_terminal=True, color_system=None, soft_wrap=True)
    table = KeyTable("unit", "kind", "params", numbers=("params",))
    table.add_row("ernie.layers.17.mlp.shared_experts.up_gate_proj", "a linear of the shared experts",
                  "1,234,567")
    console.print(table)
    text = buf.getvalue()
    assert "ernie.layers.17.mlp.shared_experts.up_gate_proj" in text and "1,234,567" in text
    assert "…" not in text and "a linear of the shared experts" not in text  # wrapped, not cut
    kinds = {w for line in text.splitlines() if line.startswith("│") for w in line.split("│")[2].split()}
    assert kinds >= {"linear", "shared"}


# -- progress bars and the sensitivity table -------------------------------------------------------

@pytest.mark.slow
def test_sensitivity_tune_and_eval_draw_progress_by_default_on_a_terminal(
        data: Path, tmp_path: Path, terminal: None, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "sensitivity", MODEL, "--data", str(data), "--seq-len", "24", "--mode",
                         "approx", width=60)
    assert code == 0, err
    assert "approximate" in err and "8/8" in err
    assert set(UNITS) <= _keys(out) and "…" not in out  # the unit names whole at 60 columns
    assert re.search(r"│ ernie\.layers\.0\.mlp\.up_gate_proj +│ linear +│ +24,576 │ +- │", out), out
    code, _, err = cli(capsys, "tune", MODEL, "--data", str(data), "--seq-len", "24", "--budget", "1",
                       "--out", str(tmp_path / "t.yaml"), "--formats", "int8,float")
    assert code == 0, err
    assert "unit costs" in err and "8/8" in err and "presets" in err
    code, _, err = cli(capsys, "eval", MODEL, "--data", str(data), "--seq-len", "24")
    assert code == 0 and "46/46" in err
    code, _, err = cli(capsys, "eval", MODEL, "--data", str(data), "--seq-len", "24", "--no-progress")
    assert code == 0 and "46/46" not in err


@pytest.mark.slow
def test_no_bar_where_stderr_is_not_a_terminal_unless_asked(data: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "eval", MODEL, "--data", str(data), "--seq-len", "24")
    assert code == 0 and "46/46" not in err
    code, _, err = cli(capsys, "tune", MODEL, "--data", str(data), "--seq-len", "24", "--budget", "1",
                       "--out", str(tmp_path / "t.yaml"), "--formats", "int8,float", "--progress")
    assert code == 0, err
    assert "unit costs" in err and "8/8" in err  # asked: the last state, written once


# -- fallback lines --------------------------------------------------------------------------------

def test_a_fallback_group_names_its_shapes_not_a_placeholder() -> None:
    from ernie_ir.cli.compile_view import fallback_lines
    from ernie_ir.ops.cuda_layout import packable
    from ernie_ir.targets.compile import group_fallbacks

    why = packable(80, 112, 8, 80)
    assert why is not None and "portable fallback" not in why and "--cuda-arch 70 packs it" in why
    fallbacks = [{"scope": f"l{i}.{name}", "op": "linear", "kernel": "dequantize(int8) + linear (portable)",
                  "reason": f"no sm80 layout for [80, {n}]: in_features 80 ..."}
                 for i in range(2) for name, n in (("qkv", 112), ("o", 80))]
    (group,) = group_fallbacks(fallbacks)
    assert group.reason == "no sm80 layout for [80, 112], [80, 80]: in_features 80 ..."
    assert fallback_lines([group]) == [
        "fallback: 4 linear nodes -> dequantize(int8) + linear (portable): no sm80 layout for [80, 112], "
        "[80, 80]: in_features 80 ...; at l0.qkv, l0.o, l1.qkv and 1 more (--verbose lists them)"]


# -- train --config --------------------------------------------------------------------------------

def test_train_config_names_every_key_it_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ernie_ir.training.erniekit_config import accepted_keys
    from ernie_ir.training.loop import OPTION_ALIASES, RUN_KEYS

    config = tmp_path / "c.yaml"
    config.write_text("output_dirr: out\n")
    line = user_error(capsys, "train", str(tmp_path / "art"), "--steps", "2", "--config", str(config))
    assert line.startswith("error: unknown training option 'output_dirr' (did you mean output_dir?); known: ")
    assert line.split("known: ")[1].split(", ") == accepted_keys()
    assert set(OPTION_ALIASES) | set(RUN_KEYS) <= set(accepted_keys())
    assert "resume_from_checkpoint" in line


def test_train_config_help_lists_only_accepted_keys_and_the_config_only_ones() -> None:
    from ernie_ir.cli.run_cmds import train
    from ernie_ir.cli.train_opts import CONFIG_ONLY_OPTIONS
    from ernie_ir.training.erniekit_config import accepted_keys

    help_text = typing.get_type_hints(train, include_extras=True)["config"].__metadata__[0].help
    listed = help_text.replace("adam_beta1/2", "adam_beta1 adam_beta2")
    named = set(re.findall(r"\b[a-z]+(?:_[a-z0-9]+)+\b", listed))
    assert named <= set(accepted_keys()), named - set(accepted_keys())
    assert {"resume_from_checkpoint", *CONFIG_ONLY_OPTIONS} <= named


# -- generate: ids the tokenizer does not have ----------------------------------------------------

@pytest.fixture(scope="module")
def untokenized(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A checkpoint whose 448-id model only ever picks ids past its tokenizer's vocabulary (the
    lm_head rows of the tokenizer's ids are zero), and that vocabulary's size."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "frontends"))
    from _fe_testkit import hf_to_paddle, random_hf_ernie, write_checkpoint
    from test_tokenizer import train_sentencepiece

    from ernie_ir.frontends.tokenizer import load_tokenizer

    cfg = {"architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
           "vocab_size": 448, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    root = tmp_path_factory.mktemp("untok") / "model"
    root.mkdir()
    train_sentencepiece(root / "tokenizer.model", dummy_prefix=False)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": False, "add_eos_token": False}))
    size = load_tokenizer(root).vocab_size
    assert size < 440
    tensors = hf_to_paddle(random_hf_ernie(cfg, seed=3), cfg)
    tensors["lm_head.weight"][:, :size] = 0.0  # [H, V]: every known id's logit is 0, some past it > 0
    write_checkpoint(root, cfg, tensors)
    return root, size


@pytest.mark.slow
def test_generate_says_which_ids_have_no_text_instead_of_an_empty_line(
        untokenized: tuple[Path, int], capsys: pytest.CaptureFixture[str]) -> None:
    model, size = untokenized
    args = ("generate", str(model), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos")
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    new = json.loads(out)["new_tokens"][0]
    assert len(new) == 4 and all(t >= size for t in new)
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert out == ""  # no text, and no empty line standing for it
    assert (f"note: 4 of the 4 generated ids are outside the tokenizer's vocabulary of {size} and have no "
            f"text: {', '.join(map(str, new))} (--json lists every id)") in err.splitlines()
    prompts = model.parent / "p.npy"
    np.save(prompts, np.array([[5, 6, 7], [8, 9, 10]], np.int64))
    code, out, err = cli(capsys, "generate", str(model), "--prompt-ids", str(prompts), "--max-new-tokens",
                         "2", "--ignore-eos")
    assert code == 0, err
    assert out.splitlines() == ["[0] ", "[1] "]
    notes = [line for line in err.splitlines() if "note:" in line]
    assert [n.split(" note: ")[0] for n in notes] == ["[0]", "[1]"] and all("2 of the 2" in n for n in notes)
