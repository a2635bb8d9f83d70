"""Memory planning: does a compiled model fit on a device, and on how many?

    from ernie_ir.planning import PlanRequest, plan_memory
    from ernie_ir.targets import CompileOptions
    plan = plan_memory("ernie-4.5-300b-a47b", "cuda", CompileOptions(quant="wint4"),
                       PlanRequest(device_memory="80GiB", seq_len=32768))
    plan.min_devices, plan.tp, plan.ep, plan.per_rank[0].by_category, plan.per_rank[0].kv_detail
    plan_memory("ernie-4.5-300b-a47b", "cuda", CompileOptions(quant="fp8", mode="training",
                sharding="stage1"), PlanRequest(devices=32))   # tp x ep x dp layouts of 32 devices, ZeRO-1

`CompileOptions` is what `compile_model` would be asked (the same object); `PlanRequest` holds the
planner's own knobs. A cuda inference plan models FastDeploy serving it (`engine="fastdeploy"`;
`engine="none"`: the bare model); see docs/planning.md.

The plan reads the rank graphs `compile` would write (full size, no weights). This package sits
above `targets` (it builds compile's pipeline) and below `cli`; nothing else imports it.
"""

from .graph_memory import PlanError
from .plan import (
    CATEGORIES,
    ENGINES,
    EngineSettings,
    LayoutTry,
    MemoryPlan,
    RankMemory,
    candidate_layouts,
    device_layouts,
    plan_memory,
    plan_target,
)
from .request import PlanRequest
from .units import MemorySizeError, format_bytes, parse_memory

__all__ = [
    "CATEGORIES",
    "ENGINES",
    "EngineSettings",
    "LayoutTry",
    "MemoryPlan",
    "MemorySizeError",
    "PlanError",
    "PlanRequest",
    "RankMemory",
    "candidate_layouts",
    "device_layouts",
    "format_bytes",
    "parse_memory",
    "plan_memory",
    "plan_target",
]
