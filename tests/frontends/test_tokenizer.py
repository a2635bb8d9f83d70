"""Checkpoint tokenizers (ernie_ir.frontends.tokenizer) against the classes that load the same files.

Tokenizers are trained here on a generated corpus (sentencepiece's and tokenizers'
trainers; nothing comes from a hub) and written as checkpoint folders:

- ERNIE 4.5: `tokenizer.model` (SentencePiece BPE, byte fallback, ERNIE's specials as
  user-defined pieces) + `tokenizer_config.json` with the chat template of REFERENCE 9.3,
  checked against paddleformers 1.2's `Ernie4_5Tokenizer` / `AutoTokenizer` and
  transformers 5.3's `LlamaTokenizer` (env `pf`);
- ERNIE-3.5-SE: `sentencepiece.bpe.model`, checked against `SentencePieceProcessor`
  (PaddleNLP's `Ernie35Tokenizer` is that plus BOS; it is not packaged);
- GPT: byte-level BPE `vocab.json` + `merges.txt` (`#version` header), checked against
  transformers 5.24's `GPT2Tokenizer` (env `hf`) and PaddleNLP's `GPTTokenizer` (env `nlp`);
- the `tokenizer.json` written for onnxruntime-genai, loaded by transformers 5.24 (env `hf`).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from _fe_testkit import run_reference

from ernie_ir.frontends.tokenizer import (
    SentencePieceTokenizer,
    StreamDecoder,
    TokenizerError,
    TokenizersTokenizer,
    load_tokenizer,
    sentencepiece_to_tokenizers,
    tokenizer_files,
    write_hf_tokenizer_json,
)
from ernie_ir.ir import ErnieIRError

spm = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

ERNIE_SPECIALS = ["<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:0>", "<mask:1>"]
# REFERENCE 9.3: cls, then per turn "User: {content}\n" / "Assistant: {content}<|end_of_sentence|>",
# system "{content}\n"; generation prompt "Assistant: "
ERNIE_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}{%- endif -%}\n"
    "{{- cls_token -}}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\\n' -}}\n"
    "  {%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' + message['content'] + sep_token -}}\n"
    "  {%- elif message['role'] == 'system' -%}{{- message['content'] + '\\n' -}}\n"
    "  {%- else -%}{{- raise_exception('unknown role ' + message['role']|tojson) -}}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！模型推理",
    "emoji 🙂🚀 and 👩‍👩‍👧 family",
    " leading space",
    "  two leading, trailing  ",
    "double  space inside",
    "line one\nline two\n\nend\n",
    "\ttab\tseparated",
    "naïve café émigré ß",
    "rare ☃ ⌘ 𝔘 ǅ",
    "<|begin_of_sentence|>User: hi\nAssistant: ",
    "x<|end_of_sentence|>y <mask:1> z",
    "<s>literal</s>",
    "",
    " ",
    "123 4567 3.14159",
]
CHATS = [
    [{"role": "user", "content": "你好"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "hi 🙂"}, {"role": "user", "content": " two  spaces"}],
]


def corpus(n: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "model",
             "tensor", "graph", "compile", "run", "User:", "Assistant:", "你好", "世界", "中文", "模型",
             "推理", "量化", "émigré", "naïve", "café", "🙂", "123", "4567", ",", ".", "!", "?"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(n)]


def train_sentencepiece(path: Path, *, normalization: str = "identity", model_type: str = "bpe",
                        vocab_size: int = 420, dummy_prefix: bool = True) -> Path:
    text = path.parent / "corpus.txt"
    text.write_text("\n".join(corpus()), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(path.with_suffix("")), vocab_size=vocab_size,
        model_type=model_type, byte_fallback=True, character_coverage=0.9995,
        normalization_rule_name=normalization, remove_extra_whitespaces=normalization != "identity",
        user_defined_symbols=ERNIE_SPECIALS, minloglevel=2, num_threads=1, hard_vocab_limit=False,
        add_dummy_prefix=dummy_prefix)
    text.unlink()
    path.with_suffix(".vocab").unlink()
    return path


@pytest.fixture(scope="module")
def ernie_dir(tmp_path_factory) -> Path:
    """ERNIE 4.5 (-Paddle): tokenizer.model + tokenizer_config.json (REFERENCE 9.3)."""
    root = tmp_path_factory.mktemp("ernie45")
    train_sentencepiece(root / "tokenizer.model", dummy_prefix=False)  # ERNIE's tokenizer adds no dummy ▁
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
        "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
        "mask_token": "<mask:1>", "add_bos_token": False, "add_eos_token": False,
        "chat_template": ERNIE_TEMPLATE}, indent=1))
    (root / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}))
    return root


@pytest.fixture(scope="module")
def se_dir(tmp_path_factory) -> Path:
    """ERNIE-3.5-SE: sentencepiece.bpe.model (Ernie35Tokenizer adds BOS)."""
    root = tmp_path_factory.mktemp("se")
    train_sentencepiece(root / "sentencepiece.bpe.model")
    return root


@pytest.fixture(scope="module")
def gpt_dir(tmp_path_factory) -> Path:
    """GPT (PaddleNLP): byte-level BPE vocab.json + merges.txt, <|endoftext|> for pad/eos/unk."""
    root = tmp_path_factory.mktemp("gpt")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(), vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(root))
    assert (root / "merges.txt").read_text(encoding="utf-8").startswith("#version")
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    return root


def id_lists(tok: Any) -> list[list[int]]:
    """Ids to decode: every text's encoding, plus runs with special tokens and partial bytes."""
    out = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    emoji = tok.encode("🙂", add_special_tokens=False)
    out.append(emoji[:-1])  # an incomplete character
    specials = [i for i in (tok.bos_token_id, tok.eos_token_id, tok.token_to_id("<|end_of_sentence|>")) if i]
    out.append([*specials, *out[0], *specials, *out[2]])
    return out


def reference(env: str, loader: str, folder: Path, tmp: Path, tok: Any) -> dict[str, Any]:
    spec = {"folder": str(folder), "loader": loader, "texts": TEXTS, "ids": id_lists(tok), "chats": CHATS}
    out = run_reference(env, "ref_tokenizer.py", spec, tmp / f"{env}-{loader}")
    return json.loads((out / "result.json").read_text(encoding="utf-8"))


def ours(tok: Any) -> dict[str, Any]:
    def chat(m: Any, prompt: bool) -> Any:
        try:
            return tok.apply_chat_template(m, add_generation_prompt=prompt)
        except TokenizerError as e:
            return {"error": str(e)}

    ids = id_lists(tok)
    return {
        "encode": [tok.encode(t) for t in TEXTS],
        "encode_plain": [tok.encode(t, add_special_tokens=False) for t in TEXTS],
        "decode": [tok.decode(x) for x in ids],
        "decode_skip": [tok.decode(x, skip_special_tokens=True) for x in ids],
        "chat": [chat(m, True) for m in CHATS],
        "chat_no_prompt": [chat(m, False) for m in CHATS],
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
    }


def assert_same(mine: dict[str, Any], ref: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        if isinstance(mine[key], list):
            for i, (a, b) in enumerate(zip(mine[key], ref[key], strict=True)):
                assert a == b, f"{key}[{i}]: {a!r} != {b!r}"
        else:
            assert mine[key] == ref[key], (key, mine[key], ref[key])


ALL = ("encode", "encode_plain", "decode", "decode_skip", "bos_token_id", "eos_token_id", "pad_token_id")


# -- the folder --------------------------------------------------------------------------------------------


def test_tokenizer_files_and_kinds(ernie_dir: Path, se_dir: Path, gpt_dir: Path, tmp_path: Path):
    assert [p.name for p in tokenizer_files(ernie_dir)] == ["tokenizer.model", "tokenizer_config.json"]
    assert [p.name for p in tokenizer_files(gpt_dir)] == ["vocab.json", "merges.txt", "tokenizer_config.json"]
    assert load_tokenizer(tmp_path) is None  # no tokenizer files
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None
    ernie, se, gpt = (load_tokenizer(d) for d in (ernie_dir, se_dir, gpt_dir))
    assert isinstance(ernie, TokenizersTokenizer) and ernie.hf_class == "LlamaTokenizer"
    assert isinstance(se, SentencePieceTokenizer)
    assert isinstance(gpt, TokenizersTokenizer) and gpt.hf_class == "GPT2Tokenizer"


def test_ernie45_special_tokens_and_no_bos(ernie_dir: Path):
    tok = load_tokenizer(ernie_dir)
    sp = spm.SentencePieceProcessor(model_file=str(ernie_dir / "tokenizer.model"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (sp.bos_id(), sp.eos_id(), sp.unk_id())
    assert tok.add_bos_token is False  # REFERENCE 9.3
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    cls_id = sp.piece_to_id("<|begin_of_sentence|>")
    assert tok.encode("<|begin_of_sentence|>hello")[0] == cls_id
    assert tok.decode([cls_id, *tok.encode("hello")], skip_special_tokens=True) == "hello"
    assert tok.stop_token_ids == (sp.eos_id(),)


def test_ernie45_matches_sentencepiece(ernie_dir: Path):
    """A model without dummy prefix (as ERNIE's): the same ids as sentencepiece, except that special
    tokens written in the text (`<s>`) are read as such, as the tokenizer classes do."""
    tok = load_tokenizer(ernie_dir)
    sp = spm.SentencePieceProcessor(model_file=str(ernie_dir / "tokenizer.model"))
    for text in TEXTS:
        if "<s>" in text:
            continue
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text
    assert tok.encode("<s>literal</s>") == [sp.bos_id(), *sp.encode("literal"), sp.eos_id()]


def test_se_is_sentencepiece_plus_bos(se_dir: Path):
    tok = load_tokenizer(se_dir)
    sp = spm.SentencePieceProcessor(model_file=str(se_dir / "sentencepiece.bpe.model"))
    assert tok.bos_token_id == sp.bos_id() and tok.eos_token_id == sp.eos_id()
    for text in TEXTS:
        if "<s>" in text:
            continue  # the tokenizer class reads special tokens in text, sentencepiece reads characters
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text
    assert tok.decode([sp.bos_id(), *sp.encode("hi")]) == "<s>hi"
    assert tok.decode([sp.bos_id(), *sp.encode("hi")], skip_special_tokens=True) == "hi"


def test_gpt_byte_level_round_trips(gpt_dir: Path):
    tok = load_tokenizer(gpt_dir)
    eot = tok.token_to_id("<|endoftext|>")
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == eot
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text  # byte level: lossless
    assert tok.encode("a<|endoftext|>b") == [*tok.encode("a"), eot, *tok.encode("b")]


@pytest.mark.parametrize("kind", ["ernie", "se", "gpt"])
def test_stream_decoder_equals_decode(kind: str, ernie_dir: Path, se_dir: Path, gpt_dir: Path):
    tok = load_tokenizer({"ernie": ernie_dir, "se": se_dir, "gpt": gpt_dir}[kind])
    prompt = tok.encode("User: 你好\nAssistant:")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        stream = tok.stream(prompt)
        pieces = [stream.push(i) for i in ids]
        assert all("\ufffd" not in p for p in pieces), (text, pieces)
        got = "".join(pieces) + stream.flush()
        full = tok.decode(prompt + ids, skip_special_tokens=True)
        assert full == tok.decode(prompt, skip_special_tokens=True) + got, (text, got)
    assert tok.decode_new(prompt, tok.encode(" world", add_special_tokens=False)).endswith("world")
    emoji = tok.encode("🙂", add_special_tokens=False)
    if len(emoji) > 1:  # byte fallback / byte level: the character waits for its last byte
        stream = StreamDecoder(tok, prompt)
        assert [stream.push(i) for i in emoji][:-1] == [""] * (len(emoji) - 1)


# -- chat templates ---------------------------------------------------------------------------------------


def test_chat_template_renders_reference_9_3(ernie_dir: Path):
    tok = load_tokenizer(ernie_dir)
    assert tok.apply_chat_template(CHATS[1]) == (
        "<|begin_of_sentence|>Be brief.\nUser: hello world\nAssistant: hi 🙂<|end_of_sentence|>"
        "User:  two  spaces\nAssistant: ")
    no_prompt = tok.apply_chat_template(CHATS[0], add_generation_prompt=False)
    assert no_prompt == "<|begin_of_sentence|>User: 你好\n"


def test_chat_template_refusals_are_one_line(ernie_dir: Path, gpt_dir: Path, tmp_path: Path):
    with pytest.raises(TokenizerError, match="no chat template") as e:
        load_tokenizer(gpt_dir).apply_chat_template(CHATS[0])
    assert "\n" not in str(e.value)
    with pytest.raises(TokenizerError, match="unknown role") as e:
        load_tokenizer(ernie_dir).apply_chat_template([{"role": "tool", "content": "x"}])
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.model").write_bytes((ernie_dir / "tokenizer.model").read_bytes())
    (bad / "chat_template.jinja").write_text("{% for m in messages %}\n{{ m.content }\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="chat template, line") as e:
        load_tokenizer(bad).apply_chat_template(CHATS[0])
    assert "\n" not in str(e.value)


# -- bad files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["model", "json", "config", "merges", "vocab-only", "vocab-not-object"])
def test_broken_files_give_one_line(case: str, gpt_dir: Path, tmp_path: Path):
    files = {
        "model": {"tokenizer.model": b"this is not a protobuf \x00\xff"},
        "json": {"tokenizer.json": b'{"model": {"type": "BPE", "vocab": 3}}'},
        "config": {"vocab.json": (gpt_dir / "vocab.json").read_bytes(),
                   "merges.txt": (gpt_dir / "merges.txt").read_bytes(), "tokenizer_config.json": b"{oops"},
        "merges": {"vocab.json": (gpt_dir / "vocab.json").read_bytes(),
                   "merges.txt": b"#version: 0.2\na b c\n"},
        "vocab-only": {"vocab.json": (gpt_dir / "vocab.json").read_bytes()},
        "vocab-not-object": {"vocab.json": b"[1, 2]", "merges.txt": b""},
    }[case]
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path)
    assert isinstance(e.value, ErnieIRError)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)


def test_decode_refuses_ids_outside_the_vocabulary(gpt_dir: Path):
    tok = load_tokenizer(gpt_dir)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_missing_library_names_the_extra(ernie_dir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import sentencepiece -> ImportError
    with pytest.raises(TokenizerError, match=r"pip install ernie-ir\[text\]") as e:
        load_tokenizer(ernie_dir)
    assert "\n" not in str(e.value)


# -- tokenizer.json for onnxruntime-genai ---------------------------------------------------------------


@pytest.mark.parametrize("normalization", ["identity", "nmt_nfkc"])
@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_sentencepiece_to_tokenizers_encodes_like_sentencepiece(normalization: str, model_type: str,
                                                                tmp_path: Path):
    """style="sentencepiece": the same ids as SentencePieceProcessor on every text without a control or
    user-defined piece in it. Such a piece written in the text is one token of the converted file
    (as in the tokenizer classes) but characters to sentencepiece (control pieces), and the text
    after it gets its own dummy prefix there (user-defined pieces: sentencepiece adds none)."""
    model = train_sentencepiece(tmp_path / "m.model", normalization=normalization, model_type=model_type)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    backend = sentencepiece_to_tokenizers(model, style="sentencepiece")
    for text in TEXTS:
        if "<" in text:
            continue
        ids = sp.encode(text)
        assert backend.encode(text, add_special_tokens=False).ids == ids, text
        assert backend.decode(ids) == sp.decode(ids), text


def test_written_tokenizer_json_reloads_identically(ernie_dir: Path, se_dir: Path, gpt_dir: Path,
                                                    tmp_path: Path):
    for name, src in {"ernie": ernie_dir, "se": se_dir, "gpt": gpt_dir}.items():
        tok = load_tokenizer(src)
        paths = write_hf_tokenizer_json(tok, tmp_path / name)
        assert [p.name for p in paths] == ["tokenizer.json", "tokenizer_config.json"]
        config = json.loads(paths[1].read_text(encoding="utf-8"))
        assert config["tokenizer_class"] == {"ernie": "PreTrainedTokenizerFast", "se": "LlamaTokenizer",
                                             "gpt": "GPT2Tokenizer"}[name]
        again = load_tokenizer(tmp_path / name)
        assert isinstance(again, TokenizersTokenizer)
        for text in TEXTS:
            if name == "se" and "<" in text:
                continue  # see test_sentencepiece_to_tokenizers_encodes_like_sentencepiece
            assert again.encode(text) == tok.encode(text), (name, text)
            ids = tok.encode(text, add_special_tokens=False)
            assert again.decode(ids) == tok.decode(ids), (name, text)
        assert (again.bos_token_id, again.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
        assert again.chat_template == tok.chat_template


# -- cross-checks in the reference environments -------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("loader", ["pf_ernie", "pf_auto"])
def test_ernie45_matches_paddleformers(loader: str, ernie_dir: Path, tmp_path: Path):
    """pf env: paddleformers 1.2's Ernie4_5Tokenizer / AutoTokenizer. (transformers 5.3's LlamaTokenizer
    adds a dummy `▁` before the first word, which ERNIE's own tokenizer does not; see docs/frontends.md.)"""
    tok = load_tokenizer(ernie_dir)
    ref = reference("pf", loader, ernie_dir, tmp_path, tok)
    assert_same(ours(tok), ref, (*ALL, "chat", "chat_no_prompt"))


@pytest.mark.reference
@pytest.mark.slow
def test_ernie45_defaults_match_paddleformers(ernie_dir: Path, tmp_path: Path):
    """tokenizer.model with a config that names only the class: no BOS added, specials from the model."""
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes((ernie_dir / "tokenizer.model").read_bytes())
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    tok = load_tokenizer(folder)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)
    ref = reference("pf", "pf_ernie", folder, tmp_path, tok)
    assert_same(ours(tok), ref, ("encode", "encode_plain", "decode", "decode_skip", "bos_token_id",
                                 "eos_token_id"))


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("loader", ["hf_gpt2", "hf_auto"])
def test_gpt_matches_transformers(loader: str, gpt_dir: Path, tmp_path: Path):
    tok = load_tokenizer(gpt_dir)
    assert_same(ours(tok), reference("hf", loader, gpt_dir, tmp_path, tok), ALL)


@pytest.mark.reference
@pytest.mark.slow
def test_gpt_matches_paddlenlp(gpt_dir: Path, tmp_path: Path):
    tok = load_tokenizer(gpt_dir)
    ref = reference("nlp", "nlp_gpt", gpt_dir, tmp_path, tok)
    assert_same(ours(tok), ref, ("encode", "encode_plain", "decode", "decode_skip", "eos_token_id"))


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.parametrize("name", ["ernie", "se"])
def test_written_tokenizer_json_matches_transformers(name: str, ernie_dir: Path, se_dir: Path,
                                                     tmp_path: Path):
    """hf env (transformers 5.24, no sentencepiece): AutoTokenizer on what write_hf_tokenizer_json wrote.

    ERNIE's file (PreTrainedTokenizerFast) is used as written: everything agrees. SE's is read as
    LlamaTokenizer, whose own Metaspace pre-tokenizer replaces the file's normalizer: it adds no
    dummy `▁` before a leading space and ignores user-defined pieces' boundaries, so only texts
    without those are compared (the ids of the rest are what sentencepiece gives, tested above)."""
    tok = load_tokenizer(ernie_dir if name == "ernie" else se_dir)
    write_hf_tokenizer_json(tok, tmp_path / "out")
    again = load_tokenizer(tmp_path / "out")
    ref = reference("hf", "hf_auto", tmp_path / "out", tmp_path, again)
    mine = ours(again)
    if name == "se":
        keep = [i for i, t in enumerate(TEXTS) if not t[:1].isspace() and "<" not in t]
        for key in ("encode", "encode_plain"):
            mine[key], ref[key] = [mine[key][i] for i in keep], [ref[key][i] for i in keep]
    assert_same(mine, ref, (*ALL, "chat", "chat_no_prompt") if name == "ernie" else ALL)
