"""Shared helpers of the paddle.distributed tests (a plain module: tests/distributed has no package).

- `compile_art(tmp, model, **kw)`: compile a built-in @tiny model for cuda into `tmp/<name>`.
- `rel_err(a, b)`: relative Frobenius error.
- `leftover_processes()`: pids of live processes a launch from this test process started
  (the launcher gives each the parent's pid in ERNIE_IR_PARENT_PID): must always be empty.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ernie_ir.targets import CompileOptions, compile_model

IDS = np.array([[1, 5, 900, 77, 3, 1000, 511, 512],
                [1023, 0, 512, 511, 767, 768, 2, 4]], dtype=np.int64)  # both vocab halves at tp 2


def compile_art(tmp: Path, model: str, name: str, **kw: Any) -> Path:
    out = tmp / name
    compile_model(model, "cuda", CompileOptions(out=out, **kw))
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def processes_with_env(key: str, value: str) -> list[int]:
    """Pids of the processes (this one excluded) whose environment holds KEY=VALUE: what a test
    started and tagged, so it kills only those."""
    needle = f"{key}={value}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def leftover_processes() -> list[int]:
    return processes_with_env("ERNIE_IR_PARENT_PID", str(os.getpid()))
