"""docs/fusion.md's Python examples run as written (tests/test_docs.py covers the other pages)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "fusion.md"


def test_fusion_doc_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_fusion"}
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"fusion.md[block {i}]", "exec"), namespace)
