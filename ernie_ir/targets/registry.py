"""The known targets by name: the built-ins (cuda, ascend, kunlun) and the plugins'.

A package adds a target through the entry-point group `ernie_ir.targets` (docs/targets.md
"Adding a target"): `dcu = "my_dcu:DCU"`, the entry point's name the target's name and its
object a `HardwareTarget` (or a function returning one). Plugins load on the first lookup
(`get_target`, `all_targets`, iterating `TARGETS`), once. A plugin that fails to load (an
import error, not a HardwareTarget, a name that differs from the entry point's or that a
target already has) is recorded with its error and never breaks the others; asking for its
target names the plugin and the error in one line, as for op and pass plugins.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points

from ernie_ir.ir.registry import BrokenPlugin
from ernie_ir.ir.suggest import did_you_mean
from ernie_ir.targets.ascend import ASCEND
from ernie_ir.targets.capabilities import HardwareTarget
from ernie_ir.targets.cuda import CUDA
from ernie_ir.targets.errors import TargetError
from ernie_ir.targets.kunlun import KUNLUN

ENTRY_POINT_GROUP = "ernie_ir.targets"
BUILTIN: tuple[HardwareTarget, ...] = (CUDA, ASCEND, KUNLUN)


class TargetRegistry(Mapping[str, HardwareTarget]):
    """Targets by name (a read-only mapping; plugins load on first use), where each came from,
    and the target plugins that failed to load."""

    def __init__(self, builtin: tuple[HardwareTarget, ...]) -> None:
        self.targets: dict[str, HardwareTarget] = {t.name: t for t in builtin}
        self.origins: dict[str, str] = {t.name: "built-in" for t in builtin}
        self.broken: list[BrokenPlugin] = []
        self._loaded = False

    def ensure_loaded(self) -> None:
        """Load every `ernie_ir.targets` entry point, once; a failure is recorded in `broken`."""
        if self._loaded:
            return
        self._loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                self.add(_as_target(ep.load()), f"plugin {ep.name} ({ep.value})", ep.name)
            except Exception as e:  # a broken plugin must never break the other targets
                self.broken.append(BrokenPlugin("target", ep.name, ep.value, f"{type(e).__name__}: {e}"))

    def add(self, target: HardwareTarget, origin: str, name: str | None = None) -> HardwareTarget:
        """Register `target` (`name`: the entry point's, which must be the target's)."""
        if name is not None and name != target.name:
            raise ValueError(f"the entry point is named {name!r} but its target is {target.name!r}")
        if target.name != target.name.strip().lower() or not target.name:
            raise ValueError(f"target name {target.name!r} must be lower case, without spaces")
        if target.name in self.targets:
            raise ValueError(f"target {target.name!r} is already registered ({self.origins[target.name]})")
        self.targets[target.name] = target
        self.origins[target.name] = origin
        return target

    def get(self, name: str, default: HardwareTarget | None = None) -> HardwareTarget | None:  # type: ignore[override]
        t = self.targets.get(name)
        if t is None:
            self.ensure_loaded()
            t = self.targets.get(name)
        return default if t is None else t

    def __getitem__(self, name: str) -> HardwareTarget:
        t = self.get(name)
        if t is None:
            raise KeyError(name)
        return t

    def __iter__(self) -> Iterator[str]:
        self.ensure_loaded()
        return iter(list(self.targets))

    def __len__(self) -> int:
        self.ensure_loaded()
        return len(self.targets)

    def __repr__(self) -> str:
        return f"TargetRegistry({', '.join(self.targets)}{'' if self._loaded else ', plugins not loaded'})"


def _as_target(obj: object) -> HardwareTarget:
    if callable(obj) and not isinstance(obj, HardwareTarget) and not isinstance(obj, type):
        obj = obj()
    if not isinstance(obj, HardwareTarget):
        raise TypeError(f"entry point gives {type(obj).__name__}, not a HardwareTarget")
    return obj


TARGETS = TargetRegistry(BUILTIN)
"""name -> HardwareTarget, built-ins first, then the plugins' (loaded on first use)."""


def get_target(name: str) -> HardwareTarget:
    """The target `name` (case and spaces ignored); TargetError (one line) lists the known ones
    and any target plugin that failed to load."""
    t = TARGETS.get(name.strip().lower())
    if t is None:
        broken = "".join(f"; {b.describe()}" for b in TARGETS.broken)
        raise TargetError(f"unknown target {name!r}{did_you_mean(name, TARGETS)}: choose one of "
                          f"{', '.join(TARGETS)}{broken}")
    return t


def find_target(name: str) -> HardwareTarget | None:
    """The target `name`, or None (an artifact's target whose plugin is not installed here)."""
    return TARGETS.get(name.strip().lower())


def all_targets() -> dict[str, HardwareTarget]:
    """Every known target, built-ins first (loads the plugins)."""
    return dict(TARGETS.items())


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "TARGETS", "TargetError", "TargetRegistry",
           "all_targets", "find_target", "get_target"]
