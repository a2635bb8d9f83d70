"""What a plan is asked besides what compile would be asked: `PlanRequest`, the planner's own knobs.

    plan_memory("ernie-4.5-300b-a47b", "cuda", CompileOptions(quant="wint4"),
                PlanRequest(device_memory="80GiB", seq_len=32768))

`CompileOptions` (ernie_ir.targets) carries what `compile` would be asked (mode, quantization,
LoRA, the target's arch option, the layout); a `PlanRequest` carries the rest: the step planned
(sequence length, batch, recompute, optimizer states), the device and the serving engine. Each
default has its home here, as the field's default; which fields the caller gave (`given`) is what
the planner needs where a default and an explicit value mean different things (a given
`device_memory` searches layouts; FastDeploy's flags are refused with `engine="none"`). Values
are checked by `plan_memory`, one line each (PlanError), against the mode they apply to.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from .graph_memory import PlanError

GiB = 1024 ** 3
DEFAULT_DEVICE_MEMORY = 80 * GiB
DEFAULT_RESERVE = 2 * GiB
"""CUDA context and library handles (~0.5-1 GiB on Hopper), cuBLAS/cuDNN workspaces, NCCL
communicator buffers and allocator fragmentation: one stated constant, not a fitted one."""
DEFAULT_SEQ_LEN = 4096
MAX_DEVICES = 64
FASTDEPLOY_MAX_NUM_SEQS = 8
FASTDEPLOY_GPU_MEMORY_UTILIZATION = 0.9
FASTDEPLOY_MAX_NUM_BATCHED_TOKENS = 8192
"""FastDeploy's defaults (`fastdeploy/engine/args_utils.py`; 8192 is what an unset
`max_num_batched_tokens` becomes on GPU under the default V1 scheduler)."""
SHARDING = ("none", "stage1", "stage2")
"""ZeRO stages a training plan can model (ERNIEKit's `sharding:` values): none, stage1 (AdamW
moments and f32 master weights divided over the data-parallel ranks), stage2 (gradients too)."""
MAX_WORLD = 1 << 16
"""The largest `devices` a plan takes (data parallelism fills it; model-parallel groups stay within
`max_devices`)."""


class PlanRequest(BaseModel):
    """The planner's own knobs (see the module docstring; docs/planning.md says what each one
    models). None for a field means "not given": its default (and `given` is False)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int = DEFAULT_SEQ_LEN
    """Tokens per sequence (under FastDeploy: its --max-model-len)."""
    batch: int = 1
    """Sequences of full length in the KV cache; per training step (per data-parallel replica)."""
    offload_optimizer: bool = False
    recompute: bool = False
    device_memory: int | str = DEFAULT_DEVICE_MEMORY
    """Bytes per device, or a string (`80GiB`); given without tp/ep: search the layouts."""
    moment_dtype: str = "fp32"
    master_weights: bool = True
    kv_cache_dtype: str | None = None
    """bf16, f16, fp8 or int8; None: the attention inputs' dtype."""
    prefill_tokens: int | None = None
    """Tokens of the inference peak's prefill step (None: seq_len); not under FastDeploy."""
    reserve: int | str = DEFAULT_RESERVE
    capacity_factor: float = 1.0
    max_devices: int = MAX_DEVICES
    engine: str | None = None
    """fastdeploy (the default for cuda inference) or none (the default elsewhere: the bare model)."""
    max_model_len: int | None = None
    """FastDeploy's flag (None: seq_len)."""
    max_num_seqs: int = FASTDEPLOY_MAX_NUM_SEQS
    gpu_memory_utilization: float = FASTDEPLOY_GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int = FASTDEPLOY_MAX_NUM_BATCHED_TOKENS
    devices: int | None = None
    """Training: a device count to lay out (max(tp, ep) x pp x dp = devices)."""

    @model_validator(mode="before")
    @classmethod
    def _none_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if v is not None}
        return data

    def given(self, name: str) -> bool:
        """Whether the caller set this field (None counts as not set)."""
        return name in self.model_fields_set


def plan_sharding(sharding: str | None) -> str:
    """The ZeRO stage a `--sharding` names: none (for None), stage1 or stage2; PlanError (one
    line) for stage3, which is not modelled, and for any other name."""
    stage = "none" if sharding is None else sharding.strip().lower()
    if stage == "stage3":
        raise PlanError("--sharding stage3 (ZeRO-3: the parameters sharded too, gathered layer by layer) "
                        "is not modelled: give stage1 (optimizer states / dp) or stage2 (gradients too)")
    if stage not in SHARDING:
        raise PlanError(f"--sharding {sharding!r}: choose none, stage1 (optimizer states / dp) or stage2 "
                        "(gradients too)")
    return stage


def check_replica_flags(mode: str, dp: int | None, sharding: str, devices: int | None) -> None:
    """dp and devices in range, and (with `sharding`, a `plan_sharding` stage) refused outside
    training: the planner's own words, which the CLI asks before it builds CompileOptions (whose
    refusal of dp outside training speaks of compile)."""
    if dp is not None and not 1 <= dp <= MAX_WORLD:
        raise PlanError(f"--dp {dp}: a parallel degree is a positive integer (at most {MAX_WORLD})")
    if devices is not None and not 1 <= devices <= MAX_WORLD:
        raise PlanError(f"--devices {devices}: a device count from 1 to {MAX_WORLD}")
    if mode == "inference":
        flag = ("--devices" if devices is not None else f"--dp {dp}" if dp is not None and dp > 1
                else f"--sharding {sharding}" if sharding != "none" else None)
        if flag is not None:
            raise PlanError(f"{flag} applies to --mode training (a serving replica's memory does not depend "
                            "on how many replicas run); --device-memory alone searches the smallest serving "
                            "layout")
