"""The legalization passes `legalize-<target>`, one per target (`legalize-cuda`, `legalize-ascend`,
`legalize-kunlun`, and one for each plugin target), made from the target by `legalize_pass`.

The built-ins are registered when this module is imported; every target's (plugins included)
through the entry-point group `ernie_ir.passes` (pyproject.toml: `targets =
"ernie_ir.targets.passes:register_target_passes"`), which the pass registry loads on its first
lookup: the pass layer never imports targets.
"""

from __future__ import annotations

from typing import Any

from pydantic import create_model, field_validator

from ernie_ir.ir import Graph
from ernie_ir.passes import NoOptions, Pass, PassContext, PassOptions, register_pass
from ernie_ir.targets.capabilities import ArchOption, HardwareTarget
from ernie_ir.targets.legalize import legalize
from ernie_ir.targets.registry import BUILTIN, all_targets

_PASSES: dict[str, type[Pass]] = {}


def _arch_options(target: HardwareTarget, opt: ArchOption) -> type[PassOptions]:
    choices = ", ".join(map(str, opt.choices))

    def check(cls: type, v: int) -> int:
        if v not in opt.choices:
            raise ValueError(f"must be one of {choices}")
        return v

    fields: dict[str, Any] = {opt.name: (int, opt.default)}
    validators = {"check_arch": field_validator(opt.name)(classmethod(check))}
    options = create_model(f"{target.name.title()}Options", __base__=PassOptions,
                           __validators__=validators, **fields)
    options.__doc__ = f"{opt.name}: the arch the weights are laid out for ({choices})."
    return options


def legalize_pass(target: HardwareTarget) -> type[Pass]:
    """The pass `legalize-<target.name>` (one class per target: the same on every call), with the
    target's arch option as its option (cuda: `cuda_arch`)."""
    done = _PASSES.get(target.name)
    if done is not None:
        return done
    opt = target.arch_option

    class Legalize(Pass):
        __doc__ = (f"Lower to {target.description}: its kernels per node, weights in their layouts, "
                   "the rest decomposed or refused.")
        name = f"legalize-{target.name}"
        description = (f"Choose {target.name} kernels per node, lay weights out for them, decompose what "
                       "it lacks, refuse what it cannot run, record the plan.")
        Options = _arch_options(target, opt) if opt is not None else NoOptions
        produces = frozenset({f"lowered:{target.name}"})

        def run(self, graph: Graph, ctx: PassContext) -> bool:
            arch = getattr(self.options, opt.name) if opt is not None else None
            return legalize(graph, target, arch)

    Legalize.__name__ = Legalize.__qualname__ = "Legalize" + target.name.title().replace("-", "")
    _PASSES[target.name] = Legalize
    return Legalize


def register_target_passes(registry: Any = None) -> None:
    """Register `legalize-<target>` for every target, plugins included (the `ernie_ir.passes`
    entry point calls it with the pass registry on its first lookup)."""
    for target in all_targets().values():
        cls = legalize_pass(target)
        if registry is None:
            register_pass(cls)
        elif registry.passes.get(cls.name) is not cls:
            registry.add(cls, "built-in" if target in BUILTIN else f"target {target.name}")


for _target in BUILTIN:
    register_pass(legalize_pass(_target))
