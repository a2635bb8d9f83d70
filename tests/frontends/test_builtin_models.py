"""The built-in models' tokenizer (frontends.builtin_tokenizer) and the `@small` built-ins.

Text prompts, chat, text data and `eval` on text work on a `@tiny` / `@small` model as on a
checkpoint folder with a tokenizer; `@small` packs for WINT2, W4A8 and FastDeploy at tp 2, sm80.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli_kit import cli, user_error

from ernie_ir.frontends import load_model
from ernie_ir.frontends.builtin_tokenizer import (
    SPECIAL_TOKENS,
    builtin_tokenizer_files,
    builtin_tokenizer_folder,
)
from ernie_ir.frontends.builtins import SMALL, builtin_config
from ernie_ir.frontends.tokenizer import load_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

TEXTS = ["Tell me about Paddle.", "hello world", "你好，世界 🙂", "  two  spaces ", "line\nbreak\ttab", "",
         "x<|end_of_sentence|>y <mask:1> z"]


@pytest.fixture(scope="module")
def tok():
    folder = builtin_tokenizer_folder("ernie-4.5-0.3b@tiny")
    assert folder is not None
    return load_tokenizer(folder)


def test_the_tokenizer_has_ernies_special_tokens_at_the_models_vocabulary(tok) -> None:
    assert tok.vocab_size == builtin_config("ernie-4.5-0.3b", "tiny")["vocab_size"] == 1024
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)  # as the configs say
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # no BOS, as ERNIE 4.5
    assert tok.encode("<|begin_of_sentence|>") == [3]


def test_every_text_round_trips_without_unknown_pieces(tok) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert 0 not in ids, text  # byte fallback: nothing becomes <unk>
        assert tok.decode(ids) == text
    assert len(tok.encode("Tell me about Paddle.")) < len("Tell me about Paddle.")  # merges, not bytes


def test_the_chat_template_is_ernies(tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert tok.apply_chat_template(messages) == ("<|begin_of_sentence|>Be brief.\nUser: hi\nAssistant: hello"
                                                 "<|end_of_sentence|>User: more\nAssistant: ")


def test_the_files_are_the_same_bytes_each_time() -> None:
    first, second = builtin_tokenizer_files("gpt-345m", "tiny"), builtin_tokenizer_files("gpt-345m", "tiny")
    assert first == second
    assert json.loads(first["tokenizer_config.json"])["chat_template"]


def test_only_builtins_with_weights_get_one(tmp_path: Path) -> None:
    assert builtin_tokenizer_folder("ernie-4.5-0.3b@meta") is None
    assert builtin_tokenizer_folder("ernie-4.5-0.3b") is None
    assert builtin_tokenizer_folder("gpt-345m@small") is None  # no such variant
    assert builtin_tokenizer_folder(str(tmp_path)) is None
    assert builtin_tokenizer_folder("ernie-4.5-21b-a3b@small") is not None


@pytest.mark.slow
def test_generate_takes_text_and_chat_on_a_builtin(capsys) -> None:
    """Before the built-in tokenizer: `--prompt needs a tokenizer` (exit 2)."""
    code, out, err = cli(capsys, "generate", "ernie-4.5-0.3b@tiny", "--prompt", "hi", "--chat",
                         "--max-new-tokens", "3", "--json", "--backend", "interpreter")
    assert code == 0, err
    result = json.loads(out)
    assert result["sequences"][0][:1] == [3]  # <|begin_of_sentence|> opens the chat template
    assert len(result["new_tokens"][0]) == 3 and len(result["texts"]) == 1


@pytest.mark.slow
def test_compile_and_export_ship_the_builtin_tokenizer(capsys, tmp_path: Path) -> None:
    code, _, err = cli(capsys, "export", "ernie-4.5-0.3b@tiny", "--out", str(tmp_path / "exported"))
    assert code == 0, err
    exported = load_tokenizer(tmp_path / "exported")
    assert exported is not None and exported.encode("Tell me") == load_tokenizer(
        builtin_tokenizer_folder("ernie-4.5-0.3b@tiny")).encode("Tell me")
    code, _, err = cli(capsys, "compile", "ernie-4.5-0.3b@tiny", "--target", "cuda", "--out",
                       str(tmp_path / "art"))
    assert code == 0, err
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["tokenizer"] and load_tokenizer(tmp_path / "art" / manifest["tokenizer"]) is not None


def test_small_widths_pack_where_the_formats_need() -> None:
    for name, sizes in SMALL.items():
        hidden = sizes["hidden_size"]
        assert hidden % 128 == 0 and (sizes["intermediate_size"] // 2) % 64 == 0
        assert (sizes["num_attention_heads"] * sizes["head_dim"] // 2) % 64 == 0  # o_proj per rank
        if "moe_intermediate_size" in sizes:
            experts = sizes["moe_intermediate_size"]
            assert experts % 128 == 0 and (experts // 2) % 128 == 0  # WINT2; W4A8 per rank at tp 2
        graph = load_model(f"{name}@small")
        assert graph.metadata["config"]["hidden_size"] == hidden


def test_small_is_refused_where_there_is_none(capsys) -> None:
    line = user_error(capsys, "show", "gpt-345m@small")
    assert "gpt-345m@tiny" in line and "@meta" in line


@pytest.mark.slow
def test_small_moe_deploys_wint2_to_fastdeploy_at_tp2(capsys, tmp_path: Path) -> None:
    """21b-a3b@tiny (hidden 80) is refused by WINT2; @small compiles to a FastDeploy folder at tp 2,
    sm80 (the default arch)."""
    assert "multiple" in user_error(capsys, "compile", "ernie-4.5-21b-a3b@tiny", "--target", "cuda",
                                    "--quant", "wint2", "--out", str(tmp_path / "tiny"))
    code, _, err = cli(capsys, "compile", "ernie-4.5-21b-a3b@small", "--target", "cuda", "--quant", "wint2",
                         "--tp", "2", "--emit", "fastdeploy", "--out", str(tmp_path / "small"))
    assert code == 0, err
    manifest = json.loads((tmp_path / "small" / "manifest.json").read_text())
    assert "fastdeploy" in manifest["formats"]
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    assert config["quantization_config"]["quantization"] == "wint2"
