"""Pipelines: an ordered list of configured passes, from text or YAML.

Text:  `canonicalize,cse,dce,my-pass{rank=32,targets=[".*qkv.*", ".*o_proj.*"]}`
YAML:  a list whose items are a pass name or a one-key mapping to options:

    pipeline:
      - canonicalize
      - my-pass: {rank: 32}

(`pipeline_syntax` reads both.) A name may also be a preset, which expands in
place. Building a pipeline validates everything before a pass runs: unknown
passes (with suggestions), options against each pass's pydantic schema, and
the requires/produces order.
`str(pipeline)` is the resolved, canonical text recorded in artifacts and
dump headers; parsing it gives the same pipeline again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from ernie_ir.ir.inputs import read_bytes

from .base import Pass
from .pipeline_syntax import PassSpec, PipelineError, parse_pipeline_text, parse_pipeline_yaml
from .registry import REGISTRY


class Pipeline:
    """Validated, instantiated passes in order."""

    def __init__(self, passes: Sequence[Pass]) -> None:
        self.passes = list(passes)

    def __str__(self) -> str:
        return ",".join(p.spec() for p in self.passes)

    def __repr__(self) -> str:
        return f"Pipeline({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        """Same passes (by name) with equal options, in the same order."""
        if not isinstance(other, Pipeline):
            return NotImplemented
        return [(p.name, p.options) for p in self.passes] == [(p.name, p.options) for p in other.passes]

    __hash__ = None  # type: ignore[assignment]  # mutable: `passes` is a list

    def __len__(self) -> int:
        return len(self.passes)

    def __iter__(self):
        return iter(self.passes)

    def __add__(self, other: Pipeline) -> Pipeline:
        return Pipeline([*self.passes, *other.passes])

    def restricted(self, disabled: Iterable[str] = (), stop_after: str | int | None = None
                   ) -> Pipeline:
        """This pipeline without the passes named in `disabled` (every occurrence) and ending
        after `stop_after` (a pass name: its first occurrence; or a 1-based position in this
        pipeline): what bisecting a pipeline needs (TVM's `disabled_pass`, LLVM's
        `-stop-after`). Unknown names are PipelineErrors; the order is not re-checked here
        (`check_order` with the graph's properties does that)."""
        disabled = list(dict.fromkeys(disabled))
        names = [p.name for p in self.passes]
        listing = ", ".join(dict.fromkeys(names)) or "empty"
        for name in disabled:
            if name not in names:
                raise PipelineError(f"cannot disable pass {name!r}: it is not in the pipeline "
                                    f"({listing})")
        passes = self.passes
        if stop_after is not None:
            if isinstance(stop_after, str) and stop_after.strip().isdigit():
                stop_after = int(stop_after)
            if isinstance(stop_after, int):
                if not 1 <= stop_after <= len(passes):
                    raise PipelineError(f"cannot stop after pass {stop_after}: the pipeline has "
                                        f"{len(passes)} passes")
                end = stop_after
            else:
                if stop_after not in names:
                    raise PipelineError(f"cannot stop after pass {stop_after!r}: it is not in the "
                                        f"pipeline ({listing})")
                end = names.index(stop_after) + 1
            if passes[end - 1].name in disabled:
                raise PipelineError(f"cannot stop after pass {stop_after!r}: it is disabled")
            passes = passes[:end]
        return Pipeline([p for p in passes if p.name not in disabled])

    def check_order(self, initial: Iterable[str] = ()) -> None:
        """Each pass's `requires` must hold when it runs; PipelineError says which pass fixes it."""
        props = set(initial)
        for i, p in enumerate(self.passes, 1):
            missing = sorted(p.requires - props)
            if missing:
                providers = sorted(
                    name for name, cls in REGISTRY.passes.items() if set(missing) & cls.produces
                )
                hint = f"; run {' or '.join(providers)} before it" if providers else ""
                raise PipelineError(
                    f"pass {p.name} (position {i}) requires {', '.join(missing)}, which no earlier "
                    f"pass produces{hint}"
                )
            props = (props - p.invalidates) | p.produces


def describe_restriction(full: Pipeline, kept: Pipeline, *, stopped: bool) -> str:
    """One line on what `full.restricted(...)` (= `kept`) left out: "stopped after P (pass i
    of N); not run: ...", "disabled P (pass i), ...", and otherwise what ran."""
    kept_ids = {id(p) for p in kept.passes}
    end = max((i for i, p in enumerate(full.passes, 1) if id(p) in kept_ids), default=0)
    disabled = [f"{p.spec()} (pass {i})" for i, p in enumerate(full.passes, 1)
                if id(p) not in kept_ids and (not stopped or i <= end)]
    parts = []
    if stopped and end:
        rest = ", ".join(p.spec() for p in full.passes[end:]) or "none"
        parts.append(f"stopped after {full.passes[end - 1].spec()} (pass {end} of {len(full)}); "
                     f"not run: {rest}")
    if disabled:
        parts.append(f"disabled {', '.join(disabled)}")
    if not stopped:
        parts.append(f"ran {kept or 'nothing'}")
    return "; ".join(parts)


def build_pipeline(specs: Sequence[PassSpec], *, initial: Iterable[str] = (),
                   check_order: bool = True, _depth: int = 0) -> Pipeline:
    """Instantiate and validate specs; presets expand in place."""
    REGISTRY.ensure_loaded()
    passes: list[Pass] = []
    for spec in specs:
        preset = REGISTRY.presets.get(spec.name)
        if preset is not None:
            if spec.options:
                raise PipelineError(f"preset {spec.name} ({spec.where}) takes no options; "
                                    f"its pipeline is {preset.pipeline}")
            if _depth > 8:
                raise PipelineError(f"preset {spec.name} expands recursively")
            passes.extend(build_pipeline(parse_pipeline_text(preset.pipeline), check_order=False,
                                         _depth=_depth + 1).passes)
            continue
        try:
            cls = REGISTRY.get(spec.name)
        except PipelineError as e:
            raise PipelineError(f"{spec.where}: {e}" if spec.where else str(e)) from None
        try:
            options = cls.make_options(spec.options)
        except PipelineError as e:
            raise PipelineError(f"{spec.where}: {e}" if spec.where else str(e)) from None
        passes.append(cls(options))
    pipeline = Pipeline(passes)
    if check_order:
        pipeline.check_order(initial)
    return pipeline


def load_pipeline(spec: str, *, initial: Iterable[str] = ()) -> Pipeline:
    """A pipeline from text, or from a YAML file when `spec` names one."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")):
        if not path.exists():
            raise PipelineError(f"pipeline file {spec} does not exist")
        try:  # a FIFO or device is refused, not waited on
            text = read_bytes(path, "pipeline file", PipelineError).decode("utf-8")
        except UnicodeDecodeError:
            raise PipelineError(f"pipeline file {spec} is not UTF-8 text: give a YAML list of passes"
                                ) from None
        specs = parse_pipeline_yaml(text, spec)
    else:
        specs = parse_pipeline_text(spec)
    return build_pipeline(specs, initial=initial)
