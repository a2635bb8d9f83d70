"""ernie-ir: a declarative graph compiler for ERNIE and GPT models.

`ernie_ir.ir` is the core (types, graph, text format, verifier); the layers
above it are `ops`, `passes`/`frontends`, `runtime`, `targets` and `cli`
(docs/architecture.md). Importing this package itself loads none of them, so
`ernie-ir --version` and `--help` start without numpy, pydantic or the op set:
the op set (`ernie_ir.ops`) is imported right after the IR core is, whoever
imports the core first, so every graph built or parsed finds its ops.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


class _Package(ModuleType):
    # The import system binds a finished subpackage on its parent with setattr; binding
    # `ir` is the moment to register the op set (before that, nothing could look an op up).
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "ir" and f"{__name__}.ops" not in sys.modules:
            from . import ops  # noqa: F401  (registers the op set)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name == "__version__":  # importlib.metadata costs ~20 ms: only when asked
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("ernie-ir")
        except PackageNotFoundError:  # running from a source tree that is not installed
            value = "0.0.0+source"
        globals()["__version__"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
