"""The known targets by name."""

from __future__ import annotations

from ernie_ir.ir import ErnieIRError

from .ascend import ASCEND
from .capabilities import HardwareTarget
from .cuda import CUDA
from .kunlun import KUNLUN

TARGETS: dict[str, HardwareTarget] = {t.name: t for t in (CUDA, ASCEND, KUNLUN)}


class TargetError(ErnieIRError):
    """An unknown target or a combination the target cannot run."""


def get_target(name: str) -> HardwareTarget:
    t = TARGETS.get(name.strip().lower())
    if t is None:
        raise TargetError(f"unknown target {name!r}: choose one of {', '.join(TARGETS)}")
    return t
