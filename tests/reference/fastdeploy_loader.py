"""Run FastDeploy's own loader (the harness `fd_load_check.py`, a byte-identical copy of
../shared/fastdeploy's) on a folder, in the `fd` reference environment.

Used by tests/targets/test_fastdeploy_loader.py and scripts/fastdeploy_matrix.py. The harness
is run as it is; what this adds is the device's compute capability for Paddle's
`weight_quantize` (`fd_device/sitecustomize.py`): FastDeploy quantizes a bf16 checkpoint at load
with `weight_quantize(..., arch=None)` for routed experts, and Paddle asks the GPU for the arch,
which a CPU has none of. The harness already answers FastDeploy's own device queries with the
same number (FDCHECK_SM).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "fd_load_check.py"
DEVICE = HERE / "fd_device"
ROOT = Path(os.environ.get("ERNIE_IR_REFENVS", Path.home() / ".cache" / "ernie-ir" / "refenvs")) / "fd"
PYTHON, SRC = ROOT / "venv" / "bin" / "python", ROOT / "src"
NOT_PREQUANTIZED = "FastDeploy does not read this folder as pre-quantized"
"""The harness's one config finding on a bf16 folder FastDeploy quantizes at load (it judges
pre-quantized folders): expected there, a mismatch anywhere else."""


def available() -> str | None:
    """None when the environment is built, else why not (with the command that builds it)."""
    if PYTHON.is_file() and (SRC / "fastdeploy").is_dir():
        return None
    return f"FastDeploy's loader environment is not built ({ROOT}): bash tests/reference/install_envs.sh fd"


@dataclass
class LoadResult:
    last: str
    """The harness's last line: "ok" or "N mismatches"."""
    ranks: list[dict]
    """Its per-rank JSON report (rank, loader, quant, params, keys, mismatches, notes)."""

    def findings(self) -> list[dict]:
        return [m for r in self.ranks for m in r["mismatches"]]

    def loads_at_load_time(self) -> bool:
        """Read cleanly as a bf16 folder FastDeploy quantizes at load: the only finding is the
        harness's "not pre-quantized" remark, once per rank."""
        found = self.findings()
        return bool(self.ranks) and len(found) == len(self.ranks) and all(
            m["kind"] == "config" and NOT_PREQUANTIZED in m["what"] for m in found)


def fastdeploy_load(folder: Path, workdir: Path, *, load_choices: str = "default_v1",
                    arch: int = 80, timeout: int = 600) -> LoadResult:
    """FastDeploy's loader `load_choices` (the engine's default: default_v1) on `folder`, on a
    device of compute capability `arch`. FastDeploy's modules write a log/ folder into the
    working folder: `workdir`, never the checkout."""
    report = workdir / f"{folder.name}-{load_choices}.json"
    command = [str(PYTHON), str(HARNESS), str(folder), "--fd-src", str(SRC), "--json", str(report),
               "--load-choices", load_choices]
    env = {**os.environ, "FDCHECK_SM": str(arch), "ERNIE_IR_FD_ARCH": str(arch),
           "PYTHONPATH": os.pathsep.join(p for p in (str(DEVICE), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=workdir, env=env)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not lines or not report.is_file():
        raise RuntimeError(f"the FastDeploy loader check printed nothing: {done.stderr[-2000:]}")
    return LoadResult(lines[-1].strip(), json.loads(report.read_text()))
