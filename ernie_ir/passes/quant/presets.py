"""Quantization and LoRA presets: `--quant NAME` expands to these pipelines.

Each preset annotates (quant-annotate{preset=NAME}) and then runs the convert
pass its algorithm needs. Aliases of other tools (ERNIEKit `wint4/8`,
FastDeploy `mix_quant`, ...) are resolved by `cli_flags.pipeline_for`.
"""

from __future__ import annotations

from ..infra.registry import REGISTRY
from .config import PRESET_DESCRIPTIONS, PRESETS, Algo, Method

CONVERT_PASS = {
    Algo.WEIGHT_ONLY_INT8: "weight-only-quant",
    Algo.WEIGHT_ONLY_INT4: "weight-only-quant",
    Algo.QAT: "qat-insert",
    Algo.FP8: "fp8-quant",
}
"""The pass that rewrites the linears an algorithm was annotated with."""


CALIBRATED_PASS = "calibrated-quant"
"""The pass that quantizes the weights whose rule names a calibrated method (`method=gptq`), on
data, before `weight-only-quant` converts the rest."""


def convert_passes(algos: set[Algo], methods: set[Method] | None = None) -> list[str]:
    """Convert passes for a set of algorithms (and weight-only methods), in a fixed order,
    without repeats: `calibrated-quant` first when a method calibrates."""
    order = ["weight-only-quant", "fp8-quant", "qat-insert"]
    wanted = {CONVERT_PASS[a] for a in algos if a in CONVERT_PASS}
    first = [CALIBRATED_PASS] if any(m.calibrated for m in methods or ()) else []
    return first + [p for p in order if p in wanted]


def preset_pipeline(name: str) -> str:
    cfg = PRESETS[name]()
    return ",".join([f"quant-annotate{{preset={name}}}", *convert_passes(cfg.algos)])


for _name in PRESETS:
    if _name not in REGISTRY.presets:
        REGISTRY.add_preset(_name, preset_pipeline(_name), PRESET_DESCRIPTIONS[_name])
