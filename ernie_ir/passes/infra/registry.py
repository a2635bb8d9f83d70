"""The pass registry: built-in passes, presets, and third-party plugins.

Lookups load the passes first (`ensure_loaded`): the built-in loader, which
`ernie_ir.passes` adds (it imports `ernie_ir.passes.builtin`, whose modules
register themselves), then the entry points, once. The registry itself
imports no pass module, so the pass modules can import it.

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

import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from ernie_ir.ir.registry import BrokenPlugin
from ernie_ir.ir.suggest import did_you_mean

from .base import Pass
from .pipeline_syntax import PipelineError, format_value

ENTRY_POINT_GROUP = "ernie_ir.passes"


@dataclass
class Preset:
    name: str
    pipeline: str
    description: str


@dataclass
class PassRegistry:
    passes: dict[str, type[Pass]] = field(default_factory=dict)
    presets: dict[str, Preset] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)
    loaders: list[Callable[[], None]] = field(default_factory=list)
    _loaded: bool = False
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

    def add_loader(self, loader: Callable[[], None]) -> None:
        """Run `loader` (it registers passes) on the first lookup; at once if that already
        happened."""
        self.loaders.append(loader)
        if self._loaded:
            loader()

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
                self.broken.append(BrokenPlugin("pass", ep.name, ep.value, f"{type(e).__name__}: {e}"))

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
        hint = did_you_mean(name, [*self.passes, *self.presets], n=3)
        broken = "".join(
            f"; plugin {b.name!r} ({b.target}) failed to load: {b.error}" for b in self.broken
        )
        raise PipelineError(f"unknown pass {name!r}{hint}; `ernie-ir passes` lists them{broken}")

    def ensure_loaded(self) -> None:
        """Run the loaders (the built-in passes), then load the plugins; each once."""
        if not self._loaded:
            self._loaded = True  # first, so that a loader's own lookups do not recurse
            for loader in self.loaders:
                loader()
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


# -- the `ernie-ir passes` listing ---------------------------------------------------------------

def _type_name(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return name or str(annotation).replace("typing.", "")


def default_spec(cls: type[Pass]) -> list[str]:
    """`name{option=default,...}` of a pass in pipeline syntax, one item per option; a required
    option shows its type as `option=<type>`. (Items, so that callers can wrap between them.)"""
    items = []
    for key, fld in cls.Options.model_fields.items():
        if fld.is_required():
            items.append(f"{key}=<{_type_name(fld.annotation)}>")
        else:
            items.append(f"{key}={format_value(fld.get_default(call_default_factory=True))}")
    return items


def _wrap_items(head: str, items: Sequence[str], width: int, sep: str = ",",
                close: str = "") -> list[str]:
    """`head` + items joined by `sep` + `close`, broken between items to fit `width`; the
    continuation lines start under the first item."""
    lines: list[str] = []
    indent = " " * len(head)
    line = head
    for i, item in enumerate(items):
        piece = item + (sep if i < len(items) - 1 else close)
        if line.strip() and len(line) > len(indent) and len(line) + len(piece) > width:
            lines.append(line.rstrip())
            line = indent
        line += piece
    lines.append(line)
    return lines


def pass_listing(width: int = 80) -> list[str]:
    """The lines `ernie-ir passes` prints: each pass as `name{option=default,...}` (pipeline
    syntax, so a line can be pasted into --pipeline), its description and properties, then the
    presets; wrapped to `width` columns between options and words."""
    width = max(width, 40)
    body = textwrap.TextWrapper(width=width, initial_indent="    ", subsequent_indent="    ",
                                break_on_hyphens=False, break_long_words=False)
    lines = [*textwrap.wrap("Passes, with their options' defaults in pipeline syntax (built-in "
                            "unless an origin is given):", width), ""]
    for name, cls in all_passes().items():
        items = default_spec(cls)
        lines.extend(_wrap_items(name + "{", items, width, close="}") if items else [name])
        lines.extend(body.wrap(cls.description or "(no description)"))
        props = []
        if cls.requires:
            props.append("requires " + ", ".join(sorted(cls.requires)))
        if cls.produces:
            props.append("produces " + ", ".join(sorted(cls.produces)))
        if cls.invalidates:
            props.append("invalidates " + ", ".join(sorted(cls.invalidates)))
        if props:
            lines.extend(body.wrap("; ".join(props)))
        origin = REGISTRY.origins.get(name, "")
        if origin and origin != "built-in":
            lines.extend(body.wrap(f"origin: {origin}"))
    presets = all_presets()
    if presets:
        lines += ["", "Presets (a name that stands for a pipeline):", ""]
        for preset in presets.values():
            lines.extend(_wrap_items(f"{preset.name} = ", preset.pipeline.split(","), width))
            if preset.description:
                lines.extend(body.wrap(preset.description))
    return lines
