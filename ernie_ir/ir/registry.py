"""The op registry: what an op is, and the table of known ops (built-in and plugins).

An op is one class: a name, its inputs, a pydantic attribute schema, a type
rule (`infer`) and a numpy reference kernel (`kernel`); its docstring states
the exact math. It may also carry its own lowerings (`lower_onnx`,
`lower_paddle`), which the ONNX and Paddle emitters consult before their own
tables, and the number of results a pattern of it has (`num_outputs`).
Decorating it with `@register_op` makes it known to the builder, the text
parser, the verifier, the interpreter, rewrite patterns and the emitters, so
adding an op is a one-file change (docs/ops.md).

The op set loads on first lookup, not on `import ernie_ir`: `ernie_ir.ops`
registers a loader that imports its modules, then the entry-point group
`ernie_ir.ops` is read. An entry point may name an OpDef subclass, a module
(whose import registers ops) or a function taking the registry. A plugin that
fails to load is recorded with its error and never breaks the built-in ops;
asking for an op it does not provide names the plugin and the error.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from .dtypes import DType
from .errors import OpError
from .suggest import did_you_mean
from .types import TensorType

ENTRY_POINT_GROUP = "ernie_ir.ops"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LOWERINGS = ("onnx", "paddle")
"""The lowering kinds an op may carry: `lower_onnx` (the onnxruntime executable) and
`lower_paddle` (the Paddle inference model, rank Layers and training)."""


class OpAttrs(BaseModel):
    """Base of every op's attribute schema: immutable, hashable, no unknown keys.

    Use tuples, not lists, for sequence attributes so that attrs hash (CSE and
    rule matching compare attrs by value). Float attributes are finite: an op
    that can take inf or nan says so per field with `Field(allow_inf_nan=True)`.
    Validators see values of the annotated type: `OpDef.make_attrs` refuses a
    bool or an enum member (a bare `bf16` in IR text) that the annotation has no
    place for before pydantic coerces it (True to 1, an enum to its value).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False,
                              allow_inf_nan=False)


def _leaf_types(annotation: Any) -> set[Any] | None:
    """The classes an attribute annotation admits at any depth (a Literal's values as their
    classes), or None when it admits something this cannot name (Any, a type variable)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {type(v) for v in typing.get_args(annotation)}
    if origin is typing.Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin is not None:
        found: set[Any] = {origin} if isinstance(origin, type) else set()
        for arg in typing.get_args(annotation):
            if arg is Ellipsis:
                continue
            inner = _leaf_types(arg)
            if inner is None:
                return None
            found |= inner
        return found
    if annotation is None or annotation is types.NoneType:
        return {types.NoneType}
    if isinstance(annotation, type) and annotation is not object:
        return {annotation}
    return None


def _misfit(value: Any, annotation: Any, loc: str = "") -> tuple[str, Any, Any] | None:
    """The bool or enum member in `value` (or in its items) that `annotation` has no place for,
    as (where: "" or ".1" for an item, the value, the annotation there), or None. Pydantic would
    coerce it (True to 1; an enum to its value, even into an int field) before validators run."""
    if isinstance(value, list | tuple):
        leaves = _leaf_types(annotation)
        if leaves is not None and not leaves & {list, tuple}:
            return None  # no sequence fits here at all: pydantic refuses it as it is
        item = _item_annotation(annotation)
        for i, v in enumerate(value):
            bad = _misfit(v, item, f"{loc}.{i}")
            if bad is not None:
                return bad
        return None
    if not isinstance(value, bool | enum.Enum):
        return None
    leaves = _leaf_types(annotation)
    if leaves is None:
        return None
    if isinstance(value, bool):
        admitted = bool in leaves
    else:
        admitted = any(isinstance(t, type) and issubclass(t, enum.Enum) and isinstance(value, t)
                       for t in leaves)
    return None if admitted else (loc, value, annotation)


def _item_annotation(annotation: Any) -> Any:
    """The items' annotation of `tuple[int, ...]` or `list[int]`; else the annotation itself."""
    args = {a for a in typing.get_args(annotation) if a is not Ellipsis}
    if typing.get_origin(annotation) in (tuple, list) and len(args) == 1:
        return next(iter(args))
    return annotation


def _spell(value: bool | enum.Enum) -> str:
    """A misfit value as IR text writes it: `true`, `the dtype bf16`."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"the dtype {value}" if isinstance(value, DType) else repr(value)


def _describe(annotation: Any) -> str:
    """An annotation as a user reads it: `int`, `float | None`, `tuple[int, ...]`."""
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("ernie_ir.ir.dtypes.", "")


class NoAttrs(OpAttrs):
    """For ops without attributes."""


@dataclass(frozen=True)
class Input:
    """One input slot of an op. A variadic input takes all remaining values."""

    name: str
    optional: bool = False
    variadic: bool = False


class OpDef(ABC):
    """Definition of an op. Subclass, fill the class attributes, implement both rules.

    `infer` receives the input types (None for an absent optional input) and
    the attrs, and returns the output types; it raises `OpError` with a
    message naming the offending input when the inputs do not fit.
    `kernel` receives numpy arrays (floats as float32, params read exactly)
    and returns the outputs in the same order.

    Optional, per op (docs/ops.md shows each):
    - `lower_onnx(self, node, onnx) -> list[str]`: the ONNX nodes of `node`, made with the
      emitter's `onnx.op(type, inputs, ...)`, `onnx.name(value)`, `onnx.const(array)`,
      `onnx.f32(x)`; returns the names of the results.
    - `lower_paddle(self, layer, node, args) -> list`: the Paddle tensors of the results from
      the input tensors `args` (`layer.P` is `paddle`, `layer.F` is `paddle.nn.functional`).
    - `no_onnx = "why"` / `no_paddle = "why"`: a lowering the op deliberately lacks; compile
      then skips that executable with this reason as a warning instead of refusing.
    - `num_outputs`: the results of `op.<name>(...)` in a rewrite pattern (default 1).
    """

    name: ClassVar[str]
    inputs: ClassVar[tuple[Input, ...]]
    Attrs: ClassVar[type[OpAttrs]] = NoAttrs
    num_outputs: ClassVar[int] = 1
    """Results a rewrite pattern of this op has unless it says `_outputs=` (split: per sizes)."""
    lower_onnx: ClassVar[Callable[..., list[str] | None] | None] = None
    lower_paddle: ClassVar[Callable[..., list[Any]] | None] = None
    no_onnx: ClassVar[str | None] = None
    no_paddle: ClassVar[str | None] = None

    def __init__(self) -> None:
        self._attr_cache: dict[Any, OpAttrs] = {}
        self._arity: tuple[int, int | None] | None = None

    @abstractmethod
    def infer(self, types: Sequence[TensorType | None], attrs: Any) -> list[TensorType]:
        """Output types for these input types and attrs."""

    @abstractmethod
    def kernel(self, args: Sequence[np.ndarray | None], attrs: Any) -> list[np.ndarray]:
        """Output arrays for these input arrays and attrs."""

    # -- helpers shared by every op -------------------------------------------------

    @property
    def doc(self) -> str:
        return (type(self).__doc__ or "").strip()

    def lowering(self, kind: str) -> Callable[..., Any] | None:
        """The op's own lowering of `kind` ("onnx" or "paddle"), or None."""
        if kind not in LOWERINGS:
            raise ValueError(f"unknown lowering kind {kind!r}: one of {', '.join(LOWERINGS)}")
        hook: Callable[..., Any] | None = getattr(self, f"lower_{kind}")
        return hook

    def lacks(self, kind: str) -> str | None:
        """Why the op deliberately has no lowering of `kind` (`no_onnx`, `no_paddle`), or None."""
        self.lowering(kind)  # checks the kind
        reason: str | None = getattr(self, f"no_{kind}")
        return reason

    def make_attrs(self, values: dict[str, Any] | OpAttrs | None) -> OpAttrs:
        """Validate attribute values against the schema; OpError names the bad key."""
        if isinstance(values, self.Attrs):
            return values
        # Attrs are immutable, so equal inputs may share one validated instance.
        try:
            # the type is part of the key: True == 1 and hash(True) == hash(1), but only one is valid
            key: Any = tuple(sorted((k, type(v), v) for k, v in (values or {}).items()))
            hash(key)
        except TypeError:
            key = None
        if key is not None:
            hit = self._attr_cache.get(key)
            if hit is not None:
                return hit
        fields = self.Attrs.model_fields
        for name, v in (values or {}).items():  # the type first: validators compare values
            if name in fields and isinstance(v, bool | enum.Enum | list | tuple):
                bad = _misfit(v, fields[name].annotation)
                if bad is not None:
                    where, got, want = bad
                    raise OpError(f"op {self.name}: attribute {name}{where}: expected {_describe(want)}, "
                                  f"got {_spell(got)}")
        try:
            attrs = self.Attrs.model_validate(values or {})
            # pydantic lets an Enum (a bare `u8` in IR text) through an int field as its str
            # value; checking the validated fields strictly refuses such pass-throughs.
            self.Attrs.model_validate(attrs.__dict__, strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "attributes"
            msg = err["msg"]
            if err["type"] == "finite_number":  # 1e309 in IR text reads as inf
                msg = f"{err['input']} is not a finite number: write a finite value"
            raise OpError(f"op {self.name}: attribute {where}: {msg}") from None
        if key is not None and len(self._attr_cache) < 4096:
            self._attr_cache[key] = attrs
        return attrs

    def check_arity(self, n: int) -> None:
        bounds = self._arity
        if bounds is None:
            required = sum(1 for i in self.inputs if not i.optional and not i.variadic)
            variadic = any(i.variadic for i in self.inputs)
            bounds = self._arity = (required, None if variadic else len(self.inputs))
        if n < bounds[0] or (bounds[1] is not None and n > bounds[1]):
            names = ", ".join(
                i.name + ("?" if i.optional else "") + ("..." if i.variadic else "")
                for i in self.inputs
            )
            raise OpError(f"op {self.name} takes ({names}) but got {n} inputs")

    def input_name(self, index: int) -> str:
        if index < len(self.inputs):
            return self.inputs[index].name
        return f"{self.inputs[-1].name}[{index - len(self.inputs) + 1}]"


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point of ours (`ernie_ir.ops`, `ernie_ir.targets`) that failed to load, and why."""

    kind: str
    """What it would have added: "op", "target"."""
    name: str
    target: str
    error: str

    def describe(self) -> str:
        return f"{self.kind} plugin {self.name!r} ({self.target}) failed to load: {self.error}"


class OpRegistry:
    """Ops by name, where each came from, and the op plugins that failed to load.

    Lookups load the op set first (`ensure_loaded`): the built-in loaders (registered by
    `ernie_ir.ops`), then the entry points of `ernie_ir.ops`, once.
    """

    def __init__(self) -> None:
        self.ops: dict[str, OpDef] = {}
        self.origins: dict[str, str] = {}
        self.broken: list[BrokenPlugin] = []
        self._loaders: list[Callable[[], None]] = []
        self._loaded = False
        self._plugin_origin: str | None = None  # set while an entry point loads

    def add(self, cls: type[OpDef], origin: str | None = None) -> type[OpDef]:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls!r} has no op name")
        if not _IDENT.fullmatch(name):
            raise OpError(f"op name {name!r} is not an identifier (IR text and GraphBuilder methods need "
                          "one): use letters, digits and _")
        if origin is None:
            module = getattr(cls, "__module__", "")
            origin = self._plugin_origin or (
                "built-in" if module.startswith("ernie_ir.") else f"module {module}")
        existing = self.ops.get(name)
        if existing is not None:
            if type(existing) is cls:
                if origin.startswith("plugin "):  # imported earlier (by a pass plugin, say)
                    self.origins[name] = origin
                return cls
            raise OpError(f"op name {name!r} is registered twice ({self.origins[name]}, "
                          f"{type(existing).__name__}, and {origin}, {cls.__name__})")
        self.ops[name] = cls()
        self.origins[name] = origin
        return cls

    def remove(self, name: str) -> None:
        """Forget op `name` (tests and docs that register ops for a while)."""
        self.ops.pop(name, None)
        self.origins.pop(name, None)

    def add_loader(self, loader: Callable[[], None]) -> None:
        """Run `loader` (it registers ops) on the first lookup; at once if that already happened."""
        self._loaders.append(loader)
        if self._loaded:
            loader()

    def ensure_loaded(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first, so that a loader's own lookups do not recurse
        for loader in self._loaders:
            loader()
        self.load_plugins()

    def load_plugins(self) -> None:
        """Load every `ernie_ir.ops` entry point; a failure is recorded in `broken` and undone."""
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            origin = f"plugin {ep.name} ({ep.value})"
            before = set(self.ops)
            self._plugin_origin = origin
            try:
                self._register_plugin_object(ep.load(), origin)
            except Exception as e:  # a broken plugin must never break the built-in ops
                for name in set(self.ops) - before:
                    self.remove(name)
                self.broken.append(BrokenPlugin("op", ep.name, ep.value, f"{type(e).__name__}: {e}"))
            finally:
                self._plugin_origin = None

    def _register_plugin_object(self, obj: Any, origin: str) -> None:
        if inspect.isclass(obj) and issubclass(obj, OpDef):
            self.add(obj, origin)
        elif inspect.ismodule(obj):
            for value in vars(obj).values():  # the ops it defines (decorated or not), not imports
                if (inspect.isclass(value) and issubclass(value, OpDef) and not inspect.isabstract(value)
                        and isinstance(getattr(value, "name", None), str)
                        and value.__module__ == obj.__name__):
                    self.add(value, origin)
        elif callable(obj):
            obj(self)
        else:
            raise TypeError(f"entry point gives {type(obj).__name__}, not an OpDef, module or function")

    def get(self, name: str) -> OpDef:
        op = self.ops.get(name)
        if op is not None:
            return op
        self.ensure_loaded()
        op = self.ops.get(name)
        if op is not None:
            return op
        hint = did_you_mean(name, self.ops, n=3)
        broken = "".join(f"; {b.describe()}" for b in self.broken)
        raise OpError(f"unknown op {name!r}{hint}{broken}")


REGISTRY = OpRegistry()
_OPS = REGISTRY.ops  # the same dict (never rebound): the lookup every Node makes stays one index


def register_op(cls: type[OpDef]) -> type[OpDef]:
    """Class decorator: register an op definition under `cls.name`."""
    return REGISTRY.add(cls)


def get_op(name: str) -> OpDef:
    """The definition of op `name`; OpError lists close names (and broken plugins) when unknown."""
    try:
        return _OPS[name]
    except KeyError:
        return REGISTRY.get(name)


def has_op(name: str) -> bool:
    if name in _OPS:
        return True
    REGISTRY.ensure_loaded()
    return name in REGISTRY.ops


def all_ops() -> dict[str, OpDef]:
    REGISTRY.ensure_loaded()
    return dict(sorted(REGISTRY.ops.items()))


def op_origin(name: str) -> str:
    """Where op `name` comes from: "built-in", "plugin NAME (target)" or "module M"."""
    get_op(name)
    return REGISTRY.origins[name]
