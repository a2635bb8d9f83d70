"""docs/targets.md: its example runs, and its table matches the capability data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ernie_ir.targets import TARGETS

DOC = Path(__file__).resolve().parents[2] / "docs" / "targets.md"


def test_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S):
        exec(compile(block, "targets.md", "exec"), {"__name__": "docs_targets"})


def test_table_matches_capabilities() -> None:
    text = DOC.read_text(encoding="utf-8")
    for t in TARGETS.values():
        for fact in (t.launch_flag, t.visible_devices_env, t.paddle_device, t.collective_backend.split()[0]):
            assert fact in text, (t.name, fact)
        assert t.weight_only is not None and t.weight_only.source
