"""Targets (cuda, ascend, kunlun, and plugins'): capability tables, legalization, weight packing, artifacts.

    from ernie_ir.targets import compile_model, load_artifact, verify_artifact
    report = compile_model("ernie-4.5-21b-a3b@tiny", "ascend", quant="wint8mix", out=Path("a"))
    graph = load_artifact("a")              # rank-0 graph, hashes checked

A target is one folder, `targets/<name>/` (a `HardwareTarget`: capability table, legalization
rules, arch option, executables, device facts); packages add targets through the entry-point
group `ernie_ir.targets` (docs/targets.md "Adding a target"). Importing this package registers
the built-in `legalize-<target>` passes; every target's, plugins' included, is also found
through the `ernie_ir.passes` entry point.
"""

from ernie_ir.targets import passes  # noqa: F401  (registers legalize-cuda/-ascend/-kunlun)
from ernie_ir.targets.artifact import (
    ArtifactError,
    artifact_mapping,
    load_artifact,
    load_rank_graphs,
    read_manifest,
    require_weights,
    verify_artifact,
    write_artifact,
)
from ernie_ir.targets.capabilities import ArchOption, FusedMoE, HardwareTarget, WeightOnlyKernel
from ernie_ir.targets.compile import CompileReport, compile_model
from ernie_ir.targets.options import CompileOptions, ParallelLayout
from ernie_ir.targets.registry import TARGETS, TargetError, all_targets, get_target
from ernie_ir.targets.rules import LegalizationRules, Legalizing

__all__ = [
    "TARGETS",
    "ArchOption",
    "ArtifactError",
    "CompileOptions",
    "CompileReport",
    "FusedMoE",
    "HardwareTarget",
    "LegalizationRules",
    "Legalizing",
    "ParallelLayout",
    "TargetError",
    "WeightOnlyKernel",
    "all_targets",
    "artifact_mapping",
    "compile_model",
    "get_target",
    "load_artifact",
    "load_rank_graphs",
    "read_manifest",
    "require_weights",
    "verify_artifact",
    "write_artifact",
]


def __getattr__(name: str) -> object:
    if name == "Target":  # the old name of HardwareTarget
        import warnings

        warnings.warn("ernie_ir.targets.Target is deprecated: use ernie_ir.targets.HardwareTarget",
                      DeprecationWarning, stacklevel=2)
        return HardwareTarget
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
