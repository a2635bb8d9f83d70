"""Where a builder's params come from: a checkpoint, a generator, or nothing (meta).

A model builder asks for each param by its graph name, shape and dtype
(`ParamMaker.__call__`); a `WeightProvider` answers with a lazy source:

- `CheckpointWeights`: the checkpoint's tensors through a layout resolver,
  which may derive a param from several tensors (transposed, concatenated,
  stacked) without reading them. Every problem (missing tensor, wrong
  shape, non-float tensor, tensors nobody asked for) is collected while the
  graph is built and reported at `finish()`, so one run names them all.
- `GeneratedWeights`: deterministic pseudo-random values (`@tiny`): the seed
  of each param is derived from its name, so a param does not change when
  another one is added.
- `MetaWeights`: no data (`@meta`): the full-size graph from the config alone.
"""

from __future__ import annotations

import math
import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from ernie_ir.ir import DType, GraphBuilder, Param, TensorType
from ernie_ir.ir.weights import GeneratedSource, TransposedSource, WeightSource

from .checkpoint import TensorStore
from .errors import CheckpointError, name_some


@dataclass(frozen=True)
class Init:
    """How `@tiny` fills a param: `normal` with `std` (None: 1/sqrt(fan_in)), `ones` or `zeros`."""

    kind: str = "normal"
    std: float | None = None

    def std_for(self, shape: Sequence[int]) -> float:
        if self.std is not None:
            return self.std
        fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
        return 1.0 / math.sqrt(max(fan_in, 1))


LINEAR = Init()  # [in, out] (or [E, in, out]) weights: N(0, 1/in)
EMBEDDING = Init(std=1.0)
NORM = Init("ones")
BIAS = Init("normal", 0.02)
SMALL = Init("normal", 0.02)


class WeightProvider(ABC):
    kind: str

    @abstractmethod
    def source(self, name: str, shape: tuple[int, ...], dtype: DType, init: Init) -> WeightSource | None:
        """The source of param `name` (None: no data, or a problem that `finish` reports)."""

    def available(self, name: str) -> bool:
        """Whether an optional param exists (generated and meta models have every one)."""
        return True

    def finish(self) -> dict[str, object]:
        """Raise for every problem seen; return facts for the graph metadata."""
        return {}


class MetaWeights(WeightProvider):
    kind = "meta"

    def source(self, name: str, shape: tuple[int, ...], dtype: DType, init: Init) -> WeightSource | None:
        return None


class GeneratedWeights(WeightProvider):
    kind = "generated"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def source(self, name: str, shape: tuple[int, ...], dtype: DType, init: Init) -> WeightSource | None:
        seed = (zlib.crc32(name.encode()) + 1_000_003 * self.seed) % 2**32
        if init.kind in ("ones", "zeros"):
            return GeneratedSource(dtype, shape, seed, init.kind)
        return GeneratedSource(dtype, shape, seed, "normal", init.std_for(shape))


class Layout(ABC):
    """How a checkpoint's tensors become the graph's params."""

    name: str = "native"

    @abstractmethod
    def resolve(self, cw: CheckpointWeights, name: str, shape: tuple[int, ...]) -> WeightSource | None:
        """The source of param `name`, built from `cw.take(...)` calls (None if one failed)."""

    def available(self, store: TensorStore, name: str) -> bool:
        """Whether the checkpoint holds what optional param `name` needs."""
        return name in store


class NativeLayout(Layout):
    """Param names are the checkpoint's keys, tensors taken as they are."""

    def resolve(self, cw: CheckpointWeights, name: str, shape: tuple[int, ...]) -> WeightSource | None:
        return cw.take(name, shape)


@dataclass
class IgnoreRule:
    """Checkpoint tensors a model does not compute with, kept visible in the metadata.

    `finish()` lists them as {reason, tensors (count), modules}: a module is the
    part of the key the pattern matched (write the pattern to match the module).
    """

    pattern: re.Pattern[str]
    reason: str


@dataclass
class CheckpointWeights(WeightProvider):
    """Params from a checkpoint, through a layout resolver."""

    store: TensorStore
    layout: Layout
    ignore: list[IgnoreRule] = field(default_factory=list)
    hint: str = "check config.json against the checkpoint"
    kind: str = "checkpoint"
    used: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    not_float: list[str] = field(default_factory=list)

    def source(self, name: str, shape: tuple[int, ...], dtype: DType, init: Init) -> WeightSource | None:
        src = self.layout.resolve(self, name, shape)
        if src is not None and tuple(src.shape) != shape:  # a layout bug, not bad input
            raise AssertionError(f"layout gave {src.shape} for {name}, expected {shape}")
        return src

    def available(self, name: str) -> bool:
        return self.layout.available(self.store, name)

    # -- used by resolvers ------------------------------------------------------------------

    def has(self, key: str) -> bool:
        return key in self.store

    def take(self, key: str, shape: Sequence[int], *, transposable: bool = False) -> WeightSource | None:
        """Tensor `key`, checked to have `shape` (or its transpose, read transposed, if allowed)."""
        shape = tuple(shape)
        if key not in self.store:
            self.missing.append(key)
            return None
        self.used.add(key)
        found = self.store.shape(key)
        src = self.store.source(key)
        if not src.dtype.is_float:
            self.not_float.append(f"{key} ({src.dtype})")
            return None
        if found == shape:
            return src
        if transposable and len(found) == 2 and found[::-1] == shape:
            return TransposedSource(src)
        self.mismatched.append(
            f"{key}: the config needs shape {list(shape)}, the checkpoint has {list(found)}"
        )
        return None

    # -- reporting --------------------------------------------------------------------------

    def finish(self) -> dict[str, object]:
        where = self.store.folder
        if self.mismatched:
            more = f" (and {len(self.mismatched) - 1} more)" if len(self.mismatched) > 1 else ""
            raise CheckpointError(
                f"{where}: config.json and the weights disagree: tensor {self.mismatched[0]}{more}; "
                f"{self.hint}"
            )
        if self.missing:
            raise CheckpointError(
                f"{where}: {len(self.missing)} tensor(s) the config needs are missing: "
                f"{name_some(self.missing)}; the checkpoint is incomplete or belongs to another config"
            )
        if self.not_float:
            raise CheckpointError(
                f"{where}: tensor(s) {name_some(self.not_float)} are not floating point: quantized "
                "checkpoints cannot be imported; use the bf16/f16/f32 weights"
            )
        ignored: dict[str, dict[str, object]] = {}
        unexpected: list[str] = []
        for key in self.store:
            if key in self.used:
                continue
            rule, match = next(((r, m) for r in self.ignore if (m := r.pattern.search(key))), (None, None))
            if rule is None or match is None:
                unexpected.append(key)
                continue
            entry = ignored.setdefault(rule.reason, {"reason": rule.reason, "tensors": 0, "modules": set()})
            entry["tensors"] += 1  # type: ignore[operator]
            entry["modules"].add(match.group(0))  # type: ignore[union-attr]
        if unexpected:
            raise CheckpointError(
                f"{where}: {len(unexpected)} tensor(s) are not part of the model the config describes: "
                f"{name_some(unexpected)}; {self.hint}"
            )
        for entry in ignored.values():
            entry["modules"] = sorted(entry["modules"])  # type: ignore[arg-type]
        return {"ignored_weights": list(ignored.values())} if ignored else {}


class ParamMaker:
    """Declares params on a builder, with sources from a provider."""

    def __init__(self, builder: GraphBuilder, provider: WeightProvider, dtype: DType) -> None:
        self.b = builder
        self.provider = provider
        self.dtype = dtype

    def __call__(self, name: str, shape: Sequence[int], *, dtype: DType | None = None,
                 init: Init = LINEAR) -> Param:
        shape = tuple(int(d) for d in shape)
        want = dtype or self.dtype
        src = self.provider.source(name, shape, want, init)
        t = TensorType(src.dtype if src is not None else want, shape)
        return self.b.param(name, t, src)
