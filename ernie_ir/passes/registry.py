"""The pass registry: built-in passes, presets, and third-party plugins.

Third-party packages register passes through the entry-point group
`ernie_ir.passes`. An entry point may name a Pass subclass, a module (whose
import registers passes with `@register_pass`) or a function taking the
registry. A plugin that fails to load is recorded with its error and never
breaks the built-ins; asking for one of its passes names the plugin and the
error.

Presets are named pipelines (`O1`, and later `wint8mix` ...); a pipeline may
name a preset wherever it may name a pass.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from .base import Pass, PipelineError

ENTRY_POINT_GROUP = "ernie_ir.passes"


@dataclass
class Preset:
    name: str
    pipeline: str
    description: str


@dataclass
class BrokenPlugin:
    name: str
    target: str
    error: str


@dataclass
class PassRegistry:
    passes: dict[str, type[Pass]] = field(default_factory=dict)
    presets: dict[str, Preset] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)
    _plugins_loaded: bool = False

    def add(self, cls: type[Pass], origin: str = "built-in") -> type[Pass]:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls!r} has no pass name")
        existing = self.passes.get(name)
        if existing is not None and existing is not cls:
            raise PipelineError(
                f"pass name {name!r} is registered twice ({self.origins[name]} and {origin})"
            )
        self.passes[name] = cls
        self.origins[name] = origin
        return cls

    def add_preset(self, name: str, pipeline: str, description: str) -> None:
        if name in self.passes:
            raise PipelineError(f"preset {name!r} clashes with a pass of that name")
        self.presets[name] = Preset(name, pipeline, description)

    def load_plugins(self) -> None:
        """Load entry points once; failures are recorded in `broken`."""
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            origin = f"plugin {ep.name} ({ep.value})"
            try:
                obj = ep.load()
                self._register_plugin_object(obj, origin)
            except Exception as e:  # a broken plugin must never break the built-ins
                self.broken.append(BrokenPlugin(ep.name, ep.value, f"{type(e).__name__}: {e}"))

    def _register_plugin_object(self, obj: Any, origin: str) -> None:
        if inspect.isclass(obj) and issubclass(obj, Pass):
            self.add(obj, origin)
        elif inspect.ismodule(obj):
            for value in vars(obj).values():
                if (inspect.isclass(value) and issubclass(value, Pass) and value is not Pass
                        and getattr(value, "name", None) and value.__module__ == obj.__name__):
                    self.add(value, origin)
        elif callable(obj):
            obj(self)
        else:
            raise TypeError(f"entry point gives {type(obj).__name__}, not a Pass, module or function")

    def get(self, name: str) -> type[Pass]:
        self.ensure_loaded()
        cls = self.passes.get(name)
        if cls is not None:
            return cls
        close = difflib.get_close_matches(name, [*self.passes, *self.presets], n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        broken = "".join(
            f"; plugin {b.name!r} ({b.target}) failed to load: {b.error}" for b in self.broken
        )
        raise PipelineError(f"unknown pass {name!r}{hint}; `ernie-ir passes` lists them{broken}")

    def ensure_loaded(self) -> None:
        importlib.import_module("ernie_ir.passes.builtin")
        self.load_plugins()


REGISTRY = PassRegistry()


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator (also usable on function passes) adding a pass to the registry."""
    module = getattr(cls, "__module__", "")
    origin = "built-in" if module.startswith("ernie_ir.") else f"module {module}"
    return REGISTRY.add(cls, origin)


def register_preset(name: str, pipeline: str, description: str) -> None:
    REGISTRY.add_preset(name, pipeline, description)


def get_pass(name: str) -> type[Pass]:
    return REGISTRY.get(name)


def all_passes() -> dict[str, type[Pass]]:
    REGISTRY.ensure_loaded()
    return dict(sorted(REGISTRY.passes.items()))


def all_presets() -> dict[str, Preset]:
    REGISTRY.ensure_loaded()
    return dict(sorted(REGISTRY.presets.items()))
