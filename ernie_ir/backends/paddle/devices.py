"""Device detection and device kernel dispatch: every device call the Paddle runtime makes.

The probes (`_cuda_count`, `_cuda_capability`, `_custom_types`, `_xpu_compiled`) are the only
functions here that ask Paddle about the machine; everything else is decided from their answers,
so tests fake a machine by monkeypatching them:

    devices.available_kinds()         # {"gpu"} on a CUDA build with a GPU, set() on CPU
    devices.target_kind("cuda")       # "gpu" (ascend -> "npu", kunlun -> "xpu")
    devices.set_device_string("gpu")  # "gpu:0" (the launcher's FLAGS_selected_gpus picks N)
    devices.cuda_arch()               # 80 on an A100, 90 on an H100
    devices.weight_only_kernel("gpu:0", 8, 80)  # KernelChoice("paddle.nn.quant.weight_only_linear", 80)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ernie_ir.backends.paddle.paddle_import import require_paddle

KINDS = ("gpu", "npu", "xpu")
"""Paddle device kinds with weight-only kernels (the `--device` choices of the rank worker)."""

TARGET_KINDS = {"cuda": "gpu", "ascend": "npu", "kunlun": "xpu"}
"""The built-in targets' Paddle device kinds, for a caller that has only a target's name. An
artifact records its own (its launch recipe's `paddle_device`, which `paddle_backend` reads), so
the runtime never needs to know a target, plugin targets included."""

ARCHS = (70, 75, 80, 86, 89, 90)
"""CUDA arches Paddle's `weight_only_linear` takes."""

GPU_KERNEL = "paddle.nn.quant.weight_only_linear"
NPU_KERNEL = "weight_only_linear_npu"
XPU_KERNEL = "weight_only_linear_xpu"
PORTABLE = "portable (int values * scale, matmul)"


def _paddle() -> Any:
    return require_paddle()


# -- probes (the only functions that ask Paddle about the machine) -----------------------------


def _cuda_count() -> int:
    """GPUs Paddle sees (0 on a CPU-only build)."""
    paddle = _paddle()
    if not paddle.is_compiled_with_cuda():
        return 0
    return int(paddle.device.cuda.device_count())


def _cuda_capability() -> tuple[int, int]:
    """(major, minor) compute capability of the current GPU."""
    major, minor = _paddle().device.cuda.get_device_capability()
    return int(major), int(minor)


def _custom_types() -> list[str]:
    """Custom device types registered with Paddle (PaddleCustomDevice plugins, e.g. "npu")."""
    try:
        return list(_paddle().device.get_all_custom_device_type() or [])
    except (AttributeError, RuntimeError):
        return []


def _xpu_compiled() -> bool:
    return bool(_paddle().is_compiled_with_xpu())


# -- decisions -----------------------------------------------------------------------------------


def available_kinds() -> set[str]:
    """The device kinds (of KINDS) this machine's Paddle can run on; empty on a CPU build."""
    kinds: set[str] = set()
    if _cuda_count() > 0:
        kinds.add("gpu")
    if "npu" in _custom_types():
        kinds.add("npu")
    if _xpu_compiled():
        kinds.add("xpu")
    return kinds


def target_kind(target: str) -> str | None:
    """The Paddle device kind of an ernie-ir target ("cuda" -> "gpu"); None for unknown names."""
    return TARGET_KINDS.get(target)


def run_device(target: str, kind: str | None = None) -> str:
    """Where to run an artifact compiled for `target` here: its device string, or "cpu".
    `kind`: the device kind the artifact records (without it: `TARGET_KINDS`)."""
    kind = kind or target_kind(target)
    if kind is not None and kind in available_kinds():
        return set_device_string(kind)
    return "cpu"


def set_device_string(kind: str) -> str:
    """The `paddle.set_device` string of this rank: "cpu", or `kind`:N (N: the launcher's choice)."""
    if kind == "cpu":
        return "cpu"
    selected = os.environ.get(f"FLAGS_selected_{kind}s", "0").split(",")[0] or "0"
    return f"{kind}:{selected}"


def arch_for(major: int, minor: int) -> int:
    """The weight-only kernel arch for a compute capability (the largest of ARCHS not above it)."""
    cc = major * 10 + minor
    return max(a for a in ARCHS if a <= max(cc, 70))


def cuda_arch() -> int:
    """The CUDA arch Paddle's weight-only kernel takes for the current GPU."""
    return arch_for(*_cuda_capability())


def device_kind(device: str) -> str:
    """"gpu" for "gpu:0", "cpu" for "cpu", ..."""
    return device.split(":", 1)[0]


@dataclass(frozen=True)
class KernelChoice:
    """The weight-only kernel one kernel-plan entry calls on a device."""

    kernel: str
    """GPU_KERNEL, NPU_KERNEL, XPU_KERNEL or PORTABLE."""
    arch: int | None = None
    """The `arch` argument of the GPU kernel (None elsewhere)."""

    @property
    def device_kernel(self) -> bool:
        """True when the Layer calls the device op (today: Paddle's GPU `weight_only_linear`)."""
        return self.kernel == GPU_KERNEL


def weight_only_kernel(device: str, bits: int, arch: int | None = None, *,
                       portable: bool = False) -> KernelChoice:
    """The kernel a weight-only linear of `bits` calls on `device` ("gpu:0", "npu:0", "cpu", ...).

    gpu: Paddle's `weight_only_linear` with `arch` (default: the current GPU's); npu: the
    PaddleCustomDevice `weight_only_linear_npu` op (int8); xpu: Paddle's XPU weight-only kernel
    (int8); anything else, other bit widths or `portable=True`: the portable form.
    """
    kind = device_kind(device)
    if portable:
        return KernelChoice(PORTABLE)
    if kind == "gpu" and bits in (4, 8):
        return KernelChoice(GPU_KERNEL, cuda_arch() if arch is None else arch)
    if kind == "npu" and bits == 8:
        return KernelChoice(NPU_KERNEL)
    if kind == "xpu" and bits == 8:
        return KernelChoice(XPU_KERNEL)
    return KernelChoice(PORTABLE)


def set_device(device: str) -> None:
    """`paddle.set_device(device)`."""
    _paddle().set_device(device)


def current_device() -> str:
    """`paddle.get_device()`."""
    return str(_paddle().get_device())
