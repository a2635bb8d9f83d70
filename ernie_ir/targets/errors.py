"""The error of the target layer: an unknown target or a combination it cannot run."""

from __future__ import annotations

from ernie_ir.ir import ErnieIRError


class TargetError(ErnieIRError):
    """An unknown target or a combination the target cannot run."""
