"""Artifacts and plugins written before the layout moved: an old launch.sh looks up the rank
worker at its old path and runs that file; it must stop in one line that says to recompile."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_an_old_launch_script_is_told_to_recompile() -> None:
    # what an old launch.sh does: look the worker up by its old module path, run the file
    lookup = "import ernie_ir.runtime.paddle_dist as w; print(w.__file__)"
    where = subprocess.run([sys.executable, "-c", lookup], capture_output=True, text=True,
                           check=True).stdout.strip()
    done = subprocess.run([sys.executable, where, "run", "art", "--tokens", "1,2"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "recompile the artifact" in lines[0]


@pytest.mark.slow
def test_the_new_workers_run_as_modules() -> None:
    for module in ("ernie_ir.backends.paddle.rank_worker", "ernie_ir.training.rank_worker"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"usage: python -m {module}" in done.stdout
