"""Reference: a tokenizer class of transformers / paddleformers / PaddleNLP loading a folder.

Runs in any reference environment (which classes exist depends on it). Never
imports ernie_ir; needs no network (files come from the spec's folder).

Usage::

    python ref_tokenizer.py SPEC OUT_DIR

SPEC: ``folder`` (a tokenizer folder), ``loader`` (one of LOADERS below),
``texts`` (strings to encode), ``ids`` (lists of ids to decode), ``chats``
(lists of messages to render with and without the generation prompt).

Writes ``OUT_DIR/result.json``: ``encode`` / ``encode_plain`` (with and without
special tokens, one list per text), ``decode`` / ``decode_skip`` (per id list),
``chat`` / ``chat_no_prompt`` (per chat, or the error's type and message),
``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``class`` and the library
versions; and ``meta.json``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import _refcommon as rc

LOADERS = {
    "hf_auto": "transformers.AutoTokenizer",
    "hf_llama": "transformers.LlamaTokenizer",
    "hf_gpt2": "transformers.GPT2Tokenizer",
    "pf_auto": "paddleformers.transformers.AutoTokenizer",
    "pf_ernie": "paddleformers.transformers.Ernie4_5Tokenizer",
    "nlp_gpt": "paddlenlp.transformers.GPTTokenizer",
}


def load(loader: str, folder: str) -> Any:
    module, name = LOADERS[loader].rsplit(".", 1)
    import importlib

    cls = getattr(importlib.import_module(module), name)
    return cls.from_pretrained(folder)


def main() -> None:
    rc.quiet_env()
    spec, out = rc.parse_args()
    timer = rc.Timer()
    tok = load(spec["loader"], spec["folder"])
    timer.lap("load")

    def call(fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # the reference's refusal is a result too
            return {"error": type(e).__name__, "message": str(e)[:500]}

    def encode(text: str, **kw: Any) -> list[int]:
        ids = tok.encode(text, **kw)
        return list(ids if isinstance(ids, list) else ids["input_ids"])  # PaddleNLP returns a dict

    texts = spec.get("texts", [])
    ids = spec.get("ids", [])
    chats = spec.get("chats", [])
    result = {
        "class": type(tok).__name__,
        "encode": [encode(t) for t in texts],
        "encode_plain": [encode(t, add_special_tokens=False) for t in texts],
        "decode": [tok.decode(x) for x in ids],
        "decode_skip": [tok.decode(x, skip_special_tokens=True) for x in ids],
        "chat": [call(lambda m=m: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True))
                 for m in chats],
        "chat_no_prompt": [call(lambda m=m: tok.apply_chat_template(m, tokenize=False,
                                                                     add_generation_prompt=False))
                           for m in chats],
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    timer.lap("run")
    versions = {}
    for name in ("transformers", "tokenizers", "sentencepiece", "paddleformers", "paddlenlp"):
        with contextlib.suppress(Exception):
            versions[name] = __import__(name).__version__
    result["versions"] = versions
    (out / "result.json").write_text(json.dumps(result, ensure_ascii=False, indent=1))
    rc.write_meta(out, {"spec": spec, "versions": versions, "timings": timer.laps})


if __name__ == "__main__":
    main()
