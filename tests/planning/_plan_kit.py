"""The planning tests' shared settings are flat dicts (`{"quant": "fp8", "mode": "training",
"recompute": True, ...}`) that mix what compile would be asked with the planner's own knobs:
`plan_args` splits them into the two objects `plan_memory` takes."""

from __future__ import annotations

from typing import Any

from ernie_ir.planning import PlanRequest
from ernie_ir.targets import CompileOptions


def plan_args(**flat: Any) -> tuple[CompileOptions, PlanRequest]:
    """(CompileOptions, PlanRequest) of flat keyword arguments: PlanRequest's fields to it, the
    rest (quant, lora_rank, tp, mode, cuda_arch, ...) to CompileOptions."""
    request = {k: flat.pop(k) for k in list(flat) if k in PlanRequest.model_fields}
    return CompileOptions(**flat), PlanRequest(**request)
