"""Small helpers shared by the reference scripts (standard library + numpy only).

Every reference script is called as::

    python SCRIPT SPEC OUT_DIR

where SPEC is either a JSON object written inline or the path of a JSON file,
and OUT_DIR is created if needed. Scripts record what they did in
``OUT_DIR/meta.json``. This module never imports a deep-learning library, so
it works in every reference environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None = None) -> tuple[dict[str, Any], Path]:
    """Return (spec, out_dir) from ``SCRIPT SPEC OUT_DIR``; exit 2 on misuse."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        name = Path(sys.argv[0]).name
        print(f"usage: python {name} SPEC_JSON_OR_PATH OUT_DIR", file=sys.stderr)
        raise SystemExit(2)
    text = args[0]
    if not text.lstrip().startswith("{"):
        text = Path(text).read_text()
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise SystemExit("spec must be a JSON object")
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    return spec, out


def token_ids(spec: dict[str, Any], vocab_size: int, seed: int) -> np.ndarray:
    """The spec's ``input_ids`` ([batch, seq] ints), or seeded random ones (2 x 7)."""
    ids = spec.get("input_ids")
    if ids is None:
        rng = np.random.default_rng(seed + 1000)
        ids = rng.integers(0, vocab_size, size=(2, 7))
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 2:
        raise SystemExit(f"input_ids must be [batch, seq], got shape {arr.shape}")
    return arr


def random_param(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A seeded float32 value for a parameter, chosen so that every weight matters.

    1-D: biases (name ends in "bias") 0.1 N(0,1); norm weights 1 + 0.1 N(0,1).
    Embeddings (name contains "embed"): 0.5 N(0,1). Other matrices:
    N(0, 1/fan_in), where fan_in is the smaller dimension of a 2-D weight (so it
    does not depend on the [in, out] vs [out, in] convention) and the last
    dimension of a 3-D (stacked expert, [E, out, in]) weight.
    """
    if len(shape) == 1:
        if name.endswith("bias"):
            return (0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1] if len(shape) == 3 else min(shape)
    std = 0.5 if "embed" in name else fan_in**-0.5
    return (std * rng.standard_normal(shape)).astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even) and return the uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits (uint16) to float32 exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_meta(out: Path, meta: dict[str, Any]) -> None:
    """Write ``meta.json`` (sorted keys, indented) into ``out``."""
    (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def check_finite(name: str, arr: np.ndarray) -> None:
    """Exit non-zero if ``arr`` holds a NaN or an infinity."""
    if not np.all(np.isfinite(arr)):
        raise SystemExit(f"{name} has non-finite values")


class Timer:
    """Wall-clock stopwatch: ``t = Timer(); ...; t.lap('build')`` records seconds."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self.start, 4)
        self.start = now


def quiet_env() -> None:
    """Reduce library log noise before the heavy imports (best effort)."""
    os.environ.setdefault("GLOG_minloglevel", "2")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
