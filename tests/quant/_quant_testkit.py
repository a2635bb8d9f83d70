"""Shared helpers of the quantization / LoRA tests (a plain module: tests/quant is not a package).

- Reference runs: `run_reference(script, spec, out)` runs a script from
  tests/quant/reference (or tests/reference) with the Python of the `pf`
  reference environment ($ERNIE_IR_REFENVS/pf, default /work/refenvs). Without
  the environment the test is skipped locally, but fails when ERNIE_IR_REFENVS
  is set (CI installs the environments and sets it, so cross-checks run there).
- `logits(graph, ids)`, `rel_error(out, ref)` (Frobenius) and `top1(out, ref)`.
- Paddle's weight_quantize layout for arch 70, undone (`undo_sm70_int8/int4`).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ernie_ir.ir import Graph
from ernie_ir.runtime.interpreter import run_graph

REPO = Path(__file__).resolve().parents[2]
SCRIPT_DIRS = (REPO / "tests" / "quant" / "reference", REPO / "tests" / "reference")


def refenvs_root() -> Path:
    return Path(os.environ.get("ERNIE_IR_REFENVS", str(Path.home() / ".cache" / "ernie-ir" / "refenvs")))


def ref_python(env: str = "pf") -> Path:
    """The Python of reference environment `env`; skip (locally) or fail (CI) if absent."""
    py = refenvs_root() / env / "bin" / "python"
    if py.is_file():
        return py
    why = (f"reference environment {env!r} not found under {refenvs_root()} "
           "(install it with tests/reference/install_envs.sh)")
    if "ERNIE_IR_REFENVS" in os.environ:
        pytest.fail(why + "; ERNIE_IR_REFENVS is set, so cross-checks must run")
    pytest.skip(why)


def run_reference(script: str, spec: Mapping[str, Any], out: Path, env: str = "pf",
                  timeout: int = 300) -> Path:
    """Run `script` SPEC OUT in the reference environment; returns OUT."""
    py = ref_python(env)
    path = next((d / script for d in SCRIPT_DIRS if (d / script).is_file()), None)
    if path is None:
        pytest.fail(f"reference script {script} is missing from {[str(d) for d in SCRIPT_DIRS]}")
    proc = subprocess.run(
        [str(py), str(path), json.dumps(dict(spec)), str(out)],
        cwd=path.parent, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(str(d) for d in SCRIPT_DIRS)},
    )
    if proc.returncode != 0:
        pytest.fail(f"{script} failed ({proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
    return out


def logits(graph: Graph, ids: np.ndarray) -> np.ndarray:
    return run_graph(graph, {"input_ids": ids})["logits"]


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref||_F / ||ref||_F, in float64."""
    a, b = out.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def top1(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean(out.argmax(-1) == ref.argmax(-1)))


def token_ids(vocab: int, shape: tuple[int, int] = (2, 12), seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int64)


def undo_sm70_int8(raw: np.ndarray, k: int, n: int) -> np.ndarray:
    """Paddle weight_quantize(int8, arch=70) bytes -> the int8 values [k, n].

    The kernel writes q row-major [in, out], adds 128 to every byte and swaps
    elements 1 and 2 of every group of 4 (add_bias_and_interleave).
    """
    b = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, 4)[:, [0, 2, 1, 3]]
    return (b.reshape(k, n).astype(np.int16) - 128).astype(np.int8)


def undo_sm70_int4(raw: np.ndarray, k: int, n: int) -> np.ndarray:
    """Paddle weight_quantize(int4, arch=70) bytes -> the int4 values [k, n] (as int8).

    Two values per byte (low nibble first), each + 8, then in every 32-bit word
    destination nibble d holds source nibble 2d (d < 4) or 2(d - 4) + 1.
    """
    words = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).view(np.uint32)
    nib = np.zeros((words.size, 8), np.uint8)
    for d in range(8):
        src = 2 * d if d < 4 else 2 * (d - 4) + 1
        nib[:, src] = (words >> np.uint32(4 * d)) & np.uint32(0xF)
    return (nib.reshape(k, n).astype(np.int16) - 8).astype(np.int8)
