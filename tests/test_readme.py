"""The README's quick start works as written (minus the install, already done here)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_quick_start_commands_run(tmp_path: Path) -> None:
    first = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)[0]
    commands = [c.strip() for c in first.strip().split("&&")]
    assert commands[0].startswith("pip install")
    ernie = Path(sys.executable).with_name("ernie-ir")
    outputs = []
    for command in commands[1:]:
        argv = shlex.split(command)
        assert argv[0] == "ernie-ir"
        done = subprocess.run([str(ernie), *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert "kernel plan" in outputs[0]
    assert "top1_agreement" in outputs[-1]
