"""`Generator`: prompts (text or ids) in, tokens and text out, through a `Decoder`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.frontends.tokenizer import Tokenizer, load_tokenizer
from ernie_ir.ir.inputs import read_json
from ernie_ir.runtime.decoding import DecodeError, DecodeOptions, DecodeResult, check_prompts

from .decoders import Decoder, open_decoder

TokenCallback = Callable[[int, int], None]
"""on_token(row, token id), called as each row's tokens are chosen."""


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


class Generator:
    """A model or artifact that generates (see `ernie_ir.generation`)."""

    def __init__(self, model: str | Path, backend: str = "interpreter", *, kv_cache_dtype: str | None = None,
                 trust_pickle: bool = False, timeout_s: float | None = None,
                 decoder: Decoder | None = None) -> None:
        """`timeout_s` bounds a multi-rank paddle run (default: the launcher's)."""
        self.decoder = decoder or open_decoder(model, backend, kv_cache_dtype=kv_cache_dtype,
                                               trust_pickle=trust_pickle, timeout_s=timeout_s)
        folder = self.decoder.folder
        self.tokenizer: Tokenizer | None = load_tokenizer(folder) if folder is not None else None
        self.generation_config: dict[str, Any] = {}
        if folder is not None and (folder / "generation_config.json").is_file():
            data = read_json(folder / "generation_config.json", "generation config", DecodeError)
            self.generation_config = data if isinstance(data, dict) else {}

    # -- what the model says ----------------------------------------------------------------------
    @property
    def eos_ids(self) -> frozenset[int]:
        """generation_config.json's eos_token_id, else config.json's, else the tokenizer's."""
        for source in (self.generation_config, self.decoder.config):
            found = _ids(source.get("eos_token_id"))
            if found:
                return frozenset(found)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return frozenset({self.tokenizer.eos_token_id})
        return frozenset()

    @property
    def pad_id(self) -> int:
        for source in (self.generation_config, self.decoder.config):
            found = _ids(source.get("pad_token_id"))
            if found:
                return min(found)
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return self.tokenizer.pad_token_id
        return 0

    # -- text -------------------------------------------------------------------------------------
    def require_tokenizer(self, flag: str = "--prompt") -> Tokenizer:
        if self.tokenizer is None:
            raise DecodeError(f"{flag} needs a tokenizer, and this model's folder has none (tokenizer.model, "
                              "tokenizer.json or vocab.json + merges.txt): give token ids with --prompt-ids")
        return self.tokenizer

    def encode(self, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids of a text prompt (`chat`: wrapped in the tokenizer's chat template first)."""
        tok = self.require_tokenizer("--chat" if chat else "--prompt")
        if not text:
            raise DecodeError("the prompt is empty: give some text")
        if chat:
            if tok.spec.chat_template is None:
                raise DecodeError("--chat needs a chat template, and this tokenizer has none "
                                  "(tokenizer_config.json's chat_template or chat_template.jinja): "
                                  "drop --chat")
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": text}]
            return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        return tok.encode(text)

    def text(self, ids: Sequence[int]) -> str:
        """The text of generated ids, special tokens skipped. Ids the tokenizer lacks (a model's
        vocabulary is often padded past the tokenizer's) have no text and are left out."""
        tok = self.require_tokenizer("text output")
        return tok.decode(self.known(ids), skip_special_tokens=True)

    def known(self, ids: Sequence[int]) -> list[int]:
        """`ids` without those outside the tokenizer's vocabulary."""
        size = self.require_tokenizer("text output").vocab_size
        return [i for i in ids if 0 <= i < size]

    # -- generating -------------------------------------------------------------------------------
    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """The prompts, refused (DecodeError, before any work) where they cannot be generated from."""
        if max_new_tokens < 1:
            raise DecodeError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
        rows = check_prompts(prompts, self.decoder.vocab_size)
        limit = self.decoder.context_length
        longest = max(len(r) for r in rows)
        if limit is not None and longest + max_new_tokens > limit:
            raise DecodeError(f"a prompt of {longest} tokens plus --max-new-tokens {max_new_tokens} is "
                              f"{longest + max_new_tokens} positions, beyond the model's {limit}: "
                              "shorten the prompt or lower --max-new-tokens")
        return rows

    def generate(self, prompts: Sequence[Sequence[int]], options: DecodeOptions | None = None, *,
                 stop_texts: Iterable[str] = (), ignore_eos: bool = False,
                 on_token: TokenCallback | None = None) -> DecodeResult:
        """New tokens after each prompt. `options.eos_ids` empty and not `ignore_eos`: the model's."""
        options = options or DecodeOptions()
        rows = self.check(prompts, options.max_new_tokens)
        eos = frozenset() if ignore_eos else (options.eos_ids or self.eos_ids)
        options = DecodeOptions(max_new_tokens=options.max_new_tokens, sampling=options.sampling,
                                eos_ids=eos, pad_id=options.pad_id if options.pad_id else self.pad_id,
                                keep_logits=options.keep_logits)
        stops = [s for s in stop_texts if s]
        stop = None
        if stops:
            tok = self.require_tokenizer("--stop")
            stop = lambda _row, new: any(s in tok.decode(self.known(new)) for s in stops)  # noqa: E731

        def on_tokens(_step: int, tokens: np.ndarray, live: list[bool]) -> None:
            if on_token is not None:
                for b, t in enumerate(tokens):
                    if live[b]:
                        on_token(b, int(t))

        d = self.decoder
        return d.generate(rows, options, stop=stop, on_tokens=on_tokens)


def generate(model: str | Path, prompts: Sequence[Sequence[int]] | Sequence[str], *,
             backend: str = "interpreter", max_new_tokens: int = 32, ignore_eos: bool = False,
             **options: Mapping[str, Any]) -> DecodeResult:
    """One call: open `model` on `backend` and generate after each prompt (ids, or text with a
    tokenizer); `options`: the other DecodeOptions fields."""
    gen = Generator(model, backend)
    rows = [gen.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    return gen.generate(rows, DecodeOptions(max_new_tokens=max_new_tokens, **options),  # type: ignore[arg-type]
                        ignore_eos=ignore_eos)
