"""Tokenizers of checkpoint folders, read with the libraries made for their files.

    from ernie_ir.frontends.tokenizer import load_tokenizer
    tok = load_tokenizer("ERNIE-4.5-0.3B-Paddle")          # None when the folder has no tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    text = tok.decode(ids, skip_special_tokens=True)

Which files, which library, which class it behaves like (REFERENCE.md 9.3):

| files | library | behaves like |
|---|---|---|
| `tokenizer.json` (wins over the rest) | tokenizers | transformers' `PreTrainedTokenizerFast` |
| `tokenizer.model` (ERNIE 4.5) | sentencepiece reads, tokenizers runs | paddleformers' `Ernie4_5Tokenizer` |
| `sentencepiece.bpe.model` (ERNIE-3.5-SE) | sentencepiece | PaddleNLP's `Ernie35Tokenizer` (adds BOS) |
| `vocab.json` + `merges.txt` (GPT) | tokenizers | `GPT2Tokenizer` (byte-level BPE) |

`tokenizer_config.json` (and `special_tokens_map.json`, `added_tokens.json`,
`chat_template.jinja` / `chat_template.json`) add the special tokens, BOS/EOS
rules and the chat template. sentencepiece, tokenizers and jinja2 are imported
when a tokenizer needs them (`pip install ernie-ir[text]`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import FrontendError

__all__ = [
    "TOKENIZER_FILES",
    "SentencePieceTokenizer",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "TokenizersTokenizer",
    "load_tokenizer",
    "sentencepiece_to_tokenizers",
    "tokenizer_files",
    "write_hf_tokenizer_json",
]

# Every file that belongs to a checkpoint's tokenizer, in the order a reader looks at them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_SPIECE = "\u2581"  # sentencepiece's whitespace mark


class TokenizerError(FrontendError):
    """Tokenizer files that cannot be read, a missing library, or a request the tokenizer cannot serve."""


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The files of `folder` that belong to its tokenizer (copy these to ship it), TOKENIZER_FILES order."""
    root = Path(folder)
    return [root / name for name in TOKENIZER_FILES if (root / name).is_file()]


def _one_line(e: BaseException | str) -> str:
    return " ".join(str(e).split())


def _require(module: str) -> Any:
    """Import a tokenizer library or say in one line how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise TokenizerError(
            f"reading this tokenizer needs the {top!r} package ({_one_line(e)}): pip install ernie-ir[text]"
        ) from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({_one_line(e)})") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"special token {value!r} is neither a string nor an AddedToken object")


# -- what the folder says ------------------------------------------------------------------------------


@dataclass
class TokenizerSpec:
    """Special tokens, BOS/EOS rules and the chat template, as the folder's JSON files state them."""

    special: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> text
    additional: list[str] = field(default_factory=list)  # additional/extra special tokens
    added: dict[int, tuple[str, bool]] = field(default_factory=dict)  # id -> (text, special)
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    tokenizer_class: str | None = None
    chat_template: str | None = None
    model_ids: dict[str, Any] = field(default_factory=dict)  # bos/eos/pad ids of config/generation_config
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json as read

    @classmethod
    def read(cls, folder: Path) -> TokenizerSpec:
        spec = cls()
        for name in ("config.json", "generation_config.json"):  # the model's ids; the later file wins
            path = folder / name
            if path.is_file():
                data = _read_json(path)
                if isinstance(data, dict):
                    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
                    spec.model_ids.update({k: data[k] for k in keys if data.get(k) is not None})
        stm = folder / "special_tokens_map.json"
        cfg_path = folder / "tokenizer_config.json"
        cfg: dict[str, Any] = {}
        for path in (stm, cfg_path):  # tokenizer_config.json wins over special_tokens_map.json
            if path.is_file():
                data = _read_json(path)
                if not isinstance(data, dict):
                    raise TokenizerError(f"{path}: expected a JSON object, found {type(data).__name__}")
                cfg.update(data)
        spec.config = cfg
        for key in _SPECIAL_NAMES:
            text = _token_text(cfg.get(key))
            if text is not None:
                spec.special[key] = text
        extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
        if isinstance(extra, Mapping):  # transformers 5 may name them
            extra = list(extra.values())
        spec.additional = [t for t in (_token_text(x) for x in extra) if t is not None]
        for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
            text = _token_text(entry)
            try:
                spec.added[int(key)] = (text or "", bool(entry.get("special", False)))
            except (ValueError, AttributeError):
                raise TokenizerError(f"{cfg_path}: added_tokens_decoder key {key!r} is not an id") from None
        added_json = folder / "added_tokens.json"
        if added_json.is_file():
            data = _read_json(added_json)
            if not isinstance(data, dict):
                raise TokenizerError(f"{added_json}: expected an object of token -> id")
            named = {*spec.special.values(), *spec.additional}
            for text, i in data.items():
                spec.added.setdefault(int(i), (text, text in named))
        for key in ("add_bos_token", "add_eos_token"):
            if isinstance(cfg.get(key), bool):
                setattr(spec, key, cfg[key])
        cls_name = cfg.get("tokenizer_class")
        spec.tokenizer_class = cls_name if isinstance(cls_name, str) else None
        spec.chat_template = _chat_template(folder, cfg)
        return spec


def _chat_template(folder: Path, cfg: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's (a string or named list)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    template: Any = cfg.get("chat_template")
    if json_file.is_file():
        data = _read_json(json_file)
        template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# -- the common interface ---------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one checkpoint, with its special tokens and chat template.

    Subclasses supply `_encode_text` (text -> ids, special tokens in the text recognised, no
    BOS/EOS added), `_decode_ids`, `token_to_id`, `id_to_token` and `vocab_size`.
    """

    kind = "abstract"

    def __init__(self, spec: TokenizerSpec, *, add_bos: bool, add_eos: bool) -> None:
        self.spec = spec
        self.add_bos_token = add_bos
        self.add_eos_token = add_eos
        self.chat_template = spec.chat_template
        self._compiled_template: Any = None

    # subclasses
    def _encode_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode_ids(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding may have more rows)."""
        raise NotImplementedError

    # special tokens
    def special_token(self, name: str) -> str | None:
        """The text of a named special token (`bos_token`, `eos_token`, `pad_token`, ...)."""
        return self.spec.special.get(name)

    def _special_id(self, name: str) -> int | None:
        text = self.special_token(name)
        token_id = self.token_to_id(text) if text is not None else None
        if token_id is None:
            fallback = self.spec.model_ids.get(f"{name}_id")
            if isinstance(fallback, list):
                fallback = fallback[0] if fallback else None
            return fallback if isinstance(fallback, int) else None
        return token_id

    @property
    def bos_token_id(self) -> int | None:
        """Id of the BOS token named by tokenizer_config.json, else config.json / generation_config.json's."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of the EOS token named by tokenizer_config.json, else config.json / generation_config.json's."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the tokenizer's EOS and the model's `eos_token_id` (int or list)."""
        ids: list[int] = []
        model_eos = self.spec.model_ids.get("eos_token_id")
        for i in [self.eos_token_id, *(model_eos if isinstance(model_eos, list) else [model_eos])]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
        return tuple(ids)

    def special_tokens(self) -> dict[str, str]:
        """Named special tokens plus the additional ones (`additional_special_tokens`: a list)."""
        out: dict[str, Any] = dict(self.spec.special)
        if self.spec.additional:
            out["additional_special_tokens"] = list(self.spec.additional)
        return out

    def all_special_texts(self) -> list[str]:
        texts = [*self.spec.special.values(), *self.spec.additional]
        texts += [t for t, special in self.spec.added.values() if special]
        return list(dict.fromkeys(t for t in texts if t))

    # text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids.

        `add_special_tokens` adds BOS / EOS where the tokenizer's rules say so
        (`add_bos_token` / `add_eos_token` of tokenizer_config.json, else the class's default).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a string, got {type(text).__name__}")
        ids = self._encode_text(text)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (special tokens written out unless `skip_special_tokens`)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._decode_ids(ids, skip_special_tokens)

    def stream(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> StreamDecoder:
        """An incremental decoder that continues after `prompt_ids`."""
        return StreamDecoder(self, prompt_ids, skip_special_tokens=skip_special_tokens)

    def decode_new(self, previous_ids: Sequence[int], new_ids: Sequence[int],
                   skip_special_tokens: bool = True) -> str:
        """The text `new_ids` add after `previous_ids`: `decode(prev + new)` minus `decode(prev)`.

        Held back: a trailing incomplete UTF-8 character (it comes with the ids that complete it).
        """
        stream = self.stream(previous_ids, skip_special_tokens=skip_special_tokens)
        return stream.push(new_ids)

    # chat
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the checkpoint's Jinja chat template the way transformers does.

        A sandboxed environment (trim_blocks, lstrip_blocks, loop controls, `tojson`,
        `raise_exception`, `strftime_now`); the context holds `messages`,
        `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...) and `kwargs`.
        """
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json has no "
                                 "'chat_template', there is no chat_template.jinja); pass plain text instead")
        jinja2 = _require("jinja2")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        context = {**self.special_tokens(), **kwargs}
        try:
            return self._compiled_template.render(messages=list(messages),
                                                  add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {_one_line(e)}") from None


def _compile_template(source: str) -> Any:
    import datetime

    jinja2 = _require("jinja2")
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's API)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template, line {e.lineno}: {_one_line(e.message or e)}") from None


class StreamDecoder:
    """Decodes generated ids as they come, without splitting characters or losing spaces.

    Each `push` decodes a short window of earlier ids plus the new ones and returns the
    text beyond what the window alone decodes to (the window carries leading spaces
    that a decoder strips at the start of a text). Text that ends in an incomplete
    UTF-8 character (U+FFFD at the end) waits for the next ids. The concatenation of
    every `push` and the final `flush` equals `decode(generated)`, where decoding
    `prompt + generated` would give the same text after the prompt.
    """

    WINDOW = 6  # earlier ids re-decoded for context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = [int(i) for i in prompt_ids]
        self.read_offset = len(self.ids)  # ids before this are already in the returned text
        self.prefix_offset = max(self.read_offset - self.WINDOW, 0)

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: int | Iterable[int]) -> str:
        """Add ids; returns the text they complete ('' while a character is still incomplete)."""
        self.ids.extend([int(new_ids)] if isinstance(new_ids, int) else (int(i) for i in new_ids))
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is left (an incomplete character comes out as U+FFFD, as `decode` writes it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        before = self._text(self.ids[self.prefix_offset:self.read_offset])
        after = self._text(self.ids[self.prefix_offset:])
        if not final and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""
        if not after.startswith(before):  # the window re-tokenised differently: fall back to the full diff
            before, after = self._text(self.ids[:self.read_offset]), self._text(self.ids)
        delta = after[len(before):]
        self.prefix_offset = max(self.read_offset, len(self.ids) - self.WINDOW)
        self.read_offset = len(self.ids)
        return delta


# -- tokenizers-backed: tokenizer.json, GPT's vocab.json + merges.txt, ERNIE 4.5's tokenizer.model ----------


class TokenizersTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` plus the folder's special tokens (transformers' fast tokenizers)."""

    kind = "tokenizers"

    def __init__(self, backend: Any, spec: TokenizerSpec, *, add_bos: bool, add_eos: bool,
                 hf_class: str = "PreTrainedTokenizerFast") -> None:
        super().__init__(spec, add_bos=add_bos, add_eos=add_eos)
        self.backend = backend
        self.hf_class = hf_class  # the transformers class that loads the same tokenizer.json
        tokenizers = _require("tokenizers")
        # transformers adds the named and additional special tokens to the backend as special tokens
        specials = [tokenizers.AddedToken(t, special=True, normalized=False)
                    for t in self.all_special_texts()]
        if specials:
            backend.add_special_tokens(specials)

    def _encode_text(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def _decode_ids(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def to_json(self) -> str:
        """tokenizer.json text; BOS/EOS as a TemplateProcessing post-processor (as transformers saves it)."""
        tokenizers = _require("tokenizers")
        clone = tokenizers.Tokenizer.from_str(self.backend.to_str())
        bos, eos = self.special_token("bos_token"), self.special_token("eos_token")
        add_bos = self.add_bos_token and bos is not None and self.bos_token_id is not None
        add_eos = self.add_eos_token and eos is not None and self.eos_token_id is not None
        if add_bos or add_eos or clone.post_processor is None:
            def template(seq: str, part: int) -> str:
                return " ".join([*([f"{bos}:{part}"] if add_bos else []), f"${seq}:{part}",
                                 *([f"{eos}:{part}"] if add_eos else [])])

            single, pair = template("A", 0), template("A", 0) + " " + template("B", 1)
            special = [*([(bos, self.bos_token_id)] if add_bos else []),
                       *([(eos, self.eos_token_id)] if add_eos and eos != bos else [])]
            clone.post_processor = tokenizers.processors.TemplateProcessing(single=single, pair=pair,
                                                                            special_tokens=special)
        return clone.to_str(pretty=True)


def _load_tokenizer_json(path: Path) -> Any:
    tokenizers = _require("tokenizers")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for malformed files
        raise TokenizerError(f"{path}: not a tokenizers tokenizer.json ({_one_line(e)[:200]})") from None


def _byte_level_bpe(vocab: Path, merges: Path) -> Any:
    """GPT-2 byte-level BPE from vocab.json + merges.txt (a `#version` first line is a header)."""
    tokenizers = _require("tokenizers")
    vocab_map = _read_json(vocab)
    if not isinstance(vocab_map, dict) or not all(isinstance(v, int) for v in vocab_map.values()):
        raise TokenizerError(f"{vocab}: expected an object of token -> id")
    try:
        lines = merges.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{merges}: cannot read ({_one_line(e)})") from None
    pairs: list[tuple[str, str]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or (n == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{merges}, line {n}: a merge is two tokens separated by one space, "
                                 f"found {line[:60]!r}")
        pairs.append((parts[0], parts[1]))
    try:
        model = tokenizers.models.BPE(vocab=vocab_map, merges=pairs, dropout=None,
                                      continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    except Exception as e:
        raise TokenizerError(f"{merges}: merges do not fit {vocab.name} ({_one_line(e)[:200]})") from None
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    return backend


# -- SentencePiece -------------------------------------------------------------------------------------


def _sp_proto(path: Path) -> Any:
    """The ModelProto of a SentencePiece .model file (via sentencepiece's own protobuf module)."""
    _require("sentencepiece")
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb2
    except ImportError as e:
        raise TokenizerError(f"reading {path.name} needs protobuf ({_one_line(e)}): "
                             "pip install protobuf") from None
    proto = pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:
        raise TokenizerError(f"{path}: not a SentencePiece model ({_one_line(e)[:200]})") from None
    if not proto.pieces:
        raise TokenizerError(f"{path}: not a SentencePiece model (no pieces)")
    return proto


_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # ModelProto.SentencePiece.Type
_SP_BPE, _SP_UNIGRAM = 2, 1  # TrainerSpec.ModelType


def sentencepiece_to_tokenizers(model: str | Path, *, style: str = "paddleformers") -> Any:
    """A `tokenizers.Tokenizer` equivalent to a SentencePiece BPE or unigram model.

    Both styles: the pieces as vocab (BPE merges ranked by the merged piece's id, as
    transformers' `generate_merges`), the model's byte fallback and unknown piece, control
    pieces as special added tokens and user-defined pieces as added tokens.

    `style="paddleformers"`: what paddleformers 1.2's `Ernie4_5Tokenizer` / `AutoTokenizer`
    builds from ERNIE 4.5's `tokenizer.model`: the model's precompiled charsmap (if any),
    spaces to `▁`, **no dummy prefix** (the original ERNIE tokenizer has none:
    `add_prefix_space=False`) and no whitespace removal.

    `style="sentencepiece"`: what `SentencePieceProcessor.encode` does on each stretch of text
    between special tokens: the model's normalizer (its precompiled charsmap, extra whitespace
    removal) and, if the model adds one, a dummy `▁` prepended to every stretch.
    """
    tokenizers = _require("tokenizers")
    from tokenizers import AddedToken, Regex, decoders, models, normalizers

    path = Path(model)
    proto = _sp_proto(path)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = next((p for p, _, t in pieces if t == _UNKNOWN), None)
    if trainer.model_type == _SP_BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        atoms = {p for p, _, t in pieces if t in (_CONTROL, _USER_DEFINED, _UNKNOWN, _BYTE)}
        merges = []
        for piece, _, t in pieces:
            if t != _NORMAL:
                continue
            found = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                     if piece[:k] in vocab and piece[k:] in vocab and piece[:k] not in atoms
                     and piece[k:] not in atoms]
            merges += [(vocab[piece], vocab[a], vocab[b], a, b) for a, b in found]
        merges.sort(key=lambda m: (m[0], len(m[3]), len(m[4])))
        backend_model = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                                   fuse_unk=True, byte_fallback=bool(trainer.byte_fallback), dropout=None)
    elif trainer.model_type == _SP_UNIGRAM:
        unk_id = next((i for i, (_, _, t) in enumerate(pieces) if t == _UNKNOWN), None)
        backend_model = models.Unigram([(p, s) for p, s, _ in pieces], unk_id, bool(trainer.byte_fallback))
    else:
        raise TokenizerError(f"{path}: SentencePiece model type {trainer.model_type} (word/char) is not "
                             "supported; BPE and unigram are")
    if style not in ("paddleformers", "sentencepiece"):
        raise ValueError(f"style must be 'paddleformers' or 'sentencepiece', not {style!r}")
    faithful = style == "sentencepiece"
    backend = tokenizers.Tokenizer(backend_model)
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if faithful and norm.remove_extra_whitespaces:  # strip, then one space for every run (after the charsmap)
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if faithful and norm.add_dummy_prefix:
        steps.append(normalizers.Prepend(_SPIECE))
    steps.append(normalizers.Replace(" ", _SPIECE))
    backend.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace(_SPIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if faithful and norm.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    backend.add_tokens([AddedToken(p, special=t == _CONTROL, normalized=False)
                        for p, _, t in pieces if t in (_CONTROL, _USER_DEFINED)])
    return backend


class SentencePieceTokenizer(Tokenizer):
    """`SentencePieceProcessor` on each stretch of text between special tokens (PaddleNLP's slow tokenizers).

    Used for ERNIE-3.5-SE's `sentencepiece.bpe.model` (`Ernie35Tokenizer`: adds BOS by
    default). Decoding writes special tokens as they are, without the extra space
    `Ernie35Tokenizer.convert_tokens_to_string` puts before one.
    """

    kind = "sentencepiece"

    def __init__(self, model: Path, spec: TokenizerSpec, *, add_bos: bool, add_eos: bool) -> None:
        spm = _require("sentencepiece")
        self.model_path = model
        self.proto = _sp_proto(model)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(self.proto.SerializeToString())
        except Exception as e:
            raise TokenizerError(f"{model}: sentencepiece cannot load it ({_one_line(e)[:200]})") from None
        super().__init__(spec, add_bos=add_bos, add_eos=add_eos)
        n = self.sp.get_piece_size()
        self._added: dict[str, int] = {}  # special texts -> ids (beyond the model's pieces when new)
        for text in self.all_special_texts():
            i = self.sp.piece_to_id(text)
            if self.sp.id_to_piece(i) != text:
                i = n + len([j for j in self._added.values() if j >= n])
            self._added[text] = i
        self._added_by_id = {i: t for t, i in self._added.items()}
        self._special_ids = set(self._added_by_id) | {i for i in range(n) if self.sp.is_control(i)}
        texts = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None

    def _encode_text(self, text: str) -> list[int]:
        if self._split is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for k, chunk in enumerate(self._split.split(text)):
            if k % 2:
                ids.append(self._added[chunk])
            elif chunk:
                ids += self.sp.encode(chunk)
        return ids

    def _decode_ids(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out, run = [], []
        for i in ids:
            if i in self._special_ids:
                out.append(self.sp.decode(run))
                run = []
                if not skip_special_tokens:
                    out.append(self._added_by_id.get(i) or self.sp.id_to_piece(i))
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added_by_id:
            return self._added_by_id[token_id]
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.sp.get_piece_size() else None

    @property
    def vocab_size(self) -> int:
        return max([self.sp.get_piece_size() - 1, *self._added.values()]) + 1


# -- the folder ----------------------------------------------------------------------------------------


def load_tokenizer(folder: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or None when it has no tokenizer files.

    Raises `TokenizerError` (one line) for files that cannot be read and when a needed
    library (sentencepiece, tokenizers, jinja2) is missing.
    """
    root = Path(folder)
    if not root.is_dir():
        return None
    present = {p.name for p in tokenizer_files(root)}
    if not present & {"tokenizer.json", "tokenizer.model", "sentencepiece.bpe.model", "vocab.json",
                      "merges.txt"}:
        return None
    spec = TokenizerSpec.read(root)
    cls_name = spec.tokenizer_class or ""
    if "tokenizer.json" in present:
        backend = _load_tokenizer_json(root / "tokenizer.json")
        hf_class = cls_name or "PreTrainedTokenizerFast"
        if spec.add_bos_token is None and spec.add_eos_token is None:
            # the file's own post-processor adds what it adds; encode through it
            return _JsonTokenizer(backend, spec, hf_class=hf_class)
        return TokenizersTokenizer(backend, spec, add_bos=bool(spec.add_bos_token),
                                   add_eos=bool(spec.add_eos_token), hf_class=hf_class)
    se_name = "sentencepiece.bpe.model"
    sp_model = root / (se_name if se_name in present else "tokenizer.model")
    if sp_model.name in present:
        proto = _sp_proto(sp_model)
        defaults = {"unk_token": _piece_of(proto, _UNKNOWN, "<unk>"), "bos_token": _piece_at(proto, "bos"),
                    "eos_token": _piece_at(proto, "eos")}
        for key, value in defaults.items():
            if value is not None:
                spec.special.setdefault(key, value)
        add_eos = bool(spec.add_eos_token)
        if sp_model.name == "sentencepiece.bpe.model" or cls_name.startswith("Ernie35"):
            add_bos = True if spec.add_bos_token is None else spec.add_bos_token  # Ernie35Tokenizer's default
            return SentencePieceTokenizer(sp_model, spec, add_bos=add_bos, add_eos=add_eos)
        add_bos = bool(spec.add_bos_token)  # paddleformers 1.2 (transformers 5) adds none unless told
        backend = sentencepiece_to_tokenizers(sp_model, style="paddleformers")
        return TokenizersTokenizer(backend, spec, add_bos=add_bos, add_eos=add_eos, hf_class="LlamaTokenizer")
    if not {"vocab.json", "merges.txt"} <= present:
        missing = ({"vocab.json", "merges.txt"} - present).pop()
        found = ({"vocab.json", "merges.txt"} & present).pop()
        raise TokenizerError(f"{root}: has {found} but no {missing}; a byte-level BPE tokenizer needs both")
    for key in ("unk_token", "bos_token", "eos_token"):
        spec.special.setdefault(key, "<|endoftext|>")
    backend = _byte_level_bpe(root / "vocab.json", root / "merges.txt")
    return TokenizersTokenizer(backend, spec, add_bos=bool(spec.add_bos_token),
                               add_eos=bool(spec.add_eos_token), hf_class="GPT2Tokenizer")


class _JsonTokenizer(TokenizersTokenizer):
    """tokenizer.json whose own post-processor decides what `add_special_tokens` adds."""

    def __init__(self, backend: Any, spec: TokenizerSpec, *, hf_class: str) -> None:
        super().__init__(backend, spec, add_bos=False, add_eos=False, hf_class=hf_class)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a string, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def to_json(self) -> str:
        return self.backend.to_str(pretty=True)


def _piece_of(proto: Any, kind: int, default: str | None) -> str | None:
    return next((p.piece for p in proto.pieces if p.type == kind), default)


def _piece_at(proto: Any, which: str) -> str | None:
    i = getattr(proto.trainer_spec, f"{which}_id")
    return proto.pieces[i].piece if 0 <= i < len(proto.pieces) else None


# -- tokenizer.json for runtimes that read only that (onnxruntime-genai) -------------------------------------

def write_hf_tokenizer_json(tokenizer: Tokenizer, folder: str | Path) -> list[Path]:
    """Write `tokenizer.json` + `tokenizer_config.json` that encode like `tokenizer`; returns both paths.

    For runtimes that read only tokenizer.json (onnxruntime-genai's `og.Tokenizer` ignores a bare
    SentencePiece model, REFERENCE.md 9.2). A `SentencePieceTokenizer` is converted with
    `sentencepiece_to_tokenizers(style="sentencepiece")`; a tokenizers-backed one is saved as it
    runs; BOS/EOS go into a TemplateProcessing post-processor. tokenizer_config.json is the
    folder's without `auto_map`, with the chat template, the special tokens, `add_bos_token` /
    `add_eos_token`, and a `tokenizer_class` that onnxruntime-extensions (og's tokenizer) reads the
    file with as we do: `GPT2Tokenizer` (byte-level BPE), `LlamaTokenizer` + `legacy` (a
    converted SentencePiece model), else `PreTrainedTokenizerFast` (which makes transformers
    use the file as it is). docs/frontends.md lists where they still differ. Overwrites both files.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, SentencePieceTokenizer):
        backend = sentencepiece_to_tokenizers(tokenizer.model_path, style="sentencepiece")
        converted = TokenizersTokenizer(backend, tokenizer.spec, add_bos=tokenizer.add_bos_token,
                                        add_eos=tokenizer.add_eos_token, hf_class="LlamaTokenizer")
        text, hf_class = converted.to_json(), "LlamaTokenizer"
    elif isinstance(tokenizer, TokenizersTokenizer):
        hf_class = "GPT2Tokenizer" if tokenizer.hf_class == "GPT2Tokenizer" else "PreTrainedTokenizerFast"
        text = tokenizer.to_json()
    else:
        raise TokenizerError(f"cannot write a tokenizer.json for a {type(tokenizer).__name__}")
    config = {k: v for k, v in tokenizer.spec.config.items() if k not in ("auto_map", "tokenizer_file")}
    config.update(tokenizer.special_tokens())
    config.update(tokenizer_class=hf_class, add_bos_token=tokenizer.add_bos_token,
                  add_eos_token=tokenizer.add_eos_token)
    if hf_class == "LlamaTokenizer":
        config["legacy"] = True  # transformers: a dummy prefix on every stretch between special tokens
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]
