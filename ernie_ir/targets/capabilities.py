"""The target model: what a device offers, as data (pydantic), and the questions compile asks it.

A target is one folder, `targets/<name>/` (or a plugin package, docs/targets.md "Adding a
target"): its `HardwareTarget` holds the capability table (dtypes, weight-only and MoE kernels,
FP8), its legalization rules (`rules`: the layouts its kernels read), its arch option (cuda's
`--cuda-arch`), its executables and their defaults, and its device facts (Paddle device kind,
visible-devices variable, launch flag, collective backend). The generic drivers (`legalize`,
`compile`, `executables`, `artifact`, `emit_paddle`) ask the target and never test its name.

Every entry names its source (shared/REFERENCE.md section 6 and the Paddle /
PaddleCustomDevice / FastDeploy files it cites); docs/targets.md has the
tables and says which entries were confirmed on real hardware (none yet:
everything here is from source code and vendor docs).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ernie_ir.targets.rules import DEFAULT_RULES, LegalizationRules


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WeightOnlyKernel(_Data):
    """A weight-only linear kernel: which bit widths and group sizes it takes."""

    kernel: str
    """Kernel / op name on the device (e.g. Paddle `weight_only_linear`)."""
    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]
    """-1 = per output channel; 64 / 128 = groups of rows along `in`."""
    source: str


class FusedMoE(_Data):
    kernel: str
    bits: tuple[int, ...]
    """Weight-only bit widths the fused MoE kernel takes (empty: float only)."""
    confirmed: bool
    source: str


class ArchOption(_Data):
    """A target option that picks the device architecture its weights are laid out for (cuda:
    `--cuda-arch`, pass option and kernel-plan key `cuda_arch`)."""

    name: str
    """The pass option of `legalize-<target>` and the key of the kernel plan and manifest."""
    flag: str
    """The CLI flag that sets it (compile and plan take its value as `cuda_arch`)."""
    choices: tuple[int, ...]
    default: int
    fp8: tuple[int, ...] = ()
    """The choices with FP8 kernels (when the target has them at all: `HardwareTarget.fp8`)."""
    fp8_hint: str = ""
    """What those choices are, for messages (cuda: "Hopper/Ada")."""


class HardwareTarget(_Data):
    """A hardware target (cuda, ascend, kunlun, or one a plugin adds) as data: its capability
    table, legalization rules, executables and launch and runtime facts. (Not to be confused
    with `passes.quant_config.WeightSite`, a weight that quantization rules select.)"""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str
    description: str
    dtypes: tuple[str, ...]
    """Float dtypes the device computes in (IR dtype names)."""
    weight_only: WeightOnlyKernel | None
    fused_moe: FusedMoE | None
    fp8: bool
    fp8_note: str
    collective_backend: str
    launch_flag: str
    visible_devices_env: str
    extra_env: dict[str, str] = {}
    paddle_device: str
    """`paddle.set_device` string."""
    inference_config: str
    """Paddle Inference `Config` call that selects the device."""
    onnx_runtime: str
    packing: str
    """How quantized weights are laid out in the artifact."""
    sources: tuple[str, ...]
    rules: LegalizationRules = DEFAULT_RULES
    """How its kernels take the nodes they accept (weight layouts; `targets/rules.py`)."""
    arch_option: ArchOption | None = None
    """The architecture the weights are laid out for, where the layout depends on it (cuda)."""
    executables: tuple[str, ...] = ("paddle", "onnx", "paddle-inference")
    """The executables an artifact for it may carry (`compile --emit`; `executables.EXECUTABLES`)."""
    default_emit: dict[str, tuple[str, ...]] = {"inference": ("paddle",), "training": ("paddle",)}
    """Mode -> the executables written without `--emit` (those that read the rank bytes)."""

    @property
    def device_kind(self) -> str:
        """The Paddle device kind it runs on ("gpu", "npu", "xpu"): `paddle_device` without the index.
        The artifact records it (launch.json's `paddle_device`), which is where the runtime reads it."""
        return self.paddle_device.split(":", 1)[0]

    def supports_weight_only(self, bits: int, group_size: int) -> bool:
        wo = self.weight_only
        return wo is not None and bits in wo.bits and group_size in wo.group_sizes

    def launch_command(self, devices: str = "0") -> str:
        return f"python -m paddle.distributed.launch {self.launch_flag} {devices}"


REFERENCE = "shared/REFERENCE.md section 6"
