"""The quantization spec: which linears get which quantization, as plain data.

A `QuantConfig` is an ordered list of rules plus ignore patterns. Each rule
names a module-path pattern and a `QuantSpec` (algorithm and its
parameters). For every linear the decision is made as ERNIEKit makes it:

1. if any `ignore` pattern matches, the linear stays float;
2. if the PaddleSlim-style `skip_tensor_map` names it (`block_N: [linear2]`),
   it stays float;
3. otherwise the **last** rule that matches decides (a rule with
   `algo: none` keeps it float); no matching rule: float.

Patterns are regular expressions matched against the whole path
(`re.fullmatch`, as ERNIEKit's `.*mlp.experts.*`); prefix `glob:` for a
shell glob (`glob:*.self_attn.*`) or `re:` to be explicit. A linear's module
path is its weight's name without the `.weight` suffix
(`ernie.layers.3.self_attn.qkv_proj`) or its node scope; a pattern matches
if it matches either (which linears of a graph are candidates, and by which
paths, is `ernie_ir.passes.quant.config`'s graph query).

Presets (`QuantConfig.preset(name)`), aliases (`resolve_quant_name`) and YAML
files (`QuantConfig.from_yaml`) all produce this object; it serialises into
the graph's metadata (`graph.metadata["quantization"]`, written by
`quant-annotate`) so an artifact records exactly what was applied, and the
file formats that name a quantization (FastDeploy's `quantization_config`)
read it back from there.

Plain data on the IR core alone: it imports nothing of ours but `ernie_ir.ir`,
so every layer (the passes that apply it, the formats that write it) can read it.
"""

from __future__ import annotations

import enum
import fnmatch
import functools
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ErnieIRError
from .inputs import read_bytes
from .paddleslim_quant import read_skip_tensor_map, skip_matches
from .suggest import did_you_mean

RECORD_KEY = "quantization"
"""`graph.metadata[RECORD_KEY]`: the resolved config `quant-annotate` applied (`QuantConfig.to_dict()`)."""
ANNOTATION_KEY = "quant"
"""`param.annotations[ANNOTATION_KEY]`: one weight's decision, as `quant-annotate` records it
(`QuantSpec.annotation()` plus the index of the deciding `rule`)."""


class QuantConfigError(ErnieIRError):
    """A quantization config, preset name or YAML file that cannot be used."""


class Algo(enum.StrEnum):
    """Quantization algorithms (TensorRT-LLM style: an enum plus per-rule parameters)."""

    NONE = "none"
    WEIGHT_ONLY_INT8 = "weight_only_int8"
    WEIGHT_ONLY_INT4 = "weight_only_int4"
    QAT = "qat"
    FP8 = "fp8"

    def __str__(self) -> str:
        return self.value

    @property
    def bits(self) -> int:
        return {Algo.WEIGHT_ONLY_INT8: 8, Algo.WEIGHT_ONLY_INT4: 4}.get(self, 0)


class Method(enum.StrEnum):
    """How a weight-only weight reaches its grid (`algo` says which grid): round to nearest, or
    calibrated on data (GPTQ). Every method writes the same format: int codes per output channel
    with the scale RTN would write."""

    RTN = "rtn"
    GPTQ = "gptq"
    AWQ = "awq"

    def __str__(self) -> str:
        return self.value

    @property
    def calibrated(self) -> bool:
        return self != Method.RTN


METHODS_BUILT = (Method.RTN, Method.GPTQ)
"""The methods a weight can be quantized by today (`awq` is named, so a rule can say it, and
refused with one line)."""


def parse_method(value: Any, where: str = "method") -> Method:
    """A `Method` from user text; QuantConfigError (one line) for an unknown or unbuilt one."""
    text = str(value.value if isinstance(value, Method) else value).strip().lower()
    if text not in {m.value for m in Method}:
        known = [m.value for m in METHODS_BUILT]
        raise QuantConfigError(f"{where}: unknown method {value!r}{did_you_mean(text, known)}; methods: "
                               f"{', '.join(known)}")
    method = Method(text)
    if method not in METHODS_BUILT:
        raise QuantConfigError(f"{where}: method {method} is not built yet; use method=gptq (calibrated) or "
                               "method=rtn")
    return method


class QuantSpec(BaseModel):
    """How one linear is quantized. Fields that do not apply to `algo` are ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    algo: Algo
    group_size: int = -1
    """Weight-only: -1 (one scale per output channel), 64 or 128 (groups of rows along `in`)."""
    weight_quantize_type: Literal["abs_max", "channel_wise_abs_max"] = "channel_wise_abs_max"
    """QAT weights: one scale per tensor, or per output channel."""
    activation_quantize_type: Literal["moving_average_abs_max", "none"] = "moving_average_abs_max"
    weight_bits: int = Field(default=8, ge=2, le=16)
    activation_bits: int = Field(default=8, ge=2, le=16)
    activation_preprocess_type: Literal["none", "PACT"] = "none"
    round_type: Literal[0, 1] = 1
    """Paddle's round type: 0 half to even, 1 half away from zero (its QAT layers' choice)."""
    moving_rate: float = Field(default=0.9, ge=0.0, le=1.0)
    fp8_format: Literal["e4m3"] = "e4m3"
    method: Method = Method.RTN
    """Weight-only: how the weight reaches the grid (rtn, or gptq calibrated on data)."""

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, v: Any) -> Any:
        try:
            return parse_method(v)
        except QuantConfigError as e:
            raise ValueError(str(e).removeprefix("method: ")) from None

    @model_validator(mode="after")
    def _method_applies(self) -> QuantSpec:
        if self.method != Method.RTN and not self.algo.bits:
            raise ValueError(f"method={self.method} calibrates weight-only weights; algo {self.algo} has "
                             "none: drop method or use algo weight_only_int8/weight_only_int4")
        if self.method != Method.RTN and self.group_size != -1:
            raise ValueError(f"method={self.method} writes per-channel scales (group_size -1), not "
                             f"group_size {self.group_size}")
        return self

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        if v not in (-1, 64, 128):
            raise ValueError(f"group_size must be -1 (per channel), 64 or 128 (Paddle's kernels), not {v}")
        return v

    @field_validator("activation_preprocess_type", mode="before")
    @classmethod
    def _pact(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.lower() in ("none", "")):
            return "none"
        if isinstance(v, str) and v.lower() == "pact":
            return "PACT"
        return v

    def annotation(self) -> dict[str, Any]:
        """What the annotate pass records on the weight param (only the fields `algo` uses)."""
        out: dict[str, Any] = {"algo": self.algo.value}
        if self.algo in (Algo.WEIGHT_ONLY_INT8, Algo.WEIGHT_ONLY_INT4):
            out["group_size"] = self.group_size
            if self.method != Method.RTN:  # rtn is the default: records from before methods read the same
                out["method"] = self.method.value
        elif self.algo == Algo.QAT:
            out.update(
                weight_quantize_type=self.weight_quantize_type,
                activation_quantize_type=self.activation_quantize_type,
                weight_bits=self.weight_bits,
                activation_bits=self.activation_bits,
                activation_preprocess_type=self.activation_preprocess_type,
                round_type=self.round_type,
                moving_rate=self.moving_rate,
            )
        elif self.algo == Algo.FP8:
            out["fp8_format"] = self.fp8_format
        return out

    @classmethod
    def from_annotation(cls, ann: dict[str, Any]) -> QuantSpec:
        return cls.model_validate({k: v for k, v in ann.items() if k in cls.model_fields})


class QuantRule(QuantSpec):
    """A pattern plus the spec for the linears it matches."""

    match: str
    """Regex full match (default, or prefix `re:`), or a shell glob with prefix `glob:`."""

    @field_validator("match")
    @classmethod
    def _pattern(cls, v: str) -> str:
        compile_pattern(v)
        return v

    def spec(self) -> QuantSpec:
        return QuantSpec.model_validate(self.model_dump(exclude={"match"}))

    def describe(self) -> str:
        extra = f", group_size={self.group_size}" if self.algo.bits and self.group_size != -1 else ""
        extra += f", method={self.method}" if self.method != Method.RTN else ""
        return f"{self.match!r} -> {self.algo.value}{extra}"


class QuantConfig(BaseModel):
    """Rules, ignore patterns and QAT options: one source of truth for a quantization."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    rules: tuple[QuantRule, ...] = ()
    ignore: tuple[str, ...] = ()
    skip_tensor_map: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    """PaddleSlim's QAT skip map: `block_N: [linear1, linear2]` keeps those linears of layer N float."""
    freeze_embedding: bool = True
    """QAT: embeddings stay frozen (PaddleFleetX's recipe)."""

    @field_validator("ignore")
    @classmethod
    def _ignore(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            compile_pattern(p)
        return v

    @field_validator("skip_tensor_map")
    @classmethod
    def _skip(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for key in v:
            if not re.fullmatch(r"block_\d+", key):
                raise ValueError(f"skip_tensor_map keys are block_N (0-based layer index), not {key!r}")
        return v

    @model_validator(mode="after")
    def _some_rule(self) -> QuantConfig:
        if not self.rules:
            raise ValueError("a quantization config needs at least one rule")
        return self

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> QuantConfig:
        """A named preset or alias (see `PRESETS` and `ALIASES`); QuantConfigError if unknown."""
        canonical = resolve_quant_name(name)
        if canonical in PASS_PRESETS:
            conv, rest = PASS_PRESETS[canonical]
            raise QuantConfigError(f"{canonical} is a conversion pass and a preset ({conv},{rest}), not a "
                                   f"rule set: give it as --quant {canonical} (or {conv},{rest} in a "
                                   "pipeline)")
        return PRESETS[canonical]()

    @classmethod
    def from_dict(cls, data: Any, source: str = "quant config") -> QuantConfig:
        """A config from parsed YAML/JSON. Accepts our form, ERNIEKit's `compute_type`,
        FastDeploy's `quantization: mix_quant` and PaddleSlim's `Quantization:` section."""
        if isinstance(data, str):
            return cls.preset(data)
        if not isinstance(data, dict):
            raise QuantConfigError(f"{source}: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        compress = data.get("Compress")
        if isinstance(compress, dict) and isinstance(compress.get("Quantization"), dict):
            data = dict(compress["Quantization"])  # PaddleFleetX reads this section of its config, only it
        for key in ("quant", "quantization_config", "Quantization"):
            if key in data and isinstance(data[key], dict) and len(data) == 1:
                data = dict(data[key])
        if "compute_type" in data:
            return _from_compute_type(data, source)
        if data.get("quantization") == "mix_quant" or "moe_quant_type" in data or "dense_quant_type" in data:
            return _from_fastdeploy_mix(data, source)
        if isinstance(data.get("quantization"), str) and len(data) == 1:
            return cls.preset(data["quantization"])
        if "weight_quantize_type" in data or "activation_quantize_type" in data:
            return _from_paddleslim(data, source)
        if "preset" in data:
            base = cls.preset(str(data.pop("preset")))
            merged = base.model_dump()
            merged.update({k: v for k, v in data.items() if k != "rules"})
            extra = data.get("rules", [])
            if not isinstance(extra, list):
                raise QuantConfigError(f"{source}: rules must be a list of {{match, algo}} mappings, "
                                       f"got {type(extra).__name__}")
            merged["rules"] = [*merged["rules"], *extra]
            data = merged
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise QuantConfigError(f"{source}: {where or 'config'}: {err['msg']}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> QuantConfig:
        import yaml  # only a YAML file needs it

        p = Path(path)
        if not p.exists():
            raise QuantConfigError(f"quant config file {p} does not exist")
        try:  # a FIFO or device is refused, not waited on
            data = yaml.safe_load(read_bytes(p, "quant config file", QuantConfigError).decode("utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            problem = " ".join(str(getattr(e, "problem", None) or e).split())  # ReaderError: several lines
            raise QuantConfigError(f"{p}: invalid YAML{where}: {problem}") from None
        except UnicodeDecodeError:
            raise QuantConfigError(f"{p}: not UTF-8 text: a quant config is a YAML file") from None
        except RecursionError:
            raise QuantConfigError(f"{p}: YAML nested too deeply: a quant config is a mapping of rules"
                                   ) from None
        except (ValueError, KeyError, AttributeError, TypeError) as e:  # an explicit tag: `!!int x`
            raise QuantConfigError(f"{p}: invalid YAML: a tagged value cannot be read ({e}): drop the "
                                   "!!tag or fix the value") from None
        cfg = cls.from_dict(data, str(p))
        return cfg if cfg.name != "custom" else cfg.model_copy(update={"name": p.stem})

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for graph metadata and YAML), defaults left out."""
        out: dict[str, Any] = {"name": self.name,
                               "rules": [{"match": r.match, **r.annotation()} for r in self.rules]}
        if self.ignore:
            out["ignore"] = list(self.ignore)
        if self.skip_tensor_map:
            out["skip_tensor_map"] = {k: list(v) for k, v in self.skip_tensor_map.items()}
        if any(r.algo == Algo.QAT for r in self.rules):
            out["freeze_embedding"] = self.freeze_embedding
        return out

    @property
    def algos(self) -> set[Algo]:
        return {r.algo for r in self.rules} - {Algo.NONE}

    @property
    def methods(self) -> set[Method]:
        """The methods of the rules that quantize weight-only (rtn when a config names none)."""
        return {r.method for r in self.rules if r.algo.bits}

    def with_method(self, method: Method | str) -> QuantConfig:
        """This config with every weight-only rule quantized by `method` (`wint4{method=gptq}`);
        QuantConfigError when no rule quantizes weights (fp8, qat-int8)."""
        m = parse_method(method)
        if not any(r.algo.bits for r in self.rules):
            raise QuantConfigError(f"{self.name}: method={m} chooses how weight-only weights are rounded, "
                                   f"and {self.name} quantizes none: use it with wint4, wint8 or wint8mix")
        grouped = next((r for r in self.rules if r.algo.bits and r.group_size != -1), None)
        if m != Method.RTN and grouped is not None:
            raise QuantConfigError(f"{self.name}: method={m} writes per-channel scales, and rule "
                                   f"{grouped.describe()} has group_size {grouped.group_size}")
        rules = tuple(r.model_copy(update={"method": m}) if r.algo.bits else r for r in self.rules)
        return self.model_copy(update={"rules": rules})

    # -- decisions ---------------------------------------------------------------------------

    def decide(self, paths: Iterable[str]) -> Decision:
        """The decision for a linear known by `paths` (see the module docstring for the order)."""
        paths = [p for p in paths if p]
        for p in self.ignore:
            if any(match_path(p, x) for x in paths):
                return Decision(None, None, f"ignored by {p!r}", ignored_by=p)
        for block, names in self.skip_tensor_map.items():
            for name in names:
                if any(skip_matches(block, name, x) for x in paths):
                    return Decision(None, None, f"skipped by skip_tensor_map {block}: {name}")
        for i in range(len(self.rules) - 1, -1, -1):
            rule = self.rules[i]
            if any(match_path(rule.match, x) for x in paths):
                spec = None if rule.algo == Algo.NONE else rule.spec()
                return Decision(spec, i, f"rule {i} ({rule.describe()})")
        return Decision(None, None, "no rule matches")


@dataclass(frozen=True)
class Decision:
    spec: QuantSpec | None
    rule: int | None
    reason: str
    ignored_by: str | None = None


def recorded_config(metadata: dict[str, Any]) -> QuantConfig | None:
    """The resolved config a graph records (`metadata[RECORD_KEY]`, written by `quant-annotate`);
    None when it records none. QuantConfigError (one line) when the record is not a config."""
    record = metadata.get(RECORD_KEY)
    if record is None:
        return None
    try:
        return QuantConfig.model_validate(record)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise QuantConfigError(f"graph.metadata[{RECORD_KEY!r}] is not a quantization config: "
                               f"{where or 'config'}: {err['msg']}") from None


def recorded_spec(annotations: dict[str, Any]) -> QuantSpec | None:
    """One weight's recorded decision (`annotations[ANNOTATION_KEY]`) as a `QuantSpec`; None when
    it records none. QuantConfigError (one line) when the record is not a decision."""
    ann = annotations.get(ANNOTATION_KEY)
    if ann is None:
        return None
    try:
        return QuantSpec.from_annotation(ann)
    except (ValidationError, AttributeError):  # not a mapping, or fields a spec refuses
        raise QuantConfigError(f"annotation {ANNOTATION_KEY}={ann!r} is not a quantization decision"
                               ) from None


# -- patterns -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """`glob:...` -> the glob as a regex; `re:...` or a bare pattern -> the regex."""
    if pattern.startswith("glob:"):
        return re.compile(fnmatch.translate(pattern[5:]))
    body = pattern[3:] if pattern.startswith("re:") else pattern
    try:
        with warnings.catch_warnings():  # re's FutureWarning ("possible nested set") is no user error
            warnings.simplefilter("ignore")
            return re.compile(body)
    except (re.error, OverflowError, RecursionError) as e:  # a huge {n}; deeply nested groups
        raise QuantConfigError(f"pattern {pattern[:60]!r} is not a valid regular expression "
                               f"({str(e)[:80]})") from None


def match_path(pattern: str, path: str) -> bool:
    """Full match of `path` against a config pattern."""
    return compile_pattern(pattern).fullmatch(path) is not None


# -- presets and aliases ----------------------------------------------------------------------------

ERNIEKIT_WINT8MIX_INT8 = (".*self_attn.qkv_proj.*", ".*self_attn.o_proj.*", ".*mlp.up_gate_proj.*",
                          ".*mlp.down_proj.*")
ROUTED_EXPERTS = ".*mlp.experts.*"


def _rule(match: str, algo: Algo, **kw: Any) -> QuantRule:
    return QuantRule(match=match, algo=algo, **kw)


def _wint8() -> QuantConfig:
    return QuantConfig(name="wint8", rules=(_rule(".*", Algo.WEIGHT_ONLY_INT8),))


def _wint4() -> QuantConfig:
    return QuantConfig(name="wint4", rules=(_rule(".*", Algo.WEIGHT_ONLY_INT4),))


def _wint8mix() -> QuantConfig:
    # FastDeploy mix_quant: routed experts int4, every other linear (shared experts too) int8.
    return QuantConfig(name="wint8mix", rules=(_rule(".*", Algo.WEIGHT_ONLY_INT8),
                                               _rule(ROUTED_EXPERTS, Algo.WEIGHT_ONLY_INT4)))


def _wint8mix_erniekit() -> QuantConfig:
    # ERNIEKit's WINT8MIX rules verbatim: shared experts match no rule and stay bf16.
    return QuantConfig(name="wint8mix-erniekit", rules=(
        _rule(ROUTED_EXPERTS, Algo.WEIGHT_ONLY_INT4),
        *(_rule(p, Algo.WEIGHT_ONLY_INT8) for p in ERNIEKIT_WINT8MIX_INT8),
    ))


def _qat_int8() -> QuantConfig:
    # PaddleFleetX / PaddleSlim GPT-345M QAT: abs_max weights, moving-average activations, PACT.
    return QuantConfig(name="qat-int8", rules=(_rule(
        ".*", Algo.QAT, weight_quantize_type="abs_max", activation_quantize_type="moving_average_abs_max",
        weight_bits=8, activation_bits=8, activation_preprocess_type="PACT"),), freeze_embedding=True)


def _fp8() -> QuantConfig:
    return QuantConfig(name="fp8", rules=(_rule(".*", Algo.FP8),))


PRESETS = {
    "wint8": _wint8,
    "wint4": _wint4,
    "wint8mix": _wint8mix,
    "wint8mix-erniekit": _wint8mix_erniekit,
    "qat-int8": _qat_int8,
    "fp8": _fp8,
}
"""Preset name -> config factory."""

PRESET_DESCRIPTIONS = {
    "wint8": "Weight-only INT8 (per output channel) on every linear and routed expert.",
    "wint4": "Weight-only INT4 (per output channel) on every linear and routed expert.",
    "wint8mix": "Routed experts INT4, every other linear INT8 (shared experts too, as FastDeploy "
                "mix_quant); embeddings, router and lm_head stay float.",
    "wint8mix-erniekit": "ERNIEKit's WINT8MIX rules verbatim: routed experts INT4, attention and dense "
                         "MLP INT8, shared experts bf16.",
    "qat-int8": "QAT (PaddleSlim GPT-345M recipe): abs_max INT8 weights, moving-average INT8 "
                "activations with PACT; embeddings frozen.",
    "fp8": "FP8 e4m3 W8A8, tensor-wise static scales (weights absmax/448, activations calibrated).",
}

ALIASES = {
    # ERNIEKit compute_type values
    "wint4/8": "wint8mix",
    "weight_only_int8": "wint8",
    "weight_only_int4": "wint4",
    "weight_only_mix": "wint8mix",
    # FastDeploy names
    "mix_quant": "wint8mix",
    "tensor_wise_fp8": "fp8",
    "wfp8afp8": "fp8",
    "qat": "qat-int8",
}
"""Other tools' names for our presets. Note ERNIEKit's `wint4/8` keeps shared experts in bf16;
it maps to `wint8mix` (shared experts INT8, like FastDeploy) — use `wint8mix-erniekit` for
ERNIEKit's exact rules."""


PASS_PRESETS = {
    "w4a8c8": ("w4a8c8", "wint8"),
    "wint2": ("wint2", "wint8mix"),
}
"""Quantizations that are a conversion pass (with options) followed by an annotate preset for the
linears it leaves float: `--quant w4a8c8` is `w4a8c8,wint8` (routed experts W4A8 and the KV cache
C8 first, on the float model; then every other linear INT8), `--quant wint2` is
`wint2,wint8mix` (the later MoE layers' experts 2-bit first; then the earlier layers' experts
INT4 and every other linear INT8). They take the pass's options: `--quant 'wint2{w4_end_layer=6}'`."""

PASS_PRESET_DESCRIPTIONS = {
    "w4a8c8": "FastDeploy W4A8C8: routed experts int4 x static int8 activations (calibrated), every "
              "other linear INT8, KV cache INT8 per channel (pipeline w4a8c8,wint8).",
    "wint2": "FastDeploy WINT2: MoE layers up to w4_end_layer INT4 experts, later MoE layers 2-bit "
             "(CCQ) experts, every other linear INT8 (pipeline wint2,wint8mix).",
}


def split_quant_options(name: str) -> tuple[str, str]:
    """`"wint2{w4_end_layer=6}"` -> ("wint2", "{w4_end_layer=6}"); a bare name -> (name, "")."""
    key = name.strip()
    brace = key.find("{")
    if brace < 0:
        return key, ""
    if not key.endswith("}"):
        raise QuantConfigError(f"quantization {name!r}: options are written NAME{{key=value,...}}")
    return key[:brace].strip(), key[brace:]


def preset_method(name: str) -> Method | None:
    """The `method=` option of a rule preset written `wint4{method=gptq}` (None: not given).
    QuantConfigError (one line) for any other option, an unknown method, or a preset that
    quantizes no weights."""
    key, options = split_quant_options(name)
    low = key.lower()
    if not options or low in PASS_PRESETS:
        return None
    body = options[1:-1].strip()
    k, eq, v = body.partition("=")
    if not eq or k.strip() != "method" or "," in v:
        raise QuantConfigError(f"quantization {name!r}: a rule preset takes one option, method=rtn|gptq "
                               f"(only {' and '.join(PASS_PRESETS)} take their pass's options)")
    method = parse_method(v.strip().strip('"').strip("'"), f"quantization {name!r}")
    QuantConfig.preset(key).with_method(method)  # a preset that quantizes no weights is refused here
    return method


def resolve_quant_name(name: str) -> str:
    """A preset name from a preset or alias (case-insensitive); QuantConfigError lists the valid ones.
    A pass preset (`PASS_PRESETS`) may carry its pass's options (`wint2{w4_end_layer=6}`), a rule
    preset the `method=` option (`wint4{method=gptq}`): the result is the bare name."""
    key, options = split_quant_options(name)
    low = key.lower()
    if low in PASS_PRESETS:
        return low
    if options:
        preset_method(name)
        return resolve_quant_name(key)
    if low in PRESETS:
        return low
    if low in ALIASES:
        return ALIASES[low]
    known = [*PRESETS, *PASS_PRESETS, *ALIASES]
    raise QuantConfigError(f"unknown quantization {name!r}{did_you_mean(key, known)}; presets and aliases: "
                           f"{', '.join(known)}")


_FD_TYPES = {"wint8": Algo.WEIGHT_ONLY_INT8, "wint4": Algo.WEIGHT_ONLY_INT4,
             "weight_only_int8": Algo.WEIGHT_ONLY_INT8, "weight_only_int4": Algo.WEIGHT_ONLY_INT4,
             "none": Algo.NONE, "bf16": Algo.NONE, "fp8": Algo.FP8, "tensor_wise_fp8": Algo.FP8}


def _from_fastdeploy_mix(data: dict[str, Any], source: str) -> QuantConfig:
    """FastDeploy `mix_quant`: dense_quant_type for every linear, moe_quant_type for routed experts."""
    try:
        dense = _FD_TYPES[str(data.get("dense_quant_type", "wint8")).lower()]
        moe = _FD_TYPES[str(data.get("moe_quant_type", "wint4")).lower()]
    except KeyError as e:
        raise QuantConfigError(f"{source}: unsupported FastDeploy quant type {e.args[0]!r} "
                               f"(supported: {', '.join(_FD_TYPES)})") from None
    name = "wint8mix" if (dense, moe) == (Algo.WEIGHT_ONLY_INT8, Algo.WEIGHT_ONLY_INT4) else "mix_quant"
    return QuantConfig(name=name, rules=(_rule(".*", dense), _rule(ROUTED_EXPERTS, moe)))


def _from_compute_type(data: dict[str, Any], source: str) -> QuantConfig:
    ct = str(data["compute_type"]).lower()
    if ct in ("bf16", "fp16", "none"):
        raise QuantConfigError(f"{source}: compute_type {ct!r} means no quantization")
    return QuantConfig.preset(ct)


def _from_paddleslim(data: dict[str, Any], source: str) -> QuantConfig:
    """PaddleSlim / PaddleFleetX `Quantization:` keys -> one QAT rule over every linear."""
    known = {"enable", "weight_quantize_type", "activation_quantize_type", "weight_preprocess_type",
             "activation_preprocess_type", "weight_bits", "activation_bits", "quantizable_layer_type",
             "onnx_format", "freeze_embedding", "skip_tensor_map", "moving_rate", "round_type"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise QuantConfigError(f"{source}: unknown PaddleSlim quantization keys {unknown}")
    if data.get("weight_preprocess_type") not in (None, "None", "none"):
        raise QuantConfigError(f"{source}: weight_preprocess_type {data['weight_preprocess_type']!r} "
                               "is not supported (only activation PACT)")
    spec = {k: data[k] for k in ("weight_quantize_type", "activation_quantize_type", "weight_bits",
                                 "activation_bits", "activation_preprocess_type", "moving_rate",
                                 "round_type") if k in data}
    try:
        return QuantConfig(
            name="qat", rules=(QuantRule(match=".*", algo=Algo.QAT, **spec),),
            freeze_embedding=bool(data.get("freeze_embedding", True)),
            skip_tensor_map=read_skip_tensor_map(data.get("skip_tensor_map"), source, QuantConfigError),
        )
    except ValidationError as e:
        err = e.errors()[0]
        raise QuantConfigError(f"{source}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
