"""docs/quantization.md's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "quantization.md"


def test_quantization_doc_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_quantization"}
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"quantization.md[block {i}]", "exec"), namespace)
