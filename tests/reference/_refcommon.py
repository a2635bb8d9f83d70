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


# -- greedy generation (spec key "generate") -----------------------------------------------------

GENERATE_DEFAULT_NEW_TOKENS = 8


def generate_spec(spec: dict[str, Any], ids: np.ndarray, vocab_size: int) -> dict[str, Any] | None:
    """The spec's ``generate`` entry, checked; None when absent.

    ``{"prompts": [[ids], ...], "max_new_tokens": N}``: prompts of any lengths (default: the
    rows of ``input_ids``), N >= 1 (default 8). Exit 2 on a malformed entry.
    """
    g = spec.get("generate")
    if g is None or g is False:
        return None
    if g is True:
        g = {}
    if not isinstance(g, dict):
        raise SystemExit("generate must be a JSON object")
    prompts = g.get("prompts", ids.tolist())
    n = g.get("max_new_tokens", GENERATE_DEFAULT_NEW_TOKENS)
    ok = isinstance(prompts, list) and prompts and all(
        isinstance(p, list) and p and all(isinstance(t, int) and 0 <= t < vocab_size for t in p)
        for p in prompts
    )
    if not ok:
        raise SystemExit(f"generate.prompts must be non-empty lists of token ids in [0, {vocab_size})")
    if not isinstance(n, int) or n < 1:
        raise SystemExit("generate.max_new_tokens must be an int >= 1")
    return {"prompts": [list(p) for p in prompts], "max_new_tokens": n}


class StepLog:
    """What a reference library's ``generate`` fed its model at each forward call, and got back.

    The library-specific hooks call ``start`` before the forward (tokens fed, cache length,
    position ids if any), ``route_gap`` from inside it (MoE routers) and ``finish`` with the
    last position's logits [V] after it.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def start(self, input_len: int, cache_len: int, positions: list[int] | None) -> None:
        self.steps.append({"input_len": int(input_len), "cache_len": int(cache_len),
                           "position_ids": positions, "route_gap": None})

    def route_gap(self, gap: float) -> None:
        """Smallest gap, over a router's tokens, between the k-th and (k+1)-th expert score."""
        s = self.steps[-1]
        s["route_gap"] = float(gap) if s["route_gap"] is None else min(s["route_gap"], float(gap))

    def finish(self, last_logits: np.ndarray) -> None:
        row = np.asarray(last_logits, dtype=np.float64).reshape(-1)
        order = np.argsort(-row, kind="stable")
        top1, top2 = float(row[order[0]]), float(row[order[1]])
        scale = float(np.max(np.abs(row)))
        self.steps[-1].update({"argmax": int(order[0]), "margin": top1 - top2, "max_abs_logit": scale,
                               "rel_margin": (top1 - top2) / scale if scale > 0 else 0.0})


def topk_gap(scores: np.ndarray, k: int) -> float:
    """min over rows of (k-th largest - (k+1)-th largest) of ``scores`` [tokens, experts]."""
    s = -np.sort(-np.asarray(scores, dtype=np.float64), axis=-1)
    if s.shape[-1] <= k:
        return float("inf")
    return float(np.min(s[..., k - 1] - s[..., k]))


def check_greedy(
    prompt: list[int], new_tokens: list[int], log: StepLog, max_new_tokens: int
) -> dict[str, Any]:
    """This prompt's record for ``generated.json``; exit 1 unless the run was plain incremental greedy.

    Checked: exactly ``max_new_tokens`` new tokens (EOS did not stop it), one forward call per
    token, the first fed the whole prompt on an empty cache and every later one only the
    previous token on a cache holding everything before it (the KV cache was used), position
    ids (when the library passes them) continue the cache, and every token is the argmax of the
    raw logits of its step (no logits processor changed the choice).
    """
    steps = log.steps
    n = len(prompt)
    problems = []
    if len(new_tokens) != max_new_tokens:
        problems.append(f"{len(new_tokens)} new tokens, expected {max_new_tokens}")
    if len(steps) != max_new_tokens:
        problems.append(f"{len(steps)} forward calls, expected {max_new_tokens}")
    for i, s in enumerate(steps):
        want_len, want_cache = (n, 0) if i == 0 else (1, n + i - 1)
        if (s["input_len"], s["cache_len"]) != (want_len, want_cache):
            problems.append(f"step {i}: fed {s['input_len']} tokens on a cache of {s['cache_len']}, "
                            f"expected {want_len} on {want_cache}")
        want_pos = list(range(want_cache, want_cache + want_len))
        if s["position_ids"] is not None and s["position_ids"] != want_pos:
            problems.append(f"step {i}: position ids {s['position_ids']}")
        if i < len(new_tokens) and s.get("argmax") != new_tokens[i]:
            problems.append(f"step {i}: token {new_tokens[i]} is not the argmax {s.get('argmax')}")
    if problems:
        raise SystemExit("generate was not plain incremental greedy decoding: " + "; ".join(problems))
    gaps = [s["route_gap"] for s in steps]
    return {
        "prompt": prompt,
        "new_tokens": new_tokens,
        "rel_margin": [s["rel_margin"] for s in steps],
        "margin": [s["margin"] for s in steps],
        "route_gap": gaps if any(g is not None for g in gaps) else None,
        "input_lengths": [s["input_len"] for s in steps],
        "cache_lengths": [s["cache_len"] for s in steps],
        "position_ids_given": any(s["position_ids"] is not None for s in steps),
    }


def write_generated(out: Path, records: list[dict[str, Any]], how: dict[str, Any]) -> None:
    """Write ``generated.json``: ``new_tokens`` (one list per prompt), per-step margins, ``how``."""
    data = {
        "prompts": [r["prompt"] for r in records],
        "new_tokens": [r["new_tokens"] for r in records],
        "max_new_tokens": len(records[0]["new_tokens"]),
        "records": records,
        "how": how,
    }
    (out / "generated.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


# -- training steps (hf_full_train, pf_full_train) -----------------------------------------------

TRAIN_OPTIM: dict[str, Any] = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
                               "clip_norm": 1.0}
"""AdamW settings of the training references and their defaults (ernie-ir's TrainOptions defaults)."""


def train_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's AdamW settings (``TRAIN_OPTIM`` keys), the defaults where absent."""
    return {**TRAIN_OPTIM, **{k: v for k, v in spec.items() if k in TRAIN_OPTIM}}


def no_decay(spec: dict[str, Any]) -> list[str]:
    """The spec's ``no_decay``: name parts (``["bias", "norm"]``, the Trainers' choice) of the
    parameters AdamW does not decay; default ``[]``: every parameter is decayed, as ernie-ir does."""
    parts = spec.get("no_decay", [])
    if not isinstance(parts, list) or not all(isinstance(x, str) and x for x in parts):
        raise SystemExit("no_decay must be a list of non-empty strings")
    return parts


def train_batches(spec: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The spec's ``batches`` (one per optimizer step) as (input_ids, labels) int64 [rows, seq]
    arrays; ``labels`` defaults to ``input_ids``. Exit 2 if malformed."""
    raw = spec.get("batches")
    if not isinstance(raw, list) or not raw:
        raise SystemExit("spec needs batches: [{input_ids: [[...]], labels: [[...]]}, ...]")
    out = []
    for i, b in enumerate(raw):
        ids = np.asarray(b["input_ids"], dtype=np.int64)
        labels = np.asarray(b.get("labels", b["input_ids"]), dtype=np.int64)
        if ids.ndim != 2 or ids.shape != labels.shape:
            raise SystemExit(f"batches[{i}]: input_ids and labels must be [rows, seq] of one shape")
        out.append((ids, labels))
    return out
