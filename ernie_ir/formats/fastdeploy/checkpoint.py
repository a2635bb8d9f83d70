"""FastDeploy's pre-quantized, pre-sharded checkpoint: the tensor names and layouts FastDeploy
reads, config.json in its Paddle form and `quantization_config`, written and read back
(REFERENCE.md section 8), and the published float checkpoint of a graph.

    config.json                the source config.json + `quantization_config`
                               ({quantization, dense_quant_type, moe_quant_type, is_quantized: true,
                               is_permuted: true}) and `ernie_ir` {cuda_arch, format}
    tokenizer files            copied from the source folder when present
    rank{r}/model.safetensors  a relative symlink to rank{r}/weights.safetensors: the rank
                               weights already hold FastDeploy's key names, dtypes and per-rank
                               shapes (`<layer>.quant_weight` int8 [out, in] / [out/2, in] in
                               Paddle's arch-permuted layout, `<layer>.weight_scale` [out] bf16,
                               per-expert keys), so the bytes are stored once
    model.safetensors (tp 1)   a relative symlink to rank0/weights.safetensors

`quantization_config` is written from what the quant passes recorded, not guessed from the
weights: the resolved `QuantConfig` (`graph.metadata["quantization"]`, `ernie_ir.ir.quant_spec`)
and each weight's decision under it, and the w4a8c8 and wint2 passes' records. The writer
refuses where a record is missing or the rank weights are not what FastDeploy reads.

`load_fastdeploy_checkpoint(folder)` reads such a folder back (any writer): each rank's tensors
dequantized to float32 in the IR's logical layout, and `merge_ranks` joins them into the
published (unsharded) layout, following the cuts FastDeploy's split functions make (REFERENCE.md
section 5); a bf16 folder (`is_quantized: false`, the form `fastdeploy.on_grid` writes) reads
as it is stored.

The unquantized form is the published checkpoint itself: `config.json` without
`quantization_config`, `model.safetensors` in the published Paddle layout (`ernie.` keys, weights
[in, out], fused qkv [Q | K | V] and up_gate [gate | up], one key per routed expert, the router
and correction bias fp32, every tensor in its own dtype) and the tokenizer files.
`published_tensors` names a float graph's params that way and `write_checkpoint_files` writes the
folder; `write_float_checkpoint` writes a FastDeploy folder read back the same way.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ernie_ir.ir import ErnieIRError, Graph, Param
from ernie_ir.ir.mapping import Mapping
from ernie_ir.ir.quant_spec import (
    ANNOTATION_KEY,
    RECORD_KEY,
    Algo,
    QuantConfigError,
    recorded_config,
    recorded_spec,
)
from ernie_ir.ir.storage import WEIGHTS_FILE
from ernie_ir.ir.weights import WeightSource
from ernie_ir.ops.cuda_layout import DEFAULT_CUDA_ARCH, unpack
from ernie_ir.ops.fastdeploy_experts import unpack_int4_rows_array, w4a8_float_weight
from ernie_ir.ops.moe_w4a8 import FASTDEPLOY_INT4_FACTOR, hadamard_blocks
from ernie_ir.ops.wint2 import wint2_dequantize

FASTDEPLOY_KEY = "fastdeploy_layout"
"""On a per-expert param in one of FastDeploy's routed-expert layouts (cuda's W4A8 and WINT2
experts, which cuda's legalization writes): {"format": "w4a8" | "wint2", "logical": [K, N]}."""
FD_WEIGHTS = "model.safetensors"
CONFIG = "config.json"
ARCHITECTURES = ("Ernie4_5_ForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM",
                 "Ernie4_5MoeForCausalLM")
"""ERNIE 4.5 as the published Paddle checkpoints, transformers and paddleformers spell it (FastDeploy
accepts each: its `ErnieArchitectures`)."""
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "generation_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "chat_template.json", "chat_template.jinja")
_LINEAR = re.compile(r".*\.(self_attn\.(qkv|o)_proj|mlp\.(up_gate|down)_proj|"
                     r"mlp\.shared_experts\.(up_gate|down)_proj|mlp\.experts\.\d+\.(up_gate|down)_proj)$")
_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.")
_KV_SCALE = re.compile(r".*\.self_attn\.cache[kv]_matmul\.activation_scale$")
_BITS = {"wint8": 8, "wint4": 4}
FASTDEPLOY_HADAMARD_BLOCK = 128
"""FastDeploy's w4a8 `hadamard_block_size` (its default; the config records it)."""


class FastDeployError(ErnieIRError):
    """A folder that is not a FastDeploy pre-quantized checkpoint ernie-ir can read."""


def is_ernie45(graph: Graph) -> bool:
    return graph.metadata.get("architecture") in ARCHITECTURES


def quantization_config(ranks: Sequence[Graph], mapping: Mapping | None = None) -> dict[str, Any]:
    """FastDeploy's `quantization_config` for these rank graphs, written from what the quant passes
    recorded, not guessed from the weights' names: the resolved `QuantConfig` quant-annotate
    applied (`graph.metadata["quantization"]`) and each packed weight's decision under it (its
    `quant` annotation: weight-only int8 / int4 -> wint8 / wint4), the w4a8c8 pass's record
    (`graph.metadata["w4a8c8"]`: W4A8 experts, the C8 KV cache, the Hadamard block) and the wint2
    pass's (`graph.metadata["wint2"]`: the layer split). The rank weights are checked against
    what FastDeploy loads (its key names, Paddle's packed layouts, cuda's per-expert layouts) and
    against the records. FastDeployError (one line) names the first thing FastDeploy would not
    load, or the record that is missing.

    Weight-only (wint8 / wint4 / mix_quant), W4A8C8 (`mix_quant` with `moe_quant_type: w4a8` and
    `kv_cache_quant_type: int8`, the w4a8c8 preset) and WINT2 (`quantization: wint2`, `moe_quant_type:
    w4w2` with the w4 / w2 layer ranges, the wint2 preset); docs/quantization.md 4.5."""
    if mapping is not None and mapping.ep > 1:
        raise FastDeployError(f"expert parallelism (ep {mapping.ep}): FastDeploy's pre-sharded loader "
                              "reads TP-only rank folders (compile with --tp N alone)")
    graph = ranks[0]
    try:
        recorded = recorded_config(graph.metadata)
    except QuantConfigError as e:
        raise FastDeployError(str(e)) from None
    dense: set[str] = set()  # FastDeploy types of the dense linears' recorded decisions
    moe: set[str] = set()  # ... and of the weight-only routed experts'
    layouts: set[str] = set()  # FastDeploy expert layouts the weights are in: w4a8, wint2
    kv_scales = False
    floats: list[str] = []
    for g in ranks:
        for p in g.params.values():
            name = p.name
            if name.endswith(".quant_weight"):
                fd = p.annotations.get(FASTDEPLOY_KEY)
                if fd is not None:
                    layouts.add(str(fd["format"]))
                    continue
                layout = p.annotations.get("cuda_layout")
                if layout is None:
                    raise FastDeployError(f"{name} {list(p.type.shape)} is not in Paddle's packed cuda "
                                          "layout (its shape has none for this arch), which FastDeploy's "
                                          "weight_only_linear reads: use --cuda-arch 70 or sizes that are "
                                          "multiples of 64")
                (moe if _EXPERT.match(name) else dense).add(_weight_only_type(p, int(layout["bits"])))
            elif name.endswith((".weight_scale", ".super_scales", ".code_scale", ".code_zp")):
                continue
            elif name.endswith(".activation_scale"):
                if _KV_SCALE.match(name):
                    kv_scales = True
                elif not _EXPERT.match(name):
                    raise FastDeployError(f"{name}: an activation scale FastDeploy has no key for")
            elif name.endswith((".weight", ".bias", ".e_score_correction_bias")):
                if name.endswith(".weight") and _LINEAR.match(name[: -len(".weight")]):
                    floats.append(name)
            else:
                raise FastDeployError(f"{name} is not a weight FastDeploy loads (LoRA, QAT or FP8 "
                                      "params, or W4A8 / WINT2 experts without cuda's per-expert "
                                      "layout): compile without them")
    if recorded is None:
        if dense or moe or layouts or kv_scales:
            raise FastDeployError("the weights are quantized but the graph records no quantization "
                                  f"config (graph.metadata[{RECORD_KEY!r}], which quant-annotate writes), "
                                  "the record FastDeploy's quantization_config is written from: quantize "
                                  "with --quant")
        raise FastDeployError("the model is not quantized (it records no quantization config): FastDeploy "
                              "serves the source checkpoint itself (quantizing and splitting at load)")
    if not dense and not moe and not layouts:
        raise FastDeployError(f"the model is not quantized (the recorded quantization {recorded.name!r} "
                              "quantizes no weight): FastDeploy serves the source checkpoint itself")
    if floats:
        raise FastDeployError(f"{floats[0]} stays float under the recorded quantization {recorded.name!r} "
                              "while FastDeploy quantizes every linear of a quantized model: use --quant "
                              "wint8, wint4, wint8mix, w4a8c8 or wint2")
    if len(dense) > 1 or len(moe) > 1:
        raise FastDeployError("mixed int4/int8 dense (or expert) weights: FastDeploy takes one type "
                              "for dense linears and one for experts")
    d = next(iter(dense)) if dense else None
    m = next(iter(moe)) if moe else None
    passes = _expert_records(graph, layouts)
    kv = (passes.get("w4a8") or {}).get("kv_cache_quant_type") == "int8"
    if kv_scales != kv:
        raise FastDeployError("the KV cache scales (cachek/cachev_matmul.activation_scale) and the w4a8c8 "
                              "record (graph.metadata['w4a8c8'].kv_cache_quant_type) disagree on an int8 "
                              "KV cache: compile with --quant w4a8c8")
    if passes:
        return _w4a8_or_wint2(passes, d, m, kv)
    if m is None or (d == m and m == "wint8"):
        kind = d or m or ""
        return {"quantization": kind, "is_quantized": True, "is_permuted": True}
    # any int4 experts: mix_quant, both types explicit (FastDeploy turns a bare wint4 on ERNIE MoE
    # into dense wint8 + experts wint4)
    return {"quantization": "mix_quant", "dense_quant_type": d or m, "moe_quant_type": m,
            "is_quantized": True, "is_permuted": True}


_FD_WEIGHT_ONLY = {Algo.WEIGHT_ONLY_INT8: "wint8", Algo.WEIGHT_ONLY_INT4: "wint4"}
"""FastDeploy's weight-only type for each recorded algorithm its pre-quantized loader reads."""
_EXPERT_RECORDS = {"w4a8": "w4a8c8", "wint2": "wint2"}
"""FastDeploy expert layout -> the pass that makes it, which records itself in graph.metadata[pass]
(and the --quant preset that runs it)."""


def _weight_only_type(p: Param, bits: int) -> str:
    """FastDeploy's type (wint8 / wint4) of a packed weight, from its recorded decision."""
    try:
        spec = recorded_spec(p.annotations)
    except QuantConfigError as e:
        raise FastDeployError(f"{p.name}: {e}") from None
    if spec is None:
        raise FastDeployError(f"{p.name} is quantized but records no decision (its {ANNOTATION_KEY!r} "
                              "annotation, which quant-annotate writes), the record FastDeploy's "
                              "quantization_config is written from: quantize with --quant")
    kind = _FD_WEIGHT_ONLY.get(spec.algo)
    if kind is None:
        raise FastDeployError(f"{p.name}: recorded as {spec.algo}, which FastDeploy's pre-quantized "
                              "checkpoints do not hold (weight-only wint8 / wint4 here)")
    if spec.group_size != -1:
        raise FastDeployError(f"{p.name}: group-wise scales (group {spec.group_size}); FastDeploy's "
                              "wint8/wint4 checkpoints are per output channel")
    if spec.algo.bits != bits:
        raise FastDeployError(f"{p.name}: recorded as {spec.algo} but packed as {bits}-bit")
    return kind


def _expert_records(graph: Graph, layouts: set[str]) -> dict[str, dict[str, Any]]:
    """FastDeploy expert layout (w4a8, wint2) -> its pass's record, for every pass the graph
    records; each must have its weights in that layout (`layouts`), and each layout a record."""
    records: dict[str, dict[str, Any]] = {}
    for layout, key in _EXPERT_RECORDS.items():
        record = graph.metadata.get(key)
        if isinstance(record, dict):
            records[layout] = record
        elif layout in layouts:
            raise FastDeployError(f"{layout} experts, but the graph records no {key} pass (graph.metadata"
                                  f"[{key!r}]), the record FastDeploy's quantization_config is written "
                                  f"from: compile with --quant {key}")
    unlaid = sorted(set(records) - layouts)
    if unlaid:
        raise FastDeployError(f"the {_EXPERT_RECORDS[unlaid[0]]} record names {unlaid[0]} experts, but no "
                              "weight is in cuda's per-expert FastDeploy layout for them")
    return records


def _w4a8_or_wint2(records: dict[str, dict[str, Any]], dense: str | None, w4: str | None,
                   kv: bool) -> dict[str, Any]:
    """The config of W4A8(C8) or WINT2 rank graphs, from their pass's record (`records`: FastDeploy
    expert layout -> record)."""
    if len(records) > 1:
        raise FastDeployError(f"both {' and '.join(sorted(records))} experts: FastDeploy takes one")
    if dense != "wint8":
        raise FastDeployError(f"{next(iter(records))} experts with {dense or 'float'} dense linears: "
                              "FastDeploy's checkpoints of these presets have wint8 dense linears")
    if "w4a8" in records:
        if w4 is not None:
            raise FastDeployError("W4A8 experts beside weight-only experts: FastDeploy's mix_quant takes "
                                  "one expert type")
        block = records["w4a8"].get("hadamard_block_size")
        if block != FASTDEPLOY_HADAMARD_BLOCK:
            raise FastDeployError(f"W4A8 experts with hadamard_block {block}: FastDeploy's w4a8 kernel "
                                  f"rotates the down_proj input in blocks of {FASTDEPLOY_HADAMARD_BLOCK} "
                                  "(the expert intermediate size must be a multiple of 128 per rank)")
        out: dict[str, Any] = {"quantization": "mix_quant", "dense_quant_type": "wint8",
                               "moe_quant_type": "w4a8"}
        if kv:
            out.update(kv_cache_quant_type="int8", is_channel_wise=True, has_zero_point=False)
        out.update(hadamard_block_size=FASTDEPLOY_HADAMARD_BLOCK, is_quantized=True, is_permuted=True)
        return out
    meta = records["wint2"]
    if kv:
        raise FastDeployError("2-bit experts with an int8 KV cache: FastDeploy's WINT2 checkpoints keep "
                              "the KV cache float (compile with --quant wint2 alone)")
    if w4 not in (None, "wint4"):
        raise FastDeployError(f"WINT2 with {w4} experts in the early MoE layers: FastDeploy's w4 layers "
                              "are wint4")
    try:
        w4_layers = (int(meta["w4_start_layer"]), int(meta["w4_end_layer"]))
        w2_layers = (int(meta["w2_start_layer"]), int(meta["w2_end_layer"]))
        group = int(meta["group_size"])
    except (KeyError, TypeError, ValueError):
        raise FastDeployError("graph.metadata['wint2'] lacks the layer split (w4/w2_start/end_layer, "
                              "group_size) the wint2 pass records: compile with --quant wint2") from None
    return {"quantization": "wint2", "dense_quant_type": "wint8", "dense_quant_config": "wint8",
            "moe_quant_type": "w4w2",
            "moe_quant_config": {
                "quant_type": "w4w2",
                "moe_w4_quant_config": {"quant_type": "wint4", "quant_granularity": "per_channel",
                                        "quant_start_layer": w4_layers[0], "quant_end_layer": w4_layers[1]},
                "moe_w2_quant_config": {"quant_type": "wint2", "quant_granularity": "pp_acc",
                                        "quant_group_size": group,
                                        "quant_start_layer": w2_layers[0], "quant_end_layer": w2_layers[1]}},
            "is_quantized": True}


def source_config(model: str, graph: Graph) -> dict[str, Any]:
    """The source model's config.json (a folder's file as written; a built-in: the resolved config)."""
    path = Path(model) / CONFIG
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None
        if isinstance(data, dict):
            return data
    return dict(graph.metadata.get("config") or {})


SERVE_TP1 = "--load-choices default"
"""What FastDeploy needs to serve a one-rank pre-quantized folder: its default v1 loader stops on
every pre-quantized non-FP8 checkpoint read from the top level (`UnboundLocalError:
fd_suffix_map`, model_executor/utils.py `rename_offline_ckpt_suffix_to_fd_suffix`); the v0 loader
(`--load-choices default`) reads it."""

TORCH_FORMAT_AFTER = (4, 56, 0)
"""FastDeploy reads a config.json with `dtype` and a `transformers_version` above this as a torch
checkpoint (fastdeploy/config.py, `ModelConfig.read_model_config`: transformers 4.56 renamed
`torch_dtype` to `dtype`)."""


def paddle_form(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as FastDeploy reads a Paddle checkpoint's config.json (fastdeploy/config.py,
    `ModelConfig.read_model_config`): `dtype` and no `torch_dtype` (alone it means a Hugging Face
    torch checkpoint, whose offline quantization FastDeploy takes only as block-wise FP8; both
    keys are an error), and no `transformers_version` above 4.56.0 (with it, `dtype` is read as
    torch format too). Every other key stays, in its place; `torch_dtype` becomes `dtype` where
    it stood. A published ERNIE 4.5 `-Paddle` config carries `dtype` and no transformers version."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key == "torch_dtype":
            if "dtype" not in config:
                out["dtype"] = value
        elif key == "transformers_version" and _version(value) > TORCH_FORMAT_AFTER:
            continue
        else:
            out[key] = value
    out.setdefault("dtype", "bfloat16")
    return out


def _version(value: Any) -> tuple[int, ...]:
    """The leading numbers of a version string ("5.0.0.dev0" -> (5, 0, 0)); () for anything else."""
    parts: list[int] = []
    for piece in str(value).split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def write_fastdeploy(root: Path, ranks: Sequence[Graph], config: dict[str, Any], quant: dict[str, Any],
                     arch: int, source_folder: Path | None = None) -> list[str]:
    """Write the FastDeploy files into the artifact folder `root` (its rank{r}/weights.safetensors
    already written); returns the files written."""
    cfg = {k: v for k, v in paddle_form(config).items() if k != "quantization_config"}
    cfg["quantization_config"] = quant
    cfg["ernie_ir"] = {"format": "fastdeploy-prequantized", "cuda_arch": arch,
                       "tensor_parallel_size": len(ranks)}
    (root / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    written = [CONFIG, *copy_tokenizer_files(source_folder, root)]
    for r in range(len(ranks)):
        link = root / f"rank{r}" / FD_WEIGHTS
        if not (root / f"rank{r}" / WEIGHTS_FILE).is_file():
            raise FastDeployError(f"rank{r}/{WEIGHTS_FILE} is missing: no weights to serve")
        os.symlink(WEIGHTS_FILE, link)
        written.append(f"rank{r}/{FD_WEIGHTS}")
    if len(ranks) == 1:
        # One rank folder is not pre-sharded to FastDeploy (load_weight_utils.is_pre_sliced_weight
        # wants more than one): it reads the top level, so the rank weights are linked there too
        # (never a second copy of the bytes). Served with `--load-choices default` (SERVE_TP1).
        os.symlink(f"rank0/{WEIGHTS_FILE}", root / FD_WEIGHTS)
        written.append(FD_WEIGHTS)
    return written


def copy_tokenizer_files(source_folder: Path | None, root: Path) -> list[str]:
    """Copy the tokenizer files (TOKENIZER_FILES) of `source_folder` into `root`, as they are;
    returns their names ([] without a source folder)."""
    written: list[str] = []
    if source_folder is not None and source_folder.is_dir():
        for name in TOKENIZER_FILES:
            f = source_folder / name
            if f.is_file():
                shutil.copyfile(f, root / name)
                written.append(name)
    return written


# -- reading a FastDeploy checkpoint back ----------------------------------------------------------

@dataclass
class FastDeployCheckpoint:
    """A pre-quantized, pre-sharded FastDeploy folder, dequantized.

    `ranks[r]`: name -> array in the IR's logical layout: a quantized linear's `<layer>.weight`
    [in, out] float32 = unpacked int values x scale (exact in float32, as Paddle's dequantize);
    a W4A8 expert's the float weight it stands for (`w4a8_float_weight`, a down_proj turned back
    from the Hadamard basis); a 2-bit expert's its WINT2 decode (`wint2_dequantize`, float32);
    every other tensor as stored (bf16 as ml_dtypes.bfloat16, the router float32)."""

    config: dict[str, Any]
    quantization: dict[str, Any]
    ranks: list[dict[str, np.ndarray]] = field(default_factory=list)
    scales: list[dict[str, np.ndarray]] = field(default_factory=list)
    """Per rank, the static activation scales (`*.activation_scale`: W4A8 experts' input scales,
    the C8 KV cache's per-channel abs-maxes) as float32, kept out of the float weights."""

    @property
    def tp(self) -> int:
        return len(self.ranks)


def rank_folders(folder: Path) -> list[Path]:
    """rank0 .. rank{N-1}: the tensor-parallel degree is their number (FastDeploy's rule)."""
    found = sorted((p for p in folder.glob("rank*") if p.is_dir() and p.name[4:].isdigit()),
                   key=lambda p: int(p.name[4:]))
    if [p.name for p in found] != [f"rank{r}" for r in range(len(found))]:
        raise FastDeployError(f"{folder}: rank folders {[p.name for p in found]} are not rank0..rank{{N-1}}")
    return found


def load_fastdeploy_checkpoint(folder: str | os.PathLike[str], *, cuda_arch: int | None = None,
                               expert_dtype: str = "float32") -> FastDeployCheckpoint:
    """Read `folder` as FastDeploy does (config.json, rank{r}/model.safetensors) and dequantize.

    `cuda_arch`: the layout of the packed bytes (default: config.json's `ernie_ir.cuda_arch`, else 80).
    `expert_dtype` "bf16": routed experts' dequantized weights rounded to bfloat16, as the
    artifact's portable MoE path does (it dequantizes expert stacks to the activation dtype), so
    the rebuilt float model reproduces the artifact's logits; "float32": exact q x scale.
    """
    if expert_dtype not in ("float32", "bf16"):
        raise FastDeployError(f"expert_dtype {expert_dtype!r}: choose float32 or bf16")
    from ernie_ir.ir.weights import SafetensorsFile

    root = Path(folder)
    cfg_path = root / CONFIG
    if not cfg_path.is_file():
        raise FastDeployError(f"{root} has no {CONFIG}: not a FastDeploy checkpoint")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise FastDeployError(f"{cfg_path} is not valid JSON") from None
    quant = config.get("quantization_config") or {}
    if not quant.get("is_quantized"):
        return _read_bf16_folder(root, config, quant, cfg_path)
    dense, moe = _reader_types(quant, cfg_path)
    block = int(quant.get("hadamard_block_size", FASTDEPLOY_HADAMARD_BLOCK))
    arch = cuda_arch or int((config.get("ernie_ir") or {}).get("cuda_arch", DEFAULT_CUDA_ARCH))
    folders = rank_folders(root)
    if not folders:
        raise FastDeployError(f"{root} has no rank0/ folder: not pre-sharded")
    out = FastDeployCheckpoint(config=config, quantization=quant)
    for rdir in folders:
        path = rdir / FD_WEIGHTS
        if not path.is_file():
            raise FastDeployError(f"{rdir}/{FD_WEIGHTS} is missing")
        tensors: dict[str, np.ndarray] = {}
        scales: dict[str, np.ndarray] = {}
        f = SafetensorsFile(path)
        keys = set(f.keys())
        for key in sorted(keys):
            if key.endswith(_AUX_SUFFIXES):
                continue
            if key.endswith(".activation_scale"):
                scales[key] = np.asarray(f.read(key), dtype=np.float32)
                continue
            if not key.endswith(".quant_weight"):
                tensors[key] = np.asarray(f.read(key))
                continue
            prefix = key[: -len(".quant_weight")]
            scale_key = prefix + ".weight_scale"
            if scale_key not in keys:
                raise FastDeployError(f"{path}: {key} has no {scale_key}")
            expert = _EXPERT.match(key) is not None
            if expert and moe == "w4a8":
                w = _read_w4a8(f, path, prefix, keys, block)
            elif expert and moe == "w4w2" and prefix + ".super_scales" in keys:
                w = _read_wint2(f, path, prefix, keys)
            else:
                bits = _BITS["wint4" if expert and moe == "w4w2" else moe if expert else dense]
                packed = f.read(key)
                scale = np.asarray(f.read(scale_key), dtype=np.float32)
                n = packed.shape[0] * (1 if bits == 8 else 2)
                k = packed.shape[1]
                if packed.dtype != np.int8 or scale.shape != (n,):
                    raise FastDeployError(f"{path}: {key} {packed.dtype}{list(packed.shape)} with "
                                          f"{scale_key} {list(scale.shape)} is not int8 [out(/2), in] "
                                          f"with [out] scales")
                w = unpack(packed, k, n, bits, arch).astype(np.float32) * scale[None, :]
            if expert_dtype == "bf16" and expert:
                w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
            tensors[prefix + ".weight"] = w
        out.ranks.append(tensors)
        out.scales.append(scales)
    return out


def _read_bf16_folder(root: Path, config: dict[str, Any], quant: dict[str, Any],
                      cfg_path: Path) -> FastDeployCheckpoint:
    """A folder FastDeploy quantizes at load (`is_quantized` false: the bf16 form of
    `fastdeploy.on_grid`): its top-level weights as stored, one rank."""
    from ernie_ir.ir.weights import SafetensorsFile

    path = root / FD_WEIGHTS
    if not quant or not path.is_file():
        raise FastDeployError(f"{cfg_path}: quantization_config.is_quantized is not true and there is no "
                              f"top-level {FD_WEIGHTS} quantized at load: not a FastDeploy checkpoint "
                              "ernie-ir reads")
    f = SafetensorsFile(path)
    return FastDeployCheckpoint(config=config, quantization=quant,
                                ranks=[{k: np.asarray(f.read(k)) for k in sorted(f.keys())}], scales=[{}])


WINT2_SUFFIXES = (".quant_weight", ".weight_scale", ".super_scales", ".code_scale", ".code_zp")
"""A 2-bit expert projection's keys (REFERENCE 14)."""
_AUX_SUFFIXES = WINT2_SUFFIXES[1:]
"""Keys read with their layer's quant_weight."""


def _reader_types(quant: dict[str, Any], cfg_path: Path) -> tuple[str, str]:
    """(dense type, expert type) of a quantization_config: wint8 / wint4, experts also w4a8
    (mix_quant) or w4w2 (wint2: wint4 experts up to the w4 end layer, 2-bit after)."""
    kind = quant.get("quantization")
    if kind == "mix_quant":
        dense, moe = quant.get("dense_quant_type"), quant.get("moe_quant_type")
    elif kind == "wint2":
        dense = quant.get("dense_quant_type") or quant.get("dense_quant_config") or "wint8"
        moe = "w4w2"
    else:
        dense = moe = kind
    if dense not in _BITS or (moe not in _BITS and moe not in ("w4a8", "w4w2")):
        raise FastDeployError(f"{cfg_path}: quantization {kind!r} ({dense}/{moe}) is not weight-only "
                              "wint8/wint4, W4A8 or WINT2: ernie-ir reads only those")
    return str(dense), str(moe)


def _read_w4a8(f: Any, path: Path, prefix: str, keys: set[str], block: int) -> np.ndarray:
    """The float weight [K, N] a W4A8 expert projection stands for (`w4a8_float_weight` of its
    int4 values, its accumulator scale = the stored in-memory weight_scale x 16 and its input
    scale = activation_scale); a down_proj is turned back from the Hadamard basis it is stored in."""
    act_key = prefix + ".activation_scale"
    if act_key not in keys:
        raise FastDeployError(f"{path}: W4A8 expert {prefix} has no {act_key}")
    packed = np.asarray(f.read(prefix + ".quant_weight"))
    scale = np.asarray(f.read(prefix + ".weight_scale"))
    in_scale = np.asarray(f.read(act_key), dtype=np.float32)
    if packed.dtype != np.int8 or packed.ndim != 2 or scale.shape != (packed.shape[1],) or in_scale.size != 1:
        raise FastDeployError(f"{path}: W4A8 expert {prefix}: quant_weight {packed.dtype}"
                              f"{list(packed.shape)}, weight_scale {list(scale.shape)}, activation_scale "
                              f"{list(in_scale.shape)} are "
                              "not int8 [K/2, N], [N] and one scalar")
    acc = scale.astype(np.float32) * np.float32(FASTDEPLOY_INT4_FACTOR)
    w = w4a8_float_weight(unpack_int4_rows_array(packed), acc, in_scale.reshape(()))
    if prefix.endswith("down_proj") and block and w.shape[0] % block == 0:
        w = hadamard_blocks(w, block, axis=-2)
    return w


def _read_wint2(f: Any, path: Path, prefix: str, keys: set[str]) -> np.ndarray:
    """A 2-bit expert projection decoded (FastDeploy's WINT2 formula, ernie_ir/ops/wint2.py)."""
    parts = [prefix + s for s in WINT2_SUFFIXES]
    missing = [k for k in parts if k not in keys]
    if missing:
        raise FastDeployError(f"{path}: WINT2 expert {prefix} has no {missing[0]}")
    qw, ws, ss, cs, zp = (np.asarray(f.read(k)) for k in parts)
    try:
        return wint2_dequantize(qw, ws, ss.astype(np.float32), cs, zp)
    except ValueError as e:
        raise FastDeployError(f"{path}: WINT2 expert {prefix}: {e}") from None


def merge_ranks(ckpt: FastDeployCheckpoint) -> dict[str, np.ndarray]:
    """The published (unsharded, [in, out]) tensors of a checkpoint's ranks.

    Inverse of FastDeploy's cuts (REFERENCE.md 5): qkv columns [Q_r | K_r | V_r] per rank (KV heads
    replicated in groups of tp / nkv when nkv < tp), up_gate [gate_r | up_r] (naive 2-fuse, also per
    expert and for shared experts), row-parallel o_proj / down_proj rows, vocabulary rows of the
    embedding, lm_head columns; norms, router and correction bias from rank 0."""
    cfg, tp = ckpt.config, ckpt.tp
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh)
    first = ckpt.ranks[0]
    merged: dict[str, np.ndarray] = {}
    for name in first:
        parts = [r[name] for r in ckpt.ranks]
        if tp == 1:
            merged[name] = parts[0]
        elif name.endswith("self_attn.qkv_proj.weight"):
            q_r = nh // tp * hd
            kv_r = (nkv // tp if nkv >= tp else 1) * hd
            qs = [p[:, :q_r] for p in parts]
            ks = [p[:, q_r:q_r + kv_r] for p in parts]
            vs = [p[:, q_r + kv_r:] for p in parts]
            group = 1 if nkv >= tp else tp // nkv
            merged[name] = np.concatenate(qs + ks[::group] + vs[::group], axis=1)
        elif name.endswith("up_gate_proj.weight"):
            half = parts[0].shape[1] // 2
            merged[name] = np.concatenate([p[:, :half] for p in parts] + [p[:, half:] for p in parts], axis=1)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight")):
            merged[name] = np.concatenate(parts, axis=0)
        elif name.endswith("lm_head.weight"):
            merged[name] = np.concatenate(parts, axis=1)
        else:
            merged[name] = parts[0]
    return merged


def write_float_checkpoint(ckpt: FastDeployCheckpoint, out: str | os.PathLike[str]) -> Path:
    """A checkpoint folder (config.json without quantization_config + model.safetensors in the
    published layout: dequantized linears float32, the rest as stored) of the merged weights:
    `ernie-ir run OUT` runs it."""
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    write_checkpoint_files(dest, ckpt.config, merge_ranks(ckpt).items())
    return dest


# -- the published float checkpoint of a graph -----------------------------------------------------

_STACKED_EXPERTS = re.compile(r"(?P<head>.+\.mlp\.experts)\.(?P<tail>(up_gate|down)_proj\.weight)$")
_PUBLISHED_SUFFIXES = (".weight", ".bias", ".e_score_correction_bias")


class _StackSlice(WeightSource):
    """Expert `index` of a stacked [E, ...] source. The E slices of one stack share one read of it
    (a merged stack is computed once, not once per expert), dropped when the last slice is read."""

    def __init__(self, shared: _SharedStack, index: int) -> None:
        self.shared, self.index = shared, index
        self.dtype = shared.source.dtype
        self.shape = tuple(shared.source.shape[1:])

    def read(self) -> np.ndarray:
        return self.shared.take(self.index)

    def describe(self) -> str:
        return f"expert {self.index} of {self.shared.source.describe()}"


class _SharedStack:
    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.left = set(range(source.shape[0]))
        self.array: np.ndarray | None = None
        self.lock = threading.Lock()

    def take(self, index: int) -> np.ndarray:
        with self.lock:
            array = self.array if self.array is not None else np.asarray(self.source.read())
            self.left.discard(index)
            self.array = array if self.left else None
            return np.array(array[index])


def published_tensors(graph: Graph) -> list[tuple[str, WeightSource]]:
    """(key, source) of every param of a float ERNIE 4.5 graph in the published Paddle layout:
    the graph's own names and [in, out] layout, routed experts' stacks [E, in, out] unstacked into
    one key per expert (`...mlp.experts.{e}.up_gate_proj.weight`); tensors keep their dtype.
    FastDeployError (one line) for another model family, a graph without weights, or params the
    published checkpoint has no key for (quantized weights and scales, LoRA adapters, QAT or FP8
    state)."""
    if graph.metadata.get("architecture") not in ARCHITECTURES:
        raise FastDeployError(f"{graph.metadata.get('architecture') or 'the model'} is not ERNIE 4.5 "
                              f"({' or '.join(ARCHITECTURES)}): the published checkpoint layout is "
                              "written for ERNIE 4.5 only")
    out: list[tuple[str, WeightSource]] = []
    for name, p in graph.params.items():
        if p.source is None:
            raise FastDeployError(f"{name} has no weights (a meta model): give a model with weights")
        lora = name.endswith((".lora_A", ".lora_B"))
        if lora or not name.endswith(_PUBLISHED_SUFFIXES) or p.type.dtype.name not in ("F32", "BF16", "F16"):
            why = ("a LoRA adapter: merge it (--lora-adapter DIR --merge-lora, or lora-merge)" if lora
                   else "a quantized, QAT or FP8 param: give the float model (no --quant)")
            raise FastDeployError(f"{name} is not a weight of the published float checkpoint ({why})")
        m = _STACKED_EXPERTS.match(name)
        if m is not None and len(p.source.shape) == 3:
            shared = _SharedStack(p.source)
            out += [(f"{m['head']}.{e}.{m['tail']}", _StackSlice(shared, e))
                    for e in range(p.source.shape[0])]
        else:
            out.append((name, p.source))
    return out


def write_checkpoint_files(dest: Path, config: dict[str, Any],
                           tensors: Iterable[tuple[str, WeightSource | np.ndarray]],
                           source_folder: Path | None = None,
                           on_tensor: Callable[[str, int, int], None] | None = None) -> dict[str, str]:
    """Write a published checkpoint into the folder `dest`: config.json (`config` without
    `quantization_config` and `ernie_ir`), model.safetensors (`tensors` in order; NaN/Inf refused,
    naming the tensor) and the tokenizer files of `source_folder`. Returns {file: sha256} of the
    config and weights."""
    from ernie_ir.ir.storage import sha256_file
    from ernie_ir.ir.weights import write_safetensors

    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "ernie_ir")}
    (dest / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    digest = write_safetensors(dest / FD_WEIGHTS, tensors, on_tensor=on_tensor, require_finite=True)
    copy_tokenizer_files(source_folder, dest)
    return {CONFIG: sha256_file(dest / CONFIG), FD_WEIGHTS: digest}
