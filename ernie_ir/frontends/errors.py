"""Errors a frontend raises: each names the problem and the fix in one line.

All are `ErnieIRError`s, so the CLI prints the message and exits with 2.
"""

from __future__ import annotations

from collections.abc import Sequence

from ernie_ir.ir import ErnieIRError


class FrontendError(ErnieIRError):
    """A model folder, config or built-in name that cannot be turned into a graph."""


class UnknownModelError(FrontendError):
    """The spec is neither a model folder nor a built-in model name."""


class ConfigError(FrontendError):
    """config.json is missing, malformed, or describes a model we cannot build."""


class CheckpointError(FrontendError):
    """The weights do not match the config: missing, unexpected or misshaped tensors, mixed layouts."""


class UntrustedPickleError(FrontendError):
    """A pickle-based checkpoint (.pdparams) was found but not trusted explicitly."""


def name_some(names: Sequence[str], first: int = 5) -> str:
    """`a, b, c (and 12 more)`: the first few names of a list, for one-line messages."""
    shown = ", ".join(names[:first])
    rest = len(names) - first
    return f"{shown} (and {rest} more)" if rest > 0 else shown
