"""The docs' Python examples run as written (so they cannot rot)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("name", ["pass-authoring.md", "ir.md", "architecture.md", "ops.md"])
def test_doc_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(DOCS / name)
    assert blocks, f"{name} has no python examples"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{name.replace('-', '_').replace('.', '_')}"}
    from ernie_ir.passes.registry import REGISTRY

    REGISTRY.ensure_loaded()  # snapshot the built-ins too, or the cleanup below would drop them
    before = dict(REGISTRY.passes)
    from ernie_ir.ir import registry as ops

    ops_before = set(ops.all_ops())  # docs/ops.md registers an op
    try:
        for i, block in enumerate(blocks, 1):
            exec(compile(block, f"{name}[block {i}]", "exec"), namespace)
    finally:
        # The tutorial registers a pass; keep the registry as other tests expect it.
        for key in set(REGISTRY.passes) - set(before):
            del REGISTRY.passes[key]
            REGISTRY.origins.pop(key, None)
        for key in set(ops.all_ops()) - ops_before:
            ops.REGISTRY.remove(key)
