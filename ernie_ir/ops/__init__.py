"""The built-in op set: one module per op family, each class decorated with `@register_op`.

Adding an op is a one-file change: drop a module here (docs/ops.md). The
modules are imported on the registry's first lookup (`get_op`, `all_ops`, a
GraphBuilder method, parsing IR text), not when `ernie_ir` is imported, so a
command that needs no op (`ernie-ir --version`) does not pay for them.
`ernie_ir.ops.<module>` still imports that module on first access.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ernie_ir.ir.registry import REGISTRY


def _modules() -> list[str]:
    return [i.name for i in pkgutil.iter_modules(__path__) if not i.name.startswith("_")]


def load_builtin_ops() -> None:
    """Import every op module of this package (each registers its ops)."""
    for name in _modules():
        importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str) -> ModuleType:
    if name in _modules():
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


REGISTRY.add_loader(load_builtin_ops)
