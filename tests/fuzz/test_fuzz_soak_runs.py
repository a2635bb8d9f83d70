"""benchmarks/fuzz_soak.py runs and reports (a few inputs: the soak itself is minutes long)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_soak.py"


@pytest.mark.slow
def test_soak_reports_inputs_bugs_and_the_slowest() -> None:
    done = subprocess.run([sys.executable, str(SOAK), "--examples", "40", "--round", "20", "--seed", "3",
                           "--only", "memory,pipeline-text"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("seed 3 ")
    assert "40 inputs" in out and "non-project exceptions: 0" in out
    assert "slowest input:" in out
    assert [line.split()[:2] for line in out.splitlines() if line.startswith(("memory", "pipeline-text"))] \
        == [["memory", "20"], ["pipeline-text", "20"]]
