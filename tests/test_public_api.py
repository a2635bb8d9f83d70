"""The public API is a promise: every name docs/pass-authoring.md and docs/ops.md import
resolves, from a public module, so a move that breaks a plugin written from the docs fails here
first (a moved module keeps its old path as a re-export: tests/test_layering.py `MOVED`)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PROMISED = ["pass-authoring.md", "ops.md"]
# Imports the docs made before a move; they must keep resolving too.
FORMERLY_DOCUMENTED = [("ernie_ir.runtime.onnx_backend", "full_sequence_feeds")]


def documented_imports() -> list[tuple[str, str, str]]:
    """(doc, module, name) for every `from ernie_ir... import ...` in the docs' code blocks."""
    found = []
    for doc in PROMISED:
        text = (DOCS / doc).read_text(encoding="utf-8")
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            joined = re.sub(r"\(\s*([^)]*?)\s*\)", lambda m: " ".join(m.group(1).split()), block)
            for module, names in re.findall(r"^\s*from (ernie_ir[\w.]*) import (.+)$", joined, flags=re.M):
                for name in names.split("#")[0].split(","):
                    name = name.split(" as ")[0].strip()
                    if name:
                        found.append((doc, module, name))
    return found


def test_the_docs_import_something() -> None:
    modules = {m for _, m, _ in documented_imports()}
    assert {"ernie_ir.passes", "ernie_ir.ir", "ernie_ir.runtime", "ernie_ir.backends.onnx"} <= modules


@pytest.mark.parametrize(("doc", "module", "name"),
                         [*documented_imports(), *(("(formerly)", m, n) for m, n in FORMERLY_DOCUMENTED)])
def test_every_documented_name_resolves_from_a_public_module(doc: str, module: str, name: str) -> None:
    assert not any(part.startswith("_") for part in module.split(".")), f"{doc}: {module} is private"
    assert hasattr(importlib.import_module(module), name), f"{doc}: {module} has no {name}"
