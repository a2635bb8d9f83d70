"""PaddleSlim's QAT config: the `Compress.Quantization` section and its `skip_tensor_map`.

PaddleFleetX's GPT reads `Compress.Quantization` from its YAML and hands `skip_tensor_map`
(`block_N: [linear1, linear2]`, N the 0-based decoder layer) to the layer it builds; the linears
named there stay float during QAT. Here a name is a linear's module path after `layers.N.`:
GPT's `linear1` / `linear2` (PaddleFleetX's own names) and `self_attn.qkv_proj`, ERNIE's
`self_attn.qkv_proj`, `mlp.down_proj`, `mlp.experts.up_gate_proj` (a layer's routed experts).

One home for both directions, so what `sensitivity --skip-top` writes is what `compile
--quant-config` reads: `skip_entry` turns a module path into its (block, name), `skip_matches`
says whether a (block, name) names a path (`QuantConfig.decide` asks it), and
`quantization_section` writes the section that `QuantConfig.from_dict` reads back. Plain data on
the IR core alone, like `quant_spec` (which imports this module, never the other way).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ErnieIRError

QUANTIZABLE_LAYER_TYPES = ("Linear", "ColumnParallelLinear", "RowParallelLinear")
"""PaddleSlim's `quantizable_layer_type` in PaddleFleetX's GPT QAT configs."""

_LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)")


class SkipMapError(ErnieIRError):
    """A linear that `skip_tensor_map` cannot name (it is in no decoder layer)."""


def skip_entry(path: str) -> tuple[str, str]:
    """A linear's module path as its `skip_tensor_map` entry:
    `gpt.decoder.layers.3.linear2` -> ("block_3", "linear2"),
    `ernie.layers.1.mlp.experts.up_gate_proj` -> ("block_1", "mlp.experts.up_gate_proj").

    The name is the whole path after the (last) `layers.N.`, so it names that linear and no
    other (a bare `up_gate_proj` would name the routed and the shared experts' alike)."""
    m = _LAYER.fullmatch(path)
    if m is None:
        raise SkipMapError(f"{path} is in no decoder layer (no layers.N. in its path): skip_tensor_map "
                           "names a layer's linears only; keep it float with an ignore pattern instead")
    return f"block_{int(m.group(1))}", m.group(2)


def skip_matches(block: str, name: str, path: str) -> bool:
    """Whether the `skip_tensor_map` entry `block: [name]` names the linear at `path`: `name` is
    the end of its path inside layer N (`linear2`, or `self_attn.qkv_proj` or just `qkv_proj`)."""
    layer = block.split("_", 1)[1]
    return re.fullmatch(rf".*layers\.{layer}\.(.*\.)?{re.escape(name)}", path) is not None


def skip_tensor_map(paths: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The `skip_tensor_map` that names exactly these linears: blocks in layer order, names in
    the order given. SkipMapError (one line) for a path in no decoder layer."""
    out: dict[str, list[str]] = {}
    for path in paths:
        block, name = skip_entry(path)
        if name not in out.setdefault(block, []):
            out[block].append(name)
    return {b: tuple(out[b]) for b in sorted(out, key=lambda b: int(b.split("_", 1)[1]))}


def read_skip_tensor_map(value: Any, source: str,
                         error: type[ErnieIRError] = SkipMapError) -> dict[str, tuple[str, ...]]:
    """A `skip_tensor_map` as a PaddleSlim file gives it: block_N -> a list of names (a single
    name, as PaddleFleetX's `in` test takes it, is a list of one; nothing or null: none).
    `error` (one line; the reader's own error class) for anything else; the block_N keys are
    the config's to check."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise error(f"{source}: skip_tensor_map maps block_N to linear names (block_3: [linear2]), "
                           f"not a {type(value).__name__}")
    out: dict[str, tuple[str, ...]] = {}
    for block, names in value.items():
        names = [] if names is None else [names] if isinstance(names, str) else names
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise error(f"{source}: skip_tensor_map {block}: give a list of linear names "
                               "([linear1, linear2])")
        out[str(block)] = tuple(names)
    return out


def quantization_section(qat: Mapping[str, Any], freeze_embedding: bool,
                         skip: Mapping[str, Iterable[str]]) -> dict[str, Any]:
    """`{"Compress": {"Quantization": {...}}}` as PaddleFleetX's GPT QAT configs write it.

    `qat`: one QAT rule's fields (`QuantSpec.annotation()` of an `algo: qat` spec);
    `skip`: block_N -> names (`skip_tensor_map`)."""
    section: dict[str, Any] = {"enable": True}
    for key in ("weight_quantize_type", "activation_quantize_type"):
        section[key] = qat[key]
    section["weight_preprocess_type"] = None
    for key in ("activation_preprocess_type", "weight_bits", "activation_bits"):
        section[key] = qat[key]
    section["quantizable_layer_type"] = list(QUANTIZABLE_LAYER_TYPES)
    section["onnx_format"] = True
    section["freeze_embedding"] = bool(freeze_embedding)
    for key in ("round_type", "moving_rate"):  # beyond PaddleFleetX's files: they keep the rule exact
        if key in qat:
            section[key] = qat[key]
    section["skip_tensor_map"] = {block: list(names) for block, names in skip.items()}
    return {"Compress": {"Quantization": section}}
