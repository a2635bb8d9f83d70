"""The CLI's quantization and LoRA flags, turned into pipeline text.

`pipeline_for(...)` is what `--quant`, `--quant-config`, `--lora-rank`,
`--lora-alpha`, `--lora-targets` and `--lora-adapter` mean. It validates
everything it can without a model (preset names, aliases, the YAML file,
flag combinations) and raises `QuantFlagError` (one line) otherwise. The
result is ordinary pipeline text: quantization first, then LoRA, so LoRA
over a quantized base (WINT8MIX LoRA) is `--quant wint8mix --lora-rank 8`.
With `--merge-lora` the order turns round: the adapter is imported and folded
into the float base weights first, then the sum is quantized (ERNIEKit's
export before FastDeploy): `lora-import{path},lora-merge,<quant passes>`.

    pipeline_for("wint8mix", None, 8, None, None, None)
        == 'wint8mix,lora{rank=8}'
    pipeline_for("wint4/8", None, None, None, None, None)        # ERNIEKit alias
        == 'wint8mix'
    pipeline_for(None, Path("q.yaml"), None, None, None, None)
        == 'quant-annotate{config="q.yaml"},weight-only-quant'
    pipeline_for("wint8mix", None, None, None, None, Path("ad"), merge_lora=True)
        == 'lora-import{path="ad"},lora-merge,wint8mix'
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ernie_ir.ir import ErnieIRError

from ..infra.pipeline import load_pipeline
from ..infra.pipeline_syntax import format_value
from .calib_data import TEXT_SUFFIX
from .config import (
    PASS_PRESETS,
    PRESETS,
    Algo,
    Method,
    QuantConfig,
    preset_method,
    resolve_quant_name,
    split_quant_options,
)
from .presets import CALIBRATED_PASS, convert_passes

NO_QUANT = ("none", "bf16", "fp16", "float", "")


class QuantFlagError(ErnieIRError):
    """Quantization / LoRA flags that cannot be combined or resolved."""


CALIBRATED = {"w4a8c8": "w4a8c8", "fp8": "fp8-quant"}
"""Quantizations that calibrate on token ids, and the pass that takes `calibration_file`."""


def quant_pipeline(quant: str | None, quant_config: Path | None, calib_data: Path | None = None,
                   calib_samples: int | None = None, calib_seq_len: int | None = None) -> list[str]:
    """Pipeline elements for `--quant` / `--quant-config` (at most one of them) and `--calib-data`
    (a .npy of token ids, or a .jsonl the caller tokenizes first: `finetune.calib_text`; for the
    calibrated quantizations: `CALIBRATED`, and `method=gptq`, which
    also takes `--calib-samples` and `--calib-seq-len`)."""
    if quant is not None and quant.strip().lower() in NO_QUANT:
        quant = None
    if quant is not None and quant_config is not None:
        raise QuantFlagError("give --quant PRESET or --quant-config FILE.yaml, not both")
    name = resolve_quant_name(quant) if quant is not None else None
    method = preset_method(quant) if quant is not None and name not in PASS_PRESETS else None
    cfg = QuantConfig.from_yaml(quant_config) if quant_config is not None else None
    weights_calibrate = (method is not None and method.calibrated) or (
        cfg is not None and any(m.calibrated for m in cfg.methods))
    _check_windows(calib_samples, calib_seq_len, weights_calibrate)
    if calib_data is not None:
        if name not in CALIBRATED and not weights_calibrate:
            raise QuantFlagError(f"--calib-data calibrates static activation scales or weights: it applies "
                                 f"to --quant {' or '.join(CALIBRATED)} and to method=gptq ('wint4{{method="
                                 f"gptq}}'), not {quant or quant_config or 'no quantization'}")
        if Path(calib_data).suffix.lower() not in (".npy", TEXT_SUFFIX):
            raise QuantFlagError(f"--calib-data {calib_data}: give a .npy array of token ids [batch, seq] "
                                 "or a .jsonl of text or ERNIEKit SFT chats")
        if not Path(calib_data).is_file():
            raise QuantFlagError(f"--calib-data {calib_data}: no such file")
    if name is not None and name in PASS_PRESETS:
        assert quant is not None
        conv, rest = PASS_PRESETS[name]
        _, options = split_quant_options(quant)
        spec = conv + options
        if calib_data is not None:
            spec = _with_option(spec, "calibration_file", str(calib_data))
        load_pipeline(spec)  # options checked now, in one line, before any model is read
        return [spec, rest]
    if name is not None and method is not None and method != Method.RTN:
        # without --calib-data, calibrated-quant refuses a model with weights (one line naming the
        # flag) and leaves a model without them (@meta, `plan`) to weight-only-quant
        passes = convert_passes(PRESETS[name]().algos, {method})
        return [f"quant-annotate{{preset={name},method={method}}}",
                *(_calibrated(p, calib_data, calib_samples, calib_seq_len) for p in passes)]
    if name is not None:
        if calib_data is not None:  # fp8: its preset, spelled out, the calibration file on fp8-quant
            return ["quant-annotate{preset=fp8}", _with_option(CALIBRATED[name], "calibration_file",
                                                                str(calib_data))]
        return [name]
    if quant_config is not None and cfg is not None:
        passes = convert_passes(cfg.algos, cfg.methods)
        return [f"quant-annotate{{config={json.dumps(str(quant_config))}}}",
                *(_calibrated(p, calib_data, calib_samples, calib_seq_len) for p in passes)]
    return []


def _check_windows(samples: int | None, seq_len: int | None, weights_calibrate: bool) -> None:
    for flag, value in (("--calib-samples", samples), ("--calib-seq-len", seq_len)):
        if value is None:
            continue
        if not weights_calibrate:
            raise QuantFlagError(f"{flag} sizes the calibration of method=gptq ('wint4{{method=gptq}}'); "
                                 "w4a8c8 and fp8 calibrate on all of --calib-data: drop it")
        if value < 1:
            raise QuantFlagError(f"{flag} must be a positive integer, not {value}")


def _calibrated(element: str, calib_data: Path | None, samples: int | None, seq_len: int | None) -> str:
    """`calibrated-quant` with the calibration flags as its options; any other element as is."""
    if element != CALIBRATED_PASS:
        return element
    opts = [f"calibration_file={format_value(str(calib_data))}"] if calib_data is not None else []
    opts += [f"{k}={v}" for k, v in (("samples", samples), ("seq_len", seq_len)) if v is not None]
    return f"{element}{{{','.join(opts)}}}" if opts else element


def _with_option(spec: str, key: str, value: str) -> str:
    """`name{a=1}` + key=value -> `name{a=1,key="value"}`; a key given twice is refused."""
    if f"{key}=" in spec:
        raise QuantFlagError(f"{key} is given twice (in --quant and by --calib-data): give one")
    opt = f"{key}={format_value(value)}"
    return f"{spec[:-1]},{opt}}}" if spec.endswith("}") else f"{spec}{{{opt}}}"


ADAPTER_CONFIG = "lora_config.json"
ADAPTER_SUBFOLDER = "adapter"
"""A training checkpoint folder (`run-K-step-N/`) holds its adapter in this subfolder."""


def adapter_folder(path: str | Path) -> Path:
    """The adapter folder `path` names: `path` itself when it holds lora_config.json, else
    `path/adapter` when that does (a training checkpoint folder), else `path` (unchanged, for the
    caller's error)."""
    folder = Path(path)
    if not (folder / ADAPTER_CONFIG).is_file() and (folder / ADAPTER_SUBFOLDER / ADAPTER_CONFIG).is_file():
        return folder / ADAPTER_SUBFOLDER
    return folder


def lora_pipeline(lora_rank: int | None, lora_alpha: float | None, lora_targets: Sequence[str] | None,
                  lora_adapter: Path | None, merge_lora: bool = False) -> list[str]:
    """Pipeline elements for the LoRA flags (`merge_lora`: fold the adapter into the base:
    `lora-import{path},lora-merge`, or `lora-merge{require=true}` for the model's own adapters)."""
    if lora_adapter is not None:
        if lora_rank is not None or lora_alpha is not None or lora_targets:
            raise QuantFlagError("--lora-adapter imports a trained adapter with its own rank, alpha and "
                                 "targets; do not combine it with --lora-rank/--lora-alpha/--lora-targets")
        folder = adapter_folder(lora_adapter)
        if not (folder / ADAPTER_CONFIG).is_file():
            raise QuantFlagError(f"--lora-adapter {lora_adapter}: not a LoRA adapter folder "
                                 f"(no {ADAPTER_CONFIG}, in it or in its {ADAPTER_SUBFOLDER}/ subfolder)")
        return [f"lora-import{{path={json.dumps(str(folder))}}}", *(["lora-merge"] if merge_lora else [])]
    if merge_lora:
        if lora_rank is not None or lora_alpha is not None or lora_targets:
            raise QuantFlagError("--merge-lora folds a trained adapter into the base weights, but "
                                 "--lora-rank/--lora-alpha/--lora-targets add a fresh one whose B is zero "
                                 "(nothing to merge): give --lora-adapter DIR instead")
        return ["lora-merge{require=true}"]
    if lora_rank is None:
        if lora_alpha is not None or lora_targets:
            raise QuantFlagError("--lora-alpha and --lora-targets need --lora-rank R")
        return []
    if lora_rank < 1:
        raise QuantFlagError(f"--lora-rank must be a positive integer, not {lora_rank}")
    opts = [f"rank={lora_rank}"]
    if lora_alpha is not None:
        if not math.isfinite(lora_alpha) or lora_alpha <= 0:
            raise QuantFlagError(f"--lora-alpha must be positive (a finite number), not {lora_alpha}")
        opts.append(f"alpha={format_value(float(lora_alpha))}")
    if lora_targets:
        from .config import compile_pattern

        targets = [t.strip() for t in lora_targets if t.strip()]
        for t in targets:
            compile_pattern(t)
        opts.append(f"targets={format_value(targets)}")
    return [f"lora{{{','.join(opts)}}}"]


class QuantChoice(BaseModel):
    """`--quant` / `--quant-config` / `--calib-data`, resolved once: the canonical preset (or the
    config file) and the pipeline elements they mean. `parse` refuses what cannot be resolved
    (QuantFlagError, one line) and returns None for no quantization."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spelled: str | None = None
    """--quant as given (an alias, or a preset with its pass's options); None: --quant-config."""
    preset: str | None = None
    """The canonical preset name (`resolve_quant_name`); None: --quant-config."""
    config: Path | None = None
    calib_data: Path | None = None
    calib_samples: int | None = None
    calib_seq_len: int | None = None
    elements: tuple[str, ...] = ()
    """The pipeline elements (`quant_pipeline`), quantization before anything else."""

    @classmethod
    def parse(cls, quant: str | None, quant_config: Path | None = None, calib_data: Path | None = None,
              calib_samples: int | None = None, calib_seq_len: int | None = None) -> QuantChoice | None:
        if quant is not None and quant.strip().lower() in NO_QUANT:
            quant = None
        elements = tuple(quant_pipeline(quant, quant_config, calib_data, calib_samples, calib_seq_len))
        if quant is None and quant_config is None:
            return None
        return cls(spelled=quant, preset=resolve_quant_name(quant) if quant is not None else None,
                   config=None if quant_config is None else Path(quant_config),
                   calib_data=None if calib_data is None else Path(calib_data), calib_samples=calib_samples,
                   calib_seq_len=calib_seq_len, elements=elements)

    @property
    def fp8(self) -> bool:
        """An FP8 preset: it needs a target with FP8 kernels."""
        return self.preset is not None and self.preset.startswith("fp8")

    @property
    def qat(self) -> bool:
        """Quantization-aware training (the qat-int8 preset, or a config file with QAT rules): its
        pass trains the float weights itself; every other quantization leaves integer weights."""
        if self.preset is not None:
            return self.preset in PRESETS and Algo.QAT in PRESETS[self.preset]().algos
        return self.config is not None and Algo.QAT in QuantConfig.from_yaml(self.config).algos


class LoraChoice(BaseModel):
    """The LoRA flags (`--lora-rank/-alpha/-targets`, `--lora-adapter`, `--merge-lora`), resolved
    once into their pipeline elements; `parse` returns None when none is given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int | None = None
    alpha: float | None = None
    targets: tuple[str, ...] | None = None
    adapter: Path | None = None
    merge: bool = False
    elements: tuple[str, ...] = ()

    @classmethod
    def parse(cls, rank: int | None = None, alpha: float | None = None,
              targets: Sequence[str] | None = None, adapter: Path | None = None,
              merge: bool = False) -> LoraChoice | None:
        elements = tuple(lora_pipeline(rank, alpha, targets, adapter, merge))
        if not elements:
            return None
        return cls(rank=rank, alpha=alpha, targets=None if targets is None else tuple(targets),
                   adapter=None if adapter is None else Path(adapter), merge=merge, elements=elements)


def pipeline_text(quant: QuantChoice | None, lora: LoraChoice | None) -> str:
    """The pipeline text of resolved quantization and LoRA choices ("" for neither): quantization
    first, then LoRA; with --merge-lora the adapter is folded in first, then quantized."""
    q = list(quant.elements) if quant is not None else []
    lo = list(lora.elements) if lora is not None else []
    return ",".join(lo + q if lora is not None and lora.merge else q + lo)


def pipeline_for(quant: str | None, quant_config: Path | None, lora_rank: int | None,
                 lora_alpha: float | None, lora_targets: Sequence[str] | None,
                 lora_adapter: Path | None, merge_lora: bool = False, calib_data: Path | None = None,
                 calib_samples: int | None = None, calib_seq_len: int | None = None) -> str:
    """Pipeline text for the CLI's quantization and LoRA flags ("" when none is given).

    quant: a preset (wint8, wint4, wint8mix, wint8mix-erniekit, qat-int8, fp8, w4a8c8, wint2), an alias
    (ERNIEKit compute_type `wint4/8`; FastDeploy `mix_quant`, `tensor_wise_fp8`, ...) or
    none. quant_config: a YAML quant-config file. lora_targets: regexes (full match) or
    `glob:` patterns; a CLI passes `--lora-targets a,b` split on commas. lora_adapter: an
    adapter folder, or a folder holding one in `adapter/` (a training checkpoint).
    merge_lora: fold the adapter (or the model's own adapters) into the float base weights
    before quantizing: LoRA first, then quantization.
    calib_data: a .npy of token ids (or a .jsonl of text, tokenized by the caller) the calibrated
    quantizations (w4a8c8, fp8, method=gptq) calibrate on; calib_samples / calib_seq_len:
    method=gptq's windows (calibrated-quant's samples, seq_len).
    quant may be a pass preset with its pass's options: `wint2{w4_end_layer=6}`,
    `w4a8c8{calibration_tokens=512,kv_cache=float}` (`config.PASS_PRESETS`).
    """
    return pipeline_text(QuantChoice.parse(quant, quant_config, calib_data, calib_samples, calib_seq_len),
                         LoraChoice.parse(lora_rank, lora_alpha, lora_targets, lora_adapter, merge_lora))
