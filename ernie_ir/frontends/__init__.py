"""Frontends: checkpoint folders and built-in model names into graphs.

    from ernie_ir.frontends import load_model
    graph = load_model("ERNIE-4.5-0.3B-Paddle")        # a folder: config.json + weights
    graph = load_model("ernie-4.5-21b-a3b@tiny")       # built-in, small, random weights
    graph = load_model("ernie-4.5-300b-a47b@meta")     # built-in, full size, no weights

Architectures: ERNIE 4.5 dense and MoE (Paddle and HF weight layouts),
ERNIE-3.5-SE, GPT (PaddleNLP / PaddleFleetX). See docs/frontends.md.
"""

from .builtins import builtin_models
from .checkpoint import TensorStore, open_checkpoint
from .config import (
    ArchConfig,
    Ernie35SEConfig,
    Ernie45Config,
    Ernie45MoeConfig,
    GPTConfig,
    parse_config,
    read_config,
    supported_architectures,
)
from .errors import (
    CheckpointError,
    ConfigError,
    FrontendError,
    UnknownModelError,
    UntrustedPickleError,
)
from .loader import build_graph, load_builtin, load_folder, load_model
from .params import GeneratedWeights, MetaWeights, WeightProvider

__all__ = [
    "ArchConfig",
    "CheckpointError",
    "ConfigError",
    "Ernie35SEConfig",
    "Ernie45Config",
    "Ernie45MoeConfig",
    "FrontendError",
    "GPTConfig",
    "GeneratedWeights",
    "MetaWeights",
    "TensorStore",
    "UnknownModelError",
    "UntrustedPickleError",
    "WeightProvider",
    "build_graph",
    "builtin_models",
    "load_builtin",
    "load_folder",
    "load_model",
    "open_checkpoint",
    "parse_config",
    "read_config",
    "supported_architectures",
]
