"""The target model: what a device offers, as data (pydantic).

Every entry names its source (shared/REFERENCE.md section 6 and the Paddle /
PaddleCustomDevice / FastDeploy files it cites); docs/targets.md has the
tables and says which entries were confirmed on real hardware (none yet:
everything here is from source code and vendor docs).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


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


class HardwareTarget(_Data):
    """A hardware target (cuda, ascend, kunlun) as data: its capability table plus launch and
    runtime facts. (Not to be confused with `passes.quant_config.WeightSite`, a weight that
    quantization rules select.)"""

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

    def supports_weight_only(self, bits: int, group_size: int) -> bool:
        wo = self.weight_only
        return wo is not None and bits in wo.bits and group_size in wo.group_sizes

    def launch_command(self, devices: str = "0") -> str:
        return f"python -m paddle.distributed.launch {self.launch_flag} {devices}"


REFERENCE = "shared/REFERENCE.md section 6"
