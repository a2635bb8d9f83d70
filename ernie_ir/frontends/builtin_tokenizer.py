"""The built-in models' tokenizer: a small byte-fallback BPE with ERNIE 4.5's special tokens and chat
template.

`@tiny` and `@small` built-ins have no checkpoint folder, so nothing ships their tokenizer;
this module builds one in code, the same bytes on every machine, so that text prompts, chat,
text data and `eval` on text work on them as on a real checkpoint:

- ids 0-6: `<unk>` (also pad), `<s>` (BOS), `</s>` (EOS), `<|begin_of_sentence|>` (cls),
  `<|end_of_sentence|>` (sep), `<mask:0>`, `<mask:1>`: ERNIE 4.5's names (REFERENCE.md 9.3);
- then the 256 byte pieces `<0x00>` .. `<0xFF>` (byte fallback: every text encodes, none is
  `<unk>`), then merges that `tokenizers`' BPE trainer learns from a fixed English text in this
  file, up to the model's vocabulary size;
- spaces are `▁` and start the piece that follows them, as in ERNIE's SentencePiece model; no BOS
  or EOS is added (`add_bos_token` false, as ERNIE 4.5's);
- the chat template is ERNIE 4.5's: `<|begin_of_sentence|>`, a system message as `{content}\\n`,
  then `User: {content}\\n` and `Assistant: {content}<|end_of_sentence|>` per turn; the
  generation prompt is `Assistant: `.

`builtin_tokenizer_folder(spec)` writes `tokenizer.json` + `tokenizer_config.json` once into
`$ERNIE_IR_CACHE_DIR/tokenizers/<digest>/` (default `~/.cache/ernie-ir`; `$XDG_CACHE_HOME`),
a folder every tokenizer reader (`load_tokenizer`, compile's copy into an artifact, `export`)
takes like a checkpoint's. It needs the `tokenizers` package (`pip install ernie-ir[text]`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from .builtins import GENERATED_VARIANTS, PUBLISHED, builtin_config

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "builtin_tokenizer_files", "builtin_tokenizer_folder"]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|begin_of_sentence|>", "<|end_of_sentence|>", "<mask:0>",
                  "<mask:1>")
CHAT_TEMPLATE = (
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
_SPIECE = "\u2581"
# What the merges are learned from: written for this file, so the pieces are ordinary English
# and the words of this project's commands.
_TEXT = """
User: Tell me about Paddle. Assistant: PaddlePaddle is a deep learning framework. It trains and
serves models on GPUs, NPUs and CPUs, and ERNIE is a family of language models written for it.
User: What does a compiler do? Assistant: A graph compiler reads a model into a typed graph,
rewrites the graph with passes and lowers it for a target device. The passes fuse operations,
quantize weights to eight or four bits and split the model over several devices.
The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine, thank you.
Once upon a time there was a small model that wanted to answer every question it was asked.
It read the prompt one token at a time, kept the keys and values of what came before, and wrote
the next word. Some answers were short and some were long, but each one ended with a stop token.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2026 3.14 0.5 1e-5.
compile run train export verify show plan eval generate sensitivity tune passes ops explain golden
target cuda ascend kunlun quant wint8 wint4 wint8mix w4a8c8 wint2 fp8 lora rank tensor parallel
the of and to in is that for it as with was on be by this are from at or an which not have has
"""
_WORDS = _TEXT.split()
# the text, then words run together in pairs (every fifth with every seventh): enough distinct
# pairs to fill a built-in's vocabulary (1024) with merges
_TEXT_LINES = [" ".join(_WORDS[i:i + 12]) for i in range(0, len(_WORDS), 12)]
_TEXT_LINES += [" ".join(a + b for b in _WORDS[::7]) for a in _WORDS[::5]]


def _cache_root() -> Path:
    root = os.environ.get("ERNIE_IR_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "ernie-ir") if xdg else os.path.join(os.path.expanduser("~"), ".cache",
                                                                         "ernie-ir")
    return Path(root) / "tokenizers"


def _tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json of the built-in tokenizer at `vocab_size` ids (deterministic)."""
    from .tokenizer import _require

    tokenizers = _require("tokenizers")
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    alphabet = [chr(c) for c in range(33, 127)] + [_SPIECE]
    learned = vocab_size - len(SPECIAL_TOKENS) - len(bytes_)
    if learned < len(alphabet):
        raise ValueError(f"a vocabulary of {vocab_size} leaves no room for the built-in tokenizer's pieces")
    pre = pre_tokenizers.Metaspace(replacement=_SPIECE, prepend_scheme="never", split=True)
    trainee = tokenizers.Tokenizer(models.BPE())
    trainee.pre_tokenizer = pre
    trainee.train_from_iterator(_TEXT_LINES, trainers.BpeTrainer(
        vocab_size=learned, initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False))
    trained = json.loads(trainee.to_str())["model"]
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *bytes_])}
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    if len(vocab) != vocab_size:  # the text must give exactly enough pieces: a model id without text
        raise ValueError(f"the built-in tokenizer's text gives {len(vocab)} pieces, not {vocab_size}")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                              byte_fallback=True))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.Sequence([decoders.Replace(_SPIECE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return backend.to_str(pretty=True)


def builtin_tokenizer_files(name: str, variant: str) -> dict[str, str]:
    """File name -> text of the tokenizer of built-in `name@variant` (a variant with weights)."""
    vocab_size = int(builtin_config(name, variant)["vocab_size"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>", "mask_token": "<mask:1>",
        "additional_special_tokens": ["<mask:0>"],
        "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    return {"tokenizer.json": _tokenizer_json(vocab_size),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def builtin_tokenizer_folder(spec: str | os.PathLike[str]) -> Path | None:
    """The folder holding the tokenizer of built-in `spec` (`NAME@tiny`, `NAME@small`), written on
    first use; None when `spec` names no built-in with weights (a folder, a file, `NAME@meta`) or
    the `tokenizers` package is missing (the model then has no tokenizer, as a folder without one).
    TokenizerError (one line) when the cache folder cannot be written."""
    from .tokenizer import TokenizerError

    name, _, variant = str(spec).partition("@")
    if (name not in PUBLISHED or variant not in GENERATED_VARIANTS or Path(spec).exists()
            or importlib.util.find_spec("tokenizers") is None):
        return None
    try:
        builtin_config(name, variant)
    except KeyError:  # no such variant of this model
        return None
    vocab_size = int(builtin_config(name, variant)["vocab_size"])
    key = hashlib.sha256(f"{__name__}:{vocab_size}:{CHAT_TEMPLATE}:{_TEXT}".encode()).hexdigest()
    folder = _cache_root() / f"{name}@{variant}-{key[:16]}"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    files = builtin_tokenizer_files(name, variant)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        # written whole beside it, then renamed: a reader never sees half a folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        for file, text in files.items():
            (tmp / file).write_text(text, encoding="utf-8")
    except OSError as e:
        raise TokenizerError(f"cannot write the built-in tokenizer of {spec} under {folder.parent} "
                             f"({e.strerror or e}): set ERNIE_IR_CACHE_DIR to a writable folder") from None
    try:
        os.replace(tmp, folder)
    except OSError:  # another process put it there first: theirs has the same bytes
        for file in files:
            (tmp / file).unlink(missing_ok=True)
        tmp.rmdir()
    return folder
