"""`ernie-ir generate`: text in and out with the checkpoint's tokenizer, --json, --stop, --chat,
--prompts files, --compare-to, artifacts carrying the tokenizer, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontends"))
from _cli_kit import cli, user_error
from _fe_testkit import hf_to_paddle, random_hf_ernie, write_checkpoint
from test_tokenizer import ERNIE_TEMPLATE, train_sentencepiece

from ernie_ir.frontends.tokenizer import load_tokenizer
from ernie_ir.targets.compile import CompileOptions, compile_model

CFG = {
    "architectures": ["Ernie4_5_ForCausalLM"], "hidden_size": 48, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 448, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 96, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}


def _checkpoint(root: Path, seed: int, template: bool = True) -> Path:
    write_checkpoint(root, CFG, hf_to_paddle(random_hf_ernie(CFG, seed=seed), CFG))
    train_sentencepiece(root / "tokenizer.model", dummy_prefix=False)
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<unk>", "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False}
    if template:
        config["chat_template"] = ERNIE_TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("gen") / "model", seed=5)


def _json(capsys, *argv: str) -> dict:
    code, out, err = cli(capsys, "generate", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_text_streams_and_equals_the_decoded_tokens(ckpt: Path, capsys):
    data = _json(capsys, str(ckpt), "--prompt", "hello world", "--max-new-tokens", "8", "--ignore-eos")
    tok = load_tokenizer(ckpt)
    prompt = tok.encode("hello world")
    assert data["sequences"][0][:len(prompt)] == prompt and len(data["new_tokens"][0]) == 8
    assert data["sequences"][0][len(prompt):] == data["new_tokens"][0]
    known = [t for t in data["new_tokens"][0] if t < tok.vocab_size]  # the model's vocabulary is larger
    assert data["texts"][0] == tok.decode(known, skip_special_tokens=True)
    assert data["prefill_ms"] > 0 and data["decode_ms_per_token"] > 0
    code, out, err = cli(capsys, "generate", str(ckpt), "--prompt", "hello world", "--max-new-tokens", "8",
                         "--ignore-eos")
    assert code == 0 and out.rstrip("\n") == data["texts"][0]
    assert "8 tokens in 1 row(s) (length)" in err


def test_stop_text_ends_the_row(ckpt: Path, capsys):
    free = _json(capsys, str(ckpt), "--prompt-ids", "7,8,9", "--max-new-tokens", "12", "--ignore-eos")
    tok = load_tokenizer(ckpt)
    new = free["new_tokens"][0]
    k = next(i for i in range(2, len(new)) if tok.decode(new[:i + 1]).strip()
             and tok.decode(new[:i + 1]) != tok.decode(new[:i]))
    piece = tok.decode(new[:k + 1])[-1]
    first = next(i for i in range(len(new)) if piece in tok.decode(new[:i + 1]))
    stopped = _json(capsys, str(ckpt), "--prompt-ids", "7,8,9", "--max-new-tokens", "12", "--ignore-eos",
                    "--stop", piece)
    assert stopped["new_tokens"][0] == new[:first + 1] and stopped["finish_reasons"] == ["stop"]


def test_chat_prompts_files_and_compare_to(ckpt: Path, tmp_path: Path, capsys):
    tok = load_tokenizer(ckpt)
    chat = _json(capsys, str(ckpt), "--prompt", "hi", "--chat", "--max-new-tokens", "3", "--ignore-eos")
    messages = [{"role": "user", "content": "hi"}]
    wrapped = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert chat["sequences"][0][:len(wrapped)] == wrapped
    lines = tmp_path / "p.jsonl"
    lines.write_text('"hello world"\n\n[5, 6, 7]\n{"ids": [9, 10]}\n{"prompt": "the fox"}\n')
    many = _json(capsys, str(ckpt), "--prompts", str(lines), "--max-new-tokens", "4", "--ignore-eos",
                 "--compare-to", str(ckpt))
    assert [s[:len(p)] for s, p in zip(many["sequences"], [tok.encode("hello world"), [5, 6, 7], [9, 10],
                                                              tok.encode("the fox")], strict=True)] == \
        [tok.encode("hello world"), [5, 6, 7], [9, 10], tok.encode("the fox")]
    assert many["compare"]["first_divergence"] == [None] * 4
    assert many["compare"]["top1_agreement"] == [1.0] * 4
    other = _checkpoint(tmp_path / "other", seed=11)
    differs = _json(capsys, str(ckpt), "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--ignore-eos",
                    "--compare-to", str(other))
    assert differs["compare"]["first_divergence"][0] is not None
    assert differs["compare"]["top1_agreement"][0] < 1.0


def test_an_artifact_carries_the_tokenizer(ckpt: Path, tmp_path: Path, capsys):
    art = compile_model(str(ckpt), "ascend", CompileOptions(out=tmp_path / "art", quant="wint8",
                                                            emit="paddle"))  # no ONNX folder to hold it
    manifest = json.loads((Path(art.out) / "manifest.json").read_text())
    assert manifest["tokenizer"] == "tokenizer"
    copied = {p.name for p in (Path(art.out) / "tokenizer").iterdir()}
    assert {"tokenizer.model", "tokenizer_config.json"} <= copied
    assert "tokenizer/tokenizer.model" in manifest["files"]
    data = _json(capsys, art.out, "--prompt", "hello world", "--max-new-tokens", "5", "--ignore-eos")
    tok = load_tokenizer(ckpt)
    known = [t for t in data["new_tokens"][0] if t < tok.vocab_size]
    assert data["texts"][0] == tok.decode(known, skip_special_tokens=True)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--prompt-ids", ""], "give at least one token id"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt-ids", "1,448"], "outside the vocabulary"),
    (["--prompt-ids", "1,-3"], "outside the vocabulary"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt-ids", "1", "--max-new-tokens", "-2"], "--max-new-tokens must be >= 1"),
    (["--prompt-ids", "1", "--max-new-tokens", "96"], "beyond the model's 96"),
    (["--prompt-ids", "1", "--temperature", "0"], "--temperature must be > 0"),
    (["--prompt-ids", "1", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt-ids", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--prompt-ids", "1", "--top-k", "0"], "--top-k must be >= 1"),
    (["--prompt-ids", "1", "--greedy", "--temperature", "0.5"], "contradict"),
    (["--prompt-ids", "1", "--prompt", "x"], "give one of"),
    ([], "give one of"),
    (["--prompt-ids", "1", "--backend", "onnxruntime"], "compile it first"),
    (["--prompt-ids", "1", "--backend", "tpu"], "unknown --backend"),
    (["--prompt-ids", "1", "--kv-cache-dtype", "i8"], "--kv-cache-dtype"),
    (["--prompt-ids", "1", "--chat"], "--chat wraps text prompts"),
])
def test_bad_input_is_one_line(ckpt: Path, args: list[str], fragment: str, capsys):
    assert fragment in user_error(capsys, "generate", str(ckpt), *args)


def test_bad_input_that_needs_files(ckpt: Path, tmp_path: Path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"prompt": "fine"}\n{"prompt": \n')
    assert "line 3 is not valid JSON" in user_error(capsys, "generate", str(ckpt), "--prompts", str(bad))
    bad.write_text('"ok"\n{"other": 1}\n')
    assert "line 2 holds nothing to read" in user_error(capsys, "generate", str(ckpt), "--prompts", str(bad))
    missing = str(tmp_path / "none.jsonl")
    assert "no such file" in user_error(capsys, "generate", str(ckpt), "--prompts", missing)
    no_tok = write_checkpoint(tmp_path / "bare", CFG, hf_to_paddle(random_hf_ernie(CFG, seed=1), CFG))
    assert "--prompt-ids" in user_error(capsys, "generate", str(no_tok), "--prompt", "hello")
    no_template = _checkpoint(tmp_path / "plain", seed=2, template=False)
    assert "chat template" in user_error(capsys, "generate", str(no_template), "--prompt", "hi", "--chat")
    assert "--stop needs a tokenizer" in user_error(capsys, "generate", str(no_tok), "--prompt-ids", "1",
                                                    "--stop", "x")
    before = sorted(p.name for p in tmp_path.iterdir())
    user_error(capsys, "generate", str(ckpt), "--prompt-ids", "1", "--max-new-tokens", "0")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_onnxruntime_genai_reads_the_artifact_and_its_tokenizer(ckpt: Path, tmp_path: Path):
    """The artifact's ONNX folder is what onnxruntime-genai loads: the decoder, genai_config.json and
    a tokenizer.json written from the checkpoint's SentencePiece model (og reads no bare .model)."""
    import numpy as np

    og = pytest.importorskip("onnxruntime_genai")
    from ernie_ir.generation import DecodeOptions, Generator

    art = compile_model(str(ckpt), "cuda", CompileOptions(emit="onnx", out=tmp_path / "onnx"))
    manifest = json.loads((Path(art.out) / "manifest.json").read_text())
    assert manifest["tokenizer"] == "inference/onnx"
    folder = Path(art.out) / "inference" / "onnx"
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "genai_config.json"} <= \
        {p.name for p in folder.iterdir()}
    cfg = og.Config(str(folder))
    cfg.clear_providers()
    model = og.Model(cfg)
    tokenizer = og.Tokenizer(model)
    ours = load_tokenizer(ckpt)
    # (digits after a space are left out: onnxruntime-extensions splits "▁123" as "▁" + "123",
    # sentencepiece's merges as "▁1" + "23"; docs/frontends.md)
    for text in ("hello world", "the quick brown fox jumps", "模型推理 量化", "naïve café émigré"):
        assert list(tokenizer.encode(text)) == ours.encode(text), text
    prompt = ours.encode("hello world model")
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + 8)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray([prompt], np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    theirs = [int(t) for t in gen.get_sequence(0)][len(prompt):]
    mine = Generator(art.out, backend="onnxruntime").generate([prompt], DecodeOptions(max_new_tokens=8))
    new = mine.new_tokens[0]
    if mine.finish_reasons[0] == "eos":
        new = new[:-1]  # og stops at EOS without appending it
    assert theirs == new and len(set(theirs)) > 1
