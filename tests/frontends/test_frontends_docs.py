"""docs/frontends.md: its Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "frontends.md"


def test_frontends_doc_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_frontends"}
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"frontends.md[block {i}]", "exec"), namespace)
