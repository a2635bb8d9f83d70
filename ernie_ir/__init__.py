"""ernie-ir: a declarative graph compiler for ERNIE and GPT models.

`ernie_ir.ir` is the core (types, graph, text format, verifier); importing
this package hooks up the op set (`ernie_ir.ops`), which loads on first lookup.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ernie-ir")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"

from . import ir, ops  # noqa: F401  (ops registers the op set's loader)
