"""`genai_config.json` for onnxruntime-genai: how it loads and drives the ONNX decoder.

    cfg = genai_config(decoder_graph, CacheLayout.of(decoder_graph))
    write_genai_config(decoder_graph, layout, Path("inference/onnx"))

The ONNX model an artifact carries (`compile --emit onnx`) is a decoder (the `kv-cache` pass):
inputs `input_ids`, `attention_mask`, `position_ids`, `past_key_values.{i}.key/.value`; outputs
`logits`, `present.{i}.key/.value` (docs/targets.md, "The ONNX decoder"). onnxruntime-genai
(0.18) reads this file beside `model.onnx`: `og.Model(og.Config(folder))`. Its rules:

- unknown keys inside `model`, `model.decoder` or `search` are a hard error, so nothing of
  ernie-ir's own goes there;
- `model.type`: "ernie4_5" for ERNIE 4.5 (dense and MoE), "decoder" (its generic separate-K/V
  decoder) for ERNIE-3.5-SE and GPT ("gpt2" would expect one combined past tensor);
- `vocab_size` must equal the logits' last dim; every attention must have the same kv heads
  and head dim (one `num_key_value_heads`, one `head_size`);
- `past_present_share_buffer` false: the decoder concatenates past and new keys (a present one
  longer than the past), it does not write into a preallocated buffer;
- the token ids come from the model's config.json (`graph.metadata["config"]`) unless given
  (`token_ids`, e.g. the tokenizer's): a missing `pad_token_id` or `bos_token_id` is the EOS id
  (GPT-2's `<|endoftext|>` is all three). One still missing is left out, and onnxruntime-genai
  uses its default (pad 0, for one: note that it masks every prompt token equal to the pad id,
  even in a batch of one); `missing_token_ids` names them, for a warning.

The tokenizer files onnxruntime-genai reads (`tokenizer.json` + `tokenizer_config.json`) belong
in the same folder (`inference/onnx/`); `write_genai_config(..., tokenizer_files=...)` writes
them there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ernie_ir.ir import ErnieIRError, Graph
from ernie_ir.passes.decoding.kv_cache import (
    ATTENTION_MASK,
    INPUT_IDS,
    PAST,
    POSITION_IDS,
    PRESENT,
    CacheLayout,
)

GENAI_CONFIG_FILE = "genai_config.json"
MODEL_FILE = "model.onnx"
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class GenaiConfigError(ErnieIRError):
    """The decoder cannot be described to onnxruntime-genai (one line: what is in the way)."""


def genai_model_type(graph: Graph) -> str:
    """onnxruntime-genai's `model.type` for the model `graph` was made from."""
    cfg = graph.metadata.get("config") or {}
    names = [str(graph.metadata.get("architecture") or ""), *map(str, cfg.get("architectures") or []),
             str(cfg.get("model_type") or "")]
    if any(n.lower().replace("_", "").startswith("ernie45") for n in names):
        return "ernie4_5"
    return "decoder"


TokenIds = Mapping[str, int | list[int] | None]


def resolve_token_ids(graph: Graph, given: TokenIds | None = None) -> dict[str, Any]:
    """The bos/eos/pad ids genai_config.json states: `given` over the model config's, pad and bos
    defaulting to the EOS id; the ones still unknown are absent."""
    cfg = graph.metadata.get("config") or {}
    ids: dict[str, Any] = {k: cfg.get(k) for k in TOKEN_KEYS}
    ids.update({k: v for k, v in (given or {}).items() if k in TOKEN_KEYS and v is not None})
    eos = ids["eos_token_id"]
    if isinstance(eos, list):  # several EOS ids: the first stands for pad and bos
        eos = eos[0] if eos else None
    for k in ("pad_token_id", "bos_token_id"):
        if ids[k] is None:
            ids[k] = eos
    return {k: v for k, v in ids.items() if v is not None and v != []}


def missing_token_ids(graph: Graph, given: TokenIds | None = None) -> list[str]:
    """The token-id keys genai_config.json leaves to onnxruntime-genai's defaults."""
    known = resolve_token_ids(graph, given)
    return [k for k in TOKEN_KEYS if k not in known]


def genai_config(graph: Graph, layout: CacheLayout, *, filename: str = MODEL_FILE,
                 max_length: int | None = None,
                 token_ids: TokenIds | None = None) -> dict[str, Any]:
    """The genai_config.json object of decoder `graph` (the `kv-cache` pass made it; `layout` its
    cache), whose ONNX file is `filename` in the same folder. `max_length` (prompt + new tokens,
    `search.max_length`): default the model's context length. `token_ids`: bos/eos/pad ids that
    override the model config's (e.g. the tokenizer's)."""
    cfg = graph.metadata.get("config") or {}
    if not layout.layers:
        raise GenaiConfigError(f"graph {graph.name} has no attention: not a decoder")
    if len(set(layout.layers)) != 1:
        shapes = ", ".join(f"{kv}x{d}" for kv, d in dict.fromkeys(layout.layers))
        raise GenaiConfigError(f"onnxruntime-genai needs one KV-head count and head size for every layer; "
                               f"this decoder's caches are {shapes} (kv heads x head dim)")
    kv_heads, head_dim = layout.layers[0]
    logits = dict(zip(graph.output_names, graph.outputs, strict=True)).get("logits")
    if logits is None or not isinstance(logits.type.shape[-1], int):
        raise GenaiConfigError(f"graph {graph.name} has no output logits [B, S, vocab] with a static vocab")
    vocab = int(logits.type.shape[-1])
    heads = {int(n.inputs[0].type.shape[2]) for n in graph.nodes_by_op("attention")
             if isinstance(n.inputs[0].type.shape[2], int)}
    num_heads = heads.pop() if len(heads) == 1 else int(cfg.get("num_attention_heads") or kv_heads)
    hidden = int(cfg.get("hidden_size") or num_heads * head_dim)
    context = cfg.get("max_position_embeddings") or cfg.get("max_sequence_length") or cfg.get("seq_length")
    if not context:
        raise GenaiConfigError("genai_config.json needs the context length: the model's config.json has no "
                               "max_position_embeddings")
    context = int(context)
    length = context if max_length is None else int(max_length)
    if not 0 < length <= context:
        raise GenaiConfigError(f"max_length {length} is outside 1..{context} (the model's context length)")
    ids = resolve_token_ids(graph, token_ids)
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": head_dim,
        "hidden_size": hidden,
        "num_attention_heads": num_heads,
        "num_hidden_layers": len(layout.layers),
        "num_key_value_heads": kv_heads,
        "inputs": {
            "input_ids": INPUT_IDS,
            "attention_mask": ATTENTION_MASK,
            "position_ids": POSITION_IDS,
            "past_key_names": PAST.format(i="%d", kind="key"),
            "past_value_names": PAST.format(i="%d", kind="value"),
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": PRESENT.format(i="%d", kind="key"),
            "present_value_names": PRESENT.format(i="%d", kind="value"),
        },
    }
    return {
        "model": {
            "type": genai_model_type(graph),
            "context_length": context,
            "vocab_size": vocab,
            **ids,
            "decoder": decoder,
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "max_length": length,
            "past_present_share_buffer": False,
        },
    }


def write_genai_config(graph: Graph, layout: CacheLayout, folder: Path, *, filename: str = MODEL_FILE,
                       max_length: int | None = None,
                       token_ids: TokenIds | None = None,
                       tokenizer_files: Mapping[str, bytes] | None = None) -> list[Path]:
    """Write `folder/genai_config.json` (see `genai_config`) and the `tokenizer_files` given (name ->
    bytes, e.g. tokenizer.json, tokenizer_config.json) beside it; the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = genai_config(graph, layout, filename=filename, max_length=max_length, token_ids=token_ids)
    path = folder / GENAI_CONFIG_FILE
    path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    written = [path]
    for name, data in (tokenizer_files or {}).items():
        if Path(name).name != name or name in (GENAI_CONFIG_FILE, filename):
            raise GenaiConfigError(f"tokenizer file {name!r}: give a plain file name, not a path or one of "
                                   "the model's files")
        (folder / name).write_bytes(data)
        written.append(folder / name)
    return written
