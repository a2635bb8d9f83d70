"""docs/targets.md: its example runs, and its table matches the capability data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ernie_ir.targets import TARGETS

DOC = Path(__file__).resolve().parents[2] / "docs" / "targets.md"


def python_blocks(text: str) -> list[str]:
    """The page's ```python blocks, in order; a page without one fails (the test would pass empty)."""
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{DOC.name} has no ```python block: its example went missing or its fence changed"
    return blocks


def test_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for block in python_blocks(DOC.read_text(encoding="utf-8")):
        exec(compile(block, "targets.md", "exec"), {"__name__": "docs_targets"})


def test_a_page_without_an_example_fails() -> None:
    with pytest.raises(AssertionError, match="no ```python block"):
        python_blocks("# targets\n\n```bash\nernie-ir passes\n```\n")


def test_table_matches_capabilities() -> None:
    text = DOC.read_text(encoding="utf-8")
    for t in TARGETS.values():
        for fact in (t.launch_flag, t.visible_devices_env, t.paddle_device, t.collective_backend.split()[0]):
            assert fact in text, (t.name, fact)
        assert t.weight_only is not None and t.weight_only.source
