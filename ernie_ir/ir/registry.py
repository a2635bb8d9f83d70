"""The op registry: what an op is, and the table of known ops.

An op is one class: a name, its inputs, a pydantic attribute schema, a type
rule (`infer`) and a numpy reference kernel (`kernel`); its docstring states
the exact math. Decorating it with `@register_op` makes it known to the
builder, the text parser, the verifier and the interpreter, so adding an op
is a one-file change in `ernie_ir/ops/` (that package imports every module
it holds).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import OpError
from .types import TensorType


class OpAttrs(BaseModel):
    """Base of every op's attribute schema: immutable, hashable, no unknown keys.

    Use tuples, not lists, for sequence attributes so that attrs hash (CSE and
    rule matching compare attrs by value).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


_NUMBERS: tuple[Any, ...] = (int, float, int | None, float | None)
"""Attribute annotations a bool must not pass as (True is an int to pydantic)."""


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
    """

    name: ClassVar[str]
    inputs: ClassVar[tuple[Input, ...]]
    Attrs: ClassVar[type[OpAttrs]] = NoAttrs

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

    def make_attrs(self, values: dict[str, Any] | OpAttrs | None) -> OpAttrs:
        """Validate attribute values against the schema; OpError names the bad key."""
        if isinstance(values, self.Attrs):
            return values
        # Attrs are immutable, so equal inputs may share one validated instance.
        try:
            key: Any = tuple(sorted((values or {}).items()))
            hash(key)
        except TypeError:
            key = None
        if key is not None:
            hit = self._attr_cache.get(key)
            if hit is not None:
                return hit
        fields = self.Attrs.model_fields
        for name, v in (values or {}).items():  # pydantic reads true as 1: a bool is no number
            if isinstance(v, bool) and name in fields and fields[name].annotation in _NUMBERS:
                raise OpError(f"op {self.name}: attribute {name}: expected a number, got {v}")
        try:
            attrs = self.Attrs.model_validate(values or {})
            # pydantic lets an Enum (a bare `u8` in IR text) through an int field as its str
            # value; checking the validated fields strictly refuses such pass-throughs.
            self.Attrs.model_validate(attrs.__dict__, strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "attributes"
            raise OpError(f"op {self.name}: attribute {where}: {err['msg']}") from None
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


_REGISTRY: dict[str, OpDef] = {}


def register_op(cls: type[OpDef]) -> type[OpDef]:
    """Class decorator: register an op definition under `cls.name`."""
    name = cls.name
    if name in _REGISTRY and type(_REGISTRY[name]) is not cls:
        raise ValueError(f"op {name!r} is already registered by {type(_REGISTRY[name]).__name__}")
    _REGISTRY[name] = cls()
    return cls


def get_op(name: str) -> OpDef:
    """The definition of op `name`; OpError lists close names when unknown."""
    try:
        return _REGISTRY[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, _REGISTRY, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise OpError(f"unknown op {name!r}{hint}") from None


def has_op(name: str) -> bool:
    return name in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    return dict(sorted(_REGISTRY.items()))
