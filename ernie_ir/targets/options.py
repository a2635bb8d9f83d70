"""What a user asks `compile` (and `plan`) for, parsed once into typed objects.

    options = CompileOptions(quant="wint8mix", tp=2, out=Path("art"))
    report = compile_model("ernie-4.5-21b-a3b@tiny", "cuda", options)

`CompileOptions` is built by the CLI or by a caller of the API and passed down whole:
quantization and LoRA are resolved choices (`QuantChoice`, `LoraChoice`: the canonical preset
and the pipeline elements it means, never a name to look up again), the layout is a `ParallelLayout`
(tp, ep, sp, pp, micro-batches, dp, sharding) checked once. Flat keyword arguments (`quant`,
`quant_config`, `calib_data`, `lora_rank`, ..., `tp`, `ep`, ...) are accepted and grouped into
those objects, so the CLI's flags and the API's arguments read alike. Every refusal is an
ErnieIRError subclass with one line naming the flag, the value and the fix, raised while the
object is built (before any model is read); the target's own limits (FP8 kernels, its arch
option, which executables it has) are checked against these options by `compile_model`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ernie_ir.ir.mapping import check_data_parallel, check_degrees, check_sequence_parallel
from ernie_ir.passes.quant.cli_flags import LoraChoice, QuantChoice, QuantFlagError, pipeline_text
from ernie_ir.targets.errors import TargetError

MODES = ("inference", "training")
ONNX_NUMERICS = ("weight-only", "exact", "fast")
"""`onnx_numerics` choices (ernie_ir.backends.onnx.lower): float32 activations with every weight
dequantized in float32 (the default), the interpreter's numerics bit for bit (the bf16 rounding of
dequantized weights kept), or int8 activations; recorded in the model and the manifest."""
DEFAULT_ONNX_NUMERICS = "weight-only"

_QUANT_KEYS = {"quant": "quant", "quant_config": "quant_config", "calib_data": "calib_data",
               "calib_samples": "calib_samples", "calib_seq_len": "calib_seq_len"}
_LORA_KEYS = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_targets": "targets",
              "lora_adapter": "adapter", "merge_lora": "merge"}
_LAYOUT_KEYS = ("tp", "ep", "sp", "pp", "micro_batches", "dp", "sharding")


class ParallelLayout(BaseModel):
    """The parallel layout asked for: the model-parallel degrees (`tp`, `ep`, `sp`), pipeline
    stages (`pp`, `micro_batches`) and data-parallel replicas (`dp`, `sharding`). The model's own
    limits (heads, experts, layers) are checked when the Mapping is made from the graph; which
    degrees were given (`given`) tells the planner what to search."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = 1
    ep: int = 1
    sp: bool = False
    pp: int = 1
    micro_batches: int | None = None
    dp: int = 1
    sharding: str | None = None
    """ZeRO over the dp group: stage1 or stage2 (an unknown stage is refused by `check_buildable`)."""

    @model_validator(mode="before")
    @classmethod
    def _none_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None or k in ("micro_batches", "sharding")}
            if data.get("sharding") == "none":
                data["sharding"] = None
        return data

    def check_buildable(self) -> None:
        """Refuse, in one line, a layout compile cannot build (before any model is read; the
        model's own limits are checked when its Mapping is made). The planner, which also
        searches layouts, checks its own way."""
        check_degrees(self.tp, self.ep, num_experts=None if self.ep == 1 else 0)
        check_sequence_parallel(self.tp, self.sp)
        if not isinstance(self.pp, int) or self.pp < 1:
            raise TargetError("the number of pipeline stages must be an integer >= 1", flag="--pp",
                              value=self.pp)
        if self.micro_batches is not None and self.micro_batches < 1:
            raise TargetError("", flag="--micro-batches", value=self.micro_batches,
                              fix="give an integer >= 1")
        if self.pp == 1 and self.micro_batches not in (None, 1):
            raise TargetError("cuts each batch for a pipeline's schedule", flag="--micro-batches",
                              value=self.micro_batches, fix="it needs --pp 2 or more")
        if self.pp > 1 and self.dp > 1:
            raise TargetError(f"--pp {self.pp} with --dp {self.dp}: data parallelism of a pipelined model "
                              "is not built; drop one of them")
        check_data_parallel(self.dp, self.sharding, self.world)

    def given(self, name: str) -> bool:
        """Whether the caller set this degree (the planner searches the others)."""
        return name in self.model_fields_set

    @property
    def world(self) -> int:
        """Model-parallel ranks: max(tp, ep)."""
        return max(self.tp, self.ep)

    @property
    def split(self) -> bool:
        """Whether the model is split into rank graphs (tp or ep above 1)."""
        return self.tp != 1 or self.ep != 1


class CompileOptions(BaseModel):
    """Everything `compile_model` is asked to do besides which model and target (see the module
    docstring; docs/targets.md lists what each option means)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: str = "inference"
    pipeline: str | None = None
    """The user's pipeline (text or a YAML file), run before quantization and LoRA."""
    quant: QuantChoice | None = None
    lora: LoraChoice | None = None
    layout: ParallelLayout = ParallelLayout()
    cuda_arch: int | None = None
    """The value of the target's arch option (cuda: --cuda-arch); None: its default."""
    emit: tuple[str, ...] | None = None
    """The executables to write; None: the target's default for the mode."""
    onnx_numerics: str | None = None
    kv_cache_dtype: str | None = None
    out: Path | None = None
    force: bool = False
    trust_pickle: bool = False
    meta: bool = False
    disabled_passes: tuple[str, ...] = ()
    stop_after: str | int | None = None
    checkpoint: str | None = None
    """A training artifact's checkpoint to compile (None: its newest)."""
    freeze: tuple[str, ...] = ()
    """Full-parameter training (--mode training without LoRA or QAT): regexes (full match) or
    `glob:` patterns of params kept fixed, matched as --lora-targets are (`full-param{freeze}`)."""
    moment_dtype: str | None = None
    """Training: AdamW's moment dtype, float32 (None: the default) or bf16 (ernie_ir.training.precision)."""
    offload_optimizer: bool = False
    """Training: the optimizer states (moments, f32 masters) in host memory; recorded in the recipe."""

    @model_validator(mode="before")
    @classmethod
    def _group_flags(cls, data: Any) -> Any:
        """Flat flags (`quant=`, `lora_rank=`, `tp=`, ...) into the typed choices."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        quant = {v: data.pop(k) for k, v in _QUANT_KEYS.items() if k in data}
        if quant:
            data["quant"] = (quant["quant"] if isinstance(quant.get("quant"), QuantChoice) else
                             QuantChoice.parse(quant.get("quant"), quant.get("quant_config"),
                                               quant.get("calib_data"), quant.get("calib_samples"),
                                               quant.get("calib_seq_len")))
        lora = {v: data.pop(k) for k, v in _LORA_KEYS.items() if k in data}
        if lora:
            data["lora"] = LoraChoice.parse(**lora)
        layout = {k: data.pop(k) for k in _LAYOUT_KEYS if k in data}
        if layout:
            data["layout"] = ParallelLayout(**layout)
        if isinstance(data.get("emit"), str | Sequence) and data.get("emit") is not None:
            from ernie_ir.targets.executables import parse_emit

            data["emit"] = parse_emit(data["emit"])
        for key in ("out",):
            if isinstance(data.get(key), str):
                data[key] = Path(data[key])
        return data

    @field_validator("kv_cache_dtype")
    @classmethod
    def _cache_dtype_name(cls, value: str | None) -> str | None:
        return None if value is None else check_kv_cache_dtype(value, "inference")

    @model_validator(mode="after")
    def _check(self) -> CompileOptions:
        if self.mode not in MODES:
            raise TargetError(f"unknown --mode {self.mode!r}", fix="choose inference or training")
        lay = self.layout
        if lay.dp != 1 and self.mode != "training":
            raise TargetError("data parallelism is a training layout (--mode training)", flag="--dp",
                              value=lay.dp,
                              fix="to serve replicas, start several inference engines (drop --dp)")
        if lay.sharding is not None and self.mode != "training":
            raise TargetError("shards optimizer states: a training layout (--mode training)",
                              flag="--sharding", value=lay.sharding)
        if lay.pp > 1 and self.emit is not None and "fastdeploy" in self.emit:
            raise TargetError(f"--emit fastdeploy with --pp {lay.pp}: a FastDeploy checkpoint is "
                              "tensor-parallel only; drop --pp (serve with --tp) or drop fastdeploy "
                              "from --emit")
        if self.onnx_numerics is not None and self.onnx_numerics not in ONNX_NUMERICS:
            raise TargetError(f"unknown --onnx-numerics {self.onnx_numerics!r}: choose weight-only (the "
                              "default: float32 activations), exact (equal to the interpreter) or fast "
                              "(int8 activations)")
        if self.kv_cache_dtype is not None:
            check_kv_cache_dtype(self.kv_cache_dtype, self.mode)
        if self.lora is not None and self.lora.merge and self.mode != "inference":
            raise QuantFlagError(f"--merge-lora folds the adapter into the base weights, leaving nothing to "
                                 f"train: --mode {self.mode} keeps the adapter apart (drop --merge-lora)")
        self._check_full_param()
        self._check_precision()
        return self

    def _check_precision(self) -> None:
        """--moment-dtype / --offload-optimizer: a known dtype, training only (one line each)."""
        from ernie_ir.training.precision import moment_dtype

        flag = (f"--moment-dtype {self.moment_dtype}" if self.moment_dtype is not None
                else "--offload-optimizer" if self.offload_optimizer else None)
        if flag is not None and self.mode != "training":
            raise TargetError(f"{flag} sets a training artifact's optimizer states, and --mode {self.mode} "
                              "keeps none: add --mode training (or drop it)")
        if self.moment_dtype is not None:
            moment_dtype(self.moment_dtype)

    def _check_full_param(self) -> None:
        """Refuse --freeze where no full-parameter training runs (one line each)."""
        from ernie_ir.passes.finetune.full_param import FullParamError
        from ernie_ir.passes.quant.config import compile_pattern

        for pattern in self.freeze:
            if not pattern.strip():
                raise FullParamError("an empty pattern", flag="--freeze", value="''",
                                     fix="give a regex matching whole param or module names, e.g. "
                                     "'.*embed_tokens'")
            compile_pattern(pattern)
        given = f"--freeze {self.freeze[0]!r}" if self.freeze else ""
        if self.freeze and self.mode != "training":
            raise FullParamError(f"{given} keeps params fixed in full-parameter training, and --mode "
                                 f"{self.mode} trains nothing: add --mode training (or drop --freeze)")
        if self.freeze and self.lora is not None:
            raise FullParamError(f"{given} applies to full-parameter training; LoRA trains its adapters "
                                 "alone (every base weight is fixed already): drop --freeze or the --lora-* "
                                 "flags")
        if self.quant is not None and self.quant.qat and self.freeze:
            raise FullParamError(f"{given} applies to full-parameter training; QAT chooses its own trainable "
                                 "params (every float weight, the embeddings fixed per its config's "
                                 "freeze_embedding): drop --freeze or --quant")

    def check_full_param(self) -> None:
        """Refuse (one line) full-parameter training of a graph whose quantization leaves integer
        or FP8 weights: compile's check (the planner models FP8 full-parameter training). With a
        --pipeline (which may add LoRA or QAT itself) the pass decides, on the graph."""
        from ernie_ir.passes.finetune.full_param import QUANTIZED_REFUSAL, FullParamError

        if self.full_param and self.quant is not None and not self.pipeline:
            what = f"--quant {self.quant.spelled or self.quant.config} leaves integer or FP8 weights"
            raise FullParamError(QUANTIZED_REFUSAL.format(what=what))

    @property
    def full_param(self) -> str:
        """The full-parameter training pass these options mean (`full-param{freeze}`), or "" (not
        training, or training LoRA or QAT, which choose their own trainable params)."""
        if self.mode != "training" or self.lora is not None or (self.quant is not None and self.quant.qat):
            return ""
        from ernie_ir.passes.infra.pipeline_syntax import format_value

        return f"full-param{{freeze={format_value(list(self.freeze))}}}" if self.freeze else "full-param"

    @classmethod
    def from_flags(cls, **flags: Any) -> CompileOptions:
        """The options a command line gives (flat flag names, as `CompileOptions(**flags)`); a value
        of the wrong kind is one line naming the flag, not pydantic's report."""
        try:
            return cls(**flags)
        except ValidationError as e:
            first = e.errors()[0]
            name = str(first["loc"][-1]) if first["loc"] else "option"
            value = flags.get(name, first.get("input"))
            raise TargetError(first["msg"].lower(), flag=f"--{name.replace('_', '-')}", value=value) from None

    @property
    def quant_text(self) -> str:
        """The quantization and LoRA pipeline text these options mean ("" for neither)."""
        return pipeline_text(self.quant, self.lora)

    @property
    def quant_name(self) -> str | None:
        """The quantization as the user spelled it (artifact names, messages)."""
        return None if self.quant is None else self.quant.spelled


def check_kv_cache_dtype(text: str, mode: str) -> str:
    """The canonical name of a --kv-cache-dtype (a float dtype), for an inference compile."""
    from ernie_ir.passes.decoding.kv_cache import CACHE_DTYPES

    name = text.strip().lower()
    if name not in CACHE_DTYPES:
        raise TargetError(f"unknown --kv-cache-dtype {text!r}: choose {', '.join(CACHE_DTYPES)}")
    if mode != "inference":
        raise TargetError(f"--kv-cache-dtype applies to inference artifacts (they decode); --mode {mode} "
                          "does not: drop it")
    return name
