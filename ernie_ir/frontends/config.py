"""config.json, parsed into one pydantic model per architecture.

Every model keeps the keys it does not know (`extra="allow"`), so the graph
metadata carries the whole config. A key is required where the reference
libraries disagree on its default or have none worth relying on
(`rms_norm_eps`: 1e-6 in paddleformers, 1e-5 in transformers and the
published configs; `rope_theta`: 10000 vs 500000; `moe_k`, `moe_num_experts`,
`moe_intermediate_size`; the model dims); elsewhere the default is the one
both libraries use, written next to the field. `resolve()` fills derived
values (kv heads, head_dim, the MoE end index) so that `model_dump()` is the
resolved config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ernie_ir.ir.inputs import read_json

from .errors import ConfigError

GELU_NAMES = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")

# Caps on the sizes a config may declare (docs/frontends.md, "Limits"). Each is far above
# every published model (ERNIE 4.5 300B: 54 layers, hidden 8192, vocab 103424, 64 experts;
# GPT-3: 96 layers, hidden 12288), and low enough that a graph of that size is built in
# bounded time and memory: a config claiming 10**30 layers is refused, not looped over.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16
MAX_INTERMEDIATE = 1 << 18
MAX_VOCAB = 1 << 22
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_POSITIONS = 1 << 24
MAX_EXPERTS = 1024


Layers = Annotated[int, Field(ge=1, le=MAX_LAYERS)]
LayerIndex = Annotated[int, Field(ge=0, le=MAX_LAYERS)]
EndIndex = Annotated[int, Field(ge=-1, le=MAX_LAYERS)]
Hidden = Annotated[int, Field(ge=1, le=MAX_HIDDEN)]
Intermediate = Annotated[int, Field(ge=1, le=MAX_INTERMEDIATE)]
Vocab = Annotated[int, Field(ge=1, le=MAX_VOCAB)]
Heads = Annotated[int, Field(ge=1, le=MAX_HEADS)]
HeadDim = Annotated[int, Field(ge=1, le=MAX_HEAD_DIM)]
Positions = Annotated[int, Field(ge=1, le=MAX_POSITIONS)]
Experts = Annotated[int, Field(ge=1, le=MAX_EXPERTS)]
SharedExperts = Annotated[int, Field(ge=0, le=MAX_EXPERTS)]
Eps = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
"""A normalization epsilon: finite, in (0, 1] (published: 1e-5, 1e-6)."""
Theta = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A finite positive float (RoPE base: 10000, 500000)."""


class ArchConfig(BaseModel):
    """Base of the per-architecture configs: unknown keys kept, errors as one line."""

    model_config = ConfigDict(extra="allow", validate_assignment=False)

    ARCHITECTURES: ClassVar[tuple[str, ...]] = ()
    HINTS: ClassVar[dict[str, str]] = {}
    """Per key, what to write when it is missing (the published models' value)."""

    architectures: list[str]

    @classmethod
    def parse(cls, data: Mapping[str, Any], source: str = "config.json") -> Self:
        """Validate a config dict; ConfigError names the key, the problem and the fix."""
        try:
            cfg = cls.model_validate(dict(data))
        except ValidationError as e:
            raise ConfigError(_describe(e, cls, source)) from None
        try:
            cfg.resolve()
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
        return cfg

    def resolve(self) -> None:
        """Fill derived values and check cross-key constraints (ValueError with the reason)."""

    @property
    def architecture(self) -> str:
        return next(a for a in self.architectures if a in self.ARCHITECTURES)

    def to_json(self) -> dict[str, Any]:
        """The resolved config, unknown keys included, as JSON values."""
        return self.model_dump(mode="json")


def _describe(e: ValidationError, cls: type[ArchConfig], source: str) -> str:
    err = e.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "config"
    arch = cls.ARCHITECTURES[0] if cls.ARCHITECTURES else "this model"
    if err["type"] == "missing":
        hint = cls.HINTS.get(key)
        fix = f"add it (published models use {hint})" if hint else "add it"
        return f"{source}: missing required key {key!r} for {arch}: {fix}"
    if err["type"] == "value_error":
        return f"{source}: {err.get('ctx', {}).get('error', err['msg'])}"
    fix = ("; that is above ernie-ir's cap for it (docs/frontends.md, Limits): check config.json"
           if err["type"] == "less_than_equal" else "")
    return f"{source}: key {key!r}: {err['msg']} (got {_shown(err.get('input'))}){fix}"


def _shown(value: Any) -> str:
    """A config value for a message: JSON, cut short (a value can be a 1000-deep list)."""
    try:
        text = json.dumps(value, default=str)
    except (RecursionError, ValueError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _rope_theta_from_parameters(data: Any) -> Any:
    """transformers 5 and paddleformers 1.2 write `rope_parameters: {rope_theta, rope_type}`."""
    if not isinstance(data, dict):
        return data
    params = data.get("rope_parameters")
    if isinstance(params, dict):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"rope_parameters.rope_type {kind!r} is not supported (only default RoPE)")
        if "rope_theta" not in data and "rope_theta" in params:
            data = {**data, "rope_theta": params["rope_theta"]}
    scaling = data.get("rope_scaling")
    if scaling not in (None, {}):
        raise ValueError(f"rope_scaling {_shown(scaling)} is not supported (only default RoPE)")
    return data


class Ernie45Config(ArchConfig):
    """ERNIE 4.5 dense (`Ernie4_5_ForCausalLM`)."""

    ARCHITECTURES = ("Ernie4_5_ForCausalLM", "Ernie4_5ForCausalLM")  # published Paddle; transformers
    HINTS = {"rms_norm_eps": "1e-05", "rope_theta": "500000.0"}

    vocab_size: Vocab
    hidden_size: Hidden
    intermediate_size: Intermediate
    num_hidden_layers: Layers
    num_attention_heads: Heads
    num_key_value_heads: Heads | None = None
    """Absent: as many as query heads (MHA), as both libraries do."""
    head_dim: HeadDim | None = None
    """Absent: 128 for the dense model (both libraries' default), hidden/heads for MoE."""
    rms_norm_eps: Eps
    rope_theta: Theta
    tie_word_embeddings: bool = True
    use_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: Positions | None = None

    DEFAULT_HEAD_DIM: ClassVar[int | None] = 128

    @model_validator(mode="before")
    @classmethod
    def _rope(cls, data: Any) -> Any:
        return _rope_theta_from_parameters(data)

    def resolve(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (ERNIE 4.5 uses silu)")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim is None:
            if self.DEFAULT_HEAD_DIM is not None:
                self.head_dim = self.DEFAULT_HEAD_DIM
            elif self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"no head_dim and hidden_size {self.hidden_size} is not a multiple of "
                    f"num_attention_heads {self.num_attention_heads}: add head_dim"
                )
            else:
                self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def kv_heads(self) -> int:
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def dim_per_head(self) -> int:
        assert self.head_dim is not None
        return self.head_dim


class Ernie45MoeConfig(Ernie45Config):
    """ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`)."""

    ARCHITECTURES = ("Ernie4_5_MoeForCausalLM", "Ernie4_5MoeForCausalLM")
    HINTS = {
        **Ernie45Config.HINTS,
        "moe_num_experts": "64",
        "moe_k": "6 (21B-A3B) or 8 (300B-A47B)",
        "moe_intermediate_size": "1536 (21B-A3B) or 3584 (300B-A47B)",
    }
    DEFAULT_HEAD_DIM = None

    moe_num_experts: Experts
    moe_k: Experts
    moe_intermediate_size: Intermediate
    moe_num_shared_experts: SharedExperts = 2
    moe_layer_start_index: LayerIndex = 1
    moe_layer_end_index: EndIndex = -1
    """-1: the last layer."""
    moe_layer_interval: Layers = 1
    moe_norm_min: Eps = 1e-12
    moe_use_aux_free: bool | None = None
    """True: the checkpoint must carry `moe_statics.e_score_correction_bias`; None: use it if present."""
    num_nextn_predict_layers: LayerIndex = 0

    def resolve(self) -> None:
        super().resolve()
        for key in ("moe_gate_act", "scoring_func"):
            value = getattr(self, key, None)
            if value not in (None, "softmax"):
                raise ValueError(f"{key} {value!r} is not supported (ERNIE 4.5 routes with softmax)")
        if self.use_bias:
            raise ValueError("use_bias: true is not supported for the MoE model (the experts have no bias)")
        if self.moe_k > self.moe_num_experts:
            raise ValueError(f"moe_k {self.moe_k} exceeds moe_num_experts {self.moe_num_experts}")
        if self.moe_layer_end_index == -1:
            self.moe_layer_end_index = self.num_hidden_layers - 1

    def is_moe_layer(self, i: int) -> bool:
        """Layer i is MoE when (i+1) % interval == 0 and start <= i <= end (REFERENCE 1.1)."""
        return (
            (i + 1) % self.moe_layer_interval == 0
            and self.moe_layer_start_index <= i <= self.moe_layer_end_index
        )


class Ernie35SEConfig(ArchConfig):
    """ERNIE-3.5-SE parallel transformer (PaddleNLP `llm/ernie-3.5-se`, `Ernie35ForCausalLM`).

    Defaults are `Ernie35Config`'s; the model dims are required.
    """

    ARCHITECTURES = ("Ernie35ForCausalLM",)

    vocab_size: Vocab
    hidden_size: Hidden
    intermediate_size: Intermediate
    num_hidden_layers: Layers
    num_attention_heads: Heads
    layer_norm_eps: Eps = 1e-6
    use_bias: bool = False
    parallel_attn_hatf: bool = True
    """Head attention, tail FFN: layer 0 is attention only, the last layer FFN only."""
    enable_random_position_ids: bool = False
    """At inference the reference then uses positions 8(s+1)-1 (see docs/frontends.md)."""
    max_position_embeddings: Positions = 2048
    tie_word_embeddings: bool = False
    weight_share_add_bias: bool = True
    """With use_bias: the lm_head has a bias [V]."""
    rope_theta: Theta = 10000.0

    def resolve(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("the head dim (hidden_size / num_attention_heads) must be even for RoPE")
        if self.parallel_attn_hatf and self.num_hidden_layers < 2:
            raise ValueError("parallel_attn_hatf needs at least 2 layers (attention head, FFN tail)")
        hidden_act = getattr(self, "hidden_act", "silu")
        if hidden_act not in (None, "silu"):
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (ERNIE-3.5-SE uses silu)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def lm_head_bias(self) -> bool:
        return self.use_bias and self.weight_share_add_bias

    def layer_kind(self, i: int) -> str:
        """`attention` (head), `ffn` (tail) or `parallel`."""
        if self.parallel_attn_hatf and i == 0:
            return "attention"
        if self.parallel_attn_hatf and i == self.num_hidden_layers - 1:
            return "ffn"
        return "parallel"


class GPTConfig(ArchConfig):
    """GPT-3 family of PaddleNLP / PaddleFleetX (`GPTForCausalLM`).

    PaddleNLP's GPT always uses tanh-GELU, LayerNorm eps 1e-5 and a head tied
    to the word embeddings, whatever config.json says (REFERENCE 2): so do we;
    `layer_norm_eps` is kept in the metadata but not used.
    """

    ARCHITECTURES = ("GPTForCausalLM", "GPTForPretraining", "GPTLMHeadModel")

    vocab_size: Vocab
    hidden_size: Hidden
    num_hidden_layers: Layers
    num_attention_heads: Heads
    intermediate_size: Intermediate
    max_position_embeddings: Positions
    hidden_activation: str = "gelu"
    normalize_before: bool = True
    fuse_attention_qkv: bool = False
    """Only used without a checkpoint; with one, the tensors say whether qkv is fused."""

    LAYER_NORM_EPS: ClassVar[float] = 1e-5

    @model_validator(mode="before")
    @classmethod
    def _activation_alias(cls, data: Any) -> Any:
        if isinstance(data, dict) and "hidden_activation" not in data and "hidden_act" in data:
            data = {**data, "hidden_activation": data["hidden_act"]}
        return data

    def resolve(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.hidden_activation not in GELU_NAMES:
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported "
                "(PaddleNLP's GPT computes tanh-GELU)"
            )
        if not self.normalize_before:
            raise ValueError("normalize_before: false (post-LayerNorm GPT) is not supported")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


CONFIG_CLASSES: tuple[type[ArchConfig], ...] = (Ernie45Config, Ernie45MoeConfig, Ernie35SEConfig, GPTConfig)


def supported_architectures() -> list[str]:
    return [a for cls in CONFIG_CLASSES for a in cls.ARCHITECTURES]


def config_class_for(data: Mapping[str, Any], source: str) -> type[ArchConfig]:
    """The config class for a config dict, from its `architectures` list."""
    supported = ", ".join(supported_architectures())
    archs = data.get("architectures")
    if archs is None:
        raise ConfigError(
            f"{source} has no 'architectures' key: add one, e.g. \"architectures\": "
            f"[\"Ernie4_5_ForCausalLM\"] (supported: {supported})"
        )
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{source}: 'architectures' must be a list of names, got {_shown(archs)}")
    for arch in archs:
        for cls in CONFIG_CLASSES:
            if arch in cls.ARCHITECTURES:
                return cls
    shown = ", ".join(a if a.isprintable() else repr(a) for a in archs) if archs else "an empty list"
    raise ConfigError(f"{source}: architecture {shown} is not supported (supported: {supported})")


def parse_config(data: Mapping[str, Any], source: str = "config.json") -> ArchConfig:
    """The typed config for a config dict (class chosen by `architectures`)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source} must hold a JSON object, got {type(data).__name__}")
    data = dict(data)
    if isinstance(data.get("architectures"), str):
        data["architectures"] = [data["architectures"]]
    return config_class_for(data, source).parse(data, source)


def read_config(folder: Path) -> ArchConfig:
    """Parse `folder/config.json`."""
    path = folder / "config.json"
    if not path.exists():
        raise ConfigError(
            f"{folder} has no config.json: a model folder needs config.json next to its weights"
        )
    data = read_json(path, "config file", ConfigError)
    return parse_config(data, str(path))
